"""`jspec.load`: one entry point above the checkpoint formats (jspec model or heads directories, Hugging
Face model directories)."""
from __future__ import annotations

import pathlib

from jspec import checkpoint, hf
from jspec.config import default_dtype
from jspec.drafters import Heads
from jspec.model import Model


def load(path: str | pathlib.Path, dtype: str | None = None, mesh=None) -> Model | Heads:
  """A model (a jspec checkpoint, or a Hugging Face llama/qwen2/mistral directory), or trained Medusa/EAGLE
  heads (`Heads`).

  Parameters and activations use `dtype`, by default fp32 on the CPU and bf16 on accelerators. With a
  `mesh` (`jspec.make_mesh`), jspec checkpoints restore directly into sharded arrays.
  Every problem is a one-line ValueError.
  """
  path = pathlib.Path(path).absolute()
  if not path.is_dir():
    raise ValueError(f"{path}: no such checkpoint directory")
  if hf.is_hf_dir(path):
    return hf.load_hf(path, dtype or default_dtype())
  if checkpoint.is_heads_dir(path):
    return checkpoint.load_heads(path, dtype, mesh)
  return checkpoint.load_model(path, dtype, mesh)
