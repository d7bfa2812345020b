"""The KV cache: an explicit pytree with one length per row.

Layout (per layer): `k, v: [B*J, T, Dh]`, batch-major (row b*J + j), or heads-major (row j*B + b) when a
mesh splits kv heads over devices, so that each device's rows are the heads its attention weights produce
(see jspec/sharding.py). One flat leading axis is what the attention matmul consumes directly. A
`[B, T, J, Dh]` or `[B, J, T, Dh]` buffer needs a reshape before the matmul, and XLA on the CPU fuses that
reshape with the in-loop update and then copies the whole buffer every step (see tests/test_hlo.py). Each
layer has its own buffer, so no slice of a stacked `[N, ...]` buffer stands between the update and the
matmul either.

Row b holds its tokens in slots `[0, lengths[b])`. Writing S new tokens puts them at `lengths[b]`;
anything past a row's length is stale and masked out, so rollback is only a smaller `lengths`.
"""
from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from jax import lax

from jspec.config import ModelConfig

# Attention reads the cache in blocks of this many slots, and only the blocks in use (see attention.py),
# so the cost of a step follows the tokens held, not the capacity. Capacities are multiples of it.
BLOCK_SIZE = 128


@flax.struct.dataclass
class KVCache:
  k: tuple[jax.Array, ...]  # N x [B*J, T, Dh]
  v: tuple[jax.Array, ...]  # N x [B*J, T, Dh]
  lengths: jax.Array  # [B] int32: slots in use in each row
  rope_len: jax.Array  # [B] int32: each row's final length, for length-dependent RoPE (`jspec.rope`)
  heads_major: bool = flax.struct.field(pytree_node=False, default=False)  # row j*B + b instead of b*J + j
  kernel: Any = flax.struct.field(pytree_node=False, default=None)  # jspec.pallas_attention.Kernel; None: reference

  def row(self, b, j, batch: int, kv_heads: int):
    """The buffer row of batch row b's kv head j."""
    return j * batch + b if self.heads_major else b * kv_heads + j

  def rewind(self, lengths_B: jax.Array) -> KVCache:
    """Rolls each row back (or forward over slots already written) to `lengths_B`. Nothing is copied."""
    return self.replace(lengths=lengths_B.astype(jnp.int32))


CAPACITY_STEPS = 8  # capacity buckets per doubling past 8 blocks: at most 1/8 more slots than asked for


def round_capacity(tokens: int) -> int:
  """The capacity bucket that holds `tokens`: a whole number of BLOCK_SIZE blocks, up to 8 blocks exactly,
  then rounded up to one of `CAPACITY_STEPS` steps per doubling (9, 10, ... 16, 18, 20, ... blocks), so a
  cache reserves at most 12.5% more than it needs while a range of lengths compiles a few shapes per
  doubling (a context of 8192 reserves 9216 slots, not the next power of two's 16384)."""
  blocks = max(-(-tokens // BLOCK_SIZE), 1)
  step = 1 << max(blocks.bit_length() - CAPACITY_STEPS.bit_length(), 0)
  return BLOCK_SIZE * -(-blocks // step) * step


def init_cache(config: ModelConfig, batch: int, capacity: int, heads_major: bool = False) -> KVCache:
  if capacity % BLOCK_SIZE:
    raise ValueError(f"cache capacity {capacity} is not a multiple of {BLOCK_SIZE}")
  shape = (batch * config.n_kv_heads, capacity, config.head_dim)
  zeros = lambda: tuple(jnp.zeros(shape, config.jnp_dtype) for _ in range(config.n_layers))
  return KVCache(k=zeros(), v=zeros(), lengths=jnp.zeros((batch,), jnp.int32),
                 rope_len=jnp.zeros((batch,), jnp.int32), heads_major=heads_major)


# Up to this many rows, each row gets its own in-place dynamic_update_slice (a vmapped one becomes a select
# over the whole buffer). Larger batches use one scatter, so the program does not grow with the batch.
MAX_UNROLLED_ROWS = 16


def write(cache: KVCache, buf: jax.Array, new_BxSxJxDh: jax.Array) -> jax.Array:
  """Writes row b's S new entries at slots `[lengths[b], lengths[b] + S)` of one of `cache`'s buffers.

  Callers guarantee `lengths + S <= T` (checked before tracing): a dynamic_update_slice would clamp and
  overwrite the last slots, and the scatter drops what falls outside.
  """
  batch, seq, kv_heads, _ = new_BxSxJxDh.shape
  lengths_B = cache.lengths
  new_BxJxSxDh = new_BxSxJxDh.transpose(0, 2, 1, 3).astype(buf.dtype)
  if batch <= MAX_UNROLLED_ROWS and not cache.heads_major:  # a row's J heads are adjacent: one update
    for b in range(batch):
      buf = lax.dynamic_update_slice(buf, new_BxJxSxDh[b], (b * kv_heads, lengths_B[b], 0))
    return buf
  if batch * kv_heads <= MAX_UNROLLED_ROWS:
    for b in range(batch):
      for j in range(kv_heads):
        buf = lax.dynamic_update_slice(buf, new_BxJxSxDh[b, j:j + 1], (cache.row(b, j, batch, kv_heads),
                                                                        lengths_B[b], 0))
    return buf
  rows_BxJx1 = cache.row(jnp.arange(batch)[:, None], jnp.arange(kv_heads), batch, kv_heads)[:, :, None]
  slots_Bx1xS = (lengths_B[:, None] + jnp.arange(seq))[:, None, :]
  return buf.at[rows_BxJx1, slots_Bx1xS].set(new_BxJxSxDh, mode="drop")
