"""Log-probabilities: each emitted token's, and the most likely tokens' at its position, are those of the
target's distribution after sampling's processing, as a full forward over the text gives them (within 1e-5
in fp32), with every drafter, chains and trees, greedy and sampled; a prompt's are the model's own."""
import jax
import numpy as np
import pytest

import jspec
from jspec import testing
from jspec.core.settings import SamplingConfig, SpecConfig, TreeConfig
from jspec.engine.requests import Request
from jspec.speculation.sampling import log_probabilities, sampling_arrays

TOP = 3
PROMPTS = [[3, 1, 4, 1, 5], [7] * 30]
SAMPLING = [SamplingConfig(), SamplingConfig(0.8, top_k=20)]


@pytest.fixture(scope="module")
def pair():
  return testing.random_pair()


def _models(kind: str, pair):
  target, draft = pair
  if kind == "plain":
    return None, None
  if kind == "model":
    return draft, testing.fixed_k(4)
  if kind == "ngram":
    return None, testing.fixed_k(3, drafter="ngram")
  heads, _, shape = kind.partition("-")
  return testing.random_draft(heads, target), (
      SpecConfig(3, drafter=heads, tree=TreeConfig(3, 8)) if shape == "tree" else testing.fixed_k(3, drafter=heads))


def _reference(target, prompt: list[int], ids: list[int], sampling: SamplingConfig | None) -> np.ndarray:
  """[len(ids), V]: the log-probabilities a full forward over the text gives each of `ids`' positions."""
  logits = testing.full_logits(target, [prompt + ids])[:, len(prompt) - 1:len(prompt) - 1 + len(ids)]
  if sampling is None:  # the model's own distribution
    return np.asarray(jax.nn.log_softmax(logits[0], -1))
  return np.asarray(log_probabilities(logits, sampling_arrays(sampling, 1)))[0]


def _check(scored, ids: list[int], reference: np.ndarray, top: int) -> None:
  assert [s.token_id for s in scored] == ids
  np.testing.assert_allclose([s.logprob for s in scored], reference[np.arange(len(ids)), ids], atol=1e-5)
  for s, row in zip(scored, reference):
    assert len(s.top) == top
    np.testing.assert_allclose([lp for _, lp in s.top], np.sort(row)[::-1][:top], atol=1e-5)
    assert all(abs(row[t] - lp) < 1e-5 for t, lp in s.top)


@pytest.mark.parametrize("kind", ["eagle-tree"])  # plain steps and the chain drafters: through generate
def test_logprobs_are_a_full_forwards(pair, kind):
  target, _ = pair
  draft, spec = _models(kind, pair)
  engine = jspec.make_engine(target, draft=draft, spec=spec, slots=3, max_len=128, segment_rounds=3,
                             max_logprobs=TOP)
  for i, (prompt, sampling) in enumerate(zip(PROMPTS, SAMPLING)):
    engine.add(Request(prompt, 24, sampling, seed=i, logprobs=TOP - i, prompt_logprobs=TOP if i == 0 else None), i)
  engine.add(Request([5, 6, 7], 12), "quiet")
  out = {}
  while engine.has_work:
    for d in engine.step():
      out.setdefault(d.index, []).append(d)
  for i, (prompt, sampling) in enumerate(zip(PROMPTS, SAMPLING)):
    ids = [t for d in out[i] for t in d.token_ids]
    assert len(ids) == 24
    _check([s for d in out[i] for s in d.logprobs], ids, _reference(target, prompt, ids, sampling), TOP - i)
  scored_prompt = out[0][0].prompt_logprobs
  assert (scored_prompt[0].token_id, scored_prompt[0].logprob) == (PROMPTS[0][0], None)
  assert len(scored_prompt) == len(PROMPTS[0])
  _check(scored_prompt[1:], PROMPTS[0][1:], _reference(target, PROMPTS[0][:1], PROMPTS[0][1:], None), TOP)
  assert all(d.logprobs is None and d.prompt_logprobs is None for d in out["quiet"])
  assert all(d.prompt_logprobs is None for d in out[0][1:])


def test_logprobs_past_the_engines_bound_are_refused(pair):
  engine = jspec.make_engine(pair[0], slots=1, max_len=64, max_logprobs=2)
  with pytest.raises(ValueError, match="logprobs must be an integer in"):
    engine.add(Request([1, 2], 4, logprobs=3))
  with pytest.raises(ValueError, match="max_logprobs"):
    jspec.make_engine(pair[0], slots=1, max_len=64).add(Request([1, 2], 4, logprobs=0))


@pytest.mark.parametrize("kind", ["plain", "model", "medusa", "ngram"])
def test_generate_gives_the_same_logprobs(pair, kind):
  """`generate(logprobs=k)`: the full forward's, greedy and sampled."""
  target, _ = pair
  draft, spec = _models(kind, pair)
  out = jspec.generate(target, PROMPTS, draft=draft, spec=spec, max_new_tokens=16, sampling=SAMPLING, logprobs=2)
  for prompt, sampling, ids, scored in zip(PROMPTS, SAMPLING, out.token_ids, out.logprobs):
    _check(scored, ids, _reference(target, prompt, ids, sampling), 2)
  with pytest.raises(ValueError, match="logprobs must be"):
    jspec.generate(target, PROMPTS, max_new_tokens=4, logprobs=21)
