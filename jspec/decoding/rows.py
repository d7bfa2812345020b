"""Row surgery for continuous batching: decoding a running batch's first rows only (`run_rows`), and
starting new requests in rows of a running state (`insert`).

Every per-row buffer of a `DecodeState` holds its rows as contiguous blocks along one axis; `_row_blocks`
finds that axis and block for each leaf by comparing the state's shapes for batches of one and two rows.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jspec.decoding.batches import Batch, make_batch
from jspec.decoding.decoder import Decoder
from jspec.decoding.loop import DecodeState, init_state, run, start
from jspec.model import cache as kvcache


def run_rows(decoder: Decoder, state: DecodeState, max_rounds: jax.Array | int | None = None,
             stop_at_finish: jax.Array | bool = False, retire_B: jax.Array | None = None, *,
             width: int, plain: bool = False) -> DecodeState:
  """`run` over the first `width` rows only (static: one program per width); the other rows must be done
  (idle slots). Done rows still cost their share of every batched forward, so a running batch whose busy
  rows fit a narrower width decodes faster in it. `retire_B` marks rows of any width to end first (aborted
  requests, idle slots). `plain`: as `run`'s."""
  if retire_B is not None:
    state = state.replace(done_B=state.done_B | retire_B)
  blocks = _state_row_blocks(decoder, state)
  leaves, treedef = jax.tree.flatten(state)
  narrow = [x if b is None else lax.slice_in_dim(x, 0, width * b[1], axis=b[0]) for x, b in zip(leaves, blocks)]
  narrow = jax.tree.leaves(run(decoder, jax.tree.unflatten(treedef, narrow), max_rounds, stop_at_finish, plain))
  return jax.tree.unflatten(treedef, [y if b is None else lax.dynamic_update_slice_in_dim(x, y, 0, b[0])
                                      for x, y, b in zip(leaves, narrow, blocks)])


def _state_row_blocks(decoder: Decoder, state: DecodeState) -> list[tuple[int, int] | None]:
  """`_row_blocks` for a running state: a batch of its shapes."""
  capacity, stop_width = state.tokens_BxT.shape[1], state.stop_BxE.shape[1]
  shape = None if state.constraint is None else state.constraint.bucket
  scored = state.logprobs
  batch = make_batch(decoder, [[0]], 1, capacity_slots=capacity, stop_width=stop_width, constraint_shape=shape,
                        logprobs=None if scored is None else [False],
                        top_logprobs=0 if scored is None else scored.top_BxTxN.shape[-1])
  table = state.target_cache.page_table
  if table is not None:  # a pool is batch-wide; its page table is per row
    batch = batch.replace(page_table_BxR=table[:1], pages=state.target_cache.k[0].shape[0])
  return _row_blocks(decoder, batch, capacity)


def insert(decoder: Decoder, state: DecodeState, batch: Batch, slot: jax.Array) -> DecodeState:
  """Starts `batch` (R rows) in rows `[slot, slot + R)` of a running state, as `start` would have in a
  state of their own: their tokens, caches, drafter state, sampling values, keys and per-row statistics
  are replaced; the batch-wide statistics keep counting. A heads-major cache (a mesh that splits kv heads)
  holds a row's heads apart, not as one block: `kvcache.put_heads_major_rows`."""
  capacity = state.tokens_BxT.shape[1]
  if decoder.drafter is not None:
    rows = batch.prompts_BxP.shape[0]
    ended = lambda x: lax.dynamic_slice_in_dim(x, slot, rows)
    state = state.replace(drafter_state=decoder.drafter.retire(
        state.drafter_state, ended(state.tokens_BxT), jnp.where(ended(state.share_B), ended(state.seq_lens_B), 0)))
  paged = state.target_cache.page_table is not None
  fresh = start(decoder, batch, capacity, state if paged else None)  # paged: prefilled into the pools
  leaves, treedef = jax.tree.flatten(state)
  new_leaves = [x if block is None else lax.dynamic_update_slice_in_dim(x, y.astype(x.dtype), slot * block[1],
                                                                        block[0])
                for x, y, block in zip(leaves, jax.tree.leaves(fresh), _row_blocks(decoder, batch, capacity))]
  inserted = jax.tree.unflatten(treedef, new_leaves)
  if paged:
    return kvcache.take_pools(inserted, fresh)
  return kvcache.put_heads_major_rows(inserted, state, fresh, slot)


def prefill_pages(decoder: Decoder, state: DecodeState, batch: Batch) -> DecodeState:
  """Prefills a chunk of `batch`'s prompts (`prefill_width` tokens from `cached_B`) into a running state's
  paged caches through their page tables; nothing else of the state changes (the rows start later, by
  `insert`, from where the chunks left off)."""
  return kvcache.take_pools(state, start(decoder, batch, state.tokens_BxT.shape[1], state))


def _row_blocks(decoder: Decoder, batch: Batch, capacity: int) -> list[tuple[int, int] | None]:
  """For each leaf of a `DecodeState`: (axis, rows of it per batch row), or None for a batch-wide leaf,
  found by comparing the state's shapes for batches of one and two rows."""
  def shapes(rows):
    as_batch = lambda x: jax.ShapeDtypeStruct((rows, *x.shape[1:]), x.dtype)
    return jax.tree.leaves(jax.eval_shape(lambda r: init_state(decoder, r, capacity),
                                          jax.tree.map(as_batch, batch)))
  blocks = []
  for one, two in zip(shapes(1), shapes(2)):
    axes = [i for i, (a, b) in enumerate(zip(one.shape, two.shape)) if a != b]
    blocks.append((axes[0], two.shape[axes[0]] - one.shape[axes[0]]) if axes else None)
  return blocks
