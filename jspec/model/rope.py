"""Rotary position embeddings with transformers' scalings (linear, dynamic NTK, llama3, yarn).

Frequencies are computed once per trace, in numpy, from the config; only dynamic NTK depends on the
sequence's length, which under `jit` is pinned to each row's final length (`rope_len_B`: prompt plus
max_new_tokens in the decode loop, the sequence length in a full forward), so every position of a request
is rotated as a full forward over the finished sequence would rotate it.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jspec.model.config import RopeScaling


def _default(theta: float, dim: int) -> np.ndarray:
  return 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)


def _llama3(inv_freq: np.ndarray, s: RopeScaling) -> np.ndarray:
  old = s.original_max_position_embeddings
  wavelen = 2 * math.pi / inv_freq
  scaled = np.where(wavelen > old / s.low_freq_factor, inv_freq / s.factor, inv_freq)
  smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
  medium = (wavelen >= old / s.high_freq_factor) & (wavelen <= old / s.low_freq_factor)
  return np.where(medium, (1 - smooth) * scaled / s.factor + smooth * scaled, scaled)


def yarn_attention_factor(s: RopeScaling) -> float:
  if s.attention_factor is not None:
    return s.attention_factor
  mscale = lambda scale, m=1.0: 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
  if s.mscale and s.mscale_all_dim:
    return mscale(s.factor, s.mscale) / mscale(s.factor, s.mscale_all_dim)
  return mscale(s.factor)


def _yarn(theta: float, dim: int, s: RopeScaling) -> np.ndarray:
  def correction_dim(rotations: float) -> float:
    return dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))
  low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
  if s.truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, dim - 1)
  ramp = np.clip((np.arange(dim // 2) - low) / ((high + 0.001 if low == high else high) - low), 0, 1)
  extrapolation = 1 - ramp
  pos_freqs = theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
  return (1 / (s.factor * pos_freqs)) * (1 - extrapolation) + (1 / pos_freqs) * extrapolation


def frequencies(theta: float, dim: int, scaling: RopeScaling | None) -> tuple[np.ndarray, float]:
  """(inv_freq [dim/2], the factor on cos and sin) for every scaling but dynamic NTK."""
  if scaling is None or scaling.type == "dynamic":
    return _default(theta, dim), 1.0
  if scaling.type == "linear":
    return _default(theta, dim) / scaling.factor, 1.0
  if scaling.type == "llama3":
    return _llama3(_default(theta, dim), scaling), 1.0
  return _yarn(theta, dim, scaling), yarn_attention_factor(scaling)


def _dynamic_inv_freq(theta: float, dim: int, s: RopeScaling, rope_len_B: jax.Array) -> jax.Array:
  """[B, dim/2]: dynamic NTK's frequencies for rows of the given final lengths."""
  limit = s.max_position_embeddings
  length = jnp.maximum(rope_len_B.astype(jnp.float32), limit)
  base = theta * ((s.factor * length / limit) - (s.factor - 1)) ** (dim / (dim - 2))
  return 1.0 / base[:, None] ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)


def apply(x_BxSxHxDh: jax.Array, positions_BxS: jax.Array, theta: float, rotary_dim: int,
          scaling: RopeScaling | None, rope_len_B: jax.Array | None) -> jax.Array:
  """Rotates the first `rotary_dim` dimensions of each head, in the rotate-half layout of Hugging Face
  checkpoints; the rest pass through."""
  if scaling is not None and scaling.type == "dynamic":
    if rope_len_B is None:
      rope_len_B = jnp.max(positions_BxS, axis=1) + 1
    inv_freq = _dynamic_inv_freq(theta, rotary_dim, scaling, rope_len_B)[:, None, :]  # [B, 1, rotary_dim/2]
    factor = 1.0
  else:
    inv_freq, factor = frequencies(theta, rotary_dim, scaling)
    inv_freq = jnp.asarray(inv_freq, jnp.float32)[None, None, :]
  angles = (positions_BxS[..., None].astype(jnp.float32) * inv_freq)[:, :, None, :]  # [B, S, 1, rotary_dim/2]
  cos, sin = jnp.cos(angles) * factor, jnp.sin(angles) * factor
  rotary, rest = x_BxSxHxDh[..., :rotary_dim].astype(jnp.float32), x_BxSxHxDh[..., rotary_dim:]
  x1, x2 = jnp.split(rotary, 2, axis=-1)
  rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x_BxSxHxDh.dtype)
  return jnp.concatenate([rotated, rest], axis=-1) if rest.shape[-1] else rotated
