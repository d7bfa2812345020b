"""Calibration: which cost model a decoder uses (a calibration kept for exactly these models and devices, else
the checkpoint's when measured on such devices, else neutral), as the API, the CLI and the server see it, and
what `python -m jspec.calibrate` measures and stores."""
import dataclasses
import json

import jax
import pytest

import jspec
from jspec import calibrate, cli, testing
from jspec.core.settings import AdaptiveConfig, CostModel, SpecConfig
from jspec.decoding.decoder import make_decoder
from jspec.formats import checkpoint, loading
from jspec.planning import calibration
from jspec.speculation import costs


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
  """Each test keeps its calibrations apart from the user's."""
  monkeypatch.setenv("JSPEC_CALIBRATION_DIR", str(tmp_path / "calibration"))


def test_a_calibration_is_kept_for_exactly_its_models_and_devices(tmp_path):
  target, draft = testing.random_pair()
  measured = CostModel(0.2, 0.05, 0.4, batches={4: CostModel(0.3, 0.1, 0.5)}, **testing.measured_here())
  where = costs.store(target, draft, "model", measured)
  assert where.parent == tmp_path / "calibration"
  assert costs.stored(target, draft, "model") == measured
  assert costs.cost_model(target, draft, "model", True) == (measured, "calibrated")
  # Anything its figures depend on, changed: another shape, dtype, drafter kind or mesh.
  wider = testing.random_model(dataclasses.replace(testing.NO_EOS, mlp_dim=256))
  assert costs.stored(wider, draft, "model") is None
  assert costs.stored(jspec.Model(dataclasses.replace(target.config, dtype="bfloat16"),
                                        jax.tree.map(lambda x: x.astype("bfloat16"), target.params), None),
                            draft, "model") is None
  assert costs.stored(target, None, "ngram") is None
  assert costs.stored(target, draft, "model", (2, 1)) is None
  assert costs.stored(loading.quantized(target, "int8"), draft, "model") is None  # each weight format its own
  # The weights' values are not part of it: retrained weights of the same shapes keep the calibration.
  assert costs.stored(target, testing.perturbed(draft, 0.1), "model") == measured
  # A corrupt file is as good as none.
  where.write_text("{not json")
  assert costs.stored(target, draft, "model") is None


def test_the_decoder_uses_the_calibration_else_the_checkpoint_else_neutral_and_says_which(tmp_path):
  target, draft = testing.random_pair()
  policy = lambda d: make_decoder(target, d, SpecConfig(adaptive=AdaptiveConfig()), 1).spec.adaptive
  # Figures measured on other devices are not used; on these, they are.
  elsewhere = dataclasses.replace(draft, cost_models={"model": CostModel(0.3, 0.1, 0.6, backend="gpu",
                                                                         device_kind="NVIDIA H200")})
  assert (policy(elsewhere).cost, policy(elsewhere).cost_source) == (CostModel.neutral(), "neutral")
  here = dataclasses.replace(draft, cost_models={"model": CostModel(0.3, 0.1, 0.6, **testing.measured_here())})
  assert (policy(here).cost, policy(here).cost_source) == (CostModel(0.3, 0.1, 0.6), "checkpoint")
  int8 = loading.quantized(target, "int8")  # the checkpoint's figures were measured with the float target
  assert costs.cost_model(int8, here, "model", True) == (CostModel.neutral(), "neutral")
  costs.store(target, draft, "model", CostModel(0.25, 0.0, 0.5, **testing.measured_here()))
  assert (policy(here).cost, policy(here).cost_source) == (CostModel(0.25, 0.0, 0.5), "calibrated")
  stats = jspec.generate(target, [[1, 2]], draft=here, max_new_tokens=4, draft_len=2).stats.to_dict()
  assert stats["cost_model"] == {"source": "calibrated", "cost_ratio": 0.25, "verify_cost": 0.0,
                                 "round_overhead": 0.5, "round_costs": [1.75, 2.0]}
  assert jspec.generate(target, [[1, 2]], max_new_tokens=4).stats.cost_model is None  # plain decoding


@pytest.mark.slow
def test_python_m_jspec_calibrate_measures_stores_and_is_used(tmp_path, capsys, monkeypatch):
  """A jspec directory pair: the CLI measures at batch 1, keeps the figures where generate finds them,
  and with --write puts them in the draft's checkpoint; a run on neutral or checkpoint figures says how to
  calibrate."""
  target, draft = testing.random_pair()
  jspec.save(target, tmp_path / "target")
  jspec.save(draft, tmp_path / "draft")
  models = ["--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft")]
  run = ["--prompt", "ab", "--max-new-tokens", "4", "--draft-len", "2", "--no-compile-cache", "--json", "--no-stream"]
  assert cli.main([*models, *run]) == 0
  captured = capsys.readouterr()
  assert json.loads(captured.out)["stats"]["cost_model"]["source"] == "neutral"
  assert f"python -m jspec.calibrate --target {tmp_path / 'target'} --draft {tmp_path / 'draft'}" in captured.err
  assert "--batches" not in captured.err  # one prompt ran as one row, whatever --batch-size allows
  assert calibrate.main([*models, "--batches", "1", "--draft-len", "2", "--repeats", "1", "--write",
                         "--json"]) == 0
  figures = json.loads(capsys.readouterr().out)
  assert figures["drafter"] == "model" and figures["cost_ratio"] >= 0 and "batches" not in figures
  assert len(figures["round_costs"]) == 2 and min(figures["round_costs"]) >= 1  # rounds of K = 1 and 2
  assert figures["backend"] == jax.default_backend()
  assert checkpoint.read_cost_models(tmp_path / "draft")["model"].cost_ratio == figures["cost_ratio"]
  assert cli.main([*models, *run]) == 0
  captured = capsys.readouterr()
  cost = json.loads(captured.out)["stats"]["cost_model"]
  assert cost["source"] == "calibrated" and cost["cost_ratio"] == figures["cost_ratio"]
  assert cost["round_costs"] == figures["round_costs"]
  assert "jspec.calibrate" not in captured.err
  # Elsewhere (another cache: another machine), the checkpoint's figures are used, and the note says so.
  monkeypatch.setenv("JSPEC_CALIBRATION_DIR", str(tmp_path / "elsewhere"))
  assert cli.main([*models, *run]) == 0
  captured = capsys.readouterr()
  assert json.loads(captured.out)["stats"]["cost_model"]["source"] == "checkpoint"
  assert "the checkpoint's cost figures" in captured.err and "python -m jspec.calibrate" in captured.err
  assert cli.main([*models, *run, "--quiet"]) == 0
  assert capsys.readouterr().err == ""
  for bad, message in [(["--batches", "x"], "--batches"), (["--no-draft"], "no cost model")]:
    assert calibrate.main([*models, *bad]) == 2
    assert message in capsys.readouterr().err


def test_the_server_calibrates_at_start_up_once(monkeypatch):
  from jspec.serve import startup
  target, draft = testing.random_pair()
  models = dict(draft=draft, spec=SpecConfig(drafter="model"), mesh=None)
  measured, figures = [], CostModel(0.2, **testing.measured_here())
  monkeypatch.setattr(calibration, "measure", lambda *a, **kw: measured.append((a[3], kw["draft_len"])) or figures)
  assert startup.calibrate(target, models, 4)  # at batch 1 and its slots, every K it may draft
  assert measured == [([1, 4], SpecConfig().draft_len)] and costs.stored(target, draft, "model") == figures
  startup.calibrate(target, models, 4)  # kept: not measured again
  assert len(measured) == 1
  startup.calibrate(target, dict(models, spec=SpecConfig(drafter="model", adaptive=None)), 4)  # fixed K
  assert len(measured) == 1


def test_measured_rounds_are_made_non_decreasing():
  """Timing noise may make a longer round look cheaper: such neighbours are pooled (least squares)."""
  assert calibration.non_decreasing([1.4, 1.8, 3.0, 2.9, 3.2]) == pytest.approx([1.4, 1.8, 2.95, 2.95, 3.2])
  assert calibration.non_decreasing([2.0, 1.0, 1.5]) == pytest.approx([1.5, 1.5, 1.5])
  assert calibration.non_decreasing([1.0, 2.0]) == [1.0, 2.0]


def test_rounds_of_the_default_draft_lengths_are_timed_and_the_others_interpolated(monkeypatch):
  """Adaptive K offers 1, 2, 4, 8 by default: those rounds are timed, and K = 3, 5, 6, 7 lie on the lines
  between them (after pooling, so they never decrease)."""
  target, draft = testing.random_pair()
  timed = []
  monkeypatch.setattr(calibration, "drafter_cost_ratio", lambda *a, **kw: 0.1)
  monkeypatch.setattr(calibration, "verify_ratio", lambda *a: 1.4)
  monkeypatch.setattr(calibration, "round_ratios", lambda target, draft, kind, lens, repeats, batch: timed.append(
      tuple(lens)) or {1: 1.5, 2: 1.8, 4: 2.2, 8: 2.1})
  cost = calibration.measure(target, draft, "model", (1,), repeats=1, draft_len=8)
  assert timed == [(1, 2, 4, 8)]
  assert cost.round_costs == pytest.approx((1.5, 1.8, 1.975, 2.15, 2.15, 2.15, 2.15, 2.15))


def test_rounds_are_timed_up_to_what_the_drafter_can_propose():
  """Medusa's heads bound its draft: a calibration asked for K up to 8 times rounds of K = 1, 2 for two heads."""
  target = testing.random_model(testing.NO_EOS)
  heads = testing.random_draft("medusa", target, heads=2)
  assert len(calibration.measure(target, heads, "medusa", (1,), repeats=1, draft_len=8).round_costs) == 2
