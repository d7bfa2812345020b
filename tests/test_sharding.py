"""Sharded decoding on 8 simulated CPU devices, and across two real processes with jax.distributed."""
import json
import os
import pathlib
import socket
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # meshes of simulated devices in subprocesses

WORKER = pathlib.Path(__file__).resolve().parent / "mesh_worker.py"
PAGED_WORKER = WORKER.parent / "paged_mesh_worker.py"


def _env(devices: int) -> dict:
  flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
  return {**os.environ, "XLA_FLAGS": flags.strip(), "JAX_PLATFORMS": "cpu"}


@pytest.fixture(scope="module")
def eight_devices(tmp_path_factory):
  out = tmp_path_factory.mktemp("mesh") / "out.json"
  proc = subprocess.run([sys.executable, str(WORKER), str(out)], env=_env(8), capture_output=True, text=True,
                        timeout=900)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(out.read_text())


@pytest.mark.parametrize("mesh", ["data=8", "model=8", "data=2,model=4"])
def test_greedy_outputs_on_a_mesh_equal_one_device(eight_devices, mesh):
  single, sharded = eight_devices["single"], eight_devices["meshes"][mesh]
  for kind in ("ar", "spec", "spec_replicated_draft", "constrained"):
    assert sharded[kind] == single[kind], (mesh, kind)
  assert sharded["kernel"] == (single["spec"] if mesh == "data=2,model=4" else None)
  assert single["spec"] == single["ar"]
  assert sharded["continuous"] == single["continuous"], mesh  # inserts into batch-major and heads-major rows
  # A Hugging Face directory read straight onto the mesh (quantized where the model axis splits weights): every
  # tensor and scale in its shards, one device's tokens.
  assert sharded["hf_directory"]["placed_by_the_rules"]
  assert sharded["hf_directory"]["spec"] == (single["spec"] if mesh == "data=8" else single["hf_directory"]["spec"])


@pytest.mark.parametrize("mesh", ["data=8", "model=8", "data=2,model=4"])
def test_seeded_sampling_gives_the_same_tokens_on_every_mesh(eight_devices, mesh):
  # Each row draws from its own key whatever the layout; only summation order differs between meshes, which
  # could flip a draw whose uniform falls within ~1e-6 of a boundary. None does here.
  assert eight_devices["meshes"][mesh]["sampled"] == eight_devices["single"]["sampled"]


def test_partition_specs_follow_the_rules(eight_devices):
  tp = eight_devices["meshes"]["model=8"]
  assert tp["param_specs"] == {"wq": "P(None, 'model')", "wk": "P(None, 'model')",
                               "wo": "P('model', None)", "w_gate": "P(None, 'model')",
                               "w_down": "P('model', None)", "embed": "P('model', None)"}
  assert tp["cache_spec"] == "P('model', None, None)" and tp["cache_heads_major"]
  # a quantized weight's scales split with its output channels
  assert tp["hf_directory"]["quantized_specs"] == ["P(None, 'model')"] * 2 + ["P('model', None)", "P(None, None)"]
  dp = eight_devices["meshes"]["data=8"]
  assert set(dp["param_specs"].values()) == {"P(None, None)"}
  assert dp["cache_spec"] == "P('data', None, None)" and not dp["cache_heads_major"]
  both = eight_devices["meshes"]["data=2,model=4"]
  assert both["cache_spec"] == "P(('model', 'data'), None, None)" and both["cache_heads_major"]
  assert all(m["sharded_init_equals_host_init"] for m in eight_devices["meshes"].values())


@pytest.mark.parametrize("mesh", ["model=8", "data=2,model=4"])
def test_collectives_per_round(eight_devices, mesh):
  # Tensor parallelism at batch 8: the target's layers all-reduce after wo and w_down (2 per layer, 2
  # layers), plus a few per round for the vocab-sharded embedding and logits (sampling branches included;
  # an argmax over sharded logits is two, a max and a min: see sampling.argmax; top-k's and top-p's bit
  # searches one each, a masked sum inside their loops).
  # The heads-major cache keeps attention local: with batch-major rows split by batch the loop all-gathered
  # 63 times per round. A replicated draft adds no model-axis traffic, only what a pure data-parallel mesh
  # has too (a batch-wide "is every row greedy?"); a sharded draft all-reduces in its own layers.
  counts = eight_devices["meshes"][mesh]["collectives"]
  assert all(counts[mode]["explicit_shardings"] for mode in ("ar", "sharded", "replicated"))
  assert 2 * 2 <= counts["ar"]["all-reduce"] <= 2 * 2 + 9
  assert counts["ar"]["all-gather"] <= 16
  data_only = eight_devices["meshes"]["data=8"]["collectives"]["replicated"]["drafter"]
  assert counts["replicated"]["drafter"] == ({"all-reduce": 0, "all-gather": 0} if mesh == "model=8" else data_only)
  assert counts["sharded"]["drafter"]["all-reduce"] > data_only["all-reduce"]


def test_paged_engines_on_a_mesh_give_one_devices_tokens_with_no_more_collectives(tmp_path):
  """An engine's paged KV cache on `model=8` (kv heads split 8 ways, every page on every device) and on
  `data=2,model=4` (each data shard a pool of its own pages for its own slots), with drafters whose caches
  page and one whose does not (`tests/paged_mesh_worker.py`):
  requests arriving mid-decode, a cached 200-token prefix, chunked prefill and preemption give one device's
  tokens (on `model=8` its prefix hits and preemptions too; a data shard finds only its own cached pages).
  On `model=8` the paged segment's loop has no collective the contiguous segment's lacks; on
  `data=2,model=4` (measured: 31 all-reduces and 36 all-gathers of small integer arrays per round, against
  20 and 40, those of whole cache writes) no more all-gathers, and at most 11 more all-reduces."""
  out = tmp_path / "paged.json"
  proc = subprocess.run([sys.executable, str(PAGED_WORKER), str(out)], env=_env(8), capture_output=True, text=True,
                        timeout=900)
  assert proc.returncode == 0, proc.stderr[-3000:]
  runs = json.loads(out.read_text())
  assert set(runs) == {"model-tree", "eagle", "ngram"} and {k for k, r in runs.items() if "data=2,model=4" in r} \
      == {"model-tree", "eagle"}
  for kind, r in runs.items():
    single, heads, both = r["single"], r["model=8"], r.get("data=2,model=4", r["single"])
    assert heads["tokens"] == both["tokens"] == single["tokens"], kind
    assert heads["prefix_hits"] == single["prefix_hits"] >= 3 * 128, kind  # the shared prefix's full pages
    assert heads["preemptions"] == single["preemptions"] > 0 and both["preemptions"] > 0, kind
    assert both["prefix_hits"] >= 128, kind
    for sharded, more in ((heads, 0), (both, 11)):
      if "collectives" in sharded:
        paged, contiguous = sharded["collectives"]["paged"], sharded["collectives"]["contiguous"]
        assert paged and all(c["all-gather"] <= contiguous["all-gather"] for c in paged), (kind, paged, contiguous)
        assert all(c["all-reduce"] <= contiguous["all-reduce"] + more for c in paged), (kind, paged, contiguous)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_two_processes_share_one_mesh_of_eight(tmp_path, eight_devices):
  port = _free_port()
  out = tmp_path / "two.json"
  procs = [subprocess.Popen([sys.executable, str(WORKER), str(out), "--meshes", "data=2,model=4",
                             "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)],
                            env=_env(4), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for i in range(2)]
  try:
    results = [p.communicate(timeout=900) for p in procs]
  finally:
    for p in procs:
      p.kill()
  for i, (p, (_, err)) in enumerate(zip(procs, results)):
    assert p.returncode == 0, f"process {i} failed:\n{err[-3000:]}"
  got = json.loads(out.read_text())
  assert got["meshes"]["data=2,model=4"]["spec"] == eight_devices["single"]["ar"]
  assert got["meshes"]["data=2,model=4"]["ar"] == eight_devices["single"]["ar"]
