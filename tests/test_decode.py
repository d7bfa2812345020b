"""End-to-end decoding: statistics, stops, the context's edge, prompt buckets, seeds, the pure loop under a
user's jit. Greedy identity, ragged batches and no retrace, for every drafter: tests/test_drafters.py."""
import dataclasses

import jax
import numpy as np
import pytest

import jspec
from jspec import testing
from jspec.decoding import loop
from jspec.decoding.batches import make_batch
from jspec.decoding.decoder import make_decoder

NO_EOS = testing.NO_EOS
FIXED_K = testing.fixed_k()
PROMPTS = ["def parse_args(", "x", "import numpy as np\nimport jax\n", "class Foo:\n    def __init__(self"]


@pytest.fixture(scope="module")
def pair():
  return testing.random_pair()


@pytest.mark.parametrize("draft_len", [2, 4])
def test_draft_equal_to_target_accepts_everything(pair, draft_len):
  target, _ = pair
  rounds = 5
  r = jspec.generate(target, PROMPTS[:1], draft=target, max_new_tokens=rounds * (draft_len + 1),
                     draft_len=draft_len, spec=FIXED_K)
  s = r.stats
  assert s.acceptance_rate == 1.0
  assert s.mean_accepted_length == draft_len + 1
  assert s.rounds == rounds and s.target_forwards == rounds
  assert s.per_position_acceptance == [1.0] * draft_len


def test_stats_identities(pair):
  target, draft = pair
  max_new, draft_len = 23, 4
  r = jspec.generate(target, PROMPTS, draft=draft, max_new_tokens=max_new, draft_len=draft_len, spec=FIXED_K)
  s = r.stats
  emitted = sum(len(ids) for ids in r.token_ids)
  assert s.emitted_tokens == emitted == max_new * len(PROMPTS)
  assert s.drafted_tokens == draft_len * s.rounds
  assert s.draft_forwards == draft_len * s.target_forwards
  # Each round proposes accepted + 1 tokens; the last round of a row may be cut at max_new_tokens.
  cut = s.accepted_tokens + s.rounds - s.emitted_tokens
  assert 0 <= cut <= len(PROMPTS) * draft_len
  assert sum(s.per_position_acceptance) * s.rounds == pytest.approx(s.accepted_tokens)
  assert s.mean_accepted_length == pytest.approx(s.emitted_tokens / s.rounds)


def test_eos_stops_each_row_and_nothing_follows_it():
  # A vocabulary where EOS is likely: every row stops at its first EOS, at its own time.
  config = dataclasses.replace(testing.TINY, vocab_size=12, eos_id=3)
  target = testing.random_model(config, seed=3, scale=1.0)
  draft = testing.perturbed(target, 0.3)
  prompts = [[1, 2], [5], [7, 8, 9, 10], [0, 0, 0]]
  for kwargs in [{}, dict(draft=draft, draft_len=3, spec=FIXED_K)]:
    r = jspec.generate(target, prompts, max_new_tokens=40, temperature=1.0, seed=7, **kwargs)
    lengths = [len(ids) for ids in r.token_ids]
    for ids in r.token_ids:
      assert 3 not in ids[:-1]
      assert ids[-1] == 3 or len(ids) == 40
    assert len(set(lengths)) > 1, lengths
    assert r.stats.emitted_tokens == sum(lengths)
    # ignore_eos: the same request decodes every row to max_new_tokens, through its EOS, with no new compile.
    r2 = jspec.generate(target, prompts, max_new_tokens=40, temperature=1.0, seed=7, ignore_eos=True, **kwargs)
    assert [len(ids) for ids in r2.token_ids] == [40] * 4
    assert all(ids[:len(a)] == a for ids, a in zip(r2.token_ids, r.token_ids))
    assert r2.stats.compile_seconds == 0.0


def test_request_at_the_edge_of_the_context_finishes(pair):
  target, draft = pair
  context = target.config.max_seq_len
  prompt = [5] * 100
  r = jspec.generate(target, [prompt], draft=draft, max_new_tokens=context - 100, draft_len=2)  # adaptive
  assert len(r.token_ids[0]) == context - 100
  ar = jspec.generate(target, [prompt], max_new_tokens=context - 100)
  assert ar.token_ids == r.token_ids
  with pytest.raises(ValueError, match="exceeds the model's context"):
    jspec.generate(target, [prompt], draft=draft, max_new_tokens=context - 99)


def test_prompt_buckets_hold_the_prompt_with_at_most_a_third_padding():
  from jspec.decoding.batches import prompt_bucket
  widths = [prompt_bucket(n) for n in range(1, 4097)]
  assert all(n <= w for n, w in zip(range(1, 4097), widths))
  assert all(n > w * 2 // 3 for n, w in zip(range(17, 4097), widths[16:]))  # padding < a third of the width
  assert sorted(set(widths)) == [16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072,
                                 4096]  # two executables an octave


def test_seeded_sampling_is_reproducible_and_seed_dependent(pair):
  target, draft = pair
  kw = dict(draft=draft, max_new_tokens=16, draft_len=3, temperature=1.0, spec=FIXED_K)
  a = jspec.generate(target, PROMPTS[:2], seed=1, **kw)
  b = jspec.generate(target, PROMPTS[:2], seed=1, **kw)
  c = jspec.generate(target, PROMPTS[:2], seed=2, **kw)
  assert a.token_ids == b.token_ids and a.token_ids != c.token_ids
  alone = jspec.generate(target, PROMPTS[1:2], seed=[2], **kw)  # row 1 of seed 1 uses seed 2
  assert alone.token_ids[0] == a.token_ids[1]


def test_requests_stop_each_row_at_its_own_tokens(pair):
  target, _ = pair
  decoder = make_decoder(target, None, None, 2)
  per_row = make_batch(decoder, [[1, 2], [3]], 4, stop_ids=[[7], [8, 9]])
  assert per_row.stop_BxE.tolist() == [[7, -1], [8, 9]]
  assert make_batch(decoder, [[1]], 4, stop_ids=[5, 6]).stop_BxE.tolist() == [[5, 6]]
  assert make_batch(decoder, [[1]], 4, ignore_eos=True).stop_BxE.tolist() == [[-1]]
  plain = jspec.generate(target, [[1, 2], [3]], max_new_tokens=8).token_ids
  stops = [plain[0][2], plain[1][4]]  # each row's third and fifth token
  batch = make_batch(decoder, [[1, 2], [3]], 8, stop_ids=[[s] for s in stops])
  r = loop.run(decoder, loop.start(decoder, batch))
  lens = (r.seq_lens_B - r.prompt_lens_B).tolist()
  assert lens[0] == plain[0].index(stops[0]) + 1 and lens[1] == plain[1].index(stops[1]) + 1


def test_a_sampling_object_is_the_keywords_and_may_differ_per_prompt(pair):
  target, draft = pair
  kw = dict(draft=draft, max_new_tokens=12, seed=3, spec=FIXED_K)
  hot = jspec.SamplingConfig(temperature=0.9, top_k=5, top_p=0.9)
  by_keywords = jspec.generate(target, PROMPTS[:2], temperature=0.9, top_k=5, top_p=0.9, **kw)
  assert jspec.generate(target, PROMPTS[:2], sampling=hot, **kw).token_ids == by_keywords.token_ids
  mixed = jspec.generate(target, PROMPTS[:2], sampling=[jspec.SamplingConfig(), hot], **kw)
  assert mixed.token_ids[0] == jspec.generate(target, PROMPTS[:1], **kw).token_ids[0]  # greedy row
  assert mixed.token_ids[1] == by_keywords.token_ids[1]
  with pytest.raises(ValueError, match="not both"):
    jspec.generate(target, PROMPTS[:1], sampling=hot, temperature=0.5)
  with pytest.raises(ValueError, match="sampling settings for 1 rows, not 2"):
    jspec.generate(target, PROMPTS[:2], sampling=[hot])


def test_chex_max_traces_on_the_pure_loop(pair):
  """The pure entry point under a user's own jit: one trace for many batch of one shape."""
  import chex
  import jax.numpy as jnp

  target, draft = pair
  chex.clear_trace_counter()
  decoder = make_decoder(target, draft, jspec.SpecConfig(draft_len=3, adaptive=None), batch=2)
  template = make_batch(decoder, [[1] * 16] * 2, 6)

  @jax.jit
  @chex.assert_max_traces(n=1)
  def run(decoder, prompts, lens, temperature, seeds):
    batch = template.replace(prompts_BxP=prompts, prompt_lens_B=lens, seeds_B=seeds,
                                sampling=template.sampling.replace(temperature=jnp.full((2,), temperature)))
    return loop.run(decoder, loop.start(decoder, batch)).tokens_BxT

  for i in range(3):
    prompts = np.random.default_rng(i).integers(0, 256, size=(2, 16)).astype(np.int32)
    run(decoder, prompts, np.asarray([16, 3 + i], np.int32), np.float32(0.5 * i), np.asarray([i, i + 1], np.uint32))
