"""Queries laid out per cache row, as the reference attention loop (`jspec.model.attention`) and the Pallas kernels
(`jspec.model.kernels.pallas_attention`) read them, and their outputs laid back.

Shapes (the legend in `jspec/__init__.py`): the cache's leading axis X = B*J rows (batch-major, or
heads-major on a mesh), each kv head serving Q = H / J query heads.
"""
from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


def _per_row(x_BxS: jax.Array, kv_heads: int, group: int, heads_major: bool) -> jax.Array:
  """A per-query value [B, S, ...] in the cache's row order, for each query head: [X, Q*S, ...]."""
  batch, seq = x_BxS.shape[:2]
  x = jnp.broadcast_to(x_BxS[:, None, None], (batch, kv_heads, group, *x_BxS.shape[1:]))
  x = jnp.swapaxes(x, 0, 1) if heads_major else x
  return x.reshape(batch * kv_heads, group * seq, *x_BxS.shape[2:])


@flax.struct.dataclass
class QueryRows:
  """S new queries per batch row, in the cache's row order: query head g of kv head j of row b is entry
  g*S + s of buffer row b*J + j (or j*B + b)."""
  q_XxQSxDh: jax.Array  # scaled, in the cache's dtype
  qpos_XxQS: jax.Array  # each query's position
  start_X: jax.Array  # the slot of a row's first new entry: its length, or its tree's base
  tree_XxQSxA: jax.Array | None = None  # trees: which entries each query sees
  seq: int = flax.struct.field(pytree_node=False, default=1)  # S: new queries per row and head

  @property
  def end_X(self) -> jax.Array:
    """One past the last slot a row's queries may see: its length + S (a tree's A entries end there)."""
    return self.start_X + (self.seq if self.tree_XxQSxA is None else self.tree_XxQSxA.shape[2])


def query_rows(q_BxSxHxDh: jax.Array, kv_heads: int, lengths_B: jax.Array, heads_major: bool,
               scale: float | None, dtype, tree_BxSxA: jax.Array | None) -> QueryRows:
  """The queries of `cached_attention` laid out per cache row, with what each may see."""
  batch, seq, heads, head_dim = q_BxSxHxDh.shape
  group = heads // kv_heads
  scale = head_dim ** -0.5 if scale is None else scale
  to_rows = (1, 0, 2, 3) if heads_major else (0, 1, 2, 3)
  q_BxJxQxSxDh = q_BxSxHxDh.reshape(batch, seq, kv_heads, group, head_dim).transpose(0, 2, 3, 1, 4)
  q_XxQSxDh = (q_BxJxQxSxDh.transpose(*to_rows, 4).reshape(batch * kv_heads, group * seq, head_dim) * scale
               ).astype(dtype)
  per_row = lambda x_BxS: _per_row(x_BxS, kv_heads, group, heads_major)
  if tree_BxSxA is None:
    start_B, tree_XxQSxA = lengths_B, None
    qpos_XxQS = per_row(lengths_B[:, None] + jnp.arange(seq)[None, :])
  else:
    start_B, tree_XxQSxA = lengths_B + seq - tree_BxSxA.shape[2], per_row(tree_BxSxA)
    qpos_XxQS = per_row(start_B[:, None] + jnp.sum(tree_BxSxA, -1) - 1)
  return QueryRows(q_XxQSxDh, qpos_XxQS, per_row(start_B[:, None])[:, 0], tree_XxQSxA, seq)


def from_rows(out_XxQSxDh: jax.Array, batch: int, seq: int, heads_major: bool, dtype) -> jax.Array:
  """`query_rows`' layout back to [B, S, H, Dh]."""
  rows, group_seq, head_dim = out_XxQSxDh.shape
  kv_heads, group = rows // batch, group_seq // seq
  to_rows = (1, 0, 2, 3) if heads_major else (0, 1, 2, 3)
  out = out_XxQSxDh.reshape(*((kv_heads, batch) if heads_major else (batch, kv_heads)), group, seq,
                            head_dim).transpose(*to_rows, 4)  # [B, J, Q, S, Dh]
  return out.transpose(0, 3, 1, 2, 4).reshape(batch, seq, kv_heads * group, head_dim).astype(dtype)
