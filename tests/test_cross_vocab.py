"""Drafts with another tokenizer (token-level intersection, `jspec.text.vocab_map`, `jspec.drafters.draft_model`):
the tables, the exact law of the first tokens, greedy identity, the target itself under another vocabulary."""
import argparse
import dataclasses
import inspect

import jax
import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

import jspec
from jspec import testing
from jspec.core import shipped
from jspec.decoding.decoder import make_decoder
from jspec.drafters.draft_model import CrossVocabDrafter, ModelDrafter
from jspec.formats import loading
from jspec.model import model
from jspec.model.model import Model
from jspec.planning import memory, shaped
from jspec.text import tokenizer, vocab_map

# The law pair: a target over 16 letters, a draft over 8 of them, 3 others and a merge of two shared ones.
TARGET_LETTERS = list("abcdefghijklmnop")
DRAFT_LETTERS = [*"abcdefgh", *"qrs", "ab"]
LAW_PROMPT = [1, 12, 2]  # b, m (which the draft cannot spell), c
N = 3000


@pytest.fixture(scope="module")
def law_pair():
  target = dataclasses.replace(testing.random_model(testing.SMALL_VOCAB, seed=0, scale=2.0),
                               tokenizer=testing.char_tokenizer(TARGET_LETTERS))
  config = dataclasses.replace(testing.TINY_DRAFT, vocab_size=len(DRAFT_LETTERS), eos_id=None)
  draft = dataclasses.replace(testing.random_model(config, seed=1, scale=2.0),
                              tokenizer=testing.char_tokenizer(DRAFT_LETTERS, [("a", "b")]))
  return target, draft


@pytest.fixture(scope="module")
def code_target():
  """A peaky random target with a BPE tokenizer of 400 tokens learned on Python source (the standard library's
  `argparse`: a text that jspec's own edits do not change)."""
  tok = tokenizer.train_bpe([inspect.getsource(argparse)] * 3, 400)
  config = dataclasses.replace(testing.NO_EOS, vocab_size=tok.get_vocab_size())
  params = model.init_params(config, jax.random.PRNGKey(0))
  return Model(config, {**params, "embed": params["embed"] * 2.0}, tok)


def _prompts(m: Model) -> list[list[int]]:
  texts = ["def generate(target, prompts", "import os\n", "    return"]
  return [tokenizer.encode(m.tokenizer, t) for t in texts]


def test_tables_pair_tokens_by_their_bytes(law_pair):
  target, draft = law_pair
  tables = vocab_map.build(target.tokenizer, draft.tokenizer, 16, len(DRAFT_LETTERS), None, None)
  assert dict(zip(tables.draft_ids_I.tolist(), tables.target_ids_I.tolist())) == {i: i for i in range(8)}
  assert tables.shared_fraction == pytest.approx(8 / 12)
  assert tables.spelling_lens_Vt.tolist() == [1] * 16  # letters the draft lacks fall back to one token
  # Byte-level BPE and SentencePiece spell a space and a newline differently; they pair all the same.
  byte_level = tokenizer.byte_tokenizer()
  spm = Tokenizer(models.BPE(vocab={"\u2581the": 0, "<0x0A>": 1, "t": 2, "h": 3, "e": 4, "\u2581": 5}, merges=[]))
  spm.pre_tokenizer, spm.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
  tables = vocab_map.build(spm, byte_level, 6, 257, None, 256)
  pairs = dict(zip(tables.target_ids_I.tolist(), tables.draft_ids_I.tolist()))
  assert pairs == {1: byte_level.token_to_id("\u010a"), 2: byte_level.token_to_id("t"), 3: byte_level.token_to_id("h"),
                   4: byte_level.token_to_id("e"), 5: byte_level.token_to_id("\u0120")}
  spelled = tables.spelling_VtxL[0, :tables.spelling_lens_Vt[0]].tolist()
  assert [byte_level.id_to_token(i) for i in spelled] == ["\u0120", "t", "h", "e"]  # " the", byte by byte


def test_spellings_give_back_each_target_tokens_bytes():
  target = tokenizer.load_tokenizer(shipped.PAIRS["code"].target)
  tables = vocab_map.build(target, tokenizer.byte_tokenizer(), 6144, 257, 0, 256)
  draft_bytes, target_bytes = tokenizer.token_bytes(tokenizer.byte_tokenizer()), tokenizer.token_bytes(target)
  for t, want in target_bytes.items():
    if len(want) <= vocab_map.MAX_SPELLING:  # longer ones are cut
      got = b"".join(draft_bytes[i] for i in tables.spelling_VtxL[t, :tables.spelling_lens_Vt[t]])
      assert got == want, t


def test_a_pair_sharing_too_little_is_refused_with_the_fraction(law_pair):
  target, _ = law_pair
  config = dataclasses.replace(testing.TINY_DRAFT, vocab_size=5, eos_id=None)
  draft = dataclasses.replace(testing.random_model(config, seed=1),
                              tokenizer=testing.char_tokenizer(["ab", "cd", "ef", "gh", "a"]))
  with pytest.raises(ValueError, match=r"shares 20\.0% of its vocabulary with the target's, under the 25%"):
    jspec.generate(target, [LAW_PROMPT], draft=draft, max_new_tokens=2)


def test_tables_are_kept_per_tokenizer_pair(law_pair, tmp_path, monkeypatch):
  target, draft = law_pair
  monkeypatch.setenv("JSPEC_VOCAB_MAP_DIR", str(tmp_path))
  monkeypatch.setattr(vocab_map, "_memory", {})
  args = (16, len(DRAFT_LETTERS), None, None)
  first = vocab_map.vocab_map(target.tokenizer, draft.tokenizer, *args)
  assert len(list(tmp_path.glob("*.npz"))) == 1
  monkeypatch.setattr(vocab_map, "_memory", {})
  monkeypatch.setattr(vocab_map, "build", lambda *a: pytest.fail("built again"))
  again = vocab_map.vocab_map(Tokenizer.from_str(target.tokenizer.to_str()),
                              Tokenizer.from_str(draft.tokenizer.to_str()), *args)
  np.testing.assert_array_equal(again.spelling_VtxL, first.spelling_VtxL)


@pytest.mark.parametrize("sp", [(1.0, 0, 1.0), (0.9, 6, 0.8)], ids=["t1", "topk-topp"])
def test_first_two_tokens_keep_the_exact_law(law_pair, sp):
  target, draft = law_pair
  tv, bound, stats = testing.two_token_tv(target, LAW_PROMPT, sp, N, draft=draft, spec=testing.fixed_k(2))
  assert tv < bound, (tv, bound)
  assert stats.accepted_tokens > 0.1 * stats.drafted_tokens  # drafts were verified, not only replaced


def test_greedy_equals_the_targets_ragged_and_adaptive(law_pair, code_target):
  draft = testing.renamed_vocab(code_target, split=12, added=6)
  prompts = _prompts(code_target)
  plain = jspec.generate(code_target, prompts, max_new_tokens=32)
  # Adaptive K (the default, here up to 2) includes plain steps and wide catch-ups.
  for spec in (testing.fixed_k(4), jspec.SpecConfig(draft_len=2)):
    got = jspec.generate(code_target, prompts, draft=draft, spec=spec, max_new_tokens=32)
    assert got.token_ids == plain.token_ids
  testing.assert_target_argmax(code_target, prompts[0], plain.token_ids[0])
  target, poor = law_pair  # a poor draft: the adaptive policy steps aside, and the draft catches up after
  plain = jspec.generate(target, [LAW_PROMPT, [3] * 9], max_new_tokens=48)
  got = jspec.generate(target, [LAW_PROMPT, [3] * 9], draft=poor, max_new_tokens=48, draft_len=2)
  assert got.token_ids == plain.token_ids and got.stats.plain_forwards > 0


def test_sampled_rows_in_a_batch_are_the_rows_alone(code_target):
  draft = testing.renamed_vocab(code_target, split=12, added=6)
  prompts, kw = _prompts(code_target), dict(max_new_tokens=24, temperature=1.0, spec=testing.fixed_k(3), seed=5)
  batch = jspec.generate(code_target, prompts, draft=draft, **kw).token_ids
  for i, p in enumerate(prompts):
    assert jspec.generate(code_target, [p], draft=draft, **{**kw, "seed": 5 + i}).token_ids[0] == batch[i]


def test_the_target_under_another_vocabulary_accepts_every_draft_where_segmentations_agree(code_target):
  prompts, k = _prompts(code_target), 4
  same = jspec.generate(code_target, prompts, draft=testing.renamed_vocab(code_target, split=0, added=6),
                        spec=testing.fixed_k(k), max_new_tokens=40)
  assert same.stats.mean_accepted_length == k + 1  # every id moved, no token split: the ceiling
  split = jspec.generate(code_target, prompts, draft=testing.renamed_vocab(code_target, split=30, added=6),
                         spec=testing.fixed_k(k), max_new_tokens=40)
  assert 1.5 < split.stats.mean_accepted_length < k + 1  # the target's split tokens cost acceptance


def test_continuous_batching_and_the_decoder(code_target):
  draft = testing.renamed_vocab(code_target, split=12, added=6)
  decoder = make_decoder(code_target, draft, testing.fixed_k(3), 1)
  assert isinstance(decoder.drafter, CrossVocabDrafter) and "vocab_map" in decoder.drafter_params
  assert decoder.context_len == code_target.config.max_seq_len // decoder.drafter.spelling_len
  prompts = _prompts(code_target) * 2
  plain = jspec.generate(code_target, prompts, max_new_tokens=16).token_ids
  streamed = jspec.stream(code_target, prompts, draft=draft, spec=testing.fixed_k(3), batch_size=2,
                          max_new_tokens=16)
  got = {}
  for delta in streamed:
    got.setdefault(delta.index, []).extend(delta.token_ids)
  assert [got[i] for i in range(len(prompts))] == plain
  with pytest.raises(ValueError, match="another tokenizer than the target's drafts chains only"):
    jspec.generate(code_target, prompts, draft=draft, spec=dataclasses.replace(
        testing.fixed_k(3), tree=jspec.TreeConfig()), max_new_tokens=4)


def test_the_memory_plan_counts_the_longer_draft_cache(code_target, tmp_path):
  jspec.save(code_target, tmp_path / "target")
  jspec.save(testing.renamed_vocab(code_target, split=12, added=6), tmp_path / "cross")
  jspec.save(testing.perturbed(code_target, 0.1), tmp_path / "same")
  target = loading.load_shapes(tmp_path / "target")
  plans = {}
  for name in ("cross", "same"):
    decoder = shaped.shaped_decoder(target, loading.load_shapes(tmp_path / name), testing.fixed_k(3), 1)
    plans[name] = memory.make_plan(decoder, 1, 512, 256)
  assert isinstance(decoder.drafter, ModelDrafter) and not isinstance(decoder.drafter, CrossVocabDrafter)
  spelling = make_decoder(code_target, jspec.load(tmp_path / "cross"), testing.fixed_k(3), 1).drafter.spelling_len
  assert plans["cross"].usage.draft_kv_cache_bytes >= spelling * plans["same"].usage.draft_kv_cache_bytes


def test_constrained_output_is_the_constrained_targets(code_target):
  """The draft proposes from its distribution masked by the constraint, laid out over the target's
  vocabulary: the target itself under another vocabulary then has every draft accepted."""
  target = dataclasses.replace(code_target, config=dataclasses.replace(code_target.config, eos_id=0))
  prompts, constraint = _prompts(target), jspec.Regex(r"[a-z_ ()]*")
  plain = jspec.generate(target, prompts, max_new_tokens=24, constraint=constraint)
  assert all(set(t) <= set("abcdefghijklmnopqrstuvwxyz_ ()") for t in plain.texts)
  free = jspec.generate(target, prompts, max_new_tokens=24)
  assert free.token_ids != plain.token_ids  # the constraint changes what the target says
  for split in (0, 12):
    got = jspec.generate(target, prompts, draft=testing.renamed_vocab(target, split=split, added=6),
                         spec=testing.fixed_k(3), max_new_tokens=24, constraint=constraint)
    assert got.token_ids == plain.token_ids
    if split == 0:
      assert got.stats.acceptance_rate == 1.0
