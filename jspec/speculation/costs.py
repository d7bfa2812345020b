"""Which cost model (c, v, o; `jspec.speculation.adaptive`) a decoder uses: a calibration kept in the user's cache for
exactly these models and devices (`python -m jspec.calibrate` measures one), else the checkpoint's figures
when they were measured on this backend and device kind (with the float target they shipped with), else
neutral ones.

A calibration is keyed by what its figures depend on: both models' shapes (a digest of their configs and
their parameters' shapes and dtypes), the drafter kind, the backend and device kind, the dtype, the mesh
shape.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import pathlib
from typing import Any

import jax

from jspec.core.settings import CostModel, user_cache_dir
from jspec.model.config import num_params

SOURCES = ("calibrated", "checkpoint", "neutral")


def device_kind() -> tuple[str, str]:
  """(backend, device kind) of the default devices."""
  return jax.default_backend(), jax.devices()[0].device_kind


def identity(m) -> str:
  """A digest of a model's or heads' shape: its config (and drafter metadata), its parameters' shapes and
  dtypes. The weights' values do not change what a step costs."""
  drafter = getattr(m, "drafter", None)
  config = (m.config if drafter is None else drafter.config)
  described = {"config": dataclasses.asdict(config) if dataclasses.is_dataclass(config) else repr(config),
               "drafter": None if drafter is None else {"kind": drafter.kind, **drafter.metadata()},
               "params": [(jax.tree_util.keystr(p), tuple(x.shape), str(x.dtype))
                          for p, x in jax.tree_util.tree_flatten_with_path(m.params)[0]]}
  return hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode()).hexdigest()[:16]


def key(target, draft, kind: str, mesh_shape: tuple[int, ...] = (1, 1)) -> dict[str, Any]:
  """What a calibration's figures depend on."""
  backend, kind_of_device = device_kind()
  return {"target": identity(target), "draft": None if draft is None else identity(draft), "drafter": kind,
          "backend": backend, "device_kind": kind_of_device, "dtype": target.config.dtype,
          "mesh": list(mesh_shape)}


def cache_dir() -> pathlib.Path:
  """$JSPEC_CALIBRATION_DIR, else jspec/calibration under the user's cache directory."""
  return pathlib.Path(os.environ.get("JSPEC_CALIBRATION_DIR") or user_cache_dir("calibration"))


def _file(described: dict) -> pathlib.Path:
  digest = hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:24]
  return cache_dir() / f"{described['drafter']}-{digest}.json"


def store(target, draft, kind: str, cost: CostModel, mesh_shape: tuple[int, ...] = (1, 1)) -> pathlib.Path:
  """Keeps a calibration in the user's cache; returns its file."""
  described = key(target, draft, kind, mesh_shape)
  path = _file(described)
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_suffix(f".{os.getpid()}.tmp")
  tmp.write_text(json.dumps({"key": described, "cost_model": cost.to_json()}, indent=2) + "\n")
  tmp.replace(path)  # whole or not at all, for a reader in another process
  return path


def stored(target, draft, kind: str, mesh_shape: tuple[int, ...] = (1, 1)) -> CostModel | None:
  """The calibration kept for exactly these models, drafter, devices, dtype and mesh, if any."""
  described = key(target, draft, kind, mesh_shape)
  try:
    entry = json.loads(_file(described).read_text())
    return CostModel(**entry["cost_model"]) if entry.get("key") == described else None
  except (OSError, ValueError, TypeError, KeyError):
    return None  # none, or unreadable: measured again when asked


def cost_model(target, draft, kind: str, needs_weights: bool,
               mesh_shape: tuple[int, ...] = (1, 1)) -> tuple[CostModel, str]:
  """The cost model the decoder uses, and where it comes from (one of `SOURCES`). The checkpoint's tree
  shape (`CostModel.tree_top_k`, `tree_nodes`) stays whichever figures are used."""
  checkpoint = (target if draft is None else draft).cost_models.get(kind)
  if checkpoint is not None and (checkpoint.target_params not in (None, num_params(target.config))
                                 or target.config.quantization is not None):
    checkpoint = None  # measured with another target, or with this one's float weights
  tree = {"tree_top_k": checkpoint and checkpoint.tree_top_k, "tree_nodes": checkpoint and checkpoint.tree_nodes}
  calibrated = stored(target, draft, kind, mesh_shape)
  if calibrated is not None:
    return dataclasses.replace(calibrated, **tree), "calibrated"
  if checkpoint is not None and (checkpoint.backend, checkpoint.device_kind) == device_kind() \
      and math.prod(mesh_shape) == 1:
    return checkpoint, "checkpoint"
  return dataclasses.replace(CostModel.neutral(needs_weights), **tree), "neutral"

