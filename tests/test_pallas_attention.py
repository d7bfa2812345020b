"""The Pallas attention kernels against the reference loop: in Pallas' interpreter on the CPU, compiled ahead
of time for a TPU topology (Mosaic runs at compile time), and lowered to Triton for a GPU."""
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec import testing
from jspec.core.settings import TreeConfig
from jspec.model import attention
from jspec.model.kernels import pallas_attention
from jspec.model.kernels.pallas_attention import Kernel

# The kernels share their block update and block ranges; the GPU's differs in its tiles and loop.
GPU_CASES = ("chain", "step", "softcap", "tree-window", "prefill", "paged", "paged-tree")


@pytest.mark.parametrize("backend, case",
                         [("tpu", c) for c in testing.ATTENTION_CASES] + [("gpu", c) for c in GPU_CASES])
def test_kernel_equals_the_reference(backend, case):
  """Paged cases against the contiguous reference: the same cache, its blocks in shuffled pages."""
  options, kernel = testing.ATTENTION_CASES[case], Kernel(backend, interpret=True)
  ref = testing.attention_case(None, jnp.float32, **{**options, "paged": False})
  if options.get("paged"):  # the reference reads pages too
    np.testing.assert_allclose(testing.attention_case(None, jnp.float32, **options), ref, atol=1e-6, rtol=1e-6)
  np.testing.assert_allclose(testing.attention_case(kernel, jnp.float32, **options), ref, atol=1e-5, rtol=1e-5)
  if case in ("chain", "tree"):  # bf16 caches: within bf16's rounding of the fp32 result
    np.testing.assert_allclose(testing.attention_case(kernel, jnp.bfloat16, **options), ref, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_decoding_with_the_kernels_gives_the_same_greedy_tokens(backend):
  """Every cache read through the kernel: the TPU's with an EAGLE tree, the GPU's with a draft model's chains."""
  target, draft = testing.random_pair()
  prompts = [[1, 2, 3], list(range(40, 60))]
  plain = jspec.generate(target, prompts, max_new_tokens=10).token_ids
  d, spec = ((testing.random_draft("eagle", target), testing.fixed_k(3, tree=TreeConfig(top_k=2, nodes=5)))
             if backend == "tpu" else (draft, testing.fixed_k(3)))
  assert jspec.generate(target, prompts, draft=d, max_new_tokens=10, spec=spec, attention=backend).token_ids == plain


def test_a_kernel_for_another_accelerator_is_refused():
  assert pallas_attention.select_kernel("auto", "cpu") is None and pallas_attention.select_kernel("xla", "tpu") is None
  assert pallas_attention.select_kernel("auto", "tpu") == Kernel("tpu")
  assert pallas_attention.select_kernel("auto", "gpu", 128) == Kernel("gpu")
  assert pallas_attention.select_kernel("auto", "gpu", 96) is None  # the loop, where the kernel cannot run
  assert pallas_attention.select_kernel("gpu", "cpu") == Kernel("gpu", interpret=True)
  with pytest.raises(ValueError, match="the gpu attention kernel does not run on tpu"):
    pallas_attention.select_kernel("gpu", "tpu")
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
  # Pools of pages read through a page table: on one chip, and on the four with each one's kv heads of every
  # page (heads-major rows) and on two data shards of two (each shard's pages its own).
  one = NamedSharding(Mesh(devices[:, :1], ("data", "model")), PartitionSpec())
  both = Mesh(devices.reshape(2, 2), ("data", "model"))
  layouts = [(Kernel("tpu"), False, 1, one, one, one, one),
             (kernel, True, 1, split(None, None, "model"), split(None, "model"), split(), split()),
             (Kernel("tpu", mesh=both, row_spec=("model", "data")), True, 2,
              NamedSharding(both, PartitionSpec("data", None, "model")),
              NamedSharding(both, PartitionSpec("data", "model")), NamedSharding(both, PartitionSpec("data")),
              NamedSharding(both, PartitionSpec("data")))]
  for kernel_, heads_major, shards, q_at, pool_at, rows_at, table_at in layouts:
    pool = _abstract((20, kv_heads, 128, head_dim), jnp.bfloat16, pool_at)
    paged = lambda q, k, v, lengths, table: attention.cached_attention(
        q, k, v, lengths, heads_major, page_table_BxR=table, kernel=kernel_, page_shards=shards)
    lowered = jax.jit(paged).lower(_abstract((batch, seq, heads, head_dim), jnp.bfloat16, q_at), pool, pool,
                                   _abstract((batch,), jnp.int32, rows_at), _abstract((batch, 8), jnp.int32, table_at))
    assert "tpu_custom_call" in lowered.as_text() and lowered.compile() is not None


def test_the_gpu_kernel_lowers_to_triton():
  """Lowering for CUDA runs the Pallas Triton lowering here (compiling it needs a GPU)."""
  batch, seq, heads, kv_heads, head_dim = 2, 5, 8, 2, 64
  args = (_abstract((batch, seq, heads, head_dim), jnp.bfloat16),
          *[_abstract((batch * kv_heads, 512, head_dim), jnp.bfloat16)] * 2, _abstract((batch,), jnp.int32))
  for tree in (None, _abstract((batch, seq, seq + 2), jnp.bool_)):
    fn = lambda q, k, v, lengths, t: attention.cached_attention(q, k, v, lengths, False, 64, 30.0, tree_BxSxA=t,
                                                                 kernel=Kernel("gpu"))
    assert "__gpu$xla.gpu.triton" in jax.jit(fn).trace(*args, tree).lower(lowering_platforms=("cuda",)).as_text()
  pool = _abstract((20, kv_heads, 128, head_dim), jnp.bfloat16)
  paged = lambda q, k, v, lengths, table: attention.cached_attention(q, k, v, lengths, page_table_BxR=table,
                                                                     kernel=Kernel("gpu"))
  traced = jax.jit(paged).trace(args[0], pool, pool, args[3], _abstract((batch, 4), jnp.int32))
  assert "__gpu$xla.gpu.triton" in traced.lower(lowering_platforms=("cuda",)).as_text()
  odd = (_abstract((1, 1, 4, 24), jnp.float32), *[_abstract((4, 128, 24), jnp.float32)] * 2,
         _abstract((1,), jnp.int32))
  with pytest.raises(ValueError, match="power-of-two head dim"):
    jax.eval_shape(lambda q, k, v, lengths: attention.cached_attention(q, k, v, lengths, kernel=Kernel("gpu")), *odd)

