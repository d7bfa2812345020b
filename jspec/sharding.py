"""Device meshes and the one list of sharding rules.

A mesh has axes ("data", "model"). Every parameter and cache array carries logical axis names; RULES maps
each logical name to a mesh axis. A dimension is sharded only when the mesh axis divides what it holds
(whole heads for attention weights, whole rows for the vocab, ...), and is replicated otherwise, so any mesh
runs any model correctly, and the common ones without waste.

Caches: a layer's `[B*K, T, Dh]` buffer is batch-major (row b*K + k; the layout the CPU needs, see
jspec/cache.py), so its leading axis shards over ("data", "model"): batch rows on "data", then each data
shard's rows split on "model". An axis that does not divide (B by data, K and H by model) is left out of the
split. The split matches the kv heads each device's attention weights produce when a data shard holds one
batch row (B == data); otherwise it is still correct, and XLA moves activations between devices (measured:
tests/test_sharding.py counts the collectives).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jspec.config import ModelConfig

AXES = ("data", "model")

# Logical axis -> mesh axis: the single place sharding is decided.
RULES = (
    ("batch", "data"),
    ("vocab", "model"),
    ("heads", "model"),     # query heads (H*Dh columns, split between heads)
    ("kv_heads", "model"),  # key/value heads (K*Dh columns)
    ("mlp", "model"),
    ("embed", None),        # the residual stream stays replicated: one all-reduce after wo and w_down
    ("head_dim", None),
    ("stack", None),
)

# Logical axes of each parameter, by its name in the parameter dict (model, Medusa and EAGLE weights).
PARAM_AXES = {
    "embed": ("vocab", "embed"), "lm_head": ("embed", "vocab"), "final_norm": ("embed",),
    "attn_norm": ("embed",), "mlp_norm": ("embed",),
    "wq": ("embed", "heads"), "wk": ("embed", "kv_heads"), "wv": ("embed", "kv_heads"),
    "wo": ("heads", "embed"), "bq": ("heads",), "bk": ("kv_heads",), "bv": ("kv_heads",),
    "w_gate": ("embed", "mlp"), "w_up": ("embed", "mlp"), "w_down": ("mlp", "embed"),
    "fc": ("embed", "embed"),  # EAGLE's input projection
    "w": ("stack", "embed", "embed"), "b": ("stack", "embed"),  # Medusa heads
}


def make_mesh(spec: str, devices: list | None = None) -> Mesh:
  """A mesh from "data=D,model=M" (either may be omitted: 1) over `devices` (default: all)."""
  sizes = {"data": 1, "model": 1}
  for part in filter(None, (p.strip() for p in spec.split(","))):
    name, _, value = part.partition("=")
    if name not in sizes or not value.isdigit() or int(value) < 1:
      raise ValueError(f"bad mesh spec {spec!r}: expected data=D,model=M with positive integers")
    sizes[name] = int(value)
  devices = list(jax.devices() if devices is None else devices)
  if sizes["data"] * sizes["model"] != len(devices):
    raise ValueError(f"mesh {spec!r} needs {sizes['data'] * sizes['model']} devices; there are {len(devices)}")
  return Mesh(np.asarray(devices).reshape(sizes["data"], sizes["model"]), AXES)


def _units(config: ModelConfig) -> dict[str, int]:
  """How many indivisible units each logical axis holds: a shard must hold whole ones."""
  return {"vocab": config.vocab_size, "heads": config.n_heads, "kv_heads": config.n_kv_heads,
          "mlp": config.mlp_dim}


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
    return logical_to_spec(PARAM_AXES[name], mesh, units)
  return jax.tree_util.tree_map_with_path(spec, params)


def cache_row_spec(batch: int, config: ModelConfig, mesh: Mesh) -> PartitionSpec:
  """The rule in the module docstring, for one `[B*K, T, Dh]` buffer."""
  axes = []
  if mesh.shape["data"] > 1 and batch % mesh.shape["data"] == 0:
    axes.append("data")
  if mesh.shape["model"] > 1 and config.n_kv_heads % mesh.shape["model"] == 0 \
      and config.n_heads % mesh.shape["model"] == 0:
    axes.append("model")
  if not axes:
    return PartitionSpec()
  return PartitionSpec(tuple(axes) if len(axes) > 1 else axes[0], None, None)


def data_spec(batch: int, mesh: Mesh) -> PartitionSpec:
  """Batch rows over "data" when it divides them (the cache of a replicated draft), else replicated."""
  return PartitionSpec("data", None, None) if batch % mesh.shape["data"] == 0 and mesh.shape["data"] > 1 \
      else PartitionSpec()


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
  target_cache: PartitionSpec
  draft_cache: PartitionSpec

  def constrain_caches(self, state):
    """Pins the target's and the drafter's KV buffers to their specs; the loop keeps them there."""
    from jspec.cache import KVCache

    def pin(spec):
      return lambda c: c.replace(k=tuple(jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))
                                         for x in c.k),
                                 v=tuple(jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))
                                         for x in c.v))
    is_cache = lambda x: isinstance(x, KVCache)
    return state.replace(
        target_cache=pin(self.target_cache)(state.target_cache),
        drafter_state=jax.tree.map(lambda x: pin(self.draft_cache)(x) if is_cache(x) else x,
                                   state.drafter_state, is_leaf=is_cache))

  def replicate(self, tree):
    replicated = NamedSharding(self.mesh, PartitionSpec())
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, replicated), tree)


def place(tree: Any, mesh: Mesh, specs: Any = None) -> Any:
  """Host or device arrays -> global arrays on the mesh (replicated where `specs` is None).

  Built from each process's own copy with `make_array_from_callback`, so it also works across processes.
  """
  if specs is None:
    specs = jax.tree.map(lambda _: PartitionSpec(), tree)

  def put(x, spec):
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, NamedSharding(mesh, spec), lambda idx: host[idx])
  return jax.tree.map(put, tree, specs, is_leaf=lambda x: x is None)


def init_params(config: ModelConfig, key: jax.Array, mesh: Mesh) -> Any:
  """Random parameters created directly in their shards: eval_shape -> specs -> jit(out_shardings)."""
  from jspec import model
  abstract = jax.eval_shape(lambda k: model.init_params(config, k), key)
  shardings = named(mesh, param_specs(abstract, config, mesh))
  return jax.jit(lambda k: model.init_params(config, k), out_shardings=shardings)(key)
