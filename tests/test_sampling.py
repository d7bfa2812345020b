"""Sampling is lossless: exactly by enumeration on a tiny vocabulary, and statistically for `verify`."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec import testing
from jspec.core.settings import AdaptiveConfig, SpecConfig
from jspec.speculation import sampling
from jspec.speculation.verify import verify, verify_greedy, verify_typical

VOCAB = 8
TINY_VOCAB = dataclasses.replace(testing.TINY, vocab_size=VOCAB, eos_id=None)
PROMPT = [1, 5, 2]
N = 3000


def exact_joint(m, sp, prompt=PROMPT):
  return testing.exact_two_token_law(m, prompt, *sp)


@pytest.fixture(scope="module")
def pair():
  target = testing.random_model(TINY_VOCAB, seed=0, scale=1.0)
  return target, testing.perturbed(target, 1.0, seed=4)


def _empirical_tv(target, prompt, sp, **kw):
  return testing.two_token_tv(target, prompt, sp, N, **kw)


@pytest.mark.parametrize("sp", [(1.0, 0, 1.0), (0.7, 3, 1.0), (1.0, 0, 0.8)], ids=["t1", "t07-topk3", "topp08"])
@pytest.mark.parametrize("draft_len", [0, 3])
def test_first_two_tokens_match_the_exact_distribution(pair, sp, draft_len):
  target, draft = pair
  # The test can fail: the draft's own distribution is far outside the bound.
  assert 0.5 * np.abs(exact_joint(draft, sp) - exact_joint(target, sp)).sum() > 3 * testing.tv_bound(
      exact_joint(target, sp), N)
  # K every round: adaptive K's law is test_adaptive_speculation_with_fallback_keeps_the_exact_distribution.
  kw = dict(draft=draft, draft_len=draft_len, spec=SpecConfig(adaptive=None)) if draft_len else {}
  tv, bound, stats = _empirical_tv(target, PROMPT, sp, **kw)
  assert tv < bound, (tv, bound)
  if draft_len:
    assert 0.02 < stats.acceptance_rate < 0.95  # both accept and reject paths are taken


@pytest.mark.parametrize("kind", ["medusa", "eagle", "ngram"])
def test_every_drafter_keeps_the_exact_distribution(pair, kind):
  target, _ = pair
  draft = testing.random_draft(kind, target, seed=0, heads=3, scale=2.0 if kind == "medusa" else 0.5)
  prompt = PROMPT + PROMPT[:2] if kind == "ngram" else PROMPT  # a repeat, so lookup proposes
  tv, bound, stats = _empirical_tv(target, prompt, (0.7, 3, 1.0), draft=draft,
                                   spec=SpecConfig(drafter=kind, adaptive=None), draft_len=3)
  assert tv < bound, (tv, bound)
  assert 0.02 < stats.acceptance_rate < 0.95


def test_top_k_top_p_masks_are_never_violated():
  logits = jax.random.normal(jax.random.PRNGKey(0), (4, 3, 50)) * 3
  sp = sampling.SamplingParams(temperature=jnp.asarray([1.0, 0.5, 1.0, 0.0]), top_k=jnp.asarray([5, 0, 3, 2]),
                               top_p=jnp.asarray([1.0, 0.6, 0.9, 0.5]))
  probs = np.asarray(sampling.probabilities(logits, sp))
  order = np.argsort(-np.asarray(logits), axis=-1)
  for b, k in enumerate([5, 50, 3, 1]):
    assert np.all(np.take_along_axis(probs[b], order[b][:, k:], axis=-1) == 0)
  np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-5)
  # top-p 0.6 at temperature 0.5: the kept set is the smallest whose mass reaches 0.6.
  full = np.asarray(jax.nn.softmax(logits[1] / 0.5))
  for s in range(3):
    kept = probs[1, s] > 0
    mass = np.sort(full[s])[::-1]
    assert full[s][kept].sum() >= 0.6 and full[s][kept].sum() - mass[kept.sum() - 1] < 0.6
  assert np.all(probs[3].max(-1) == 1.0)  # temperature 0: one-hot argmax


def _kept_by_sorting(logits, k, p):
  """What top-k then top-p keep, by sorting (float64): ties with the k-th, and with the least probable
  token the top-p set needs, are kept; top-p reads the distribution top-k left."""
  x = logits.astype(np.float64)
  if k:
    x = np.where(x >= np.sort(x)[::-1][min(k, len(x)) - 1], x, -np.inf)
  probs = np.exp(x - x.max())
  probs /= probs.sum()
  ordered = np.sort(probs)[::-1]
  needed = int(np.sum(np.cumsum(ordered) - ordered < p))  # tokens before the mass reaches p, and the one that does
  return probs >= ordered[needed - 1] if p < 1 else np.isfinite(x)


def test_top_k_top_p_keep_what_a_sort_keeps():
  rng = np.random.default_rng(0)
  for trial in range(40):
    vocab = [7, 50, 6144][trial % 3]
    logits = rng.normal(size=(4, 2, vocab)).astype(np.float32) * [0.3, 1.0, 4.0][trial % 3]
    if trial % 4 == 0:
      logits = np.round(logits * 2) / 2  # ties, -0.0 among them
    top_k = rng.integers(0, vocab + 2, 4).astype(np.int32) * (rng.random(4) < 0.5)
    top_p = np.where(rng.random(4) < 0.7, rng.uniform(0.05, 0.98, 4), 1.0).astype(np.float32)
    sp = sampling.SamplingParams(temperature=jnp.ones(4), top_k=jnp.asarray(top_k), top_p=jnp.asarray(top_p))
    kept = np.asarray(sampling.probabilities(jnp.asarray(logits), sp)) > 0
    for b in range(4):
      for s in range(2):
        assert np.array_equal(kept[b, s], _kept_by_sorting(logits[b, s], int(top_k[b]), float(top_p[b]))), (
            trial, b, s)


def test_verify_converges_to_target_like_vllm():
  """vLLM's method: with random p and q, the histogram's distance to p shrinks with the draw count far
  faster than its distance to random reference distributions does."""
  vocab, k = 16, 2
  rng = np.random.default_rng(0)
  p = rng.dirichlet(np.ones(vocab) * 0.7, size=k + 1).astype(np.float32)
  q = rng.dirichlet(np.ones(vocab) * 0.7, size=k).astype(np.float32)
  refs = rng.dirichlet(np.ones(vocab), size=100)

  @functools.partial(jax.jit, static_argnums=1)
  def draws(key, n):
    kd, kv = jax.random.split(key)
    drafts = jax.random.categorical(kd, jnp.log(jnp.asarray(q)), shape=(n, k)).astype(jnp.int32)
    keys = jax.random.split(kv, n)
    n_acc, nxt = verify(keys, drafts, jnp.broadcast_to(q, (n, k, vocab)), jnp.broadcast_to(p, (n, k + 1, vocab)))
    return jnp.where(n_acc > 0, drafts[:, 0], nxt)  # the first emitted token, which must follow p[0]

  def distances(n):
    hist = np.bincount(np.asarray(draws(jax.random.PRNGKey(n), n)), minlength=vocab) / n
    return np.linalg.norm(hist - p[0]), np.linalg.norm(hist[None] - refs, axis=1).mean()

  (t_small, r_small), (t_big, r_big) = distances(10), distances(100_000)
  assert t_small / t_big > 20 * (r_small / r_big)


def test_verify_greedy_cases():
  vocab = 6
  onehot = lambda ids: jax.nn.one_hot(jnp.asarray(ids), vocab)
  p = onehot([[2, 4, 1]])  # target argmaxes
  keys = jax.random.split(jax.random.PRNGKey(0), 1)
  for drafts, want_n, want_next in [([2, 4], 2, 1), ([2, 5], 1, 4), ([0, 4], 0, 2)]:
    n, nxt = verify(keys, jnp.asarray([drafts]), onehot([drafts]), p)
    assert (int(n[0]), int(nxt[0])) == (want_n, want_next)
    # The all-greedy shortcut works from logits whose argmax is p's one-hot, and must agree.
    n, nxt = verify_greedy(jnp.asarray([drafts]), p * 3.0 + 0.5)
    assert (int(n[0]), int(nxt[0])) == (want_n, want_next)


def test_argmax_is_jnp_argmax_with_ties_and_infinities():
  rng = np.random.default_rng(0)
  x = rng.integers(-3, 3, (4, 5, 97)).astype(np.float32)  # many ties: the first maximal index wins
  x[0, 0] = -np.inf
  x[1, 1, 40:] = np.inf
  np.testing.assert_array_equal(sampling.argmax(jnp.asarray(x)), np.argmax(x, axis=-1))


def test_typical_acceptance_is_labelled_lossy_and_keeps_greedy_output(pair):
  target, draft = pair
  greedy = jspec.generate(target, [PROMPT] * 4, draft=draft, draft_len=3, max_new_tokens=12,
                          spec=SpecConfig(adaptive=None))
  typical = jspec.generate(target, [PROMPT] * 4, draft=draft, draft_len=3, max_new_tokens=12,
                           spec=SpecConfig(typical_acceptance=True, adaptive=None))
  assert typical.token_ids == greedy.token_ids
  assert typical.stats.lossy is True and "lossy" in typical.stats.verify
  assert greedy.stats.lossy is False
  sampled = jspec.generate(target, [PROMPT] * 64, draft=draft, draft_len=3, max_new_tokens=12, temperature=1.0,
                           spec=SpecConfig(typical_acceptance=True, adaptive=None))
  assert all(len(ids) == 12 for ids in sampled.token_ids)


def test_typical_acceptance_rule():
  # p = [0.5, 0.3, 0.2, 0, ...]: entropy 1.03, delta * exp(-H) = 0.107 > epsilon = 0.09, so the bar is 0.09.
  p = jnp.zeros((1, 3, VOCAB)).at[:, :, :3].set(jnp.asarray([0.5, 0.3, 0.2]))
  n, _ = verify_typical(jax.random.PRNGKey(0)[None], jnp.asarray([[2, 1]]), p)
  assert int(n[0]) == 2
  n, _ = verify_typical(jax.random.PRNGKey(0)[None], jnp.asarray([[2, 5]]), p)
  assert int(n[0]) == 1


def test_adaptive_speculation_with_fallback_keeps_the_exact_distribution(pair):
  # A high threshold and a window of one round: a row whose first round rejects early falls back to plain
  # steps for its second token, so both plain and speculative tokens are in the sample.
  target, draft = pair
  spec = SpecConfig(adaptive=AdaptiveConfig(fallback_threshold=0.9, probe_interval=1, window=1))
  tv, bound, stats = _empirical_tv(target, PROMPT, (1.0, 0, 1.0), draft=draft, draft_len=3, spec=spec)
  assert tv < bound, (tv, bound)
  assert stats.fallback_rounds > 0 and stats.draft_len_counts.get(3, 0) > 0
