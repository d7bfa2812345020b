"""The prepared accelerator check (`python -m jspec.bench --suite gpu`) runs end to end on tiny shapes
(`--smoke`), on whatever backend this is, and its figures are sane: ratios of positive times, exact checks."""
import json
import math

import pytest

from jspec.bench.cli import main
from jspec.planning import gpus

pytestmark = pytest.mark.slow  # the whole suite's sections, end to end


def test_gpu_check_smoke_run_writes_every_section(tmp_path):
  assert main(["--suite", "gpu", "--smoke", "--out", str(tmp_path)]) == 0
  result = json.loads((tmp_path / "bench.json").read_text())
  assert result["suite"] == "gpu" and result["ok"] and "partial" not in result
  sections = result["sections"]
  assert set(sections) == {"lossless", "kernel", "target", "verify", "rounds", "shipped"}
  assert sections["kernel"]["within_tolerance"] and set(sections["kernel"]["max_error"]) == {"chain"}
  assert all(s["seconds"] > 0 for s in sections.values())
  lossless = sections["lossless"]
  assert lossless["greedy_speculative_equals_plain"] and lossless["greedy_equals_full_forward_argmax"]
  assert lossless["two_token_law_exact"] and lossless["cached_forward_matches"]
  target = sections["target"]
  # A per-token time is a difference of two decode times, which this shared CPU can even make negative: only
  # ratios of times are asserted positive.
  assert math.isfinite(target["ar_ms_per_token"])
  assert target["weight_streaming_bound_ms"] > 0 and target["bandwidth_gb_s"] > 0
  assert abs(target["bound_over_measured"] - target["weight_streaming_bound_ms"] / target["ar_ms_per_token"]) < 1e-9
  curve = sections["verify"]["verify_over_step"]
  assert set(curve) == {"1", "2", "4", "8"} and curve["1"] == 1.0 and all(v > 0 for v in curve.values())
  assert set(sections["rounds"]["round_in_target_steps"]) == {"2"}
  assert sections["rounds"]["round_in_target_steps"]["2"] > 0
  assert sections["shipped"]["greedy_identical"] and sections["shipped"]["speedup"] > 0


@pytest.mark.skipif(not gpus.compiler_installed(), reason="no CUDA plugin: pip install -e '.[gpu-compile]'")
def test_the_checks_programs_compile_here_for_an_h100(tmp_path):
  """`--compile-for gpu:h100:1`: the target section's plain decoding (Triton kernel and XLA loop) and the
  rounds section's round compile for an abstract H100, nothing run."""
  assert main(["--suite", "gpu", "--smoke", "--compile-for", "gpu:h100:1", "--out", str(tmp_path)]) == 0
  result = json.loads((tmp_path / "bench.json").read_text())
  assert result["compiled_for"] == "gpu:h100:1" and set(result["plain"]) == {"auto", "xla"}
  assert result["plain"]["auto"]["attention"] == "Pallas GPU (Triton) kernel"
  assert result["plain"]["xla"]["attention"] == "XLA loop"
  assert all(p["total_bytes"] > 0 and p["estimated_plain_step_s"] > 0 for p in result["plain"].values())
  assert set(result["rounds"]) == {"2"} and result["rounds"]["2"]["estimated_round_in_target_steps"] > 1
