"""The memory plan: what a batch needs on each device (weights, KV caches, workspace) against what a device
has, the largest batch and context that fit, and the refusal of what does not, before anything is
allocated or compiled.

The weights and caches are counted from the abstract shapes (`jax.eval_shape`: nothing is allocated), each
divided as `jspec.model.sharding` splits it over the mesh. The workspace is everything else the decode program
holds at its peak (activations, logits, the token buffer, the statistics): `estimated_workspace` is the
formula the refusal uses without compiling, and `jspec.planning.shaped` reads it from XLA where a plan may compile.
What the devices have comes from `jspec.core.machine`.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from jspec.core.machine import device_memory
from jspec.decoding import batches, loop
from jspec.decoding.batches import Batch
from jspec.decoding.decoder import Decoder
from jspec.model import cache as kvcache
from jspec.model import sharding
from jspec.model.config import num_params
from jspec.model.kernels import pallas_attention
from jspec.speculation.sampling import sampling_arrays

GB = 1e9


def nbytes(tree: Any) -> int:
  return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def _shards(spec: PartitionSpec, sizes: dict[str, int]) -> int:
  """How many pieces a spec cuts an array into."""
  axes = [a for part in spec if part is not None for a in (part if isinstance(part, tuple) else (part,))]
  return math.prod(sizes[a] for a in axes)


def _per_device(tree: Any, specs: Any, sizes: dict[str, int]) -> int:
  sizes = jax.tree.map(lambda x, s: nbytes(x) // _shards(s, sizes), tree, specs,
                       is_leaf=lambda x: isinstance(x, PartitionSpec))
  return sum(jax.tree.leaves(sizes))


@dataclasses.dataclass(frozen=True)
class PlannedMesh:
  """What the sharding rules read of a mesh, its axis sizes: a plan needs no devices."""
  shape: dict[str, int]


def planned_mesh(sizes: dict[str, int]) -> PlannedMesh:
  return PlannedMesh({**{a: 1 for a in sharding.AXES}, **sizes})


def axis_sizes(mesh) -> dict[str, int]:
  """Each mesh axis's size (1 for every axis without a mesh); `mesh_shape` elsewhere is the tuple of them."""
  return {a: 1 for a in sharding.AXES} if mesh is None else dict(mesh.shape)


def abstract_batch(decoder: Decoder, batch: int, prompt_width: int, capacity: int, pages: int | None = None,
                   prefill: bool = False) -> Batch:
  """The shapes of a `Batch` of `batch` rows (nothing allocated, whatever its size); with `pages`, rows read
  their caches through page tables into pools of that many pages (`prefill`: a server's prefill of a prompt
  after its cached pages, as `jspec.engine.batcher.Batcher.batch` makes it)."""
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  sampling = jax.tree.map(lambda x: jax.ShapeDtypeStruct((batch, *np.shape(x)[1:]), np.asarray(x).dtype),
                          sampling_arrays(batches.GREEDY, 1))
  paged = {} if pages is None else {"page_table_BxR": i32(batch, capacity // kvcache.PAGE_SIZE), "pages": pages}
  if prefill:
    paged.update(cached_B=i32(batch), prefill_width=prompt_width)
  return Batch(**paged, prompts_BxP=i32(batch, prompt_width), prompt_lens_B=i32(batch), max_new_tokens_B=i32(batch),
                  sampling=sampling, seeds_B=jax.ShapeDtypeStruct((batch,), jnp.uint32),
                  stop_BxE=i32(batch, max(1, len(decoder.target_config.stop_ids))),
                  speculate_B=jax.ShapeDtypeStruct((batch,), jnp.bool_),
                  share_B=jax.ShapeDtypeStruct((batch,), jnp.bool_), capacity=capacity)


@dataclasses.dataclass(frozen=True)
class Usage:
  """Bytes one device holds for a batch, by what holds them."""
  weights_bytes: int
  draft_weights_bytes: int
  kv_cache_bytes: int
  draft_kv_cache_bytes: int
  workspace_bytes: int

  @property
  def total_bytes(self) -> int:
    return (self.weights_bytes + self.draft_weights_bytes + self.kv_cache_bytes + self.draft_kv_cache_bytes
            + self.workspace_bytes)


def estimated_workspace(decoder: Decoder, batch: int, prompt_width: int, prefill_rows: int | None = None,
                        model_shards: int = 1, scores_in_memory: bool = True) -> int:
  """The activations' peak on one device, without compiling:
  - per row, ten fp32 vocabulary rows for each token a round verifies (logits, probabilities, the draft's q,
    their residuals);
  - per row prefilled together (default all), per prompt token, twice one layer's activations in the model's
    dtype (XLA keeps the next layer's beside the current one): three model-width rows (the residual stream,
    the attention's projected output, the MLP's input), this device's share (`model_shards`) of the
    queries, keys, values and attention output and of the MLP's two hidden rows (a mixture's: its top-k
    experts' and the shared experts'), and the feature layers a
    head drafter keeps;
  - `scores_in_memory` (the XLA loop; a kernel keeps them on chip): six fp32 rows of a block's scores per
    query head per prompt token.
  The constants are set against XLA's TPU compiles (docs/hardware.md); on a CPU the estimate bounds what
  `jspec.planning.shaped.compiled_workspace` measures (tests/test_memory.py)."""
  config = decoder.target_config
  share = lambda n: -(-n // model_shards)
  verified = decoder.verify_width
  prefill_rows = batch if prefill_rows is None else prefill_rows
  moe = config.moe  # a token's hidden rows: its experts' and the shared experts', or a dense layer's
  mlp = config.mlp_dim if moe is None else max(moe.top_k * moe.expert_dim + moe.shared_dim,
                                               config.mlp_dim if moe.dense_layers else 0)
  layer = (3 * config.dim + 2 * (share(config.n_heads) + share(config.n_kv_heads)) * config.head_dim
           + 2 * share(mlp))
  per_prompt_token = ((2 * layer + len(decoder.feature_layers) * config.dim) * jnp.dtype(config.jnp_dtype).itemsize
                      + scores_in_memory * 6 * 4 * config.n_heads * kvcache.BLOCK_SIZE)
  return 4 * batch * 10 * verified * config.vocab_size + prefill_rows * prompt_width * per_prompt_token


def scores_in_memory(decoder: Decoder, platform: str) -> bool:
  """Whether the attention a program for `platform` runs holds its scores in memory: the XLA loop, or a
  kernel Pallas interprets."""
  kernel = decoder.kernel(decoder.target_config.head_dim, platform)
  return kernel is None or kernel.interpret


def usage(decoder: Decoder, batch: int, prompt_width: int, capacity: int, mesh=None, shard_draft: bool = True,
          workspace_per_row: float | None = None, prefill_rows: int | None = None,
          platform: str | None = None) -> Usage:
  """What one device holds for `batch` rows of `capacity` cache slots, prompts padded to `prompt_width`
  (`prefill_rows` of them prefilled together; default all). `workspace_per_row`: a measured workspace
  (`jspec.planning.shaped.compiled_workspace` / rows), else `estimated_workspace` for the attention a program for
  `platform` runs (default: the mesh's devices')."""
  shape = axis_sizes(mesh)
  plan_mesh = planned_mesh(shape)
  target_config, drafter = decoder.target_config, decoder.drafter
  draft_config = getattr(drafter, "config", None) if shard_draft else None
  weights = _per_device(decoder.target_params, sharding.param_specs(decoder.target_params, target_config, plan_mesh),
                        shape)
  draft_weights = 0
  if decoder.drafter_params is not None:
    specs = (sharding.param_specs(decoder.drafter_params, draft_config, plan_mesh) if draft_config is not None
             else jax.tree.map(lambda _: PartitionSpec(), decoder.drafter_params))
    draft_weights = _per_device(decoder.drafter_params, specs, shape)
  state = jax.eval_shape(loop.init_state, decoder, abstract_batch(decoder, batch, prompt_width, capacity))

  def cache_bytes(tree, config) -> int:
    spec = sharding.cache_layout(batch, config, plan_mesh).spec
    is_cache = lambda x: isinstance(x, kvcache.KVCache)
    caches = [x for x in jax.tree.leaves(tree, is_leaf=is_cache) if is_cache(x)]
    others = [x for x in jax.tree.leaves(tree, is_leaf=is_cache) if not is_cache(x)]
    return sum(nbytes((c.k, c.v)) // _shards(spec, shape) + nbytes((c.lengths, c.rope_len)) for c in caches) \
        + nbytes(others)
  kv = cache_bytes(state.target_cache, target_config)
  draft_kv = cache_bytes(state.drafter_state, draft_config)
  rows_here = batch // shape["data"] if batch % shape["data"] == 0 else batch
  rest = nbytes(state) - nbytes((state.target_cache, state.drafter_state))
  if workspace_per_row is not None:
    activations = workspace_per_row * rows_here
  else:
    scores = scores_in_memory(decoder, platform or pallas_attention.platform_of(mesh))
    activations = estimated_workspace(decoder, rows_here, prompt_width,
                                      None if prefill_rows is None else min(prefill_rows, rows_here), shape["model"],
                                      scores)
  return Usage(weights, draft_weights, kv, draft_kv, int(rest + activations))


EXPERT_WEIGHTS = ("we_gate_up", "we_down")


@dataclasses.dataclass(frozen=True)
class Experts:
  """A mixture-of-experts target's experts, and what one device holds of them."""
  per_layer: int
  per_token: int  # experts a token runs in each sparse layer
  sparse_layers: int
  params: int  # every expert's, every layer's
  bytes_per_device: int
  total_params: int  # the target's
  active_params: int  # the target's parameters one token runs

  @classmethod
  def of(cls, decoder: Decoder, mesh=None) -> Experts | None:
    config = decoder.target_config
    if config.moe is None:
      return None
    sparse = [layer for layer in decoder.target_params["layers"] if "router" in layer]
    experts = [{name: layer[name] for name in EXPERT_WEIGHTS} for layer in sparse]
    specs = sharding.param_specs(experts, config, planned_mesh(axis_sizes(mesh)))
    return cls(config.moe.experts, config.moe.top_k, len(sparse), sum(x.size for x in jax.tree.leaves(experts)),
               _per_device(experts, specs, axis_sizes(mesh)), num_params(config), num_params(config, active=True))

  def to_json(self) -> dict:
    return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Plan:
  """A batch's memory on each device against the device's, with the largest batch (at this context) and
  context (tokens a row holds, at this batch) that fit."""
  batch: int
  context: int
  prompt_len: int
  capacity: int  # cache slots per row: the context, a round's headroom, in blocks
  devices: int
  usage: Usage
  workspace_source: str  # "compiled" (memory_analysis) or "estimate"
  device_memory_bytes: int
  memory_source: str
  max_batch: int
  max_context: int
  pages: int | None = None  # serving: the paged KV cache's pages of `kvcache.PAGE_SIZE` tokens that fit (0: none)
  page_shards: int = 1  # serving on a mesh: the data shards that split the pages (`page_shards`)
  experts: Experts | None = None  # a mixture-of-experts target's

  @property
  def fits(self) -> bool:
    return self.usage.total_bytes <= self.device_memory_bytes

  def to_json(self) -> dict:
    return {"batch": self.batch, "context": self.context, "prompt_len": self.prompt_len,
            "capacity": self.capacity, "devices": self.devices, **dataclasses.asdict(self.usage),
            "total_bytes": self.usage.total_bytes, "workspace_source": self.workspace_source,
            "device_memory_bytes": self.device_memory_bytes, "device_memory_source": self.memory_source,
            "fits": self.fits, "max_batch": self.max_batch, "max_context": self.max_context,
            **({} if self.pages is None else {"kv_pages": self.pages, "kv_pages_per_device": self.pages_per_device}),
            **({} if self.experts is None else {"experts": self.experts.to_json()})}

  @property
  def pages_per_device(self) -> int | None:
    """The pages each device holds (its kv heads' share of each): those of its data shard."""
    return None if self.pages is None else self.pages // self.page_shards

  def rows_at(self, tokens: int) -> int:
    """Rows of `tokens` tokens a server's pages hold at once (at most its slots)."""
    return min(self.batch, (self.pages or 0) // -(-tokens // kvcache.PAGE_SIZE))

  def refusal(self) -> str:
    u = self.usage
    where = "per device" if self.devices > 1 else ""
    largest = []
    if self.max_batch:
      largest.append(f"at most {self.max_batch} rows fit at this context")
    if self.max_context:
      largest.append(f"{self.max_context:,} tokens per row fit at this batch")
    return (f"{self.batch} rows of {self.context:,} tokens need {gb(u.total_bytes)}{' ' + where if where else ''} "
            f"(weights {gb(u.weights_bytes + u.draft_weights_bytes)}, KV caches "
            f"{gb(u.kv_cache_bytes + u.draft_kv_cache_bytes)}, workspace {gb(u.workspace_bytes)}), but "
            f"{gb(self.device_memory_bytes)} is available ({self.memory_source}): "
            + (" or ".join(largest) or "not even one row of the shortest context fits"))


def gb(n: int) -> str:
  """Bytes as GB, or MB below one GB, to three figures."""
  return f"{n / GB:.3g} GB" if n >= GB else f"{n / 1e6:.3g} MB"


def shape(decoder: Decoder, context: int, prompt_len: int, serving: bool = False) -> tuple[int, int]:
  """(padded prompt width, cache slots per row) for rows of `context` tokens, `prompt_len` of them prompt.

  A batch (`jspec.generate`) pads its prompts to their bucket and sizes its caches in the capacity buckets
  it compiles (`jspec.model.cache.round_capacity`). A serving engine (`serving`) takes any prompt up to its
  context, so it pads to the context's bucket, and sizes its caches once, in whole blocks."""
  if serving:
    needed = max(context + decoder.headroom + 1, batches.prompt_bucket(context))
    return batches.prompt_bucket(max(context - 1, 1)), -(-needed // kvcache.BLOCK_SIZE) * kvcache.BLOCK_SIZE
  width = batches.prompt_bucket(prompt_len)
  return width, kvcache.round_capacity(max(context + decoder.headroom + 1, width))


def make_plan(decoder: Decoder, batch: int, context: int, prompt_len: int, *, mesh=None, shard_draft: bool = True,
              memory: tuple[int, str] | None = None, workspace_per_row: float | None = None,
              serving: bool = False, platform: str | None = None) -> Plan:
  """The plan for `batch` rows holding `context` tokens each, of which `prompt_len` are prompt, against
  `memory` per device (default `device_memory(mesh)`). A batch prefills its rows together; a serving
  engine (`serving`) one request at a time, with caches shaped as `shape` says. `workspace_per_row`: the
  workspace XLA reports (`jspec.planning.shaped.compiled_workspace_per_row`), else the estimate for `platform`'s
  attention (`usage`)."""
  prefill_rows = 1 if serving else None
  width, capacity = shape(decoder, context, prompt_len, serving)
  per_row, source = workspace_per_row, "estimate" if workspace_per_row is None else "compiled"
  memory = memory or device_memory(mesh)

  def need(rows: int, ctx: int) -> Usage:
    w, c = shape(decoder, ctx, min(prompt_len, max(ctx - 1, 1)), serving)
    return usage(decoder, rows, w, c, mesh, shard_draft, per_row, prefill_rows, platform)
  pages = None
  if serving and batch >= 1:
    try:
      pages = pool_pages(decoder, batch, context, None, mesh, shard_draft, memory)
    except ValueError:  # not even one page fits
      pages = 0
  return Plan(batch, context, prompt_len, capacity, math.prod(axis_sizes(mesh).values()), need(batch, context),
              source, memory[0], memory[1], max_batch(need, context, memory[0], axis_sizes(mesh)["data"]),
              max_context(need, batch, decoder.context_len, memory[0]), pages, page_shards(mesh, batch),
              Experts.of(decoder, mesh))


def max_batch(need, context: int, memory: int, data: int) -> int:
  """The most rows (a multiple of the mesh's data axis) of `context` tokens that fit: the need grows by
  the same bytes with every `data` rows."""
  one, two = need(data, context).total_bytes, need(2 * data, context).total_bytes
  if one > memory:
    return 0
  rows = data * (1 + (memory - one) // max(two - one, 1))
  while rows > data and need(rows, context).total_bytes > memory:  # rounding at the edge
    rows -= data
  return int(rows)


def max_context(need, batch: int, limit: int, memory: int) -> int:
  """The most tokens a row may hold at `batch` rows, up to `limit` (the model's context)."""
  lo, hi = 0, limit
  while lo < hi:  # the need grows with the context: the largest that fits
    mid = (lo + hi + 1) // 2
    lo, hi = (mid, hi) if need(batch, mid).total_bytes <= memory else (lo, mid - 1)
  return lo


def check(decoder: Decoder, batch: int, context: int, prompt_len: int, mesh=None, shard_draft: bool = True,
          serving: bool = False, memory: tuple[int, str] | None = None) -> None:
  """Raises a one-line ValueError when `batch` rows of `context` tokens (`prompt_len` of them prompt; the
  caches shaped as `shape` says) do not fit the device: the weights, the caches and the estimated
  workspace. The line says what they need, what there is, and the largest batch or context that fits."""
  memory = memory or device_memory(mesh)
  width, capacity = shape(decoder, context, prompt_len, serving)
  if usage(decoder, batch, width, capacity, mesh, shard_draft, None, 1 if serving else None).total_bytes > memory[0]:
    raise ValueError(make_plan(decoder, batch, context, prompt_len, mesh=mesh, shard_draft=shard_draft,
                               memory=memory, serving=serving).refusal())


def page_shards(mesh, slots: int) -> int:
  """The data shards a server's pool of pages splits into on `mesh`: its data axis where that splits the
  slots (as it splits contiguous rows), else 1."""
  data = axis_sizes(mesh)["data"]
  return data if slots % data == 0 else 1


def pool_pages(decoder: Decoder, slots: int, max_len: int, pages: int | None = None, mesh=None,
               shard_draft: bool = True, memory: tuple[int, str] | None = None) -> int:
  """The usable pages of a serving engine's paged caches (`jspec.engine.pages`): `pages`, or as many as fit beside
  the weights and the workspace, at most every slot's whole context; a multiple of the pool's data shards
  (`page_shards`: each device holds its shard's pages, and a scratch page). A one-line ValueError when the
  pool asked for, or a single page, does not fit."""
  memory = memory or device_memory(mesh)
  width, capacity = shape(decoder, max_len, max_len - 1, serving=True)
  need = usage(decoder, slots, width, capacity, mesh, shard_draft, None, 1)
  caches = need.kv_cache_bytes + need.draft_kv_cache_bytes
  per_row = capacity // kvcache.PAGE_SIZE
  page_bytes = caches / (slots * per_row)  # per device, of the pages of all shards together
  shards = page_shards(mesh, slots)
  fit = (int((memory[0] - (need.total_bytes - caches)) // page_bytes) - shards) // shards * shards  # less scratch
  wanted = min(fit, slots * per_row) if pages is None else pages - pages % shards
  if wanted > fit or wanted < 1:
    raise ValueError(f"{max(wanted, 1)} KV pages of {kvcache.PAGE_SIZE} tokens need "
                     f"{gb(int((max(wanted, 1) + 1) * page_bytes))} beside {gb(need.total_bytes - caches)} of weights "
                     f"and workspace, but {gb(memory[0])} is available ({memory[1]}): "
                     + (f"at most {fit} pages fit" if fit >= 1 else "not even one page fits"))
  return wanted

