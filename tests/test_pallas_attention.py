"""The Pallas attention kernels against the reference loop: in Pallas' interpreter on the CPU, compiled ahead
of time for a TPU topology (Mosaic runs at compile time), and lowered to Triton for a GPU."""
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec import attention, testing
from jspec.attention import Kernel
from jspec.settings import TreeConfig

# (name, options): ragged rows of S new queries over a 384-slot cache (3 blocks), grouped-query heads
CASES = {
    "chain": dict(),
    "step": dict(seq=1, lengths=(0, 383)),
    "window": dict(window=64, lengths=(100, 250)),
    "softcap": dict(softcap=5.0, scale=0.3),
    "tree": dict(tree=True),
    "tree-window": dict(tree=True, window=40, lengths=(90, 200)),
    "heads-major": dict(heads_major=True),
    "mha": dict(heads=2, kv_heads=2, seq=4),
    "prefill": dict(seq=300, lengths=(0, 60), window=100),  # 600 queries a row: several query tiles
}


def _ancestors(batch: int, seq: int, entries: int, rng) -> np.ndarray:
  """Random trees: entry e's parent is an earlier entry; each of the last `seq` entries sees its ancestors."""
  parent = [-1] + [int(rng.integers(0, e)) for e in range(1, entries)]
  mask = np.zeros((batch, seq, entries), bool)
  for i, e in enumerate(range(entries - seq, entries)):
    while e >= 0:
      mask[:, i, e], e = True, parent[e]
  return mask


def _attend(backend: str | None, dtype, seq=3, heads=4, kv_heads=2, lengths=(5, 200), window=0, softcap=None,
            scale=None, tree=False, heads_major=False):
  batch, head_dim, capacity = len(lengths), 16, 384
  kq, kk, kv = jax.random.split(jax.random.PRNGKey(0), 3)
  q = jax.random.normal(kq, (batch, seq, heads, head_dim)).astype(dtype)
  k = jax.random.normal(kk, (batch * kv_heads, capacity, head_dim)).astype(dtype)
  v = jax.random.normal(kv, (batch * kv_heads, capacity, head_dim)).astype(dtype)
  mask = jnp.asarray(_ancestors(batch, seq, seq + 2, np.random.default_rng(0))) if tree else None
  kernel = None if backend is None else Kernel(backend, interpret=True)
  return attention.cached_attention(q, k, v, jnp.asarray(lengths, jnp.int32), heads_major, window, softcap, scale,
                                    tree_BxSxA=mask, kernel=kernel).astype(jnp.float32)


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
@pytest.mark.parametrize("case", CASES)
def test_kernel_equals_the_reference(backend, case):
  ref = _attend(None, jnp.float32, **CASES[case])
  np.testing.assert_allclose(_attend(backend, jnp.float32, **CASES[case]), ref, atol=1e-5, rtol=1e-5)
  if case in ("chain", "tree"):  # bf16 caches: within bf16's rounding of the fp32 result
    np.testing.assert_allclose(_attend(backend, jnp.bfloat16, **CASES[case]), ref, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_decoding_with_the_kernels_gives_the_same_greedy_tokens(backend):
  """A draft model's chains and an EAGLE tree, every cache read through the kernel."""
  target, draft = testing.random_pair()
  prompts = [[1, 2, 3], list(range(40, 60))]
  plain = jspec.generate(target, prompts, max_new_tokens=10).token_ids
  eagle = testing.random_draft("eagle", target)
  for d, spec in ((draft, testing.fixed_k(3)), (eagle, testing.fixed_k(3, tree=TreeConfig(top_k=2, nodes=5)))):
    out = jspec.generate(target, prompts, draft=d, max_new_tokens=10, spec=spec, attention=backend)
    assert out.token_ids == plain


def test_a_kernel_for_another_accelerator_is_refused():
  assert attention.select_kernel("auto", "cpu") is None and attention.select_kernel("xla", "tpu") is None
  assert attention.select_kernel("auto", "tpu") == Kernel("tpu")
  assert attention.select_kernel("auto", "gpu") == Kernel("gpu")
  assert attention.select_kernel("gpu", "cpu") == Kernel("gpu", interpret=True)
  with pytest.raises(ValueError, match="the gpu attention kernel does not run on tpu"):
    attention.select_kernel("gpu", "tpu")
  with pytest.raises(ValueError, match="attention 'flash'"):
    jspec.generate(testing.random_model(), [[1, 2]], max_new_tokens=2, attention="flash")


def _abstract(shape, dtype, sharding=None):
  return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="no libtpu: pip install -e '.[tpu]'")
def test_the_tpu_kernel_compiles_for_a_v5e_topology():
  """Chains and trees on four v5e chips, each attending for its own kv heads: Mosaic lowers the kernel."""
  from jax.experimental import topologies
  from jax.sharding import Mesh, NamedSharding, PartitionSpec
  devices = np.array(topologies.get_topology_desc("v5e:2x2", platform="tpu").devices).reshape(1, 4)
  mesh = Mesh(devices, ("data", "model"))
  kernel = Kernel("tpu", mesh=mesh, row_spec="model")
  batch, seq, heads, kv_heads, head_dim = 2, 5, 16, 8, 128
  split = lambda *spec: NamedSharding(mesh, PartitionSpec(*spec))
  args = (_abstract((batch, seq, heads, head_dim), jnp.bfloat16, split(None, None, "model")),
          *[_abstract((batch * kv_heads, 1024, head_dim), jnp.bfloat16, split("model"))] * 2,
          _abstract((batch,), jnp.int32, split()))
  for tree in (None, _abstract((batch, seq, seq + 2), jnp.bool_, split())):
    fn = lambda q, k, v, lengths, t: attention.cached_attention(q, k, v, lengths, True, 0, 30.0, tree_BxSxA=t,
                                                                 kernel=kernel)
    lowered = jax.jit(fn).lower(*args, tree)
    assert "tpu_custom_call" in lowered.as_text()
    assert lowered.compile().memory_analysis().argument_size_in_bytes > 0


def test_the_gpu_kernel_lowers_to_triton():
  """Lowering for CUDA runs the Pallas Triton lowering here (compiling it needs a GPU)."""
  batch, seq, heads, kv_heads, head_dim = 2, 5, 8, 2, 64
  args = (_abstract((batch, seq, heads, head_dim), jnp.bfloat16),
          *[_abstract((batch * kv_heads, 512, head_dim), jnp.bfloat16)] * 2, _abstract((batch,), jnp.int32))
  for tree in (None, _abstract((batch, seq, seq + 2), jnp.bool_)):
    fn = lambda q, k, v, lengths, t: attention.cached_attention(q, k, v, lengths, False, 64, 30.0, tree_BxSxA=t,
                                                                 kernel=Kernel("gpu"))
    assert "__gpu$xla.gpu.triton" in jax.jit(fn).trace(*args, tree).lower(lowering_platforms=("cuda",)).as_text()
  odd = (_abstract((1, 1, 4, 24), jnp.float32), *[_abstract((4, 128, 24), jnp.float32)] * 2,
         _abstract((1,), jnp.int32))
  with pytest.raises(ValueError, match="power-of-two head dim"):
    jax.eval_shape(lambda q, k, v, lengths: attention.cached_attention(q, k, v, lengths, kernel=Kernel("gpu")), *odd)

