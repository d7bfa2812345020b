"""Paged serving on 8 simulated CPU devices (a file of its own: its one test takes as long as the rest of
tests/test_sharding.py, so the two can run side by side)."""
import json
import pathlib
import subprocess
import sys

import pytest

from jspec import testing

pytestmark = pytest.mark.slow  # meshes of simulated devices in a subprocess

PAGED_WORKER = pathlib.Path(__file__).resolve().parent / "paged_mesh_worker.py"


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
  proc = subprocess.run([sys.executable, str(PAGED_WORKER), str(out)], env=testing.simulated_devices_env(8),
                        capture_output=True, text=True, timeout=900)
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
