"""Medusa heads in the formats they are published in, read and written: FasterDecoding's heads
(`medusa_lm_head.*`: `{i}.{j}.linear`, `{i}.{layers}`) and vLLM's layout (`blocks.{i}.layers.{j}`,
`lm_heads.{i}` or one shared `lm_head`). The reader builds the drafter class it is given
(`jspec.drafters.medusa.MedusaDrafter`), which calls it.
"""
from __future__ import annotations

import pathlib
from typing import Any

import jax.numpy as jnp
import numpy as np

from jspec.drafters.base import Heads
from jspec.drafters.published import Found, HeadTensors, f32, weight_files
from jspec.model import model
from jspec.model.config import ModelConfig

FORMATS = ("medusa",)
MEDUSA_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt", "medusa_lm_head.bin")


def detect(path: pathlib.Path, config: dict) -> Found | None:
  """Medusa heads' format, from their directory and config; None when it holds none."""
  medusa = [path / f for f in MEDUSA_FILES if (path / f).is_file()]
  if "medusa_num_heads" in config or config.get("model_type") == "medusa" or medusa:
    return Found("medusa", config, medusa[:1] or weight_files(path))
  return None


def read(cls: type, found: Found, tensors: HeadTensors, dtype: str) -> Heads:
  """Published Medusa heads as `Heads` of drafter class `cls`."""
  fields = found.config
  vllm = tensors.has("blocks.0.layers.0.weight")
  heads = int(fields.get("medusa_num_heads") or fields.get("num_heads") or 0)
  layers = int(fields.get("medusa_num_layers") or fields.get("num_hidden_layers") or 0)
  if not heads or not layers:
    raise ValueError("a Medusa config without medusa_num_heads/num_heads and medusa_num_layers/num_hidden_layers")
  if vllm and fields.get("truncated_vocab_size") not in (None, fields.get("vocab_size")) or tensors.has("token_map"):
    raise ValueError("Medusa heads over a truncated vocabulary (token_map): not supported")
  block = (lambda i, j: f"blocks.{i}.layers.{j}") if vllm else (lambda i, j: f"{i}.{j}.linear")
  w = [[tensors.take(f"{block(i, j)}.weight", True) for j in range(layers)] for i in range(heads)]
  dim = w[0][0].shape[0]
  b = [[tensors.take(f"{block(i, j)}.bias") if tensors.has(f"{block(i, j)}.bias") else jnp.zeros(dim, w[0][0].dtype)
        for j in range(layers)] for i in range(heads)]
  params: dict[str, Any] = {"w": jnp.stack([jnp.stack(r) for r in w]), "b": jnp.stack([jnp.stack(r) for r in b])}
  if vllm and tensors.has("lm_head.weight"):  # one head shared by all (`original_lm_head`)
    heads_VxD = [tensors.raw("lm_head.weight")]
  else:
    heads_VxD = [tensors.raw(f"lm_heads.{i}.weight" if vllm else f"{i}.{layers}.weight") for i in range(heads)]
  params["lm_head"] = jnp.asarray(np.stack([h.astype(tensors.dtype).T for h in heads_VxD]))
  tensors.done()
  vocab = params["lm_head"].shape[-1]
  config = ModelConfig(vocab_size=vocab, dim=dim, n_layers=1, n_heads=1, n_kv_heads=1, head_dim=dim, mlp_dim=dim,
                       dtype=dtype)
  source = "Medusa heads (vLLM layout)" if vllm else "Medusa heads (FasterDecoding)"
  return Heads(cls(config, heads, layers, own_heads=len(heads_VxD)), params, source=source)


def write(heads: Heads, fmt: str, target, verifier: str) -> tuple[dict, dict]:
  """Medusa heads for `target` as vLLM's layout (its `MedusaModel`) has them: a `config.json` and tensors,
  biases kept (`medusa_fc_bias`), the target's LM head written once (`original_lm_head`) when the heads share
  it."""
  if fmt != "medusa":
    raise ValueError(f"Medusa heads cannot be written as {fmt}; they are written as medusa")
  p, d = heads.params, heads.drafter
  tensors = {}
  for i in range(d.num_heads):
    for j in range(d.num_layers):
      tensors[f"blocks.{i}.layers.{j}.weight"] = f32(p["w"][i, j]).T
      tensors[f"blocks.{i}.layers.{j}.bias"] = f32(p["b"][i, j])
    if d.own_heads > 1:
      tensors[f"lm_heads.{i}.weight"] = f32(p["lm_head"][i]).T
  if d.own_heads <= 1:
    head = p["lm_head"][0] if d.own_heads else model.with_head(target.params)["lm_head"]
    tensors["lm_head.weight"] = f32(head).T
  config = {"architectures": ["MedusaModel"], "model_type": "medusa", "num_heads": d.num_heads,
            "num_hidden_layers": d.num_layers, "hidden_size": d.config.dim, "vocab_size": d.config.vocab_size,
            "truncated_vocab_size": d.config.vocab_size, "medusa_fc_bias": True,
            "original_lm_head": d.own_heads <= 1, "medusa_num_heads": d.num_heads, "medusa_num_layers": d.num_layers,
            "base_model_name_or_path": verifier}
  return config, tensors
