"""Drafters behind one interface (`base.Drafter`): a draft model, Medusa heads, an EAGLE head, n-gram lookup.

Trained heads live in their own checkpoint directory: `drafter.json` (kind and shape) and orbax `params/`.
They borrow the target's embedding and LM head, so they load next to a target of the same shape.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
from typing import Any

import jax

from jspec import checkpoint
from jspec.config import default_dtype
from jspec.drafters.base import Drafter, Features
from jspec.drafters.draft_model import ModelDrafter
from jspec.drafters.eagle import EagleDrafter
from jspec.drafters.medusa import MedusaDrafter
from jspec.drafters.ngram import NgramDrafter

KINDS = ("model", "medusa", "eagle", "ngram")
HEADS_FILE = "drafter.json"

__all__ = ["Drafter", "Features", "ModelDrafter", "MedusaDrafter", "EagleDrafter", "NgramDrafter", "Heads",
           "KINDS", "load_heads", "save_heads", "resolve"]


@dataclasses.dataclass(frozen=True)
class Heads:
  """Trained Medusa or EAGLE weights and the drafter they belong to."""
  drafter: MedusaDrafter | EagleDrafter
  params: dict

  @property
  def num_params(self) -> int:
    return sum(x.size for x in jax.tree.leaves(self.params))


def save_heads(heads: Heads, path: str | pathlib.Path, storage_dtype: str | None = None) -> None:
  path = pathlib.Path(path).absolute()
  path.mkdir(parents=True, exist_ok=True)
  d = heads.drafter
  config = d.target_config if d.kind == "medusa" else d.config
  meta = {"kind": d.kind, "config": json.loads(config.to_json())}
  if d.kind == "medusa":
    meta["num_heads"] = d.num_heads
  (path / HEADS_FILE).write_text(json.dumps(meta, indent=2) + "\n")
  checkpoint.save_params(heads.params, path, storage_dtype)


def load_heads(path: str | pathlib.Path, dtype: str | None = None, mesh=None) -> Heads:
  path = pathlib.Path(path).absolute()
  meta = checkpoint.read_json(path / HEADS_FILE)
  config = checkpoint.parse_config(meta.get("config", {}), dtype or default_dtype(), path / HEADS_FILE)
  if meta.get("kind") == "medusa":
    drafter = MedusaDrafter(config, int(meta["num_heads"]))
  elif meta.get("kind") == "eagle":
    drafter = EagleDrafter(config)
  else:
    raise ValueError(f"{path / HEADS_FILE}: unknown drafter kind {meta.get('kind')!r}")
  return Heads(drafter, checkpoint.restore_params(path, lambda: drafter.init_params(jax.random.PRNGKey(0)), config,
                                                  mesh))


@functools.lru_cache(maxsize=16)  # by identity: a loaded pair is checked once, not on every request (~4 ms)
def _same_vocab(a, b) -> bool:
  return a.get_vocab() == b.get_vocab()


def resolve(target: checkpoint.Model, draft: Any, drafter: str | None, max_ngram: int = 3,
            draft_len: int = 1) -> tuple[Drafter | None, Any]:
  """(drafter, its params) for a request, or (None, None) for plain decoding. Mismatches are ValueErrors.

  `draft` is a draft `Model`, trained `Heads`, or None; `drafter` names the kind, and may be omitted when
  `draft` implies it.
  """
  if drafter is not None and drafter not in KINDS:
    raise ValueError(f"unknown drafter {drafter!r}; choose one of {', '.join(KINDS)}")
  if drafter == "ngram" or (drafter is None and draft is None):
    if draft is not None:
      raise ValueError("the ngram drafter takes no draft weights")
    return (NgramDrafter(target.config.vocab_size, max_ngram), None) if drafter else (None, None)
  if draft is None:
    raise ValueError(f"the {drafter} drafter needs draft weights")
  kind = "model" if isinstance(draft, checkpoint.Model) else draft.drafter.kind
  if drafter is not None and drafter != kind:
    raise ValueError(f"--drafter {drafter} was given {kind} weights")
  if kind == "model":
    if draft.config.vocab_size != target.config.vocab_size:
      raise ValueError(f"draft vocab size {draft.config.vocab_size} differs from the target's "
                       f"{target.config.vocab_size}")
    if not _same_vocab(draft.tokenizer, target.tokenizer):
      raise ValueError("the draft's tokenizer differs from the target's")
    return ModelDrafter(draft.config), draft.params
  shape = draft.drafter.target_config if kind == "medusa" else draft.drafter.config
  if (shape.dim, shape.vocab_size) != (target.config.dim, target.config.vocab_size):
    raise ValueError(f"these {kind} heads were trained for a target of width {shape.dim} and vocab "
                     f"{shape.vocab_size}, not {target.config.dim} and {target.config.vocab_size}")
  if kind == "medusa" and draft_len > draft.drafter.num_heads:
    raise ValueError(f"draft_len {draft_len} exceeds the {draft.drafter.num_heads} Medusa heads")
  return draft.drafter, draft.params
