"""The memory plan: what a batch needs on each device (weights, KV caches, workspace) against what a device
has, the largest batch and context that fit, and the refusal of what does not, before anything is
allocated or compiled.

The weights and caches are counted from the abstract shapes (`jax.eval_shape`: nothing is allocated), each
divided as `jspec.sharding` splits it over the mesh. The workspace is everything else the decode program
holds at its peak (activations, logits, the token buffer, the statistics). `compiled_workspace` reads it
from XLA's `memory_analysis()` of the decode program built with one layer per model (a layer's temporaries
are reused by the next, so the figure does not grow with depth); `estimated_workspace` is the formula the
refusal uses without compiling.
"""
from __future__ import annotations

import dataclasses
import math
import os
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from jspec import cache as kvcache
from jspec import decode, request, sharding
from jspec.decoder import Decoder, make_decoder
from jspec.request import Requests
from jspec.sampling import sampling_arrays

GB = 1e9


def nbytes(tree: Any) -> int:
  return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def _shards(spec: PartitionSpec, mesh_shape: dict[str, int]) -> int:
  """How many pieces a spec cuts an array into."""
  axes = [a for part in spec if part is not None for a in (part if isinstance(part, tuple) else (part,))]
  return math.prod(mesh_shape[a] for a in axes)


def _per_device(tree: Any, specs: Any, mesh_shape: dict[str, int]) -> int:
  sizes = jax.tree.map(lambda x, s: nbytes(x) // _shards(s, mesh_shape), tree, specs,
                       is_leaf=lambda x: isinstance(x, PartitionSpec))
  return sum(jax.tree.leaves(sizes))


@dataclasses.dataclass(frozen=True)
class PlannedMesh:
  """What the sharding rules read of a mesh, its axis sizes: a plan needs no devices."""
  shape: dict[str, int]


def planned_mesh(sizes: dict[str, int]) -> PlannedMesh:
  return PlannedMesh({**{a: 1 for a in sharding.AXES}, **sizes})


def mesh_shape(mesh) -> dict[str, int]:
  return {a: 1 for a in sharding.AXES} if mesh is None else dict(mesh.shape)


def abstract_requests(decoder: Decoder, batch: int, prompt_width: int, capacity: int) -> Requests:
  """The shapes of a batch's requests (nothing allocated, whatever the batch)."""
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  sampling = jax.tree.map(lambda x: jax.ShapeDtypeStruct((batch, *np.shape(x)[1:]), np.asarray(x).dtype),
                          sampling_arrays(request.GREEDY, 1))
  return Requests(prompts_BxP=i32(batch, prompt_width), prompt_lens_B=i32(batch), max_new_tokens_B=i32(batch),
                  sampling=sampling, seeds_B=jax.ShapeDtypeStruct((batch,), jnp.uint32),
                  stop_BxE=i32(batch, max(1, len(decoder.target_config.stop_ids))),
                  speculate_B=jax.ShapeDtypeStruct((batch,), jnp.bool_), capacity=capacity)


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


def shaped_decoder(target, draft, spec, batch: int) -> Decoder:
  """`make_decoder` over models whose parameters may be shapes only (`jspec.loading.load_shapes`):
  a decoder of abstract arrays, nothing allocated."""
  with_params = lambda m, p: None if m is None else dataclasses.replace(m, params=p)
  return jax.eval_shape(lambda tp, dp: make_decoder(with_params(target, tp), with_params(draft, dp), spec, batch),
                        target.params, None if draft is None else draft.params)


def estimated_workspace(decoder: Decoder, batch: int, prompt_width: int, prefill_rows: int | None = None) -> int:
  """The activations' peak, without compiling: per row, ten fp32 vocabulary rows for each token a round
  verifies (logits, probabilities, the draft's q, their residuals), and per row prefilled together (default
  all), per prompt token, eight fp32 model-width rows (the prefill's residual stream and the features head
  drafters keep) and two fp32 rows of attention scores over a cache block per head. It bounds what
  `compiled_workspace` measures (tests/test_memory.py)."""
  config = decoder.target_config
  verified = decoder.headroom + 1
  prefill_rows = batch if prefill_rows is None else prefill_rows
  per_prompt_token = 8 * config.dim + 2 * config.n_heads * kvcache.BLOCK_SIZE
  return 4 * (batch * 10 * verified * config.vocab_size + prefill_rows * prompt_width * per_prompt_token)


def _one_layer(decoder: Decoder) -> Decoder:
  """The same program with one layer in the target and in a draft model: the same activations."""
  def cut(params, config):
    if config is None or config.n_layers == 1 or "layers" not in (params or {}):
      return params, config
    return {**params, "layers": params["layers"][:1]}, dataclasses.replace(config, n_layers=1, sliding_windows=())
  target_params, target_config = cut(decoder.target_params, decoder.target_config)
  decoder = decoder.replace(target_params=target_params, target_config=target_config)
  drafter = decoder.drafter
  if drafter is not None and getattr(drafter, "config", None) is not None:
    params, config = cut(decoder.drafter_params, drafter.config)
    decoder = decoder.replace(drafter_params=params, drafter=dataclasses.replace(drafter, config=config))
  return decoder


def compiled_workspace(decoder: Decoder, batch: int, prompt_width: int, capacity: int) -> int | None:
  """The decode program's temporaries beyond its caches, from XLA's `memory_analysis()` of the program with
  one layer per model (compiled for the abstract shapes; nothing allocated). None where the backend does
  not say."""
  from jspec import programs  # the compiled programs sit above the plan
  small = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), _one_layer(decoder.replace(layout=None)))
  requests = abstract_requests(small, batch, prompt_width, capacity)
  analysis = programs.lower(small, requests).compile().memory_analysis()
  if analysis is None or not getattr(analysis, "temp_size_in_bytes", 0):
    return None
  state = jax.eval_shape(decode.init_state, small, requests)
  return max(int(analysis.temp_size_in_bytes) - nbytes((state.target_cache, state.drafter_state)), 0)


def usage(decoder: Decoder, batch: int, prompt_width: int, capacity: int, mesh=None, shard_draft: bool = True,
          workspace_per_row: float | None = None, prefill_rows: int | None = None) -> Usage:
  """What one device holds for `batch` rows of `capacity` cache slots, prompts padded to `prompt_width`
  (`prefill_rows` of them prefilled together; default all). `workspace_per_row`: a measured workspace
  (`compiled_workspace` / rows), else `estimated_workspace`."""
  shape = mesh_shape(mesh)
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
  state = jax.eval_shape(decode.init_state, decoder, abstract_requests(decoder, batch, prompt_width, capacity))

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
  activations = (workspace_per_row * rows_here if workspace_per_row is not None
                 else estimated_workspace(decoder, rows_here, prompt_width,
                                          None if prefill_rows is None else min(prefill_rows, rows_here)))
  return Usage(weights, draft_weights, kv, draft_kv, int(rest + activations))


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

  @property
  def fits(self) -> bool:
    return self.usage.total_bytes <= self.device_memory_bytes

  def to_json(self) -> dict:
    return {"batch": self.batch, "context": self.context, "prompt_len": self.prompt_len,
            "capacity": self.capacity, "devices": self.devices, **dataclasses.asdict(self.usage),
            "total_bytes": self.usage.total_bytes, "workspace_source": self.workspace_source,
            "device_memory_bytes": self.device_memory_bytes, "device_memory_source": self.memory_source,
            "fits": self.fits, "max_batch": self.max_batch, "max_context": self.max_context}

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


def _resident_bytes() -> int:
  try:
    return int(pathlib.Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
  except (OSError, ValueError, IndexError):
    return 0


def _cgroup_free() -> int | None:
  try:
    limit = pathlib.Path("/sys/fs/cgroup/memory.max").read_text().strip()
    used = int(pathlib.Path("/sys/fs/cgroup/memory.current").read_text())
  except (OSError, ValueError):
    return None
  return None if limit == "max" else int(limit) - used


def host_available() -> int:
  """Memory this process may use: what it holds, and what the host (or its cgroup) has free."""
  try:
    meminfo = dict(line.split(":", 1) for line in pathlib.Path("/proc/meminfo").read_text().splitlines())
    free = int(meminfo["MemAvailable"].split()[0]) * 1024
  except (OSError, KeyError, ValueError):
    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
  cgroup = _cgroup_free()
  return _resident_bytes() + min(free, cgroup if cgroup is not None else free)


def device_memory(mesh=None) -> tuple[int, str]:
  """Bytes one device of `mesh` (default: the first device) may hold, and what that figure is. CPU
  devices share the host's memory."""
  devices = list(np.asarray(mesh.devices).flat) if mesh is not None else jax.devices()[:1]
  device = devices[0]
  if device.platform != "cpu":
    limit = (device.memory_stats() or {}).get("bytes_limit")
    if limit:
      return int(limit), f"{device.device_kind} memory"
  return host_available() // len(devices), "memory available to this process"


def budget(mesh=None, fraction: float = 1.0) -> tuple[int, str]:
  """`fraction` of what one device may hold (`device_memory`), as a server reserves it."""
  if not (isinstance(fraction, (int, float)) and 0 < fraction <= 1):
    raise ValueError(f"the memory fraction must be in (0, 1], got {fraction}")
  available, source = device_memory(mesh)
  return int(available * fraction), source if fraction == 1 else f"{fraction:g} of the {source}"


def shape(decoder: Decoder, context: int, prompt_len: int, serving: bool = False) -> tuple[int, int]:
  """(padded prompt width, cache slots per row) for rows of `context` tokens, `prompt_len` of them prompt.

  A batch (`jspec.generate`) pads its prompts to their bucket and sizes its caches in the capacity buckets
  it compiles (`jspec.cache.round_capacity`). A serving engine (`serving`) takes any prompt up to its
  context, so it pads to the context's bucket, and sizes its caches once, in whole blocks."""
  if serving:
    needed = max(context + decoder.headroom + 1, request.prompt_bucket(context))
    return request.prompt_bucket(max(context - 1, 1)), -(-needed // kvcache.BLOCK_SIZE) * kvcache.BLOCK_SIZE
  width = request.prompt_bucket(prompt_len)
  return width, kvcache.round_capacity(max(context + decoder.headroom + 1, width))


def make_plan(decoder: Decoder, batch: int, context: int, prompt_len: int, *, mesh=None, shard_draft: bool = True,
              memory: tuple[int, str] | None = None, workspace: str = "estimate", serving: bool = False) -> Plan:
  """The plan for `batch` rows holding `context` tokens each, of which `prompt_len` are prompt, against
  `memory` per device (default `device_memory(mesh)`). A batch prefills its rows together; a serving
  engine (`serving`) one request at a time, with caches shaped as `shape` says. `workspace="compiled"`
  measures the workspace (`compiled_workspace`: a compile of a few seconds) where the backend reports it."""
  prefill_rows = 1 if serving else None
  width, capacity = shape(decoder, context, prompt_len, serving)
  per_row, source = None, "estimate"
  if workspace == "compiled":
    rows = max(batch // mesh_shape(mesh)["data"], 1)
    measured = compiled_workspace(decoder, rows, width, capacity)
    if measured is not None:
      per_row, source = measured / rows, "compiled"
  memory = memory or device_memory(mesh)

  def need(rows: int, ctx: int) -> Usage:
    w, c = shape(decoder, ctx, min(prompt_len, max(ctx - 1, 1)), serving)
    return usage(decoder, rows, w, c, mesh, shard_draft, per_row, prefill_rows)
  return Plan(batch, context, prompt_len, capacity, math.prod(mesh_shape(mesh).values()), need(batch, context),
              source, memory[0], memory[1], max_batch(need, context, memory[0], mesh_shape(mesh)["data"]),
              max_context(need, batch, decoder.context_len, memory[0]))


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
