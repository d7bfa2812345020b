"""Attention over the KV cache, reading only the blocks in use.

Shapes (the legend in `jspec/__init__.py`): the cache's leading axis X = B*J rows (batch-major, or
heads-major on a mesh), each kv head serving Q = H / J query heads.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jspec.cache import BLOCK_SIZE


def cached_attention(q_BxSxHxDh: jax.Array, k_XxTxDh: jax.Array, v_XxTxDh: jax.Array,
                     lengths_B: jax.Array, heads_major: bool = False) -> jax.Array:
  """Causal attention of S new queries over a cache that already holds them.

  Query i of row b sits at slot `lengths[b] + i` and sees slots `j <= lengths[b] + i`. The loop runs over
  `ceil((max(lengths) + S) / BLOCK_SIZE)` blocks with an online softmax, so a step costs what the rows
  hold, not what the cache could hold.
  """
  batch, seq, heads, head_dim = q_BxSxHxDh.shape
  rows, capacity, _ = k_XxTxDh.shape
  kv_heads = rows // batch
  group = heads // kv_heads
  block = min(BLOCK_SIZE, capacity)
  scale = head_dim ** -0.5

  # Queries in the cache's row order: [B, J, Q, S] (or [J, B, Q, S]) flattened to [X, Q*S].
  to_rows = (1, 0, 2, 3) if heads_major else (0, 1, 2, 3)
  q_BxJxQxSxDh = q_BxSxHxDh.reshape(batch, seq, kv_heads, group, head_dim).transpose(0, 2, 3, 1, 4)
  q_XxQSxDh = (q_BxJxQxSxDh.transpose(*to_rows, 4).reshape(rows, group * seq, head_dim) * scale
               ).astype(k_XxTxDh.dtype)
  qpos_BxS = lengths_B[:, None] + jnp.arange(seq)[None, :]
  qpos_XxQS = jnp.broadcast_to(qpos_BxS[:, None, None, :], (batch, kv_heads, group, seq)
                               ).transpose(*to_rows).reshape(rows, -1)
  num_blocks = (jnp.max(lengths_B) + seq + block - 1) // block

  def attend_block(i, carry):
    max_XxQS, sum_XxQS, acc_XxQSxDh = carry
    k_blk = lax.dynamic_slice_in_dim(k_XxTxDh, i * block, block, axis=1)
    v_blk = lax.dynamic_slice_in_dim(v_XxTxDh, i * block, block, axis=1)
    s_XxQSxT = jnp.einsum("xqd,xtd->xqt", q_XxQSxDh, k_blk, preferred_element_type=jnp.float32)
    kpos_T = i * block + jnp.arange(block)
    s_XxQSxT = jnp.where(kpos_T[None, None, :] <= qpos_XxQS[:, :, None], s_XxQSxT, -jnp.inf)
    new_max = jnp.maximum(max_XxQS, s_XxQSxT.max(-1))  # finite: block 0 always holds slot 0
    p_XxQSxT = jnp.exp(s_XxQSxT - new_max[..., None])
    rescale = jnp.exp(max_XxQS - new_max)
    pv = jnp.einsum("xqt,xtd->xqd", p_XxQSxT.astype(v_blk.dtype), v_blk, preferred_element_type=jnp.float32)
    return new_max, sum_XxQS * rescale + p_XxQSxT.sum(-1), acc_XxQSxDh * rescale[..., None] + pv

  init = (jnp.full((rows, group * seq), -jnp.inf, jnp.float32), jnp.zeros((rows, group * seq), jnp.float32),
          jnp.zeros((rows, group * seq, head_dim), jnp.float32))
  _, sum_XxQS, acc = lax.fori_loop(0, num_blocks, attend_block, init)
  out = (acc / sum_XxQS[..., None]).reshape(*((kv_heads, batch) if heads_major else (batch, kv_heads)),
                                            group, seq, head_dim).transpose(*to_rows, 4)  # [B, J, Q, S, Dh]
  return out.transpose(0, 3, 1, 2, 4).reshape(batch, seq, heads, head_dim).astype(q_BxSxHxDh.dtype)


def causal_attention(q_BxSxHxDh: jax.Array, k_BxSxJxDh: jax.Array, v_BxSxJxDh: jax.Array) -> jax.Array:
  """Plain causal attention over one full sequence: the reference the cached path is tested against."""
  group = q_BxSxHxDh.shape[2] // k_BxSxJxDh.shape[2]
  k = jnp.repeat(k_BxSxJxDh, group, axis=2)
  v = jnp.repeat(v_BxSxJxDh, group, axis=2)
  s_BxHxSxS = jnp.einsum("bqhd,bkhd->bhqk", q_BxSxHxDh, k, preferred_element_type=jnp.float32)
  s_BxHxSxS = s_BxHxSxS * q_BxSxHxDh.shape[-1] ** -0.5
  seq = q_BxSxHxDh.shape[1]
  causal = jnp.tril(jnp.ones((seq, seq), bool))
  p = jax.nn.softmax(jnp.where(causal, s_BxHxSxS, -jnp.inf), axis=-1)
  return jnp.einsum("bhqk,bkhd->bqhd", p.astype(v.dtype), v).astype(q_BxSxHxDh.dtype)
