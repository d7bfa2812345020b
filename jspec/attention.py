"""Attention over the KV cache, reading only the blocks in use.

Shape legend: B batch, S new tokens, T cache capacity, H query heads, K kv heads, G = H // K query heads per
kv head, Dh head dim, X = B*K (the cache's leading axis: batch-major, or heads-major on a mesh).
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

  # Queries in the cache's row order: [B, K, G, S] (or [K, B, G, S]) flattened to [X, G*S].
  to_rows = (1, 0, 2, 3) if heads_major else (0, 1, 2, 3)
  q_BxKxGxSxDh = q_BxSxHxDh.reshape(batch, seq, kv_heads, group, head_dim).transpose(0, 2, 3, 1, 4)
  q_XxGSxDh = (q_BxKxGxSxDh.transpose(*to_rows, 4).reshape(rows, group * seq, head_dim) * scale
               ).astype(k_XxTxDh.dtype)
  qpos_BxS = lengths_B[:, None] + jnp.arange(seq)[None, :]
  qpos_XxGS = jnp.broadcast_to(qpos_BxS[:, None, None, :], (batch, kv_heads, group, seq)
                               ).transpose(*to_rows).reshape(rows, -1)
  num_blocks = (jnp.max(lengths_B) + seq + block - 1) // block

  def attend_block(i, carry):
    max_XxGS, sum_XxGS, acc_XxGSxDh = carry
    k_blk = lax.dynamic_slice_in_dim(k_XxTxDh, i * block, block, axis=1)
    v_blk = lax.dynamic_slice_in_dim(v_XxTxDh, i * block, block, axis=1)
    s_XxGSxT = jnp.einsum("xqd,xtd->xqt", q_XxGSxDh, k_blk, preferred_element_type=jnp.float32)
    kpos_T = i * block + jnp.arange(block)
    s_XxGSxT = jnp.where(kpos_T[None, None, :] <= qpos_XxGS[:, :, None], s_XxGSxT, -jnp.inf)
    new_max = jnp.maximum(max_XxGS, s_XxGSxT.max(-1))  # finite: block 0 always holds slot 0
    p_XxGSxT = jnp.exp(s_XxGSxT - new_max[..., None])
    rescale = jnp.exp(max_XxGS - new_max)
    pv = jnp.einsum("xqt,xtd->xqd", p_XxGSxT.astype(v_blk.dtype), v_blk, preferred_element_type=jnp.float32)
    return new_max, sum_XxGS * rescale + p_XxGSxT.sum(-1), acc_XxGSxDh * rescale[..., None] + pv

  init = (jnp.full((rows, group * seq), -jnp.inf, jnp.float32), jnp.zeros((rows, group * seq), jnp.float32),
          jnp.zeros((rows, group * seq, head_dim), jnp.float32))
  _, sum_XxGS, acc = lax.fori_loop(0, num_blocks, attend_block, init)
  out = (acc / sum_XxGS[..., None]).reshape(*((kv_heads, batch) if heads_major else (batch, kv_heads)),
                                            group, seq, head_dim).transpose(*to_rows, 4)  # [B, K, G, S, Dh]
  return out.transpose(0, 3, 1, 2, 4).reshape(batch, seq, heads, head_dim).astype(q_BxSxHxDh.dtype)


def causal_attention(q_BxSxHxDh: jax.Array, k_BxSxKxDh: jax.Array, v_BxSxKxDh: jax.Array) -> jax.Array:
  """Plain causal attention over one full sequence: the reference the cached path is tested against."""
  group = q_BxSxHxDh.shape[2] // k_BxSxKxDh.shape[2]
  k = jnp.repeat(k_BxSxKxDh, group, axis=2)
  v = jnp.repeat(v_BxSxKxDh, group, axis=2)
  s_BxHxSxS = jnp.einsum("bqhd,bkhd->bhqk", q_BxSxHxDh, k, preferred_element_type=jnp.float32)
  s_BxHxSxS = s_BxHxSxS * q_BxSxHxDh.shape[-1] ** -0.5
  seq = q_BxSxHxDh.shape[1]
  causal = jnp.tril(jnp.ones((seq, seq), bool))
  p = jax.nn.softmax(jnp.where(causal, s_BxHxSxS, -jnp.inf), axis=-1)
  return jnp.einsum("bhqk,bkhd->bqhd", p.astype(v.dtype), v).astype(q_BxSxHxDh.dtype)
