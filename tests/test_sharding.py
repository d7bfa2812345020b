"""Sharded decoding on 8 simulated CPU devices, and across two real processes with jax.distributed."""
import json
import pathlib
import socket
import subprocess
import sys

import pytest

from jspec import testing

pytestmark = pytest.mark.slow  # meshes of simulated devices in subprocesses

WORKER = pathlib.Path(__file__).resolve().parent / "mesh_worker.py"


@pytest.fixture(scope="module")
def eight_devices(tmp_path_factory):
  out = tmp_path_factory.mktemp("mesh") / "out.json"
  proc = subprocess.run([sys.executable, str(WORKER), str(out)], env=testing.simulated_devices_env(8),
                        capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(out.read_text())


@pytest.mark.parametrize("mesh", ["data=8", "model=8", "data=2,model=4"])
def test_greedy_outputs_on_a_mesh_equal_one_device(eight_devices, mesh):
  single, sharded = eight_devices["single"], eight_devices["meshes"][mesh]
  for kind in ("ar", "spec", "spec_replicated_draft", "constrained"):
    assert sharded[kind] == single[kind], (mesh, kind)
  assert sharded["moe"] == (single["moe"] if mesh == "data=2,model=4" else None), mesh  # experts split over model
  assert sharded["dflash"] == (single["ar"] if mesh == "data=2,model=4" else None), mesh
  assert single["dflash"] == single["ar"]
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
                               "w_down": "P('model', None)", "embed": "P('model', None)",
                               # every expert on every device, its MLP columns split; the router whole
                               "router": "P(None, None)", "we_gate_up": "P(None, None, 'model')",
                               "we_down": "P(None, 'model', None)"}
  assert tp["cache_spec"] == "P('model', None, None)" and tp["cache_heads_major"]
  # a quantized weight's scales split with its output channels
  assert tp["hf_directory"]["quantized_specs"] == ["P(None, 'model')"] * 2 + ["P('model', None)", "P(None, None)"]
  dp = eight_devices["meshes"]["data=8"]
  assert set(dp["param_specs"].values()) == {"P(None, None)", "P(None, None, None)"}
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


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_two_processes_share_one_mesh_of_eight(tmp_path, eight_devices):
  port = _free_port()
  out = tmp_path / "two.json"
  procs = [subprocess.Popen([sys.executable, str(WORKER), str(out), "--meshes", "data=2,model=4",
                             "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)],
                            env=testing.simulated_devices_env(4), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
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
