"""Weight-only quantized linear layers: int8 or fp8 (e4m3) values with float32 scales, held in the parameter
tree as Qwix `QArray`s (`qvalue [I,O]`, `scale`), so sharding, checkpoints and the jitted loop see ordinary
pytrees.

Formats (a model's `ModelConfig.quantization`):
- "int8": symmetric int8, one scale per output channel (absmax / 127.5, Qwix's
  bound: the largest magnitudes round to 127 or -128);
- "fp8": float8_e4m3fn, one scale per output channel (absmax / 448). Compressed-tensors FP8 checkpoints load
  as this format; a per-tensor scale becomes the same scale on every channel (the same weights exactly);
- "fp8-block": float8_e4m3fn with one scale per 128 x 128 block (`quant_method: "fp8"` checkpoints:
  Qwen3-*-FP8, DeepSeek-V3). Quantizing a float model to it is also possible.

The attention projections and the MLP are quantized (`LINEARS`); embeddings, the LM head and norms stay in
the model's dtype, as the published FP8 checkpoints keep them. Activations stay in the model's dtype.

Qwix (and the flax.nnx and optax it imports) loads with the first quantized weight, not with the decode loop.
"""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

if TYPE_CHECKING:
  from qwix import QArray

QTYPES = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn, "fp8-block": jnp.float8_e4m3fn}
BLOCK = 128  # fp8-block's tile, both ways
LINEARS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def is_qarray(x: Any) -> bool:
  """Whether `x` is a quantized weight (none exists before Qwix is imported)."""
  return "qwix" in sys.modules and isinstance(x, sys.modules["qwix"].QArray)


def quantize(w_IxO: jax.Array, fmt: str) -> QArray:
  """A float weight [I,O] in `fmt`, symmetric, scaled by its absolute maximum per channel or per block."""
  import qwix
  if fmt == "fp8-block":
    if w_IxO.shape[0] % BLOCK or w_IxO.shape[1] % BLOCK:
      raise ValueError(f"fp8-block needs weights in whole {BLOCK} x {BLOCK} blocks; one is {w_IxO.shape}")
    return qwix.quantize(w_IxO, QTYPES[fmt], tiled_axes={0: BLOCK, 1: BLOCK}, scale_dtype=jnp.float32)
  return qwix.quantize(w_IxO, QTYPES[fmt], channelwise_axes=[1], scale_dtype=jnp.float32)


def from_stored(values_IxO: jax.Array, scale: jax.Array) -> QArray:
  """A checkpoint's quantized weight as jspec holds it: `scale` holds one value per output channel (any
  shape of O elements), one for the whole tensor, or one per block [I/128, O/128]; kept in float32."""
  scale = jnp.asarray(scale, jnp.float32)
  if scale.size in (1, values_IxO.shape[1]):
    scale = jnp.broadcast_to(scale.reshape(1, -1), (1, values_IxO.shape[1]))
  elif scale.shape != (values_IxO.shape[0] // BLOCK, values_IxO.shape[1] // BLOCK):
    raise ValueError(f"a weight of {values_IxO.shape} with scales of {scale.shape}: neither per channel, per "
                     f"tensor nor per {BLOCK} x {BLOCK} block")
  from qwix import QArray
  return QArray(values_IxO, scale, None, values_IxO.dtype)


def columns(w_IxO: jax.Array | QArray, start: int, stop: int) -> jax.Array | QArray:
  """Output channels [start, stop) of a float or quantized weight (a fused projection's part)."""
  if not is_qarray(w_IxO):
    return w_IxO[:, start:stop]
  if not per_channel(w_IxO) and (start % BLOCK or stop % BLOCK):
    raise ValueError(f"a fused projection splits at column {start or stop}, inside a {BLOCK}-wide block of scales")
  tile = 1 if per_channel(w_IxO) else BLOCK
  from qwix import QArray
  return QArray(w_IxO.qvalue[:, start:stop], w_IxO.scale[:, start // tile:stop // tile], None, w_IxO.qtype)


def quantize_params(params: Any, fmt: str | None) -> Any:
  """Every weight named in `LINEARS` (at any depth) in `fmt`; the rest as it was. `None`: unchanged."""
  if fmt is None:
    return params
  if isinstance(params, dict):
    return {k: quantize(v, fmt) if k in LINEARS and not is_qarray(v) else quantize_params(v, fmt)
            for k, v in params.items()}
  if isinstance(params, (list, tuple)):
    return type(params)(quantize_params(v, fmt) for v in params)
  return params


def dequantize_params(params: Any, dtype) -> Any:
  """The float model that the quantized one computes with: each `QArray` as `values * scale` in `dtype`."""
  return jax.tree.map(lambda x: dequantize(x).astype(dtype) if is_qarray(x) else x, params, is_leaf=is_qarray)


def dequantize(w: QArray) -> jax.Array:
  """`values * scale`, in float32."""
  import qwix
  return qwix.dequantize(w)


def linear(x: jax.Array, w: jax.Array | QArray) -> jax.Array:
  """`x @ w` for a float or quantized weight, in `x`'s dtype.

  A scale per output channel factors out of the contraction, so the dot reads the stored values converted to
  `x`'s dtype (exact: int8 and e4m3 fit bf16) and the scale multiplies its output. A block's scale varies
  along the contraction, so that weight is dequantized to `x`'s dtype first.
  (Qwix's own `dot_general` with a float left side dequantizes to the scale's dtype, float32, and then runs
  the dot in float32 as well.)
  """
  if not is_qarray(w):
    return x @ w
  if not per_channel(w):
    return x @ dequantize(w).astype(x.dtype)
  y = jnp.matmul(x, w.qvalue.astype(x.dtype), preferred_element_type=jnp.float32)
  return (y * w.scale[0]).astype(x.dtype)


def is_quantized(params: Any) -> bool:
  return any(map(is_qarray, jax.tree.leaves(params, is_leaf=is_qarray)))


def per_channel(w: QArray) -> bool:
  return w.scale.shape == (1, w.qvalue.shape[1])
