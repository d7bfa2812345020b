"""Device meshes and the one list of sharding rules.

A mesh has axes ("data", "model"). Every parameter and cache array carries logical axis names; RULES maps
each logical name to a mesh axis. A dimension is sharded only when the mesh axis divides what it holds
(whole heads for attention weights, whole rows for the vocab, ...), and is replicated otherwise, so any mesh
runs any model correctly, and the common ones without waste.

Caches: a layer's `[B*J, T, Dh]` buffer (one flat leading axis, the layout the CPU needs, see
jspec/model/cache.py) shards kv heads on "model" and batch rows on "data", each where it divides (J and H by
model, B by data), and is replicated otherwise. When kv heads split, the rows are heads-major (row j*B + b)
and the leading axis shards over ("model", "data"): device (d, m) holds heads [m J/M, (m+1) J/M) of batch
rows [d B/D, (d+1) B/D), exactly the heads its attention weights produce, so attention needs no
communication. Otherwise the rows stay batch-major (row b*J + j) and shard over "data" alone.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jspec.model import model, moe
from jspec.model.cache import KVCache
from jspec.model.config import ModelConfig

AXES = ("data", "model")

# Logical axis -> mesh axis: the single place sharding is decided.
RULES = (
    ("batch", "data"),
    ("vocab", "model"),
    ("heads", "model"),     # query heads (H*Dh columns, split between heads)
    ("kv_heads", "model"),  # key/value heads (J*Dh columns)
    ("mlp", "model"),
    ("expert_mlp", "model"),  # every expert's MLP columns split as a dense MLP's: each device holds all experts
    ("experts", None),
    ("embed", None),        # the residual stream stays replicated: one all-reduce after wo and w_down
    ("head_dim", None),
    ("stack", None),
)

# Logical axes of each parameter, by its name in the parameter dict (model, Medusa and EAGLE weights).
PARAM_AXES = {
    "embed": ("vocab", "embed"), "lm_head": ("embed", "vocab"), "final_norm": ("embed",),
    "attn_norm": ("embed",), "mlp_norm": ("embed",), "post_attn_norm": ("embed",), "post_mlp_norm": ("embed",),
    "q_norm": ("head_dim",), "k_norm": ("head_dim",),
    "wq": ("embed", "heads"), "wk": ("embed", "kv_heads"), "wv": ("embed", "kv_heads"),
    "wo": ("heads", "embed"), "bq": ("heads",), "bk": ("kv_heads",), "bv": ("kv_heads",),
    "w_gate": ("embed", "mlp"), "w_up": ("embed", "mlp"), "w_down": ("mlp", "embed"),
    "router": ("embed", "experts"), "router_bias": ("experts",),
    "we_gate_up": ("experts", "embed", "expert_mlp"), "we_down": ("experts", "expert_mlp", "embed"),
    # EAGLE's input projections and EAGLE-3's norms (its `lm_head` over a draft vocabulary: `target_ids`)
    "fc": ("embed", "embed"), "fc_bias": ("embed",), "fuse": ("embed", "embed"), "embed_norm": ("embed",),
    "hidden_norm": ("embed",),
    "enorm": ("embed",), "hnorm": ("embed",), "eh_proj": ("embed", "embed"),  # an MTP layer's input
    "w": ("embed", "embed"), "b": ("embed",),  # Medusa's blocks, stacked by head and layer
    # a cross-tokenizer draft's tables (`jspec.text.vocab_map`), whole on every device
    "draft_ids": (None,), "target_ids": (None,), "spelling": (None, None), "spelling_lens": (None,),
}


def mesh_sizes(spec: str) -> dict[str, int]:
  """The axis sizes "data=D,model=M" asks for (either may be omitted: 1)."""
  sizes = {"data": 1, "model": 1}
  for part in filter(None, (p.strip() for p in spec.split(","))):
    name, _, value = part.partition("=")
    if name not in sizes or not value.isdigit() or int(value) < 1:
      raise ValueError(f"bad mesh spec {spec!r}: expected data=D,model=M with positive integers")
    sizes[name] = int(value)
  return sizes


def make_mesh(spec: str, devices: list | None = None) -> Mesh:
  """A mesh from "data=D,model=M" (either may be omitted: 1) over `devices` (default: all)."""
  sizes = mesh_sizes(spec)
  devices = list(jax.devices() if devices is None else devices)
  if sizes["data"] * sizes["model"] != len(devices):
    raise ValueError(f"mesh {spec!r} needs {sizes['data'] * sizes['model']} devices; there are {len(devices)}")
  return Mesh(np.asarray(devices).reshape(sizes["data"], sizes["model"]), AXES)


def _units(config: ModelConfig) -> dict[str, int]:
  """How many indivisible units each logical axis holds: a shard must hold whole ones."""
  return {"heads": config.n_heads, "kv_heads": config.n_kv_heads,  # experts: whole blocks of `moe.chunk`
          "expert_mlp": config.moe.expert_dim // moe.chunk(config.moe.expert_dim) if config.moe else 0}


# Axes whose shards need only hold whole columns: each weight's own size decides (a draft vocabulary, shared
# experts' MLP width).
SIZED_BY_WEIGHT = ("vocab", "mlp")


def logical_to_spec(axes: tuple, mesh: Mesh, units: dict[str, int]) -> PartitionSpec:
  rules = dict(RULES)
  out = []
  for name in axes:
    mesh_axis = rules.get(name)
    ok = mesh_axis is not None and units.get(name, 0) % mesh.shape[mesh_axis] == 0
    out.append(mesh_axis if ok and mesh.shape[mesh_axis] > 1 else None)
  return PartitionSpec(*out)


def param_specs(params: Any, config: ModelConfig, mesh: Mesh) -> Any:
  """PartitionSpecs for a parameter pytree (a model's, or heads' that live next to it)."""
  units = _units(config)
  # GQA: a model-axis shard of query heads must see its own kv heads, so both split or neither does.
  if units["kv_heads"] % mesh.shape["model"] or units["heads"] % mesh.shape["model"]:
    units["heads"] = units["kv_heads"] = 0

  def spec(path, leaf):
    name = next(str(k.key) for k in reversed(path) if isinstance(k, jax.tree_util.DictKey))
    axes = ("stack",) * (leaf.ndim - len(PARAM_AXES[name])) + PARAM_AXES[name]  # stacked weights: heads first
    sizes = {**units, **{name: leaf.shape[axes.index(name)] for name in SIZED_BY_WEIGHT if name in axes}}
    weight = logical_to_spec(axes, mesh, sizes)
    if getattr(path[-1], "name", None) != "scale":
      return weight
    # A quantized weight's scales split with its columns where each shard holds whole channels or blocks.
    return PartitionSpec(*(axis if axis and n % mesh.shape[axis] == 0 else None
                           for axis, n in zip(tuple(weight) + (None,) * leaf.ndim, leaf.shape)))
  return jax.tree_util.tree_map_with_path(spec, params)


@dataclasses.dataclass(frozen=True)
class CacheLayout:
  """How one model's `[B*J, T, Dh]` cache buffers lie on a mesh: the row order and the spec."""
  spec: PartitionSpec
  heads_major: bool = False


def cache_layout(batch: int, config: ModelConfig | None, mesh: Mesh) -> CacheLayout:
  """The rule in the module docstring. `config=None`: a replicated model's cache, split by batch only."""
  axes = []
  if config is not None and mesh.shape["model"] > 1 and config.n_kv_heads % mesh.shape["model"] == 0 \
      and config.n_heads % mesh.shape["model"] == 0:
    axes.append("model")
  if mesh.shape["data"] > 1 and batch % mesh.shape["data"] == 0:
    axes.append("data")
  if not axes:
    return CacheLayout(PartitionSpec())
  return CacheLayout(PartitionSpec(tuple(axes) if len(axes) > 1 else axes[0], None, None),
                     heads_major=axes[0] == "model")


def pool_spec(layout: CacheLayout) -> PartitionSpec:
  """How a paged cache's pools `[pages, J, PAGE_SIZE, Dh]` lie where contiguous caches lie as `layout` says:
  kv heads over "model" where they split, and where "data" splits the rows, pages over "data" (each data
  shard's rows hold only its pages: `jspec.engine.pages.KVPages`)."""
  axes = jax.tree.leaves(layout.spec[0]) if layout.spec else []
  return PartitionSpec("data" if "data" in axes else None, "model" if layout.heads_major else None, None, None)


def named(mesh: Mesh, specs: Any) -> Any:
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, PartitionSpec))


def is_placed(tree: Any, mesh: Mesh) -> bool:
  """Whether the arrays already live on this mesh (for example restored sharded by `jspec.load`)."""
  leaves = jax.tree.leaves(tree)
  return bool(leaves) and all(isinstance(getattr(x, "sharding", None), NamedSharding) and x.sharding.mesh == mesh
                              for x in leaves)


@dataclasses.dataclass(frozen=True)
class Layout:
  """How one request is laid out on a mesh: a static argument of the jitted loop (hashable)."""
  mesh: Mesh
  target_cache: CacheLayout
  draft_cache: CacheLayout
  draft_replicated: bool = False  # the drafter's weights are whole on every device

  def constrain_caches(self, state):
    """Gives the target's and the drafter's fresh (empty) KV caches their row order and pins their buffers
    to their specs; the loop keeps them there."""
    def pin(layout: CacheLayout):
      kernel = lambda c: c.kernel and dataclasses.replace(c.kernel, mesh=self.mesh, row_spec=layout.spec[0]
                                                          if layout.spec else None)
      def pinned(c):
        spec = layout.spec if c.page_table is None else pool_spec(layout)
        constrain = lambda x: jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))
        paged = c.page_table is not None
        shards = self.mesh.shape["data"] if paged and spec[0] == "data" else 1
        rows = NamedSharding(self.mesh, PartitionSpec(layout.spec[0] if layout.spec else None)) if paged else None
        table = c.page_table if shards == 1 else jax.lax.with_sharding_constraint(  # with its rows
            c.page_table, NamedSharding(self.mesh, PartitionSpec("data")))
        return c.replace(k=tuple(map(constrain, c.k)), v=tuple(map(constrain, c.v)), page_table=table,
                         heads_major=layout.heads_major, kernel=kernel(c), page_shards=shards, rows_sharding=rows)
      return pinned
    is_cache = lambda x: isinstance(x, KVCache)
    return state.replace(
        target_cache=pin(self.target_cache)(state.target_cache),
        drafter_state=jax.tree.map(lambda x: pin(self.draft_cache)(x) if is_cache(x) else x,
                                   state.drafter_state, is_leaf=is_cache))

  def pin_draft_logits(self, logits: jax.Array) -> jax.Array:
    """A replicated draft's logits stay replicated. Otherwise the partitioner splits them by vocabulary
    where they meet the target's (vocab-sharded) logits in verification, and that split travels back into
    the draft's own sampling and embedding lookups as all-reduces."""
    return self.replicate(logits) if self.draft_replicated else logits

  def replicate(self, tree):
    replicated = NamedSharding(self.mesh, PartitionSpec())
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, replicated), tree)


def place(tree: Any, mesh: Mesh, specs: Any = None) -> Any:
  """Host or device arrays -> global arrays on the mesh (replicated where `specs` is None).

  Built from each process's own copy with `make_array_from_callback`, so it also works across processes.
  Shapes (`jax.ShapeDtypeStruct`) stay shapes, given the sharding: a program lowered for a mesh of devices
  that are not here (`jspec.planning.accelerators`).
  """
  if specs is None:
    specs = jax.tree.map(lambda _: PartitionSpec(), tree)

  def put(x, spec):
    if x is None:  # an absent part (a batch without constraints)
      return None
    if isinstance(x, jax.ShapeDtypeStruct):
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, NamedSharding(mesh, spec), lambda idx: host[idx])
  return jax.tree.map(put, tree, specs, is_leaf=lambda x: x is None)


def place_decoder(mesh: Mesh, decoder: Any, batch: int, shard_draft: bool = True) -> Any:
  """A `jspec.decoding.decoder.Decoder` with its weights placed on the mesh by the rules above (the drafter's too,
  unless `shard_draft=False` replicates them) and the cache `layout` for batches of `batch` rows."""
  target_params, drafter_params = decoder.target_params, decoder.drafter_params
  draft_config = None if decoder.drafter is None else decoder.drafter.config
  if not is_placed(target_params, mesh):
    target_params = place(target_params, mesh, param_specs(target_params, decoder.target_config, mesh))
  if drafter_params is not None and not is_placed(drafter_params, mesh):
    drafter_params = place(drafter_params, mesh, param_specs(drafter_params, draft_config, mesh) if shard_draft
                           else None)
  layout = Layout(mesh, cache_layout(batch, decoder.target_config, mesh),
                  cache_layout(batch, draft_config if shard_draft else None, mesh), draft_replicated=not shard_draft)
  return decoder.replace(target_params=target_params, drafter_params=drafter_params, layout=layout)


def init_params(config: ModelConfig, key: jax.Array, mesh: Mesh) -> Any:
  """Random parameters created directly in their shards: eval_shape -> specs -> jit(out_shardings)."""
  abstract = jax.eval_shape(lambda k: model.init_params(config, k), key)
  shardings = named(mesh, param_specs(abstract, config, mesh))
  return jax.jit(lambda k: model.init_params(config, k), out_shardings=shardings)(key)


def resharded(args: tuple, shardings: tuple) -> tuple:
  """`args` placed as an executable takes them (`input_shardings`, None for an argument it does not read):
  only the arrays placed otherwise move, and host values become global arrays, on every process."""
  leaves, treedef = jax.tree.flatten(args)
  wanted = treedef.flatten_up_to(shardings)
  return jax.tree.unflatten(treedef, [x if s is None or getattr(x, "sharding", None) == s else jax.device_put(x, s)
                                      for x, s in zip(leaves, wanted)])
