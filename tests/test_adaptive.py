"""Adaptive speculation: the decisions from synthetic statistics, and losslessness and no retrace with it on."""
import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec import drafters, testing
from jspec.bench import end_to_end
from jspec.core import shipped
from jspec.core.settings import AdaptiveConfig, CostModel, SpecConfig
from jspec.decoding import loop
from jspec.decoding.decoder import make_decoder
from jspec.formats import checkpoint
from jspec.model.config import num_params
from jspec.speculation import adaptive

# Every K up to 8 offered, so the decisions below follow the formula alone (the default offers 1, 2, 4, 8).
POLICY = AdaptiveConfig(cost_ratio=0.1, verify_cost=0.05, round_overhead=0.0, fallback_threshold=0.4,
                        probe_interval=4, window=4, draft_lens=tuple(range(1, 9)))
CONFIG = testing.SMALL_VOCAB


def stats_with(rounds):
  """Acceptance statistics after the given rounds: a list of (n_accepted per row, K)."""
  acc = adaptive.Acceptance.zeros(len(rounds[0][0]), POLICY.window, 8)
  for n_accepted, k in rounds:
    acc = acc.record(jnp.ones(len(n_accepted), bool), jnp.asarray(n_accepted), k)
  return acc


def choose(acc, active=None, policy=POLICY):
  active = jnp.ones(acc.ewma_tested_B.shape, bool) if active is None else jnp.asarray(active)
  k, probe = adaptive.choose(acc, active, policy, 8)
  return int(k), bool(probe)


def test_per_token_rate_counts_the_first_rejection_as_a_test():
  acc = stats_with([([2, 4], 4)])  # row 0: 2 accepted, 3 tested; row 1: all 4 accepted, 4 tested
  np.testing.assert_allclose(acc.window_rate, [2 / 3, 1.0])


def test_draft_len_follows_the_expected_speedup():
  assert choose(adaptive.Acceptance.zeros(1, 4, 8)) == (POLICY.initial_draft_len, False)  # no data yet
  ks = {a: choose(stats_with([([a], 8)] * 20))[0] for a in (8, 6, 3, 2)}
  assert ks == {8: 8, 6: 6, 3: 3, 2: 2}  # every round accepted a: position a+1 always fails
  # Rounds that accept 6 or 2 in turn: r = 1, 1, ~1/2, 1, 1, 1, 0 (EWMAs), each shrunk a little toward
  # 1 by the prior; position 8, never tested, is 1.
  mixed = stats_with([([6], 8), ([2], 8)] * 30)
  rates = np.asarray(mixed.position_rates[0])
  observed = np.asarray([1, 1, 0.5, 1, 1, 1, 0])
  np.testing.assert_allclose(np.asarray(mixed.ewma_hit_BxK / mixed.ewma_tested_BxK)[0, :7], observed, atol=0.05)
  assert np.all(np.abs(rates[:7] - observed) < 0.2) and np.all(rates[:7] >= observed - 1e-6)
  assert rates[7] == pytest.approx(1.0)
  tokens = 1 + np.cumsum(np.cumprod(rates))
  for policy in (POLICY, dataclasses.replace(POLICY, verify_cost=0.3)):  # the choice maximizes the formula
    gains = tokens / (1 + policy.round_overhead + np.arange(1, 9) * (policy.cost_ratio + policy.verify_cost))
    assert choose(mixed, policy=policy)[0] == 1 + int(np.argmax(gains))
  # A dearer verify (each extra token costs more of the target forward) shortens the draft: 6 -> 2 here;
  # a dearer round (fixed overhead) lengthens it again (so dear that no K beats a plain step: with
  # fallback off, the best K is still taken).
  costly = dataclasses.replace(POLICY, verify_cost=0.3)
  assert choose(mixed)[0] == 6 and choose(mixed, policy=costly)[0] == 2
  assert choose(mixed, policy=dataclasses.replace(costly, round_overhead=2.0, fallback_threshold=0.0))[0] == 6
  # Leviathan's formula is the special case r_i = alpha.
  alpha, c = 0.7, 0.1
  rounds = [CostModel(c).round_cost(k) for k in range(1, 6)]
  np.testing.assert_allclose(adaptive.expected_speedup(jnp.full((1, 5), alpha), rounds)[0],
                             [(1 - alpha ** (k + 1)) / ((1 - alpha) * (k * c + 1)) for k in range(1, 6)], rtol=1e-5)


def test_the_default_draft_lengths_are_powers_of_two_and_the_longest():
  assert [AdaptiveConfig().lens(k) for k in (1, 2, 3, 6, 8, 12)] == [
      (1,), (1, 2), (1, 2, 3), (1, 2, 4, 6), (1, 2, 4, 8), (1, 2, 4, 8, 12)]
  assert AdaptiveConfig(draft_lens=(3, 5, 9)).lens(8) == (1, 3, 5)  # 1 always: probes draft one token
  with pytest.raises(ValueError, match="draft_lens must be integers >= 1"):
    AdaptiveConfig(draft_lens=(0, 2))
  # The best of the lengths offered: rounds that accept 6 or 2 in turn make K = 6 best of all (above);
  # of 1, 2, 4, 8 the formula's best is 4, and before any data the initial 4 (3 would start at 2).
  mixed = stats_with([([6], 8), ([2], 8)] * 30)
  offered = dataclasses.replace(POLICY, draft_lens=())
  tokens = 1 + np.cumsum(np.cumprod(np.asarray(mixed.position_rates[0])))
  gains = tokens / (1 + np.arange(1, 9) * (POLICY.cost_ratio + POLICY.verify_cost))
  assert choose(mixed)[0] == 6 and choose(mixed, policy=offered)[0] == max((1, 2, 4, 8), key=lambda k: gains[k - 1])
  assert choose(mixed, policy=offered)[0] == 4
  fresh = adaptive.Acceptance.zeros(1, 4, 8)
  assert choose(fresh, policy=offered)[0] == 4
  assert choose(fresh, policy=dataclasses.replace(offered, initial_draft_len=3))[0] == 2


def test_measured_rounds_win_over_the_line():
  """Rounds as calibrated (`CostModel.round_costs`) set K, not 1 + o + K (c + v): a round of 6 measured
  nearly as cheap as one of 4 (a verify's cost is not linear in its width) lengthens the draft, and the
  line continues past the longest measured K."""
  measured = CostModel(0.1, 0.15, 0.3, round_costs=(1.4, 1.7, 2.0, 2.3, 2.35, 2.4))
  assert [measured.round_cost(k) for k in (1, 6, 8)] == [1.4, 2.4, pytest.approx(2.9)]
  assert CostModel(0.1, 0.15, 0.3).round_cost(4) == pytest.approx(2.3)
  policy = dataclasses.replace(POLICY, cost_ratio=None, verify_cost=None, round_overhead=None)
  acc = stats_with([([5], 8), ([6], 8), ([4], 8)] * 10)  # rounds that accept 4 to 6 of 8
  line = policy.with_costs(dataclasses.replace(measured, round_costs=()), 1, 8)
  rounds = policy.with_costs(measured, 1, 8)
  assert rounds.costs_by_rows == ((1.4, 1.7, 2.0, 2.3, 2.35, 2.4, pytest.approx(2.65), pytest.approx(2.9)),)
  rates = np.asarray(acc.position_rates[0])
  best = lambda p: 1 + int(np.argmax((1 + np.cumsum(np.cumprod(rates))) / np.asarray(p.costs_by_rows[0])))
  assert [choose(acc, policy=p)[0] for p in (line, rounds)] == [best(line), best(rounds)] == [5, 6]
  # A cost field set in the policy replaces the measured rounds with its line.
  assert dataclasses.replace(policy, verify_cost=0.15).with_costs(measured, 1, 8).costs_by_rows == line.costs_by_rows
  assert CostModel(**json.loads(json.dumps(measured.to_json()))) == measured


def test_one_early_rejection_does_not_pin_the_draft_short():
  # The first round accepted 1 of 4: position 2 has one test, a rejection, which moves its rate only
  # halfway to 0, so with the shipped pair's costs the next round still drafts past it.
  acc = stats_with([([1], 4)])
  assert float(acc.position_rates[0, 1]) == pytest.approx(0.5)
  shipped_costs = dataclasses.replace(POLICY, cost_ratio=0.08, verify_cost=0.025, round_overhead=0.28)
  assert choose(acc, policy=shipped_costs)[0] >= 2


def test_an_untested_position_drifts_back_to_optimism():
  """Early rounds rejected position 2; then only K = 1 rounds, all accepted, test position 1. Position 2's
  low rate fades toward 1, so longer drafts get tried again instead of K staying pinned at 1; so do the
  deep positions of a bursty text whose short rounds kept failing at once."""
  acc = stats_with([([1], 4)] * 3)
  r2 = lambda a: float(a.position_rates[0, 1])
  early = r2(acc)
  assert early < 0.3
  acc = stats_with([([1], 4)] * 3 + [([1], 1)] * 40)
  assert r2(acc) > 0.9 > early
  assert choose(acc)[0] == 8
  # Long runs measured, then a stretch of K = 1 rounds rejected at once: the deep rates stay high, and
  # when the first position accepts again the draft is long at once.
  bursty = stats_with([([8], 8)] * 10 + [([0], 1)] * 6 + [([1], 1)] * 3)
  assert float(bursty.position_rates[0, 7]) > 0.9 and choose(bursty, policy=dataclasses.replace(
      POLICY, fallback_threshold=0.0))[0] == 8


def test_fallback_below_the_threshold_and_probes_every_interval():
  low = stats_with([([0], 4)] * 4)  # window rate 0
  assert choose(low) == (0, False)
  for _ in range(POLICY.probe_interval - 1):
    low = low.after_plain_round()
  assert choose(low) == (0, False)
  k, probe = choose(low.after_plain_round())
  assert probe and k >= 1
  # A good probe lifts the window back over the threshold: speculation resumes.
  recovered = low.after_plain_round().record(jnp.ones(1, bool), jnp.asarray([4]), 4)
  recovered = recovered.record(jnp.ones(1, bool), jnp.asarray([4]), 4)
  assert choose(recovered)[0] >= 1 and not choose(recovered)[1]


def test_fallback_waits_for_a_full_window():
  assert choose(stats_with([([0], 4)]))[0] >= 1  # one rejected round is too little to stop on
  assert choose(stats_with([([0], 4)] * (POLICY.window - 1)))[0] >= 1
  assert choose(stats_with([([0], 4)] * POLICY.window))[0] == 0


def test_fallback_when_no_draft_length_beats_a_plain_step():
  acc = stats_with([([1], 4)] * 8)  # rate 0.5, over the threshold: each round makes 2 tokens
  assert choose(acc)[0] >= 1
  dear = dataclasses.replace(POLICY, cost_ratio=0.5, verify_cost=0.5, round_overhead=0.2)  # K = 1 costs 2.2
  assert choose(acc, policy=dear)[0] == 0
  assert choose(acc, policy=dataclasses.replace(dear, fallback_threshold=0.0))[0] >= 1  # 0: never fall back


def test_batch_rule_uses_the_mean_of_active_rows():
  acc = stats_with([([0, 4], 4)] * 4)  # row 0 rate 0, row 1 rate 1: mean 0.5 >= 0.4
  assert choose(acc)[0] >= 1
  assert choose(acc, active=[True, False])[0] == 0  # only the poor row is still decoding


@pytest.fixture(scope="module")
def pair():
  return testing.random_pair(CONFIG)


@pytest.mark.parametrize("drafter,threshold,draft_len", [("model", 0.95, 5), ("ngram", 0.0, 3)])
def test_adaptive_greedy_equals_plain_decoding(pair, drafter, threshold, draft_len):
  """With fallback and probes (a threshold few rounds reach; K = 1, 2, 4 or 5), and with speculation that
  never falls back: the target's greedy tokens, its full-forward argmax."""
  target, draft = pair
  prompts = [[1, 2, 3], [5], [7, 8, 9, 10, 11, 3], [0, 0]]
  ar = jspec.generate(target, prompts, max_new_tokens=40)
  spec = SpecConfig(drafter=drafter, adaptive=AdaptiveConfig(fallback_threshold=threshold, probe_interval=3))
  r = jspec.generate(target, prompts, draft=draft if drafter == "model" else None, spec=spec, max_new_tokens=40,
                     draft_len=draft_len)
  assert r.token_ids == ar.token_ids
  assert 0 < r.stats.acceptance_rate < 1  # drafts are accepted and rejected, so rollback paths run too
  for p, ids in zip(prompts, r.token_ids):
    testing.assert_target_argmax(target, p, ids)
  counts = r.stats.draft_len_counts
  assert sum(counts.values()) == r.stats.target_forwards
  if threshold > 0:
    assert r.stats.fallback_rounds > 0 and r.stats.probe_rounds > 0
    assert counts.get(0, 0) == r.stats.fallback_rounds
  else:
    assert r.stats.fallback_rounds == 0


def test_no_retrace_as_k_changes_at_run_time(pair):
  target, draft = pair
  kw = dict(draft=draft, draft_len=4,
            spec=SpecConfig(adaptive=AdaptiveConfig(fallback_threshold=0.5, probe_interval=2, verify_cost=0.3)))
  jspec.generate(target, [[1, 2]], max_new_tokens=30, **kw)
  before = dict(loop.trace_counts)
  seen = set()
  for i in range(3):
    r = jspec.generate(target, [[3 + i] * (2 + i)], max_new_tokens=30, seed=i, temperature=0.5 * i, **kw)
    assert r.stats.compile_seconds == 0.0
    counts = r.stats.draft_len_counts
    seen |= set(counts)
    # The branch that ran drafted the K chosen: a draft model drafts every round it is given, one row.
    assert r.stats.draft_forwards == r.stats.drafted_tokens == sum(k * n for k, n in counts.items())
  assert len(seen) >= 3 and seen <= {0, 1, 2, 4}  # K really changed inside the compiled loop, among those offered
  assert dict(loop.trace_counts) == before
  # Rounds priced at a cost model of free drafts and verifies: one target step each, so τ.
  free = dataclasses.replace(r.stats, cost_model=dict(r.stats.cost_model, round_costs=[1.0] * 8))
  assert end_to_end.priced_speedup(free) == pytest.approx(r.stats.mean_accepted_length)
  assert end_to_end.priced_speedup(r.stats) < r.stats.mean_accepted_length  # drafts cost c = 0.1 each


def test_disable_at_batch_size_decodes_plainly_while_that_many_rows_run(pair):
  target, draft = pair
  spec = SpecConfig(draft_len=2, disable_at_batch_size=3)
  r = jspec.generate(target, [[1]] * 3, draft=draft, max_new_tokens=8, spec=spec)
  assert r.stats.draft_forwards == 0 and r.stats.draft_len_counts == {0: 8}
  assert end_to_end.priced_speedup(r.stats) is None  # priced for one row only
  # Rows that finish make room: the last prompt, alone in its slot, speculates.
  stream = jspec.stream(target, [[1], [2], [3], [4]], draft=draft, max_new_tokens=8, batch_size=3, spec=spec)
  drafted = [d.stats.drafted_tokens for d in stream if d.finished]
  assert drafted[:3] == [0, 0, 0] and drafted[3] > 0
  # Without adaptive K the rule is per batch.
  fixed = SpecConfig(disable_at_batch_size=3, adaptive=None)
  assert jspec.generate(target, [[1]] * 3, draft=draft, max_new_tokens=8, spec=fixed).stats.drafter is None


def test_a_draft_trails_the_text_by_at_most_a_probe_interval_or_its_context(pair):
  """A draft model catches up the plain steps between probes in one forward: as wide as the interval, but
  no wider than the longest text it holds (an interval of 10^5 asks no 10^5-token forward)."""
  target, draft = pair
  lag = lambda interval: make_decoder(target, draft, SpecConfig(
      adaptive=AdaptiveConfig(probe_interval=interval)), 1).drafter.max_lag
  assert lag(16) == 17 and lag(10 ** 5) == draft.config.max_seq_len


def test_a_loaded_batch_steps_aside_when_its_verify_cannot_pay(pair):
  """Costs measured at 4 rows that no K can beat: a batch of 4 decodes plainly, one of 2 speculates."""
  target, draft = pair
  measured = CostModel(0.1, 0.05, 0.2, batches={4: CostModel(0.5, 0.6, 1.0)}, **testing.measured_here())
  draft = dataclasses.replace(draft, cost_models={"model": measured})
  spec = SpecConfig(draft_len=2)
  policy = make_decoder(target, draft, spec, 4).spec.adaptive
  assert policy.costs_by_rows == (pytest.approx((1.35, 1.5)),) * 3 + (pytest.approx((3.1, 4.2)),)
  # Four rows decode plainly; once the last two have ended, the first two run at width 2, and speculate.
  engine = jspec.make_engine(target, draft=draft, spec=spec, slots=4, max_len=64)
  for i, n in enumerate([24, 24, 4, 4]):
    engine.add(jspec.Request([1 + i], n), i)
  drafted = {}
  while engine.has_work:
    drafted.update({d.index: d.stats.drafted_tokens for d in engine.step() if d.finished})
  assert drafted[2] == drafted[3] == 0 and drafted[0] > 0 and drafted[1] > 0


def test_the_measured_cost_model_travels_with_the_checkpoint(pair, tmp_path):
  target, draft = pair
  measured = CostModel(0.3, 0.05, 0.7, target_params=num_params(target.config), **testing.measured_here(),
                       batches={4: CostModel(0.35, 0.2, 0.5), 8: CostModel(0.4, 0.3, 0.4)})
  checkpoint.save(dataclasses.replace(draft, cost_models={"model": measured}), tmp_path / "draft")
  loaded = jspec.load(tmp_path / "draft")
  assert loaded.cost_models == {"model": measured}
  policy = lambda t, d, batch=1, **kw: make_decoder(t, d, SpecConfig(adaptive=AdaptiveConfig(**kw)),
                                                            batch).spec.adaptive
  assert policy(target, loaded).cost == CostModel(0.3, 0.05, 0.7)
  # A batch takes the costs measured at the largest batch up to its size.
  assert [policy(target, loaded, b).cost for b in (3, 4, 7, 16)] == [
      CostModel(0.3, 0.05, 0.7), CostModel(0.35, 0.2, 0.5), CostModel(0.35, 0.2, 0.5), CostModel(0.4, 0.3, 0.4)]
  assert policy(target, loaded, verify_cost=0.2).cost == CostModel(0.3, 0.2, 0.7)  # what is given wins
  # Measured with another target: the neutral defaults, as for a drafter never measured.
  wider = testing.random_model(dataclasses.replace(CONFIG, mlp_dim=256))
  assert policy(wider, loaded).cost == CostModel.neutral() == policy(target, draft).cost == CostModel(0.1)
  # Heads carry theirs too; n-gram's lives with the target.
  heads = testing.random_heads(drafters.MedusaDrafter(target.config, 4))
  checkpoint.save_heads(dataclasses.replace(heads, cost_models={"medusa": measured}), tmp_path / "medusa")
  assert policy(target, jspec.load(tmp_path / "medusa")).cost == CostModel(0.3, 0.05, 0.7)
  ngram = dataclasses.replace(target, cost_models={"ngram": measured})
  spec = SpecConfig(drafter="ngram", adaptive=AdaptiveConfig())
  assert make_decoder(ngram, None, spec, 1).spec.adaptive.cost == CostModel(0.3, 0.05, 0.7)
  assert make_decoder(target, None, spec, 1).spec.adaptive.cost == CostModel(0.0)


@pytest.mark.parametrize("pair", shipped.PAIRS.values(), ids=shipped.PAIRS)
def test_the_shipped_checkpoints_carry_their_measured_cost_models(pair):
  target = jspec.load(pair.target)
  assert target.cost_models["ngram"].target_params == num_params(target.config)
  for kind, path in pair.drafts.items():
    cost = checkpoint.read_cost_models(path)[kind]
    assert cost.target_params == num_params(target.config) and 0 < cost.cost_ratio < 1
    assert (cost.backend, cost.device_kind) == ("cpu", "cpu")  # what CPU users get (`jspec.planning.calibration`)


def test_settings_refuse_every_bad_value():
  for make, message in [
      (lambda: AdaptiveConfig(fallback_threshold=float("nan")), "fallback_threshold"),
      (lambda: AdaptiveConfig(window=0), "window"), (lambda: AdaptiveConfig(initial_draft_len=0), "initial_draft_len"),
      (lambda: AdaptiveConfig(cost_ratio=float("inf")), "cost_ratio"),
      (lambda: CostModel(-1.0), "cost_ratio"), (lambda: CostModel(0.1, target_params=1.5), "target_params"),
      (lambda: CostModel(0.1, tree_nodes=0), "tree_nodes"),
      (lambda: CostModel(0.1, batches={1: CostModel(0.1)}), "batches"),
      (lambda: CostModel(0.1, batches={4: {"cost_ratio": -1}}), "cost_ratio"),
      (lambda: SpecConfig(draft_len=True), "draft_len"), (lambda: SpecConfig(trace_rounds=-1), "trace_rounds"),
      (lambda: SpecConfig(drafter="tree"), "unknown drafter")]:
    with pytest.raises(ValueError, match=message):
      make()
