"""Segmented decoding: streaming equals one loop, continuous batching equals each prompt alone, and text
deltas never break a character."""
import dataclasses
import pathlib
import random

import pytest

import jspec
from jspec import drafters, testing
from jspec.core import shipped
from jspec.decoding import loop
from jspec.text import tokenizer

NO_EOS = testing.NO_EOS
PROMPTS = ["def parse_args(", "x", "import numpy as np\nimport jax\nimport os, sys, re\n", "class Foo:\n    def",
           "ab", "for i in range(10):\n    print(i, i * i, i ** 3)\n"]  # two prompt buckets


@pytest.fixture(scope="module")
def pair():
  return testing.random_pair()


def collect(stream):
  """{index: (token ids, text)} from a stream's deltas, checking each prompt finishes exactly once."""
  ids, texts, finished = {}, {}, set()
  for d in stream:
    assert d.index not in finished
    ids[d.index] = ids.get(d.index, []) + d.token_ids
    texts[d.index] = texts.get(d.index, "") + d.text
    if d.finished:
      finished.add(d.index)
      assert d.stats.emitted_tokens == len(ids[d.index])
  assert finished == set(ids)
  return ids, texts


VOLATILE = ("wall_seconds", "compile_seconds", "tokens_per_second")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("segment_rounds", [1, 3])
def test_segments_decode_exactly_what_one_loop_does(pair, temperature, segment_rounds):
  """Adaptive K (the default) included: every decision lives in the carried state."""
  target, draft = pair
  kw = dict(draft=draft, draft_len=2, max_new_tokens=20, temperature=temperature, seed=4)
  one = jspec.generate(target, PROMPTS, **kw)
  stream = jspec.stream(target, PROMPTS, segment_rounds=segment_rounds, **kw)
  ids, texts = collect(stream)
  assert [ids[i] for i in range(len(PROMPTS))] == one.token_ids
  assert [texts[i] for i in range(len(PROMPTS))] == one.texts
  strip = lambda s: {k: v for k, v in s.to_dict().items() if k not in VOLATILE}
  assert strip(stream.stats) == strip(one.stats)
  assert stream.stats.target_forwards > 0 and stream.stats.drafted_tokens > 0


def test_the_decoder_is_built_for_the_rows_that_run(pair):
  """One prompt streamed with room for 8 rows runs one row: planned as batch 1, not compared with a
  batch-size threshold as if 8 rows ran."""
  target, draft = pair
  spec = jspec.SpecConfig(draft_len=2, disable_at_batch_size=2)
  stream = jspec.stream(target, PROMPTS[:1], draft=draft, spec=spec, batch_size=8, max_new_tokens=12)
  assert stream.slots == 1 and stream.decoder.drafter is not None
  collect(stream)
  assert stream.stats.drafted_tokens > 0
  two = jspec.stream(target, PROMPTS[:2], draft=draft, spec=spec, batch_size=8, max_new_tokens=12,
                     ignore_eos=True)
  assert two.slots == 2
  collect(two)
  assert two.stats.draft_forwards == 0  # the two rows run together throughout: plain steps


EOS_LIKELY = dataclasses.replace(testing.TINY, vocab_size=12, eos_id=3)


@pytest.mark.parametrize("kind", ["model", "ngram", "eagle"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_continuous_batching_gives_each_prompt_its_output_alone(kind, temperature):
  """Rows finish at their own EOS and take new prompts (of other prompt buckets); each prompt's tokens are
  those it gets decoded alone with its own seed."""
  target = testing.random_model(EOS_LIKELY, seed=3, scale=1.0)
  draft = {"model": testing.perturbed(target, 0.3), "ngram": None,
           "eagle": testing.random_heads(drafters.EagleDrafter.for_target(target.config))}[kind]
  prompts = [[1, 2], [5], [7, 8, 9, 10] * 5, [0, 0, 0], [4, 5, 6], [9] * 20, [2, 1], [11, 10, 9, 8]]
  kw = dict(draft=draft, spec=jspec.SpecConfig(drafter=kind, adaptive=None), draft_len=3, max_new_tokens=24,
            temperature=temperature)
  ids, _ = collect(jspec.stream(target, prompts, batch_size=3, seed=11, **kw))
  lengths = {len(v) for v in ids.values()}
  assert len(lengths) > 1  # rows did finish at different times
  for i, p in enumerate(prompts):
    assert ids[i] == jspec.generate(target, [p], seed=[11 + i], **kw).token_ids[0], i


FIXED_K = dict(draft_len=3, spec=jspec.SpecConfig(adaptive=None))


def test_totals_and_per_prompt_statistics_agree(pair):
  target, draft = pair
  stream = jspec.stream(target, PROMPTS, draft=draft, batch_size=2, max_new_tokens=12, **FIXED_K)
  per_prompt = [d.stats for d in stream if d.finished]
  s = stream.stats
  assert sum(r.emitted_tokens for r in per_prompt) == s.emitted_tokens == 12 * len(PROMPTS)
  assert sum(r.drafted_tokens for r in per_prompt) == s.drafted_tokens
  assert sum(r.accepted_tokens for r in per_prompt) == s.accepted_tokens
  assert sum(r.rounds for r in per_prompt) == s.rounds
  for r in per_prompt:
    assert r.mean_accepted_length == r.emitted_tokens / r.rounds
  result = jspec.generate(target, PROMPTS[:2], draft=draft, max_new_tokens=12, **FIXED_K)
  assert sum(r.emitted_tokens for r in result.request_stats) == result.stats.emitted_tokens


def test_no_retrace_across_streams_of_a_bucket(pair):
  target, draft = pair
  kw = dict(draft=draft, batch_size=2, **FIXED_K)
  collect(jspec.stream(target, ["a", "bb", "ccc"], max_new_tokens=10, **kw))
  before = dict(loop.trace_counts)
  for i, temperature in enumerate([0.0, 0.8, 1.2]):
    stream = jspec.stream(target, ["xyz", "q", "hello", "w"][i:], max_new_tokens=10 + i, temperature=temperature,
                          top_k=3 * i, seed=i, ignore_eos=bool(i % 2), **kw)
    collect(stream)
    assert stream.stats.compile_seconds == 0.0
  assert dict(loop.trace_counts) == before


def test_bad_stream_arguments_raise_value_error(pair):
  target, draft = pair
  with pytest.raises(ValueError, match="batch_size must be an integer >= 1"):
    jspec.stream(target, ["x"], batch_size=0)
  with pytest.raises(ValueError, match="segment_rounds must be an integer >= 1"):
    jspec.stream(target, ["x"], segment_rounds=0)


def test_text_deltas_never_break_a_character():
  tok = tokenizer.byte_tokenizer()
  text = "naïve café → 日本語 🎉 done"
  ids = tokenizer.encode(tok, text)
  assert len(ids) > len(text)  # multi-byte characters span several tokens
  inc = tokenizer.IncrementalDetokenizer(tok)
  pieces = [inc.push([t]) for t in ids]
  assert all("\ufffd" not in p for p in pieces)
  assert "".join(pieces) + inc.flush() == text
  # Bytes that never complete a character come out at the end.
  inc = tokenizer.IncrementalDetokenizer(tok)
  assert inc.push(ids[:1] + tokenizer.encode(tok, "é")[:1]) == text[0]
  assert inc.flush() == "\ufffd"


def _trained(model, trainer, normalizer, pre_tokenizer, decoder, text: str):
  from tokenizers import Tokenizer
  tok = Tokenizer(model)
  tok.normalizer, tok.pre_tokenizer, tok.decoder = normalizer, pre_tokenizer, decoder
  tok.train_from_iterator([text], trainer)
  return tok


def test_text_deltas_from_a_window_are_those_of_the_whole_text():
  """Pieces decoded from a window of the latest tokens equal those of decoding every token each time, for
  byte-level BPE (the shipped code model's), Llama-2's SentencePiece BPE (whose decoder strips the text's
  first space) and WordPiece (spaces between words depend on the token before), over outputs several
  windows long pushed in ragged pieces, a special token (no text) alone in some."""
  from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers
  sep = "<sep>"
  source = pathlib.Path(tokenizer.__file__).read_text()
  text = "".join(f"{source[i:i + 500]}{sep} naïve café → 日本語 🎉 " for i in range(0, 5000, 500))
  llama_decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
  tokenizers = {
      "byte-level": tokenizer.load_tokenizer(shipped.resolve("code")),
      "llama-2": _trained(models.BPE(), trainers.BpeTrainer(vocab_size=400),
                          normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]),
                          None, llama_decoder, text),
      "wordpiece": _trained(models.WordPiece(unk_token="[UNK]"),
                            trainers.WordPieceTrainer(vocab_size=400, special_tokens=["[UNK]"]), None,
                            pre_tokenizers.BertPreTokenizer(), decoders.WordPiece(), text),
  }
  rng = random.Random(0)
  for name, tok in tokenizers.items():
    tok.add_special_tokens([sep])
    ids = tokenizer.encode(tok, text)
    special = tok.token_to_id(sep)
    assert len(ids) > 4 * tokenizer.DETOKENIZE_WINDOW and ids.count(special) == 10, name
    whole = tokenizer.detokenize(tok, ids)
    for _ in range(3):
      window, sent, i = tokenizer.IncrementalDetokenizer(tok), 0, 0
      while i < len(ids):
        n = 1 if ids[i] == special else rng.choice([1, 1, 2, 3, 7, 40, 90])
        n = min([n] + [j - i for j in range(i + 1, min(i + n, len(ids))) if ids[j] == special])
        full = tokenizer.detokenize(tok, ids[:i + n])  # every token decoded, a trailing U+FFFD held back
        end = max(sent, len(full.rstrip("\ufffd")))
        assert window.push(ids[i:i + n]) == full[sent:end], (name, i)
        sent, i = max(sent, end), i + n
      assert window.flush() == whole[sent:], name
      assert window.start > len(ids) - 2 * tokenizer.DETOKENIZE_WINDOW - 90, name  # the window moved along
