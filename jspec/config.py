"""Frozen configuration dataclasses. Hashable, so they can be static arguments of `jax.jit`."""
from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A Llama-family decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU."""

  vocab_size: int
  dim: int
  n_layers: int
  n_heads: int
  n_kv_heads: int
  head_dim: int
  mlp_dim: int
  rope_theta: float = 10000.0
  norm_eps: float = 1e-6
  qkv_bias: bool = False
  tie_embeddings: bool = True
  max_seq_len: int = 4096
  dtype: str = "float32"
  bos_id: int | None = None
  eos_id: int | None = None

  def __post_init__(self):
    if self.n_heads % self.n_kv_heads:
      raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")

  @property
  def jnp_dtype(self) -> jnp.dtype:
    return jnp.dtype(self.dtype)

  def to_json(self) -> str:
    return json.dumps(dataclasses.asdict(self), indent=2)

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(d) - names
    if unknown:
      raise ValueError(f"unknown model config fields: {sorted(unknown)}")
    return cls(**d)


def default_dtype() -> str:
  """fp32 on the CPU (where bf16 matmuls are several times slower), bf16 on accelerators."""
  return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def num_params(config: ModelConfig) -> int:
  """Parameter count, from the config alone."""
  d, h, k, dh, f, v = (config.dim, config.n_heads, config.n_kv_heads, config.head_dim,
                       config.mlp_dim, config.vocab_size)
  attn = d * h * dh + 2 * d * k * dh + h * dh * d + (h * dh + 2 * k * dh) * config.qkv_bias
  layer = attn + 3 * d * f + 2 * d
  head = 0 if config.tie_embeddings else d * v
  return v * d + config.n_layers * layer + d + head
