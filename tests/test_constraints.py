"""Constrained decoding: compiled automata agree with the regex, the constrained law is kept exactly (plain,
every drafter, chains and trees), greedy speculative decoding is constrained plain decoding on ragged
batches of mixed constraints, outputs satisfy their constraints, and bad constraints are one-line errors."""
import dataclasses
import itertools
import json
import re

import jsonschema
import numpy as np
import pytest

import jspec
from jspec import testing
from jspec.core.settings import AdaptiveConfig, SpecConfig, TreeConfig
from jspec.decoding import loop
from jspec.model import model
from jspec.text import automaton, constraints, tokenizer

# Nine tokens: '!' .. '(' (ids 0..7) and an EOS (id 8).
LAW_CONFIG = dataclasses.replace(testing.TINY, vocab_size=9, eos_id=8)
# Token paths the constraint allows depend on the first token, and no path ends within two tokens.
LAW_REGEX = r"""(!["#]|"[$%&]|#[!']|[$%&']+)[!-']+"""
PROMPT = [1, 5, 2]
N = 3000


def regex_allowed(vocabulary: constraints.Vocabulary, pattern: str, lookahead: int = 3):
  """The tokens allowed after a prefix, by Python's `re` alone: those some full match continues with (a
  suffix of at most `lookahead` tokens); the stop token where the prefix is a full match."""
  spelled = [b.decode("latin-1") for b in vocabulary.tokens]
  ordinary = [i for i, b in enumerate(vocabulary.tokens) if b and i not in vocabulary.stop_ids]
  tails = [""] + ["".join(spelled[i] for i in t) for n in range(1, lookahead + 1)
                  for t in itertools.product(ordinary, repeat=n)]
  compiled = re.compile(pattern)

  def allowed(prefix):
    text = "".join(spelled[i] for i in prefix)
    out = np.zeros(len(spelled), bool)
    for i in ordinary:
      out[i] = any(compiled.fullmatch(text + spelled[i] + tail) for tail in tails)
    out[list(vocabulary.stop_ids)] = compiled.fullmatch(text) is not None
    return out
  return allowed


@pytest.fixture(scope="module")
def law_target():
  return testing.random_model(LAW_CONFIG, seed=0, scale=1.0)


@pytest.fixture(scope="module")
def law_vocabulary(law_target):
  return constraints.Vocabulary.of(law_target.tokenizer, LAW_CONFIG.stop_ids, LAW_CONFIG.vocab_size)


def test_the_automaton_allows_what_the_regex_allows_along_every_short_path(law_vocabulary):
  tables = constraints.compile(jspec.Regex(LAW_REGEX), law_vocabulary)
  oracle = regex_allowed(law_vocabulary, LAW_REGEX)
  automata = automaton.stack([tables], LAW_CONFIG.vocab_size)
  for path in [()] + [p for n in (1, 2, 3) for p in itertools.product(range(8), repeat=n)]:
    if not all(oracle(path[:i])[t] for i, t in enumerate(path)):
      continue
    state = automata.path_states(np.asarray([path], np.int32))[:, -1]
    np.testing.assert_array_equal(np.asarray(automata.allowed(state[:, None]))[0, 0], oracle(list(path)), str(path))
  assert tables.num_classes < LAW_CONFIG.vocab_size  # tokens that behave alike share a class


KINDS = [("plain", (1.0, 0, 1.0), None), ("model", (1.0, 0, 1.0), None), ("eagle", (0.7, 3, 1.0), None),
         ("medusa", (1.0, 0, 0.8), None), ("ngram", (1.0, 0, 1.0), None),
         ("eagle", (1.0, 0, 1.0), TreeConfig(top_k=3, nodes=6)),
         ("model", (0.7, 3, 1.0), TreeConfig(top_k=3, nodes=6, sampled=True)),
         ("medusa", (1.0, 0, 0.8), TreeConfig(top_k=3, nodes=6))]


@pytest.mark.parametrize("kind,sp,shape", KINDS, ids=[f"{k}-t{t}-topk{tk}-topp{tp}{'-tree' * bool(s)}"
                                                      for k, (t, tk, tp), s in KINDS])
def test_constrained_decoding_keeps_the_exact_constrained_law(law_target, law_vocabulary, kind, sp, shape):
  """The first two tokens under a regex are distributed as the constrained target's (the target's
  distribution masked to the allowed tokens and renormalised, then top-k and top-p)."""
  kw = {}
  if kind != "plain":
    draft = testing.random_draft(kind, law_target, heads=3, scale=1.0, noise=1.0)
    kw = dict(draft=draft, spec=SpecConfig(drafter=kind, draft_len=2, adaptive=None, tree=shape))
  prompt = PROMPT + [2, 0, 1] if kind == "ngram" else PROMPT  # a repeat, so lookup proposes
  oracle = regex_allowed(law_vocabulary, LAW_REGEX)
  tv, bound, stats = testing.two_token_tv(law_target, prompt, sp, N, allowed=oracle,
                                          constraint=jspec.Regex(LAW_REGEX), **kw)
  assert tv < bound, (tv, bound)
  # The test can fail: the unconstrained law is far from the constrained one.
  free = testing.exact_two_token_law(law_target, prompt, *sp)
  assert 0.5 * np.abs(free - testing.exact_two_token_law(law_target, prompt, *sp, allowed=oracle)).sum() > 3 * bound
  if kind not in ("plain", "ngram"):
    assert 0.05 < stats.acceptance_rate < 0.95


# Greedy identity and validity, on the byte-level tiny model (a random target that does stop at EOS).
SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
          "required": ["color", "ok"]}
PROMPTS = ["def parse_args(", "x", "import numpy as np\nimport jax\n", "Answer: "]
ROWS = [jspec.Regex(r"[a-z]{2,6}( [0-9]{1,3})?"), jspec.JsonSchema(SCHEMA), None, jspec.Choice(["yes", "no", "maybe"])]


def satisfied(constraint, text: str) -> bool:
  if isinstance(constraint, jspec.Regex):
    return re.fullmatch(constraint.pattern, text) is not None
  if isinstance(constraint, jspec.Choice):
    return text in constraint.choices
  try:
    jsonschema.validate(json.loads(text), json.loads(constraint.schema))
  except (json.JSONDecodeError, jsonschema.ValidationError):
    return False
  return True


@pytest.fixture(scope="module")
def target():
  return testing.random_model(testing.TINY, seed=0, scale=2.0)


@pytest.fixture(scope="module")
def plain(target):
  return jspec.generate(target, PROMPTS, max_new_tokens=40, constraint=ROWS)


def test_constrained_greedy_outputs_satisfy_their_constraints_and_are_the_masked_argmax(target, plain):
  vocabulary = constraints.Vocabulary.of(target.tokenizer, target.config.stop_ids, target.config.vocab_size)
  for constraint, prompt, ids, text in zip(ROWS, PROMPTS, plain.token_ids, plain.texts):
    if constraint is None:
      continue
    ended = ids[-1] in target.config.stop_ids
    assert ended or len(ids) == 40
    assert satisfied(constraint, text) or not ended, text
    automata = automaton.stack([constraints.compile(constraint, vocabulary)], target.config.vocab_size)
    full = np.asarray(target.tokenizer.encode(prompt).ids + ids)[None]
    logits = np.asarray(model.forward_full(target.params, full, target.config)[0][0])
    states = automata.path_states(np.asarray([ids], np.int32))[:, :-1]
    allowed = np.asarray(automata.allowed(states))[0]
    start = len(full[0]) - len(ids) - 1
    masked = np.where(allowed, logits[start:start + len(ids)], -np.inf)
    assert ids == masked.argmax(-1).tolist()
  assert any(satisfied(c, t) for c, t in zip(ROWS, plain.texts) if c is not None)


CHAINS = [("model", None), ("eagle", None), ("medusa", None), ("ngram", None),
          ("eagle", TreeConfig(top_k=3, nodes=10)), ("model", TreeConfig(top_k=2, nodes=6)),
          ("medusa", TreeConfig(top_k=3, nodes=10))]


@pytest.mark.parametrize("kind,shape", CHAINS, ids=[f"{k}{'-tree' * bool(s)}" for k, s in CHAINS])
def test_constrained_greedy_speculation_is_constrained_plain_decoding(target, plain, kind, shape):
  draft = testing.random_draft(kind, target, heads=3, scale=2.0 if kind == "medusa" else 0.5)
  # Adaptive K (plain steps and catch-ups under a constraint) with the draft model; trees and the other
  # chains draft K every round.
  adaptive = AdaptiveConfig() if kind == "model" and shape is None else None
  spec = SpecConfig(drafter=kind, draft_len=3, tree=shape, adaptive=adaptive)
  r = jspec.generate(target, PROMPTS, draft=draft, spec=spec, max_new_tokens=40, constraint=ROWS)
  assert r.token_ids == plain.token_ids


@pytest.mark.parametrize("shape", [None, TreeConfig(top_k=2, nodes=8)], ids=["chain", "tree"])
def test_a_draft_that_is_the_target_accepts_every_draft_under_the_constraint(target, shape):
  """The draft is masked along its own path (each tree node by its path's state) as the target is: a copy
  of the target drafts exactly the constrained target's tokens, forced ones included."""
  spec = SpecConfig(draft_len=4, adaptive=None, tree=shape)
  r = jspec.generate(target, ["Answer: "], draft=target, spec=spec, max_new_tokens=20,
                     constraint=jspec.Choice(["internationalization", "localization"]))
  assert r.texts[0] in ("internationalization", "localization")
  assert r.stats.acceptance_rate == 1.0


def test_streaming_with_few_slots_decodes_what_one_batch_does(target, plain):
  """Rows start and finish in slots of a running batch whose automata grow and are dropped as
  constrained and free requests come and go."""
  draft = testing.random_draft("eagle", target)
  s = jspec.stream(target, PROMPTS + PROMPTS[2:3], draft=draft, max_new_tokens=40, batch_size=2,
                   constraint=ROWS + [None], spec=testing.fixed_k(3))
  out, reasons = {}, {}
  for delta in s:
    out.setdefault(delta.index, []).extend(delta.token_ids)
    if delta.finished:
      reasons[delta.index] = delta.finish_reason
  assert [out[i] for i in range(len(PROMPTS))] == plain.token_ids
  assert out[4] == plain.token_ids[2]
  # A constrained text ends with EOS when it is complete, and says "length" where max_new_tokens cut it.
  assert [reasons[i] for i in range(len(PROMPTS))] == ["length" if len(ids) == 40 else "stop"
                                                       for ids in plain.token_ids]


def test_constraints_of_one_bucket_do_not_retrace(target):
  draft = testing.random_draft("model", target)
  kw = dict(draft=draft, spec=testing.fixed_k(3), max_new_tokens=8)
  jspec.generate(target, ["warm up"], constraint=jspec.Regex("[a-z]+"), **kw)
  before = dict(loop.trace_counts)
  for i, c in enumerate([jspec.Regex("[0-9]+"), jspec.Choice(["a", "b"]), jspec.Regex("(ab|cd)*e")]):
    r = jspec.generate(target, ["abc" * (i + 1)], constraint=c, temperature=0.5 * i, seed=i, **kw)
    assert r.stats.compile_seconds == 0.0
  assert dict(loop.trace_counts) == before


@pytest.mark.parametrize("constraint,message", [
    (lambda: jspec.Regex("("), "cannot compile the constraint"),
    (lambda: jspec.Regex("\u00e9+"), "cannot compile the constraint"),
    (lambda: jspec.JsonSchema({"type": "string", "minLength": 5, "maxLength": 2}), "cannot compile the JSON Schema"),
    (lambda: jspec.JsonSchema({"type": "nothing"}), "cannot compile the JSON Schema"),
    (lambda: jspec.JsonSchema("{not json"), "not valid JSON"),
    (lambda: jspec.Choice([]), "non-empty list"),
    (lambda: "[a-z]+", "must be a jspec.Regex"),
])
def test_bad_constraints_are_one_line_errors_before_decoding(law_target, constraint, message):
  with pytest.raises(ValueError, match=re.escape(message)) as e:
    jspec.generate(law_target, [PROMPT], max_new_tokens=2, constraint=constraint())
  assert "\n" not in str(e.value)


def test_a_constraint_cannot_ignore_eos(law_target):
  with pytest.raises(ValueError, match="ignore_eos"):
    jspec.generate(law_target, [PROMPT], max_new_tokens=2, constraint=jspec.Regex("!+"), ignore_eos=True)


def test_tables_stay_small_and_are_cached(target):
  vocabulary = constraints.Vocabulary.of(target.tokenizer, target.config.stop_ids, target.config.vocab_size)
  schema = jspec.JsonSchema(SCHEMA)
  tables = constraints.compile(schema, vocabulary)
  assert constraints.compile(jspec.JsonSchema(json.dumps(SCHEMA)), vocabulary) is tables
  dense = tables.num_states * target.config.vocab_size * 4  # a [states, V] table
  assert tables.num_classes < 64 and 4 * tables.nbytes < dense


def test_token_bytes_read_byte_level_and_sentencepiece_vocabularies(target):
  from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
  byte_level = tokenizer.token_bytes(target.tokenizer)
  ids = [target.tokenizer.token_to_id(t) for t in ("\u0120", "a", "\u010a")]
  assert [byte_level[i] for i in ids] == [b" ", b"a", b"\n"]
  assert target.config.eos_id not in byte_level  # special tokens are never allowed
  spm = Tokenizer(models.BPE(vocab={"\u2581the": 0, "<0x0A>": 1, "a\u2581b": 2}, merges=[]))
  spm.pre_tokenizer = pre_tokenizers.Metaspace()
  spm.decoder = decoders.Metaspace()
  spm.add_special_tokens([AddedToken("<s>", special=True)])
  assert tokenizer.token_bytes(spm) == {0: b" the", 1: b"\n", 2: b"a b"}
