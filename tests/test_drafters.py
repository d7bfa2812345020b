"""Every drafter behind the one interface: greedy identity, ragged batches, rollback, no retrace, n-gram lookup."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec import drafters, testing
from jspec.core import shipped
from jspec.core.settings import SpecConfig
from jspec.decoding import loop
from jspec.decoding.batches import make_batch
from jspec.decoding.decoder import make_decoder
from jspec.formats import checkpoint

CONFIG = testing.SMALL_VOCAB
VOCAB = CONFIG.vocab_size
KINDS = testing.KINDS


@pytest.fixture(scope="module")
def target():
  return testing.random_model(CONFIG, seed=0, scale=2.0)


make_draft = testing.random_draft


def prompts(count: int, seed: int = 0) -> list[list[int]]:
  rng = np.random.default_rng(seed)
  return [rng.integers(0, VOCAB, size=int(n)).tolist() for n in rng.integers(1, 12, size=count)]


# (kind, K), every round drafting K; adaptive K's greedy identity: test_adaptive.py.
GREEDY = [("model", 1), ("medusa", 4), ("eagle", 4), ("eagle", 1), ("ngram", 4)]


@pytest.mark.parametrize("kind,draft_len", GREEDY)
def test_greedy_equals_plain_decoding_and_target_argmax(target, kind, draft_len):
  ps = prompts(6)
  ar = jspec.generate(target, ps, max_new_tokens=20)
  spec = testing.fixed_k(draft_len, drafter=kind)
  r = jspec.generate(target, ps, draft=make_draft(kind, target), spec=spec, max_new_tokens=20)
  assert r.stats.drafter == kind
  assert r.token_ids == ar.token_ids
  assert 0 < r.stats.acceptance_rate < 1  # drafts are accepted and rejected, so rollback paths run too
  for p, ids in zip(ps, r.token_ids):
    assert len(ids) == 20
    testing.assert_target_argmax(target, p, ids)


# suffix: a batch's rows draft from each other's text, so a row's sampled tokens depend on the others (its law does
# not: tests/test_suffix.py)
@pytest.mark.parametrize("kind", [k for k in KINDS if k != "suffix"])
def test_sampled_rows_in_a_ragged_batch_equal_rows_alone(target, kind):
  ps = prompts(3, seed=1)
  kw = dict(draft=make_draft(kind, target), spec=SpecConfig(drafter=kind, adaptive=None), max_new_tokens=16,
            draft_len=3, temperature=1.0)
  batched = jspec.generate(target, ps, seed=5, **kw)
  for b, p in enumerate(ps):
    assert jspec.generate(target, [p], seed=[5 + b], **kw).token_ids[0] == batched.token_ids[b]


def parallel_draft(target, mask: int = 15):
  """A random parallel draft model (PARD's layout): a perturbed copy of the target with a mask token."""
  draft = make_draft("model", target)
  return dataclasses.replace(draft, config=dataclasses.replace(draft.config, mask_id=mask))


@pytest.mark.parametrize("kind", ["model", "medusa", "eagle", "eagle3", "dflash", "parallel"])
def test_rollback_leaves_the_drafter_as_a_fresh_prefill_would(target, kind):
  """After each round, the drafter's next proposal from its carried state equals its proposal after a fresh
  prefill of the accepted text, including rows rejected in the middle of their draft."""
  draft_len, rows, width = 4, 16, 16
  draft = {"eagle3": testing.random_eagle3, "parallel": parallel_draft}.get(kind, lambda t: make_draft(kind, t))(target)
  spec = SpecConfig(draft_len, drafter={"eagle3": "eagle", "parallel": "model"}.get(kind, kind), adaptive=None)
  decoder = make_decoder(target, draft, spec, rows)
  ps = prompts(rows, seed=2)
  batch = make_batch(decoder, ps, 64, width=width)
  keys = jnp.zeros((draft_len, rows, 2), jnp.uint32)

  @jax.jit
  def fresh(tokens_BxP, lens_B):
    return loop.start(decoder, batch.replace(prompts_BxP=tokens_BxP, prompt_lens_B=lens_B))

  @jax.jit
  def proposal(state):
    return decoder.drafter.propose(decoder.weights, state.drafter_state, state.context, keys)[1].logits_BxKxV

  step = jax.jit(lambda s: loop.speculative_step(decoder, s))
  state = fresh(batch.prompts_BxP, batch.prompt_lens_B)
  mid_rejections = 0
  for _ in range(6):
    before = state.seq_lens_B
    state = step(state)
    accepted = np.asarray(state.seq_lens_B - before - 1)
    mid_rejections += int(np.sum((accepted > 0) & (accepted < draft_len)))
    text = state.tokens_BxT[:, :width + 6 * (draft_len + 1)]  # one fixed width: `fresh` compiles once
    np.testing.assert_allclose(proposal(state), proposal(fresh(text, state.seq_lens_B)), atol=2e-4, rtol=2e-4)
  assert mid_rejections > 0


@pytest.mark.parametrize("kind", KINDS)
def test_no_retrace_across_requests(target, kind):
  """New prompts of a bucket, lengths, seeds, sampling values and ignore_eos compile nothing new."""
  kw = dict(draft=make_draft(kind, target), spec=testing.fixed_k(3, drafter=kind))
  jspec.generate(target, [[1, 2, 3]], max_new_tokens=10, **kw)
  before = dict(loop.trace_counts)
  for i, temp in enumerate([0.0, 0.8, 1.2]):
    r = jspec.generate(target, [[4] * (i + 2)], max_new_tokens=10 + i, temperature=temp, top_k=i,
                       top_p=1.0 - 0.1 * i, seed=i, ignore_eos=bool(i % 2), **kw)
    assert r.stats.compile_seconds == 0.0
  assert dict(loop.trace_counts) == before


def test_ngram_lookup_finds_the_most_recent_longest_match():
  tokens = jnp.asarray([[1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3, 0, 0],   # "1 2 3" last seen at 4: continue at 7
                        [4, 5, 6, 4, 8, 6, 0, 0, 0, 0, 0, 0, 0, 0],   # only "6" matches (at 2): continue at 3
                        [1, 2, 3, 4, 5, 0, 0, 0, 0, 0, 0, 0, 0, 0]])  # no match
  found, start, length = drafters.ngram.lookup(tokens, jnp.asarray([12, 6, 5]), max_ngram=3)
  assert found.tolist() == [True, True, False]
  assert start[:2].tolist() == [7, 3] and length[:2].tolist() == [3, 1]


def test_ngram_without_a_match_runs_plain_target_steps(target):
  ngram = SpecConfig(drafter="ngram", adaptive=None)
  r = jspec.generate(target, [[1, 2, 3]], spec=ngram, max_new_tokens=1, draft_len=4)
  assert r.stats.plain_forwards == 1 and r.stats.drafted_tokens == 0
  # On a prompt that repeats itself, the greedy continuation is found in the context.
  loop = [3, 1, 4, 1, 5, 9, 2, 6] * 4
  r = jspec.generate(target, [loop], spec=ngram, max_new_tokens=32, draft_len=4)
  assert r.token_ids == jspec.generate(target, [loop], max_new_tokens=32).token_ids


def test_heads_save_and_load_round_trip(target, tmp_path):
  for kind in ("medusa", "eagle"):
    heads = make_draft(kind, target)
    checkpoint.save_heads(heads, tmp_path / kind)
    loaded = jspec.load(tmp_path / kind)
    assert loaded.drafter == heads.drafter
    jax.tree.map(np.testing.assert_array_equal, loaded.params, heads.params)


def test_bad_drafter_requests_are_one_line_errors(target):
  with pytest.raises(ValueError, match="unknown drafter"):
    jspec.generate(target, [[1]], spec=SpecConfig(drafter="tree"))
  with pytest.raises(ValueError, match="needs draft weights"):
    jspec.generate(target, [[1]], spec=SpecConfig(drafter="medusa"))
  with pytest.raises(ValueError, match="exceeds the 5 Medusa heads"):  # a fixed K; an adaptive one is capped
    jspec.generate(target, [[1]], draft=make_draft("medusa", target), draft_len=6, spec=testing.fixed_k(6))
  capped = make_decoder(target, make_draft("medusa", target), SpecConfig(8), 1)  # adaptive: K_max is a ceiling
  assert capped.spec.draft_len == 5 and capped.spec.adaptive is not None
  with pytest.raises(ValueError, match="the eagle drafter was given medusa weights"):
    jspec.generate(target, [[1]], draft=make_draft("medusa", target), spec=SpecConfig(drafter="eagle"))
  wide = testing.random_model(dataclasses.replace(CONFIG, dim=96))
  with pytest.raises(ValueError, match="trained for a target of width 64"):
    jspec.generate(wide, [[1]], draft=make_draft("eagle", target))


@pytest.mark.slow  # the shipped checkpoints, end to end
def test_dflash_drafts_a_block_in_one_forward_and_decodes_losslessly(target):
  """A random DFlash drafter (two layers, blocks of 6): greedy rounds of 5 and adaptive ones (whose plain steps
  write its pending context) give the target's tokens in a ragged batch; the first two tokens keep the exact
  law; a draft longer than its block is refused."""
  drafter = drafters.DFlashDrafter.for_training(target.config, {"draft_layers": 2, "block_size": 6, "mask_token": 15})
  heads = testing.random_heads(drafter, seed=3)
  ps = prompts(6, seed=5)
  plain = jspec.generate(target, ps, max_new_tokens=24).token_ids
  adaptive = SpecConfig(5, drafter="dflash", adaptive=jspec.AdaptiveConfig(probe_interval=2, draft_lens=(5,)))
  for spec in (testing.fixed_k(5, drafter="dflash"), adaptive):
    r = jspec.generate(target, ps, draft=heads, spec=spec, max_new_tokens=24)
    assert r.token_ids == plain and 0 < r.stats.acceptance_rate < 1
  assert r.stats.draft_len_counts.get(0, 0) > 0  # the adaptive run took plain steps
  tv, bound, stats = testing.two_token_tv(target, [3, 1, 4], (1.0, 0, 1.0), 4000, draft=heads,
                                          spec=testing.fixed_k(2, drafter="dflash"))
  assert tv < bound and 0 < stats.acceptance_rate < 1
  with pytest.raises(ValueError, match="draft_len 6 exceeds the 5 tokens a DFlash block of 6 drafts"):
    jspec.generate(target, ps, draft=heads, spec=testing.fixed_k(6, drafter="dflash"))


def test_a_parallel_draft_model_drafts_a_round_in_one_forward_and_decodes_losslessly(target):
  """A draft model with a mask token drafts K tokens from K - 1 masks in one forward: greedy rounds of 4 and
  adaptive ones (whose plain steps leave its cache further behind) give the target's tokens in a ragged batch;
  the first two tokens keep the exact law; trees grow as a draft model's do."""
  draft = parallel_draft(target)
  ps = prompts(6, seed=6)
  plain = jspec.generate(target, ps, max_new_tokens=24).token_ids
  adaptive = SpecConfig(4, adaptive=jspec.AdaptiveConfig(probe_interval=2, draft_lens=(4,)))
  tree = SpecConfig(3, tree=jspec.TreeConfig(2, 6), adaptive=None)
  for spec in (testing.fixed_k(4), adaptive, tree):
    r = jspec.generate(target, ps, draft=draft, spec=spec, max_new_tokens=24)
    assert r.token_ids == plain and 0 < r.stats.acceptance_rate < 1
    assert spec is not adaptive or r.stats.draft_len_counts.get(0, 0) > 0  # plain steps were taken
  tv, bound, stats = testing.two_token_tv(target, [3, 1, 4], (1.0, 0, 1.0), 4000, draft=draft,
                                          spec=testing.fixed_k(2))
  assert tv < bound and 0 < stats.acceptance_rate < 1


# the kinds whose weights ship for it, and those that need none (it has no MTP layer; no DFlash drafter ships)
@pytest.mark.parametrize("kind", [k for k in KINDS if k in shipped.SMALL.drafts or k in ("ngram", "suffix")])
def test_shipped_drafters_match_plain_decoding_on_the_small_shipped_target(kind):
  target = jspec.load("code-small")  # a shipped pair's name loads its target, as --target does
  draft = jspec.load(shipped.SMALL.drafts[kind]) if kind in shipped.SMALL.drafts else None
  prompts = ["def parse_args(argv):\n", "class Stack:\n    def push(self, item):\n"]
  r = jspec.generate(target, prompts, draft=draft, spec=SpecConfig(drafter=kind, adaptive=None), max_new_tokens=32,
                     draft_len=4)
  assert r.token_ids == jspec.generate(target, prompts, max_new_tokens=32).token_ids
  assert r.stats.acceptance_rate > 0.05  # proposals do get accepted


def test_eagle3_reads_several_layers_and_decodes_losslessly(target):
  """EAGLE-3 heads (low, middle and high layers fused) as a chain and a dynamic tree: greedy output is the
  target's; sampled rows in a ragged batch equal each row alone; a save/load round trip keeps the layers."""
  heads = testing.random_eagle3(target)
  assert len(heads.drafter.feature_layers) >= 2 and heads.drafter.version == 3
  ps = prompts(5, seed=3)
  ar = jspec.generate(target, ps, max_new_tokens=20)
  tree = SpecConfig(4, drafter="eagle", tree=jspec.TreeConfig(2, 6), adaptive=None)
  for spec in (testing.fixed_k(4, drafter="eagle"), tree):
    r = jspec.generate(target, ps, draft=heads, spec=spec, max_new_tokens=20)
    assert r.token_ids == ar.token_ids and 0 < r.stats.acceptance_rate
  kw = dict(draft=heads, spec=testing.fixed_k(3, drafter="eagle"), max_new_tokens=12, temperature=1.0)
  batched = jspec.generate(target, ps[:3], seed=7, **kw)
  for b, p in enumerate(ps[:3]):
    assert jspec.generate(target, [p], seed=[7 + b], **kw).token_ids[0] == batched.token_ids[b]


def test_eagle3_over_a_draft_vocabulary_keeps_the_exact_law(target):
  """An EAGLE-3 head drafting over 10 of the 16 tokens (its q zero off them; a token the target may pick
  is missing from it): the first two tokens keep the exact law, and a greedy tree gives the target's text."""
  heads = testing.random_eagle3(target, draft_vocab=10)
  assert sorted(np.asarray(heads.params["target_ids"]).tolist()) != list(range(10))
  spec = testing.fixed_k(2, drafter="eagle")
  tv, bound, stats = testing.two_token_tv(target, [3, 1, 4], (1.0, 0, 1.0), 4000, draft=heads, spec=spec)
  assert tv < bound and stats.accepted_tokens > 0  # accepted and rejected drafts both verified
  ps = prompts(4, seed=4)
  plain = jspec.generate(target, ps, max_new_tokens=12).token_ids
  tree = SpecConfig(3, drafter="eagle", tree=jspec.TreeConfig(2, 6), adaptive=None)
  assert jspec.generate(target, ps, draft=heads, spec=tree, max_new_tokens=12).token_ids == plain


def test_eagle3_round_trip_and_eagle1_heads_still_load(target, tmp_path):
  heads = testing.random_eagle3(target)
  checkpoint.save_heads(heads, tmp_path / "eagle3")
  loaded = jspec.load(tmp_path / "eagle3")
  assert loaded.drafter == heads.drafter and loaded.drafter.feature_layers == heads.drafter.feature_layers
  eagle1 = jspec.load(shipped.SMALL.drafts["eagle"])  # jspec's first EAGLE-1 layout, with its two extra norms
  assert eagle1.drafter.feature_layers == () and eagle1.drafter.version == 1 and eagle1.drafter.extra_norms


def test_training_time_test_unrolls_exactly_what_drafting_computes(target):
  """The unrolled training pass (`ttt_loss`'s step j at position t) gives the same features as drafting:
  real features fed to the cache up to t - j, then the head's own outputs for j steps."""
  from jspec.drafters.eagle import unrolled_attention
  from jspec.model import cache as kvcache
  from jspec.model import model

  heads = testing.random_eagle3(target, scale=1.0)
  d, params, tp = heads.drafter, heads.params, target.params
  tokens = jax.random.randint(jax.random.PRNGKey(2), (1, 13), 0, VOCAB)
  feats = model.forward_full(tp, tokens[:, :-1], target.config, d.feature_layers)[1]
  seq = feats.shape[1] - 1
  positions = jnp.arange(seq)[None]
  next_tokens = tokens[:, 1:-1]
  feature, keys, values, outs = d._fused(params, feats[:, :-1]), [], [], []
  for _ in range(3):
    def attend(i, q, k, v):
      keys.append(k)
      values.append(v)
      return unrolled_attention(q, keys, values, d.config.head_dim ** -0.5)
    out = d.unrolled(params, tp, feature, next_tokens, positions, attend)
    outs.append(out)
    feature = jnp.roll(out, 1, axis=1)
  for start in (0, 4, 7):
    cache = kvcache.init_cache(d.config, 1, 128)
    own, cache = d.step(params, tp, cache, d._fused(params, feats[:, :start + 1]), next_tokens[:, :start + 1],
                        positions[:, :start + 1])
    own = own[:, -1]
    np.testing.assert_allclose(own, outs[0][:, start], atol=1e-5)
    for j in (1, 2):
      own, cache = d.step(params, tp, cache, own[:, None], next_tokens[:, start + j:start + j + 1],
                          positions[:, start + j:start + j + 1])
      own = own[:, 0]
      np.testing.assert_allclose(own, outs[j][:, start + j], atol=1e-5)
