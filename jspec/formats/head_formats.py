"""Draft heads in the formats they are published for vLLM and SGLang: found, read and written through the
drafter kinds that have them (`Drafter.published`: the module beside the drafter that reads and writes
them, e.g. `jspec.drafters.eagle_formats`). Nothing here knows a kind."""
from __future__ import annotations

import json
import pathlib

import numpy as np
from safetensors.numpy import save_file

from jspec.core import registry
from jspec.drafters.base import Heads
from jspec.drafters.published import Found, HeadTensors, read_config


def _publishing() -> list[type]:
  """The drafter classes that read and write published formats, in the registry's order."""
  return [c for c in map(registry.drafter_class, registry.kinds()) if c.published is not None]


def formats() -> tuple[str, ...]:
  return tuple(f for c in _publishing() for f in c.published.FORMATS)


def detect(path: pathlib.Path) -> Found | None:
  """The published head format of a directory, None when it holds none (a model, a jspec checkpoint)."""
  path = pathlib.Path(path)
  config = read_config(path)
  return next((found for c in _publishing() if (found := c.published.detect(path, config)) is not None), None)


def load_head(path: pathlib.Path, found: Found, dtype: str) -> Heads:
  """A published head as jspec `Heads` (`source` names its format)."""
  cls = next(c for c in _publishing() if found.format in c.published.FORMATS)
  return cls.published.read(cls, found, HeadTensors(found, path, dtype), dtype)


def export(heads: Heads, fmt: str, out: pathlib.Path, target, verifier: str) -> pathlib.Path:
  """Writes jspec heads for `target` (a `Model`) in a published format, naming `verifier` (the target's name
  or path as the serving system will load it) where the format records one."""
  if fmt not in formats():
    raise ValueError(f"unknown format {fmt!r}: choose one of {', '.join(formats())}")
  drafter = heads.drafter
  if drafter.config.quantization is not None:
    raise ValueError(f"published head formats hold float weights; these heads are {drafter.config.quantization}")
  if drafter.published is None:
    raise ValueError(f"the {drafter.kind} drafter's weights have no published format")
  config, tensors = drafter.published.write(heads, fmt, target, verifier)
  out = pathlib.Path(out)
  out.mkdir(parents=True, exist_ok=True)
  (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
  save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(out / "model.safetensors"))
  return out
