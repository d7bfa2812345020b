"""`jspec.load`: one entry point above the checkpoint formats (jspec model or heads directories, Hugging
Face model directories)."""
from __future__ import annotations

import pathlib

from jspec import checkpoint, hf, shipped
from jspec.config import default_dtype
from jspec.drafters import Heads
from jspec.model import Model
from jspec.settings import DTYPES


def load(path: str | pathlib.Path, dtype: str | None = None, mesh=None) -> Model | Heads:
  """A model (a jspec checkpoint, a Hugging Face model directory of a family in `jspec.hf.FAMILIES`, or a
  shipped pair's name such as "code" for its target), or trained Medusa/EAGLE heads (`Heads`).

  Parameters and activations use `dtype` ("float32" or "bfloat16"), by default fp32 on the CPU and bf16 on
  accelerators. With a `mesh` (`jspec.make_mesh`), each array is placed in its shards as it is read.
  Every problem is a one-line ValueError.
  """
  if dtype not in (None, *DTYPES):
    raise ValueError(f"unsupported dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
  path = shipped.resolve(path).absolute()
  if not path.is_dir():
    raise ValueError(f"{path}: no such checkpoint directory")
  if hf.is_hf_dir(path):
    return hf.load_hf(path, dtype or default_dtype(), mesh)
  if checkpoint.is_heads_dir(path):
    return checkpoint.load_heads(path, dtype, mesh)
  return checkpoint.load_model(path, dtype, mesh)
