"""The KV cache: an explicit pytree with one length per row.

Layout (per layer): `k, v: [B*J, T, Dh]`, batch-major (row b*J + j), or heads-major (row j*B + b) when a
mesh splits kv heads over devices, so that each device's rows are the heads its attention weights produce
(see jspec/model/sharding.py). One flat leading axis is what the attention matmul consumes directly. A
`[B, T, J, Dh]` or `[B, J, T, Dh]` buffer needs a reshape before the matmul, and XLA on the CPU fuses that
reshape with the in-loop update and then copies the whole buffer every step (see tests/test_hlo.py). Each
layer has its own buffer, so no slice of a stacked `[N, ...]` buffer stands between the update and the
matmul either.

Paged (`page_table` set): each layer's buffers are a pool of pages, `[pages, J, PAGE_SIZE, Dh]`, and row b's
slots `[r*PAGE_SIZE, (r+1)*PAGE_SIZE)` live in page `page_table[b, r]`. A page is an attention block, so
attention reads a row's blocks through its page table. Rows may share a page (a common prefix) as long as
neither writes into it. A pool is read and written with its J kv heads whole (the axis a mesh splits), and
`heads_major` orders the rows attention makes of a block as contiguous caches order theirs.

Row b holds its tokens in slots `[0, lengths[b])`. Writing S new tokens puts them at `lengths[b]`;
anything past a row's length is stale and masked out, so rollback is only a smaller `lengths`.
"""
from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from jax import lax

from jspec.model.config import ModelConfig

# Attention reads the cache in blocks of this many slots, and only the blocks in use (see attention.py),
# so the cost of a step follows the tokens held, not the capacity. Capacities are multiples of it.
BLOCK_SIZE = 128
PAGE_SIZE = BLOCK_SIZE  # slots per page of a paged cache: one attention block


@flax.struct.dataclass
class KVCache:
  k: tuple[jax.Array, ...]  # N x [B*J, T, Dh]
  v: tuple[jax.Array, ...]  # N x [B*J, T, Dh]
  lengths: jax.Array  # [B] int32: slots in use in each row
  rope_len: jax.Array  # [B] int32: each row's final length, for length-dependent RoPE (`jspec.model.rope`)
  heads_major: bool = flax.struct.field(pytree_node=False, default=False)  # row j*B + b instead of b*J + j
  # `jspec.model.kernels.pallas_attention.Kernel`; None: the reference loop
  kernel: Any = flax.struct.field(pytree_node=False, default=None)
  page_table: jax.Array | None = None  # [B, R] int32: the pool page of each row's R pages; None: contiguous rows
  # A pool split over a mesh's data axis in this many shards of whole pages (`take_pages`)
  page_shards: int = flax.struct.field(pytree_node=False, default=1)
  # On a mesh, where the rows attention reads a pool's blocks into lie (a `NamedSharding` of `[B*J, ...]`)
  rows_sharding: Any = flax.struct.field(pytree_node=False, default=None)

  def row(self, b, j, batch: int, kv_heads: int):
    """The buffer row of batch row b's kv head j (contiguous rows)."""
    return j * batch + b if self.heads_major else b * kv_heads + j

  @property
  def kv_heads(self) -> int:
    return self.k[0].shape[0] // self.lengths.shape[0] if self.page_table is None else self.k[0].shape[1]

  @property
  def capacity(self) -> int:
    """Slots each row may hold."""
    return self.k[0].shape[1] if self.page_table is None else self.page_table.shape[1] * PAGE_SIZE

  def locate(self, slots_BxS: jax.Array) -> tuple:
    """The index into a buffer of each row's `slots_BxS`, all kv heads: `buf[index]` is `[B, J, S, Dh]`
    (contiguous) or `[B, S, J, Dh]` (paged, the heads a slice: a mesh's split of them stays on each device).
    A slot past a paged row's capacity is in no page (one past the pool's last, which a scatter drops)."""
    if self.page_table is None:
      batch = slots_BxS.shape[0]
      b, j = jnp.arange(batch)[:, None, None], jnp.arange(self.kv_heads)[None, :, None]
      return self.row(b, j, batch, self.kv_heads), slots_BxS[:, None, :]
    table = self.page_table
    page_BxS = jnp.take_along_axis(table, jnp.minimum(slots_BxS // PAGE_SIZE, table.shape[1] - 1), axis=1)
    return jnp.where(slots_BxS < self.capacity, page_BxS, self.k[0].shape[0]), slice(None), slots_BxS % PAGE_SIZE

  def read(self, buf: jax.Array, slots_BxS: jax.Array) -> jax.Array:
    """Each row's entries at `slots_BxS` of one of this cache's buffers: `[B, S, J, Dh]`."""
    at = self.locate(slots_BxS)
    if self.page_table is None:
      return buf[at].transpose(0, 2, 1, 3)
    return take_pages(buf, at[0], at[2], shards=self.page_shards)

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


def _by_shard(pool: jax.Array, page_BxN: jax.Array, shards: int, rest: tuple):
  """`pool` as `[shards, pages/shards, ...]`, and `page_BxN` (pool pages) and `rest` (arrays of B rows) as
  `[shards, B/shards, ...]` with the pages each shard's own; None when the B rows do not split over them."""
  batch = page_BxN.shape[0]
  if shards == 1 or batch % shards:
    return None
  per_shard = pool.shape[0] // shards
  split = lambda x: x.reshape(shards, batch // shards, *x.shape[1:])
  first = (jnp.arange(shards, dtype=page_BxN.dtype) * per_shard).reshape(shards, *[1] * page_BxN.ndim)
  return pool.reshape(shards, per_shard, *pool.shape[1:]), split(page_BxN) - first, tuple(map(split, rest))


def take_pages(pool: jax.Array, page_BxN: jax.Array, *slots_BxN: jax.Array, shards: int = 1) -> jax.Array:
  """`pool[page_BxN]` (`[B, N, J, PAGE_SIZE, Dh]`), or with `slots_BxN` the entries at those slots of the
  pages (`pool[page, :, slot]`: `[B, N, J, Dh]`). On a pool split over `shards` data shards, rows
  `[d B/D, (d+1) B/D)` read shard d's pages (the engine gives them only those), each shard indexing its own
  part of the pool, so that a mesh's partitioner moves nothing between them."""
  take = (lambda p, page, slot: p[page, :, slot]) if slots_BxN else (lambda p, page: p[page])
  local = _by_shard(pool, page_BxN, shards, slots_BxN)
  if local is None:
    return take(pool, page_BxN, *slots_BxN)
  out = jax.vmap(take)(local[0], local[1], *local[2])
  return out.reshape(page_BxN.shape[0], *out.shape[2:])


def put_entries(pool: jax.Array, page_BxS: jax.Array, slots_BxS: jax.Array, new_BxSxJxDh: jax.Array,
                shards: int = 1) -> jax.Array:
  """`pool` with `new_BxSxJxDh` at `pool[page, :, slot]` (pages past the pool's dropped), by data shard as
  `take_pages` reads them."""
  put = lambda p, page, slot, new: p.at[page, :, slot].set(new.astype(p.dtype), mode="drop")
  local = _by_shard(pool, page_BxS, shards, (slots_BxS, new_BxSxJxDh))
  if local is None:
    return put(pool, page_BxS, slots_BxS, new_BxSxJxDh)
  return jax.vmap(put)(local[0], local[1], *local[2]).reshape(pool.shape)


def paged(cache: KVCache, page_table_BxR: jax.Array, pages: int) -> KVCache:
  """`cache` (empty) as a pool of `pages` pages read through `page_table_BxR`."""
  shape = (pages, cache.kv_heads, PAGE_SIZE, cache.k[0].shape[2])
  zeros = lambda bufs: tuple(jnp.zeros(shape, b.dtype) for b in bufs)
  return cache.replace(k=zeros(cache.k), v=zeros(cache.v), page_table=page_table_BxR.astype(jnp.int32))


def put_heads_major_rows(tree, state, fresh, slot: jax.Array):
  """`tree` (a decode state) with each heads-major cache's rows of batch rows `[slot, slot + R)` taken from
  `fresh` (a state of R rows) and the rest from `state`: in a heads-major buffer a batch row's kv heads lie
  B rows apart, so the buffer is seen as `[J, B, T, Dh]` and updated along B."""
  is_cache = lambda x: isinstance(x, KVCache)

  def put(c, old, new):
    if not (is_cache(c) and c.heads_major):
      return c
    j = c.kv_heads
    rows = lambda x, y: lax.dynamic_update_slice_in_dim(
        x.reshape(j, -1, *x.shape[1:]), y.reshape(j, -1, *y.shape[1:]).astype(x.dtype), slot, 1).reshape(x.shape)
    return c.replace(k=tuple(map(rows, old.k, new.k)), v=tuple(map(rows, old.v, new.v)))
  return jax.tree.map(put, tree, state, fresh, is_leaf=is_cache)


def _paged_caches(fn, tree, *rest):
  """`fn` applied to each paged cache of `tree` (with the matching parts of `rest`, of the same structure)."""
  is_cache = lambda x: isinstance(x, KVCache)
  return jax.tree.map(lambda c, *r: fn(c, *r) if is_cache(c) and c.page_table is not None else c, tree, *rest,
                      is_leaf=is_cache)


def take_pools(tree, source):
  """`tree` (a decode state) with its paged caches' pools taken from `source`'s (a state of the same
  structure): what a prefill into a running batch's pools starts from, or leaves."""
  return _paged_caches(lambda c, s: c.replace(k=s.k, v=s.v), tree, source)


def with_page_table(tree, page_table_BxR):
  """`tree` (a decode state) with every paged cache reading through `page_table_BxR`, each from a buffer of
  its own (a program that donates the state takes each buffer once)."""
  return _paged_caches(lambda c: c.replace(page_table=jnp.array(page_table_BxR, jnp.int32)), tree)


# Up to this many rows, each row gets its own in-place dynamic_update_slice (a vmapped one becomes a select
# over the whole buffer). Larger batches use one scatter, so the program does not grow with the batch.
MAX_UNROLLED_ROWS = 16


def write(cache: KVCache, buf: jax.Array, new_BxSxJxDh: jax.Array) -> jax.Array:
  """Writes row b's S new entries at slots `[lengths[b], lengths[b] + S)` of one of `cache`'s buffers (through
  its page table when paged: one scatter).

  Callers guarantee `lengths + S <= capacity` (checked before tracing): a dynamic_update_slice would clamp
  and overwrite the last slots, and the scatter drops what falls outside.
  """
  batch, seq, kv_heads, _ = new_BxSxJxDh.shape
  lengths_B = cache.lengths
  new_BxJxSxDh = new_BxSxJxDh.transpose(0, 2, 1, 3).astype(buf.dtype)
  contiguous = cache.page_table is None
  if contiguous and batch <= MAX_UNROLLED_ROWS and not cache.heads_major:  # a row's J heads adjacent: one update
    for b in range(batch):
      buf = lax.dynamic_update_slice(buf, new_BxJxSxDh[b], (b * kv_heads, lengths_B[b], 0))
    return buf
  if contiguous and batch * kv_heads <= MAX_UNROLLED_ROWS:
    for b in range(batch):
      for j in range(kv_heads):
        buf = lax.dynamic_update_slice(buf, new_BxJxSxDh[b, j:j + 1], (cache.row(b, j, batch, kv_heads),
                                                                        lengths_B[b], 0))
    return buf
  at = cache.locate(lengths_B[:, None] + jnp.arange(seq))
  if contiguous:
    return buf.at[at].set(new_BxJxSxDh, mode="drop")
  return put_entries(buf, at[0], at[2], new_BxSxJxDh, cache.page_shards)
