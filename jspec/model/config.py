"""The model's shape: frozen dataclasses, hashable, so they are static parts of a jitted program.

One decoder serves every family jspec reads; each way the families differ is a field of `ModelConfig`
(norm style, activation, soft-caps, a sliding window per layer, q/k norms, RoPE scaling), set by the loader.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax
import jax.numpy as jnp

from jspec.core.settings import WEIGHT_FORMATS

ACTIVATIONS = ("silu", "gelu_tanh")
ROUTINGS = ("softmax", "sigmoid")
ROPE_TYPES = ("linear", "dynamic", "llama3", "yarn")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """RoPE scaling, as transformers' `rope_type`s define it (see `jspec.model.rope`)."""
  type: str  # linear | dynamic | llama3 | yarn
  factor: float = 1.0
  original_max_position_embeddings: int | None = None  # llama3, yarn: the pretraining context
  max_position_embeddings: int | None = None  # dynamic: the length past which the base grows
  low_freq_factor: float = 1.0  # llama3
  high_freq_factor: float = 4.0  # llama3
  beta_fast: float = 32.0  # yarn
  beta_slow: float = 1.0  # yarn
  attention_factor: float | None = None  # yarn: scales cos and sin; None: from factor (and mscale)
  mscale: float | None = None  # yarn
  mscale_all_dim: float | None = None  # yarn
  truncate: bool = True  # yarn: round the correction range to whole dimensions

  def __post_init__(self):
    if self.type not in ROPE_TYPES:
      raise ValueError(f"unsupported RoPE scaling type {self.type!r}: jspec reads {', '.join(ROPE_TYPES)}")


@dataclasses.dataclass(frozen=True)
class MoeConfig:
  """Mixture-of-experts MLPs (`jspec.model.moe`): each token's MLP is the weighted sum of `top_k` of
  `experts` small gated MLPs, chosen per token by a router, plus `shared_dim` columns of an MLP every token
  runs (shared experts). The layers in `dense_layers` keep an ordinary MLP of `ModelConfig.mlp_dim`."""
  experts: int
  top_k: int
  expert_dim: int  # each expert's MLP width
  routing: str = "softmax"  # softmax over the router's logits (Mixtral, Qwen3), or sigmoid (GLM-4.5, DeepSeek-V3)
  normalize: bool = True  # the chosen experts' weights are divided by their sum
  scale: float = 1.0  # and then multiplied by this (routed_scaling_factor)
  groups: int = 1  # sigmoid routing chooses among the experts of the `top_groups` best groups only
  top_groups: int = 1
  shared_dim: int = 0
  dense_layers: tuple[int, ...] = ()

  def __post_init__(self):
    if self.routing not in ROUTINGS:
      raise ValueError(f"unsupported expert routing {self.routing!r}: jspec has {', '.join(ROUTINGS)}")
    if not 0 < self.top_k <= self.experts or self.experts % self.groups or not 0 < self.top_groups <= self.groups:
      raise ValueError(f"a router choosing {self.top_k} of {self.experts} experts in {self.top_groups} of "
                       f"{self.groups} groups")

  def sparse(self, layer: int) -> bool:
    return layer not in self.dense_layers


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A decoder-only transformer: RMSNorm, RoPE, grouped-query attention, a gated MLP."""

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
  eos_id: int | tuple[int, ...] | None = None  # every one of them ends a row
  rope_scaling: RopeScaling | None = None
  partial_rotary_factor: float = 1.0  # RoPE rotates this share of each head's dimensions
  local_rope_theta: float | None = None  # RoPE base of sliding-window layers, unscaled (Gemma 3)
  sliding_windows: tuple[int, ...] = ()  # per layer: attend to the last W positions; 0 = all (empty: all)
  activation: str = "silu"  # the MLP's gate: silu (SwiGLU) or gelu_tanh (GeGLU)
  norm_plus_one: bool = False  # RMSNorm scales by (1 + w), as Gemma stores it
  sandwich_norms: bool = False  # also norm each block's output before the residual add (Gemma 2/3)
  qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3)
  scale_embeddings: bool = False  # embeddings times sqrt(dim) (Gemma)
  query_scale: float | None = None  # attention logits scale by query_scale**-0.5; None: head_dim
  attn_softcap: float | None = None  # attention logits -> cap * tanh(logits / cap) (Gemma 2)
  final_softcap: float | None = None  # the same on the output logits
  quantization: str | None = None  # the linear layers' stored format (WEIGHT_FORMATS); None: `dtype`
  moe: MoeConfig | None = None  # mixture-of-experts MLPs; None: every layer's MLP is dense
  # A parallel draft model's mask token (PARD's `pard_token`): it drafts K tokens in one forward from K - 1 of
  # them after the text (`jspec.drafters.draft_model`); None: one token per forward.
  mask_id: int | None = None

  def __post_init__(self):
    if self.n_heads % self.n_kv_heads:
      raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
    if self.activation not in ACTIVATIONS:
      raise ValueError(f"unsupported activation {self.activation!r}: jspec has {', '.join(ACTIVATIONS)}")
    if self.sliding_windows and len(self.sliding_windows) != self.n_layers:
      raise ValueError(f"sliding_windows has {len(self.sliding_windows)} entries for {self.n_layers} layers")
    if self.quantization not in (None, *WEIGHT_FORMATS):
      raise ValueError(f"unknown weight format {self.quantization!r}: jspec has {', '.join(WEIGHT_FORMATS)}")
    if self.moe is not None and self.quantization is not None:
      raise ValueError(f"unsupported: a mixture of experts in {self.quantization}; jspec holds experts in float")
    if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2:
      raise ValueError(f"partial_rotary_factor {self.partial_rotary_factor} must leave an even rotary dimension")

  @property
  def jnp_dtype(self) -> jnp.dtype:
    return jnp.dtype(self.dtype)

  @property
  def rotary_dim(self) -> int:
    return int(self.head_dim * self.partial_rotary_factor)

  @property
  def stop_ids(self) -> tuple[int, ...]:
    """The tokens that end a row."""
    return () if self.eos_id is None else (self.eos_id,) if isinstance(self.eos_id, int) else self.eos_id

  def window(self, layer: int) -> int:
    """The layer's sliding window; 0 when it attends to every position."""
    return self.sliding_windows[layer] if self.sliding_windows else 0

  def to_json(self) -> str:
    return json.dumps(dataclasses.asdict(self), indent=2)

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(d) - names
    if unknown:
      raise ValueError(f"unknown model config fields: {sorted(unknown)}")
    d = dict(d)
    if isinstance(d.get("rope_scaling"), dict):
      d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
    if isinstance(d.get("moe"), dict):
      d["moe"] = MoeConfig(**{**d["moe"], "dense_layers": tuple(d["moe"].get("dense_layers", ()))})
    for name in ("eos_id", "sliding_windows"):  # JSON lists back to hashable tuples
      if isinstance(d.get(name), list):
        d[name] = tuple(d[name])
    return cls(**d)


def default_dtype() -> str:
  """fp32 on the CPU (where bf16 matmuls are several times slower), bf16 on accelerators."""
  return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def num_params(config: ModelConfig, active: bool = False) -> int:
  """Parameter count, from the config alone; `active`: only the experts one token runs are counted."""
  d, h, j, dh, v = config.dim, config.n_heads, config.n_kv_heads, config.head_dim, config.vocab_size
  attn = d * h * dh + 2 * d * j * dh + h * dh * d + (h * dh + 2 * j * dh) * config.qkv_bias
  norms = (4 if config.sandwich_norms else 2) * d + 2 * dh * config.qk_norm
  head = 0 if config.tie_embeddings else d * v
  return v * d + sum(attn + norms + mlp_params(config, i, active) for i in range(config.n_layers)) + d + head


def mlp_params(config: ModelConfig, layer: int, active: bool = False) -> int:
  """A layer's MLP parameters: a dense MLP's, or a mixture's (router, experts, shared experts)."""
  moe = config.moe
  if moe is None or not moe.sparse(layer):
    return 3 * config.dim * config.mlp_dim
  experts = moe.top_k if active else moe.experts
  return (config.dim * moe.experts + moe.experts * (moe.routing == "sigmoid")
          + 3 * config.dim * (experts * moe.expert_dim + moe.shared_dim))
