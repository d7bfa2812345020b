"""Pallas kernels for `attention.cached_attention` on TPUs and GPUs: the same contract as its reference loop.

Queries are cut into tiles (a prefill's thousands of queries do not fit on chip at once), and each tile of
a row reads the cache only over the blocks its queries can see (`_tile_ranges`), keeping an online softmax
in fp32. The block update (`_update`) is shared, so the two kernels differ only in how they walk the blocks:
- TPU (Mosaic): a grid of (row groups, query tiles, cache blocks). The index map clamps the block index into
  the tile's visible range, so a block outside it repeats the previous index and is not fetched again; the
  kernel body skips it. A group holds up to 8 cache rows (a row's kv heads, batch-major).
- GPU (Triton): a program per (cache row, query tile) looping over its visible blocks, as jax's decode
  attention does. Triton wants power-of-two tiles, so queries and tree entries are padded; a head dim that
  is not a power of two is refused (`--attention xla` runs the reference).

Tree rows see a tree entry when it is an ancestor (`tree_XxQSxA`): the entry of each slot is picked with a
one-hot matmul, which both backends lower (a gather does not). On a mesh the kernel runs under `shard_map`
over the cache's row split, each device on its own rows: attention is independent per row.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec

from jspec.model.cache import BLOCK_SIZE
from jspec.model.masking import MASKED, scores, visible

if TYPE_CHECKING:
  from jspec.model.queries import QueryRows

ROWS_PER_STEP = 8  # TPU: cache rows one grid step attends for (a Llama-3 row's 8 kv heads)
QUERY_ROWS_PER_STEP = 512  # TPU: rows x queries of one grid step (its fp32 accumulators stay ~1 MB in VMEM)
GPU_QUERY_TILE = 64  # GPU: queries per program


KERNEL_PLATFORMS = {"tpu": "tpu", "gpu": "gpu"}  # a kernel's backend -> the jax platform it compiles for
KERNEL_NAMES = {"tpu": "TPU (Mosaic)", "gpu": "GPU (Triton)"}


@dataclasses.dataclass(frozen=True)
class Kernel:
  """A Pallas kernel for cached attention (`jspec.model.kernels.pallas_attention`), static in a program: hashable."""
  backend: str  # "tpu" or "gpu"
  interpret: bool = False  # run through Pallas' interpreter (on a CPU)
  mesh: Any = None  # the program's mesh: the kernel then runs on each device over its own cache rows
  row_spec: Any = None  # how the cache's row axis is split on that mesh (a PartitionSpec entry)

  @property
  def name(self) -> str:
    """What reads the caches, for reports."""
    return f"Pallas {KERNEL_NAMES[self.backend]} kernel{' (interpreted)' * self.interpret}"


def attention_name(kernel: Kernel | None) -> str:
  """A program's attention, for reports: a kernel's name, or the reference loop's."""
  return "XLA loop" if kernel is None else kernel.name


def platform_of(mesh) -> str:
  """The platform a program on `mesh` is compiled for: its devices' (which may be another machine's), or
  this machine's backend (no mesh, or a planned one without devices)."""
  devices = getattr(mesh, "devices", None)
  return devices.flat[0].platform if devices is not None else jax.default_backend()


def select_kernel(attention: str, platform: str, head_dim: int | None = None) -> Kernel | None:
  """The kernel `--attention` asks for on a program for `platform` ("cpu", "tpu", "gpu"); None: the
  reference loop. `attention` is one of `ATTENTION_CHOICES` (`make_decoder` checks). A kernel for another
  accelerator than the program's is refused; on a CPU it is interpreted. `auto` runs the loop where the
  kernel cannot: the GPU's for a head dim that is not a power of two."""
  if attention == "auto":
    if platform == "gpu" and head_dim is not None and head_dim & (head_dim - 1):
      return None
    return next((Kernel(b) for b, p in KERNEL_PLATFORMS.items() if p == platform), None)
  if attention == "xla":
    return None
  if platform not in (KERNEL_PLATFORMS[attention], "cpu"):
    raise ValueError(f"the {attention} attention kernel does not run on {platform}")
  return Kernel(attention, interpret=platform == "cpu")


def attend(kernel: Kernel, rows: QueryRows, k_XxTxDh: jax.Array, v_XxTxDh: jax.Array, window: int,
           softcap: float | None, page_table_BxR: jax.Array | None = None, page_shards: int = 1) -> jax.Array:
  """Attention of `rows`' queries over the cache: [X, QS, Dh] in the cache's dtype (the reference's fp32
  result, rounded). With `page_table_BxR`, the caches are pools of pages (`jspec.model.cache`), split over
  `page_shards` data shards."""
  head_dim = k_XxTxDh.shape[-1]
  if kernel.backend == "gpu" and head_dim & (head_dim - 1):
    raise ValueError(f"the GPU attention kernel needs a power-of-two head dim, not {head_dim}: use --attention xla")
  run = functools.partial(_tpu if kernel.backend == "tpu" else _gpu, window=window, softcap=softcap,
                          seq=rows.seq, interpret=kernel.interpret)
  per_row = (rows.q_XxQSxDh, rows.qpos_XxQS, rows.start_X) + (
      () if rows.tree_XxQSxA is None else (rows.tree_XxQSxA,))

  split = kernel.row_spec if isinstance(kernel.row_spec, tuple) else (kernel.row_spec,)
  heads_split = "model" in split  # heads-major rows (`jspec.model.sharding`)
  data = "data" if page_shards > 1 else None

  def call(k, v, table, *per_row):
    if table is None:
      return run(per_row[0], k, v, *per_row[1:])
    if data:  # this shard's part of the pool: its own pages, numbered from its first
      table = table - lax.axis_index("data") * k.shape[0]
    # The paged kernels read batch-major rows; on a mesh that splits kv heads the rows are heads-major.
    heads, batch = k.shape[1], table.shape[0]
    swap = lambda x, h, b: x.reshape(h, b, *x.shape[1:]).swapaxes(0, 1).reshape(x.shape)
    if heads_split:
      per_row = tuple(swap(x, heads, batch) for x in per_row)
    q, *rest = per_row
    out = run(q, k, v, *rest, table=table)
    return swap(out, batch, heads) if heads_split else out

  if kernel.mesh is not None:  # each device on its own rows, and (paged) its kv heads of its shard's pages
    rows_spec = PartitionSpec(kernel.row_spec)
    paged = page_table_BxR is not None
    cache_spec = PartitionSpec(data, "model" if heads_split else None) if paged else rows_spec
    call = jax.shard_map(call, mesh=kernel.mesh, check_vma=False, out_specs=rows_spec,
                         in_specs=(cache_spec, cache_spec, PartitionSpec(data), *(rows_spec,) * len(per_row)))
  return call(k_XxTxDh, v_XxTxDh, page_table_BxR, *per_row)


def _cost(q: jax.Array, capacity: int, cache_bytes: int) -> pl.CostEstimate:
  """What XLA's cost analysis counts for a kernel: every query over a row's whole capacity (a full context;
  the kernel reads only the blocks in use), and the caches (or pools) read once."""
  rows, queries, head_dim = q.shape
  logits = rows * queries * capacity
  return pl.CostEstimate(flops=4 * logits * head_dim, transcendentals=logits,
                         bytes_accessed=2 * cache_bytes + 2 * q.nbytes)


def _padded(x: jax.Array, axis: int, size: int, mode: str = "constant") -> jax.Array:
  return jnp.pad(x, [(0, size - x.shape[axis]) if a == axis else (0, 0) for a in range(x.ndim)], mode=mode)


def _tiles(queries: int, most: int, multiple) -> tuple[int, int]:
  """(tiles, tile size) covering `queries` with tiles of at most `most`, each size rounded by `multiple`."""
  tiles = -(-queries // most)
  return tiles, multiple(-(-queries // tiles))


def _tile_ranges(qpos_XxQS: jax.Array, end_X: jax.Array, tree: bool, window: int, block: int, group: int,
                 tile: int) -> tuple[jax.Array, jax.Array]:
  """The cache blocks each (group of `group` rows, query tile) may see: first and one past the last, each
  [X / group, tiles]. A query at position p sees slots up to p (a tree's queries: up to the row's last
  entry, `end_X` - 1), and from p + 1 - window with a window. `qpos_XxQS` is padded to whole tiles."""
  rows, queries = qpos_XxQS.shape
  lo = jnp.maximum(qpos_XxQS + 1 - window, 0) if window else jnp.zeros_like(qpos_XxQS)
  hi = jnp.broadcast_to(end_X[:, None], qpos_XxQS.shape) if tree else qpos_XxQS + 1
  per_tile = lambda x, reduce: reduce(x.reshape(rows // group, group, queries // tile, tile), axis=(1, 3))
  return per_tile(lo, jnp.min) // block, -(-per_tile(hi, jnp.max) // block)


def _positions(start, tree, first_query, shape: tuple[int, ...], seq: int):
  """The positions of a tile's queries, [.., tile, 1], computed in the kernel (a [X, QS, 1] input would be
  padded to whole lanes in HBM): a chain's query g*S + s sits at the row's length + s, a tree node at the
  base + its depth (its ancestors but itself). Padded queries get positions they cannot use."""
  if tree is not None:
    return start + jnp.sum(tree, axis=-1, keepdims=True).astype(jnp.int32) - 1
  index = first_query + lax.broadcasted_iota(jnp.int32, shape, len(shape) - 2)
  return start + lax.rem(index, seq)


def _dot(a: jax.Array, b: jax.Array, contract_b: int) -> jax.Array:
  """a @ b over a's last axis and b's `contract_b`, batched over a leading row axis when there is one."""
  batch = ((0,), (0,)) if a.ndim == 3 else ((), ())
  precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
  return lax.dot_general(a, b, (((a.ndim - 1,), (contract_b,)), batch), precision=precision,
                         preferred_element_type=jnp.float32)


def _update(q, k, v, qpos, kpos, base, tree, window: int, softcap: float | None, carry):
  """One cache block's step of the online softmax, for one row ([QS, ...]) or a group of rows ([G, QS, ...]).

  q [.., QS, Dh]; k, v [.., T, Dh]; qpos [.., QS, 1]; kpos [1, T] slots; base [.., 1, 1] and tree
  [.., QS, A] for tree rows; carry (max [.., QS, 1], sum [.., QS, 1], acc [.., QS, Dh]), fp32."""
  max_, sum_, acc = carry
  contract = k.ndim - 1
  s = scores(_dot(q, k, contract), softcap)
  seen = visible(kpos, qpos, window)
  if tree is not None:  # tree entries: ancestors only, picked by a one-hot matmul over the entries
    rel = kpos - base  # [.., 1, T]
    entry = lax.broadcasted_iota(jnp.int32, (*rel.shape[:-2], tree.shape[-1], rel.shape[-1]), rel.ndim - 2)
    ancestor = _dot(tree.astype(jnp.float32), (entry == rel).astype(jnp.float32), contract - 1) > 0.5
    before = jnp.broadcast_to(rel, seen.shape) < 0  # Mosaic broadcasts and selects no booleans
    seen = (before & seen) | (~before & ancestor)
  s = jnp.where(seen, s, MASKED)
  new_max = jnp.maximum(max_, s.max(-1, keepdims=True))
  p = jnp.exp(s - new_max)
  rescale = jnp.exp(max_ - new_max)
  return new_max, sum_ * rescale + p.sum(-1, keepdims=True), acc * rescale + _dot(p.astype(v.dtype), v, contract - 1)


def _tpu(q, k, v, qpos, start, tree=None, table=None, *, window, softcap, seq, interpret):
  """Contiguous caches [X, T, Dh], or (with the page table `table` [B, R]) pools [pages, J, BLOCK_SIZE, Dh],
  whose grid steps take one batch row's J kv heads and fetch each block from its page."""
  from jax.experimental.pallas import tpu as pltpu
  rows, head_dim = q.shape[0], k.shape[-1]
  capacity = k.shape[1] if table is None else table.shape[1] * BLOCK_SIZE
  block, asked = min(BLOCK_SIZE, capacity), q.shape[1]
  kv_heads = None if table is None else k.shape[1]
  most = QUERY_ROWS_PER_STEP if table is None else max(QUERY_ROWS_PER_STEP // kv_heads, 8)
  tiles, tile = _tiles(asked, most, lambda n: -(-n // 8) * 8)  # sublane multiples
  group = kv_heads or max(g for g in range(1, min(ROWS_PER_STEP, QUERY_ROWS_PER_STEP // tile) + 1)
                          if rows % g == 0)
  q, qpos = _padded(q, 1, tiles * tile), _padded(qpos, 1, tiles * tile, "edge")
  end = start + (seq if tree is None else tree.shape[2])
  first_blk, end_blk = _tile_ranges(qpos, end, tree is not None, window, block, group, tile)
  tree_args, tree_specs = (), []
  if tree is not None:  # Mosaic takes the mask as numbers, its entries in whole lanes
    entries = -(-tree.shape[2] // 128) * 128
    tree_args = (_padded(_padded(tree, 1, tiles * tile), 2, entries).astype(jnp.float32),)
    tree_specs = [pl.BlockSpec((group, tile, entries), lambda g, t, i, *_: (g, t, 0))]
  per_tile = lambda g, t, i, *_: (g, t, 0)
  visible_block = lambda g, t, i, first_ref, end_ref, *_: jnp.clip(i, first_ref[g, t], end_ref[g, t] - 1)
  if table is None:
    kv_spec = pl.BlockSpec((group, block, head_dim), lambda g, t, i, *refs: (g, visible_block(g, t, i, *refs), 0))
  else:  # the page of batch row g's visible block, its J heads
    kv_spec = pl.BlockSpec((None, group, block, head_dim),
                           lambda g, t, i, *refs: (refs[2][g, visible_block(g, t, i, *refs)], 0, 0, 0))
  prefetch = (first_blk, end_blk) + (() if table is None else (table,))
  nblocks = capacity // block

  def kernel(first_ref, end_ref, *refs):
    if table is not None:
      refs = refs[1:]  # the page table: read by the index maps only
    q_ref, k_ref, v_ref, start_ref, *refs = refs
    *tree_ref, o_ref, max_ref, sum_ref, acc_ref = refs
    g, t, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)

    @pl.when(i == 0)
    def _():
      max_ref[...] = jnp.full(max_ref.shape, MASKED, jnp.float32)
      sum_ref[...] = jnp.zeros(sum_ref.shape, jnp.float32)
      acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when((i >= first_ref[g, t]) & (i < end_ref[g, t]))
    def _():
      kpos = i * block + lax.broadcasted_iota(jnp.int32, (1, block), 1)
      tree_ = tree_ref[0][...] if tree_ref else None
      start_ = start_ref[...]
      qpos_ = _positions(start_, tree_, t * tile, (1, tile, 1), seq)
      carry = _update(q_ref[...], k_ref[...], v_ref[...], qpos_, kpos, start_, tree_, window, softcap,
                      (max_ref[...], sum_ref[...], acc_ref[...]))
      max_ref[...], sum_ref[...], acc_ref[...] = carry

    @pl.when(i == nblocks - 1)
    def _():
      o_ref[...] = (acc_ref[...] / sum_ref[...]).astype(o_ref.dtype)

  out = pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=len(prefetch), grid=(rows // group, tiles, nblocks),
          in_specs=[pl.BlockSpec((group, tile, head_dim), per_tile), kv_spec, kv_spec,
                    pl.BlockSpec((group, 1, 1), lambda g, t, i, *_: (g, 0, 0)), *tree_specs],
          out_specs=pl.BlockSpec((group, tile, head_dim), per_tile),
          scratch_shapes=[pltpu.VMEM((group, tile, 1), jnp.float32), pltpu.VMEM((group, tile, 1), jnp.float32),
                          pltpu.VMEM((group, tile, head_dim), jnp.float32)]),
      out_shape=jax.ShapeDtypeStruct((rows, tiles * tile, head_dim), q.dtype),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
      interpret=interpret, cost_estimate=_cost(q, capacity, k.nbytes),
  )(*prefetch, q, k, v, start[:, None, None], *tree_args)
  return out[:, :asked]


def _pow2(n: int) -> int:
  return max(16, 1 << (n - 1).bit_length())  # Triton's smallest matmul tile is 16


def _gpu(q, k, v, qpos, start, tree=None, table=None, *, window, softcap, seq, interpret):
  """Contiguous caches [X, T, Dh], or (with the page table `table` [B, R]) pools [pages, J, BLOCK_SIZE, Dh]:
  a program reads its kv head of each visible block's page."""
  from jax.experimental.pallas import triton as plgpu
  rows, head_dim = q.shape[0], k.shape[-1]
  capacity = k.shape[1] if table is None else table.shape[1] * BLOCK_SIZE
  block, asked = min(BLOCK_SIZE, capacity), q.shape[1]
  tiles, tile = _tiles(asked, GPU_QUERY_TILE, _pow2)
  q, qpos = _padded(q, 1, tiles * tile), _padded(qpos, 1, tiles * tile, "edge")
  end = start + (seq if tree is None else tree.shape[2])
  first_blk, end_blk = _tile_ranges(qpos, end, tree is not None, window, block, 1, tile)
  # Per (row, tile): its first and one-past-last visible block, and the row's first slot (a tile of 8).
  meta = jnp.stack([first_blk, end_blk, jnp.broadcast_to(start[:, None], first_blk.shape)], 2)
  meta = _padded(meta.astype(jnp.int32), 2, 8)
  tree_args, tree_specs = (), []
  if tree is not None:
    tree_args = (_padded(_padded(tree, 1, tiles * tile), 2, _pow2(tree.shape[2])).astype(jnp.int32),)
    tree_specs = [pl.BlockSpec((None, tile, tree_args[0].shape[2]), lambda x, t: (x, t, 0))]

  whole_row = lambda x, t: (x, 0, 0)
  if table is None:
    kv_spec, table_args, table_specs = pl.BlockSpec((None, capacity, head_dim), whole_row), (), []
  else:  # every page of the program's kv head, and its batch row's page table
    kv_heads = k.shape[1]
    kv_spec = pl.BlockSpec((k.shape[0], None, block, head_dim), lambda x, t: (0, x % kv_heads, 0, 0))
    table_args, table_specs = (table,), [pl.BlockSpec((None, table.shape[1]), lambda x, t: (x // kv_heads, 0))]

  def kernel(q_ref, k_ref, v_ref, meta_ref, *refs):
    table_ref, refs = (refs[0], refs[1:]) if table is not None else (None, refs)
    *tree_ref, o_ref = refs
    qs, start_ = q_ref[...], meta_ref[2]
    tree_ = tree_ref[0][...] if tree_ref else None
    qpos_ = _positions(start_, tree_, pl.program_id(1) * tile, (tile, 1), seq)

    def body(i, carry):
      at = (pl.ds(i * block, block), slice(None)) if table_ref is None else (table_ref[i], slice(None), slice(None))
      kpos = i * block + lax.broadcasted_iota(jnp.int32, (1, block), 1)
      return _update(qs, k_ref[at], v_ref[at], qpos_, kpos, start_, tree_, window, softcap, carry)

    init = (jnp.full((tile, 1), MASKED, jnp.float32), jnp.zeros((tile, 1), jnp.float32),
            jnp.zeros((tile, head_dim), jnp.float32))
    _, sum_, acc = lax.fori_loop(meta_ref[0], meta_ref[1], body, init)
    o_ref[...] = (acc / sum_).astype(o_ref.dtype)

  per_tile = lambda x, t: (x, t, 0)
  out = pl.pallas_call(
      kernel, grid=(rows, tiles),
      in_specs=[pl.BlockSpec((None, tile, head_dim), per_tile), kv_spec, kv_spec,
                pl.BlockSpec((None, None, 8), per_tile), *table_specs, *tree_specs],
      out_specs=pl.BlockSpec((None, tile, head_dim), per_tile),
      out_shape=jax.ShapeDtypeStruct((rows, tiles * tile, head_dim), q.dtype),
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
      interpret=interpret, cost_estimate=_cost(q, capacity, k.nbytes),
  )(q, k, v, meta, *table_args, *tree_args)
  return out[:, :asked]
