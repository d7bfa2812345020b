"""Attention over the KV cache, reading only the blocks in use.

Shapes (the legend in `jspec/__init__.py`): the cache's leading axis X = B*J rows (batch-major, or
heads-major on a mesh), each kv head serving Q = H / J query heads.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jspec.model import masking
from jspec.model.cache import BLOCK_SIZE, take_pages
from jspec.model.kernels import pallas_attention
from jspec.model.kernels.pallas_attention import Kernel
from jspec.model.queries import from_rows, query_rows


def cached_attention(q_BxSxHxDh: jax.Array, k_XxTxDh: jax.Array, v_XxTxDh: jax.Array, lengths_B: jax.Array,
                     heads_major: bool = False, window: int = 0, softcap: float | None = None,
                     scale: float | None = None, tree_BxSxA: jax.Array | None = None,
                     kernel: Kernel | None = None, page_table_BxR: jax.Array | None = None,
                     page_shards: int = 1, rows_sharding=None) -> jax.Array:
  """Causal attention of S new queries over a cache that already holds them.

  Query i of row b sits at slot `lengths[b] + i` and sees slots `j <= lengths[b] + i` (and, with a
  sliding `window`, `j > lengths[b] + i - window`). With a draft tree (`jspec.speculation.tree`), the S new entries
  are the last S of A tree entries written from slot `base = lengths[b] + S - A` on: query i sees the
  slots before `base` and tree entry j when `tree_BxSxA[b, i, j]` (j is i or an ancestor), and its
  position is `base` plus its depth (its ancestors but itself). Trees must be shallower than the window.
  `scale` multiplies the logits (default head_dim ** -0.5); `softcap` bounds them as Gemma 2 does.

  `kernel`: a Pallas kernel for the accelerator (`jspec.model.kernels.pallas_attention`); None runs the reference below,
  the CPU's path: a loop over the blocks of BLOCK_SIZE slots that some query can see, with an online
  softmax, so a step costs what the rows hold, not what the cache could hold. `page_table_BxR`: the cache
  is a pool of pages `[pages, J, BLOCK_SIZE, Dh]` (`jspec.model.cache`, batch-major), block i of row b in page
  `page_table_BxR[b, i]`, the pool split over `page_shards` data shards (`jspec.model.cache.take_pages`), and
  its blocks' rows laid out on a mesh as `rows_sharding` says.
  """
  batch, seq, heads, head_dim = q_BxSxHxDh.shape
  if page_table_BxR is None:
    rows, capacity, _ = k_XxTxDh.shape
    block_of = lambda buf, i: lax.dynamic_slice_in_dim(buf, i * block, block, axis=1)
  else:
    rows, capacity = batch * k_XxTxDh.shape[1], page_table_BxR.shape[1] * BLOCK_SIZE
    order = (1, 0, 2, 3) if heads_major else (0, 1, 2, 3)  # [B, J, ...] pages -> the query rows' order
    pin = (lambda x: x) if rows_sharding is None else (lambda x: lax.with_sharding_constraint(x, rows_sharding))
    block_of = lambda buf, i: pin(take_pages(buf, page_table_BxR[:, i], shards=page_shards).transpose(order).reshape(
        rows, BLOCK_SIZE, head_dim))
  rows_ = query_rows(q_BxSxHxDh, rows // batch, lengths_B, heads_major, scale, k_XxTxDh.dtype, tree_BxSxA)
  if kernel is not None and not (page_table_BxR is not None and batch % page_shards):
    # (rows that do not split over a pool's data shards, a server's prefill of one, run the loop below)
    out = pallas_attention.attend(kernel, rows_, k_XxTxDh, v_XxTxDh, window, softcap, page_table_BxR, page_shards)
    return from_rows(out, batch, seq, heads_major, q_BxSxHxDh.dtype)
  block = min(BLOCK_SIZE, capacity)
  q_XxQSxDh, qpos_XxQS, tree_XxQSxA = rows_.q_XxQSxDh, rows_.qpos_XxQS, rows_.tree_XxQSxA
  group_seq = q_XxQSxDh.shape[1]
  # From the [B] lengths, not the [X] rows: on a mesh that splits the rows, a reduction over them would be a
  # collective. The first query of a row: its length, or its tree's base.
  first_query_B = lengths_B if tree_XxQSxA is None else lengths_B + seq - tree_XxQSxA.shape[2]
  end_block = (jnp.max(lengths_B) + seq + block - 1) // block
  first_block = jnp.maximum(jnp.min(first_query_B) + 1 - window, 0) // block if window else 0

  def attend_block(i, carry):
    max_XxQS, sum_XxQS, acc_XxQSxDh = carry
    k_blk, v_blk = block_of(k_XxTxDh, i), block_of(v_XxTxDh, i)
    s_XxQSxT = masking.scores(jnp.einsum("xqd,xtd->xqt", q_XxQSxDh, k_blk, preferred_element_type=jnp.float32), softcap)
    kpos_T = i * block + jnp.arange(block)
    visible = masking.visible(kpos_T[None, None, :], qpos_XxQS[:, :, None], window)
    if tree_XxQSxA is not None:  # tree entries: ancestors only
      entries = tree_XxQSxA.shape[2]
      rel_XxT = kpos_T[None, :] - rows_.start_X[:, None]
      entry_XxQSxT = jnp.broadcast_to(jnp.clip(rel_XxT, 0, entries - 1)[:, None, :], (rows, group_seq, block))
      is_ancestor = jnp.take_along_axis(tree_XxQSxA, entry_XxQSxT, axis=2)
      visible = jnp.where((rel_XxT < 0)[:, None, :], visible, (rel_XxT < entries)[:, None, :] & is_ancestor)
    s_XxQSxT = jnp.where(visible, s_XxQSxT, masking.MASKED)
    new_max = jnp.maximum(max_XxQS, s_XxQSxT.max(-1))
    p_XxQSxT = jnp.exp(s_XxQSxT - new_max[..., None])
    rescale = jnp.exp(max_XxQS - new_max)
    pv = jnp.einsum("xqt,xtd->xqd", p_XxQSxT.astype(v_blk.dtype), v_blk, preferred_element_type=jnp.float32)
    return new_max, sum_XxQS * rescale + p_XxQSxT.sum(-1), acc_XxQSxDh * rescale[..., None] + pv

  init = (jnp.full((rows, group_seq), masking.MASKED, jnp.float32), jnp.zeros((rows, group_seq), jnp.float32),
          jnp.zeros((rows, group_seq, head_dim), jnp.float32))
  _, sum_XxQS, acc = lax.fori_loop(first_block, end_block, attend_block, init)
  return from_rows(acc / sum_XxQS[..., None], batch, seq, heads_major, q_BxSxHxDh.dtype)


def causal_attention(q_BxSxHxDh: jax.Array, k_BxSxJxDh: jax.Array, v_BxSxJxDh: jax.Array, window: int = 0,
                     softcap: float | None = None, scale: float | None = None) -> jax.Array:
  """Plain causal attention over one full sequence: the reference the cached path is tested against."""
  group = q_BxSxHxDh.shape[2] // k_BxSxJxDh.shape[2]
  k = jnp.repeat(k_BxSxJxDh, group, axis=2)
  v = jnp.repeat(v_BxSxJxDh, group, axis=2)
  s_BxHxSxS = jnp.einsum("bqhd,bkhd->bhqk", q_BxSxHxDh, k, preferred_element_type=jnp.float32)
  s_BxHxSxS = masking.scores(s_BxHxSxS * (q_BxSxHxDh.shape[-1] ** -0.5 if scale is None else scale), softcap)
  pos_S = jnp.arange(q_BxSxHxDh.shape[1])
  p = jax.nn.softmax(jnp.where(masking.visible(pos_S[None, :], pos_S[:, None], window), s_BxHxSxS, -jnp.inf), axis=-1)
  return jnp.einsum("bhqk,bkhd->bqhd", p.astype(v.dtype), v).astype(q_BxSxHxDh.dtype)


def masked_attention(q_BxQxHxDh: jax.Array, k_BxKxJxDh: jax.Array, v_BxKxJxDh: jax.Array, visible_BxQxK: jax.Array,
                     softcap: float | None = None, scale: float | None = None) -> jax.Array:
  """Attention of Q queries over K keys where `visible_BxQxK` says (every query must see one), as training lays
  out several drafts side by side (DFlash's blocks, a parallel draft's mask copies)."""
  group = q_BxQxHxDh.shape[2] // k_BxKxJxDh.shape[2]
  k, v = jnp.repeat(k_BxKxJxDh, group, axis=2), jnp.repeat(v_BxKxJxDh, group, axis=2)
  s = jnp.einsum("bqhd,bkhd->bhqk", q_BxQxHxDh, k, preferred_element_type=jnp.float32)
  s = masking.scores(s * (q_BxQxHxDh.shape[-1] ** -0.5 if scale is None else scale), softcap)
  p = jax.nn.softmax(jnp.where(visible_BxQxK[:, None], s, masking.MASKED), axis=-1)
  return jnp.einsum("bhqk,bkhd->bqhd", p.astype(v.dtype), v).astype(q_BxQxHxDh.dtype)
