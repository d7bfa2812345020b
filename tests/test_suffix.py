"""The suffix drafter: an index of earlier requests' texts on the device, shared by the rows of an engine."""
import dataclasses

import jax.numpy as jnp
import numpy as np

import jspec
from jspec import testing
from jspec.decoding import loop
from jspec.decoding.batches import GREEDY
from jspec.drafters.base import DraftContext
from jspec.drafters.suffix import MAX_MATCH, SuffixDrafter
from jspec.speculation.sampling import sampling_arrays


def test_the_index_finds_the_longest_latest_match_and_forgets_what_the_ring_overwrote():
  # Drafts of 2: an occurrence is indexed if 2 tokens of its text follow; these n-grams share no bucket.
  drafter = SuffixDrafter(vocab_size=50, cache_tokens=16, buckets=1 << 12, depth=2)
  state = drafter.init(1, 128, 4)
  texts = jnp.asarray([[1, 2, 3, 4, 5, 6, 0, 0], [9, 2, 3, 7, 8, 0, 0, 0]])
  state = drafter.retire(state, texts, jnp.asarray([6, 5]))  # 11 tokens written: 1 2 3 4 5 6 9 2 3 7 8
  assert int(state.written) == 11
  rows = jnp.asarray([[4, 1, 2, 3, 0, 0], [8, 8, 2, 3, 0, 0], [5, 5, 4, 0, 0, 0], [6, 9, 2, 0, 0, 0]])
  length, start = drafter.find(state, rows, jnp.asarray([4, 4, 3, 3]))
  # "1 2 3" (then 4); "2 3" latest in the second text (then 7); "4" (then 5); "9 2" (then 3)
  assert length.tolist() == [3, 2, 1, 2]  # "6 9 2" spans two texts, which are indexed apart
  assert [int(state.ring[s % 16]) for s in start.tolist()] == [4, 7, 5, 3]
  # 11 more tokens overwrite the first text: its n-grams are no longer found, the rest still are.
  state = drafter.retire(state, jnp.asarray([[30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 0]]), jnp.asarray([11]))
  length, start = drafter.find(state, rows, jnp.asarray([4, 4, 3, 3]))
  assert length.tolist() == [2, 2, 0, 2] and int(state.ring[int(start[0]) % 16]) == 7
  assert MAX_MATCH >= 3


def test_running_rows_are_indexed_as_they_commit_and_found_by_the_others():
  drafter = SuffixDrafter(vocab_size=50, cache_tokens=16, buckets=1 << 12, depth=2)
  state = drafter.init(2, 8, 2)
  tokens = jnp.asarray([[1, 2, 3, 4, 5, 6, 0, 0], [2, 3, 0, 0, 0, 0, 0, 0]])
  share = jnp.asarray([True, True])
  context = DraftContext(tokens, jnp.asarray([6, 2]), sampling_arrays(GREEDY, 2), share)
  # A round took row 0 from 3 to 6 tokens: positions 2..4 are now followed by a whole draft of 2.
  state = drafter.observe(None, state, context, jnp.zeros((2, 4, 1)), jnp.asarray([3, 2]))
  length, at = drafter.find_running(state, tokens, jnp.asarray([6, 2]))
  assert length.tolist()[1] == 2 and int(tokens.reshape(-1)[int(at[1])]) == 4  # "2 3" is followed by 4 in row 0
  assert drafter.find(state, tokens, jnp.asarray([6, 2]))[0].tolist() == [0, 0]  # nothing has ended
  # A row that keeps its text to itself indexes nothing.
  hidden = drafter.init(2, 8, 2)
  hidden = drafter.observe(None, hidden, context.replace(share_B=jnp.asarray([False, True])), jnp.zeros((2, 4, 1)),
                           jnp.asarray([3, 2]))
  assert drafter.find_running(hidden, tokens, jnp.asarray([6, 2]))[0].tolist() == [0, 0]
  # Once row 0 holds another request's text, its old entries no longer match.
  other = tokens.at[0].set(jnp.asarray([9, 9, 9, 9, 9, 9, 9, 9]))
  assert drafter.find_running(state, other, jnp.asarray([6, 2]))[0].tolist() == [0, 0]
  # Row 1 proposes what follows "2 3" in row 0; a match of one token ("3" alone) proposes nothing.
  keys = jnp.zeros((2, 2, 2), jnp.uint32)
  proposal = drafter.propose(None, state, context, keys)[1]
  assert proposal.has_draft_B.tolist()[1] and proposal.tokens_BxK[1].tolist() == [4, 5]
  one = context.replace(tokens_BxT=tokens.at[1, 0].set(7))
  assert not drafter.propose(None, state, one, keys)[1].has_draft_B.tolist()[1]


def _per_request(target, prompts, spec, slots=1, **kw):
  """Tokens and acceptance of each prompt, decoded one after another through `slots` slots."""
  tokens, acceptance = [[] for _ in prompts], [None] * len(prompts)
  for delta in jspec.stream(target, prompts, spec=spec, max_new_tokens=24, batch_size=slots, **kw):
    tokens[delta.index] += delta.token_ids
    if delta.finished:
      acceptance[delta.index] = delta.stats.acceptance_rate
  return tokens, acceptance


def test_requests_draft_from_earlier_requests_losslessly_and_without_recompiling():
  target = testing.random_model(testing.NO_EOS, seed=3)
  prompts = [[5, 17, 30, 2], [40, 41, 42], [5, 17, 30, 2], [40, 41, 42], [5, 17, 30, 2]]
  plain = jspec.generate(target, prompts, max_new_tokens=24).token_ids
  suffix = testing.fixed_k(4, drafter="suffix")
  tokens, acceptance = _per_request(target, prompts, suffix)
  assert tokens == plain
  # A repeated prompt's continuation is an earlier request's text: every proposal is accepted.
  assert all(a == 1.0 for a in acceptance[2:]), acceptance
  _, own = _per_request(target, prompts, testing.fixed_k(4, drafter="ngram"))
  assert all(a < 1.0 for a in own[2:]), own  # its own context alone does not know it
  before = dict(loop.trace_counts)
  assert _per_request(target, prompts[::-1], suffix)[0] == plain[::-1]  # a fuller index compiles nothing new
  assert dict(loop.trace_counts) == before


def test_a_request_drafts_from_one_still_running():
  """Two slots: the second request repeats the first's prompt while the first still decodes; it proposes
  the first's output as the first writes it (n-gram drafts, from its own text, do not know it)."""
  target = testing.random_model(testing.NO_EOS, seed=3)
  first, short = [5, 17, 30, 2], [40, 41, 42]
  plain = jspec.generate(target, [first, short], max_new_tokens=48).token_ids
  for drafter in ("suffix", "ngram"):
    engine = jspec.make_engine(target, spec=testing.fixed_k(4, drafter=drafter), slots=2, max_len=96)
    engine.add(jspec.Request(first, 48), "first")
    engine.add(jspec.Request(short, 4), "short")
    tokens, rate = {"first": [], "short": [], "again": []}, {}
    while engine.has_work:
      for delta in engine.step():
        tokens[delta.index] += delta.token_ids
        if delta.finished:
          rate[delta.index] = delta.stats.acceptance_rate
          if delta.index == "short":  # the first is still running: it has 48 tokens to write
            engine.add(jspec.Request(first, 16), "again")
    assert tokens == {"first": plain[0], "short": plain[1][:4], "again": plain[0][:16]}
    if drafter == "suffix":
      assert rate["again"] > 0.9, rate
    else:
      assert rate["again"] < 0.9, rate


def test_proposals_from_the_index_keep_the_exact_two_token_law():
  """Sampled: each request's first two tokens follow the target's law while the index holds the texts the
  requests before it sampled after the same prompt, which it proposes."""
  target = testing.random_model(dataclasses.replace(testing.TINY, vocab_size=8, eos_id=None), seed=0)
  prompt, n, sp = [1, 5, 2], 2000, (0.7, 3, 1.0)
  want = testing.exact_two_token_law(target, prompt, *sp)
  tokens, drafted = [[] for _ in range(n)], 0
  for delta in jspec.stream(target, [prompt] * n, spec=testing.fixed_k(2, drafter="suffix"), max_new_tokens=2,
                            batch_size=8, temperature=sp[0], top_k=sp[1], top_p=sp[2], seed=11):
    tokens[delta.index] += delta.token_ids
    drafted += delta.stats.drafted_tokens if delta.finished else 0
  counts = np.zeros_like(want)
  for a, b in tokens:
    counts[a, b] += 1
  assert 0.5 * np.abs(counts / n - want).sum() < testing.tv_bound(want, n)
  assert drafted > n  # most requests verified proposals


def test_a_request_can_keep_its_text_out_of_the_index():
  """`suffix_cache=False`: the request drafts from its own text only, and its text is not kept for later ones."""
  target = testing.random_model(testing.NO_EOS, seed=3)
  first, second = [5, 17, 30, 2], [40, 41, 42]
  plain = jspec.generate(target, [first, second], max_new_tokens=24).token_ids
  engine = jspec.make_engine(target, spec=testing.fixed_k(4, drafter="suffix"), slots=1, max_len=64)

  def run(prompt, shared):
    rid = engine.add(jspec.Request(prompt, 24, suffix_cache=shared))
    tokens, rate = [], None
    while engine.has_work:
      for delta in engine.step():
        assert delta.index == rid
        tokens += delta.token_ids
        rate = delta.stats.acceptance_rate if delta.finished else rate
    return tokens, rate

  assert run(first, True)[0] == plain[0]
  tokens, rate = run(first, False)  # the index holds the first text, which this request does not read
  assert tokens == plain[0] and rate < 1.0
  assert run(first, True) == (plain[0], 1.0)  # the index still holds it
  assert run(second, False)[0] == plain[1]
  tokens, rate = run(second, True)  # the opted-out text never entered the index
  assert tokens == plain[1] and rate < 1.0
  assert run(second, True) == (plain[1], 1.0)
