"""The prepared accelerator check runs end to end on tiny shapes (`--smoke`), on whatever backend this is."""
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tools"))

import gpu_check  # noqa: E402


def test_gpu_check_smoke_run_writes_every_section(tmp_path):
  out = tmp_path / "check.json"
  assert gpu_check.main(["--smoke", "--out", str(out)]) == 0
  result = json.loads(out.read_text())
  sections = result["sections"]
  assert set(sections) == {"lossless", "target", "verify", "rounds", "shipped"}
  lossless = sections["lossless"]
  assert lossless["greedy_speculative_equals_plain"] and lossless["greedy_equals_full_forward_argmax"]
  assert lossless["two_token_law_exact"] and lossless["cached_forward_matches"]
  assert 0 < sections["target"]["bound_over_measured"] and sections["target"]["ar_ms_per_token"] > 0
  assert sections["verify"]["verify_over_step"]["1"] == 1.0 and len(sections["verify"]["verify_over_step"]) == 4
  assert set(sections["rounds"]["round_in_target_steps"]) == {"2"}
  assert sections["shipped"]["greedy_identical"] and sections["shipped"]["speedup"] > 0
