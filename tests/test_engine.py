"""The online engine: requests that arrive while others decode get the tokens they get alone; aborts, stop
strings, stop tokens and the per-request speculation switch; refusals before anything queues."""
import threading

import pytest

import jspec
from jspec import testing
from jspec.decoding import loop
from jspec.engine.requests import Request
from jspec.engine.text import TextOutput
from jspec.text import tokenizer

FIXED_K = testing.fixed_k(3)


@pytest.fixture(scope="module")
def pair():
  return testing.random_pair()


@pytest.fixture(scope="module")
def engine(pair):
  target, draft = pair
  return jspec.make_engine(target, draft=draft, spec=FIXED_K, slots=2, max_len=96, segment_rounds=2)


def drain(engine, until=None) -> dict:
  """Steps until the engine is idle (or `until` finished); returns {id: [deltas]}."""
  out = {}
  while engine.has_work and (until is None or not any(d.finished for d in out.get(until, []))):
    for d in engine.step():
      assert not any(x.finished for x in out.get(d.index, []))
      out.setdefault(d.index, []).append(d)
  return out


def alone(pair, prompt, max_new_tokens, seed=0, temperature=0.0):
  target, draft = pair
  return jspec.generate(target, [prompt], draft=draft, spec=FIXED_K, max_new_tokens=max_new_tokens,
                        temperature=temperature, seed=[seed]).token_ids[0]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_requests_that_arrive_while_others_decode_get_their_tokens_alone(pair, engine, temperature):
  sampling = jspec.SamplingConfig(temperature)
  prompts = {"a": [5, 6, 7], "b": [9] * 20, "c": [1, 2], "d": [100, 50, 25, 12]}
  lengths = {"a": 30, "b": 8, "c": 17, "d": 12}
  engine.add(Request(prompts["a"], lengths["a"], sampling, seed=1), "a")
  out = {d.index: [d] for d in engine.step()}  # "a" decodes alone for a segment
  for i in "bcd":  # three more arrive; "d" waits for a free slot
    engine.add(Request(prompts[i], lengths[i], sampling, seed=ord(i)), i)
  for i, deltas in drain(engine).items():
    out.setdefault(i, []).extend(deltas)
  for i, p in prompts.items():
    ids = [t for d in out[i] for t in d.token_ids]
    assert ids == alone(pair, p, lengths[i], seed=1 if i == "a" else ord(i), temperature=temperature), i
    last = out[i][-1]
    assert last.finished and last.finish_reason == "length" and last.stats.emitted_tokens == lengths[i]
    assert last.stats.drafts > 0 and last.stats.mean_acceptance_length == 1 + last.stats.accepted_tokens / \
        last.stats.drafts
  assert engine.num_running == engine.num_waiting == 0


def test_aborted_requests_end_and_free_their_slots(pair, engine):
  for i in range(3):
    engine.add(Request([3 + i] * 4, 60), i)
  first = engine.step() + engine.step()  # 0 and 1 run, 2 waits; a step returns the segment before its own
  assert {d.index for d in first} == {0, 1} and engine.num_waiting == 1
  engine.abort(0)
  engine.abort(2)
  engine.add(Request([8, 9], 10), 3)
  out = drain(engine)
  assert out[0][-1].finish_reason == "abort" and out[2][-1].finish_reason == "abort" and out[2][-1].text == ""
  assert [t for d in out[3] for t in d.token_ids] == alone(pair, [8, 9], 10)  # took the aborted slot
  assert [t for d in first + out[1] if d.index == 1 for t in d.token_ids] == alone(pair, [4] * 4, 60)


def test_stop_strings_cut_the_text_and_stop_ids_end_the_request(pair, engine):
  target, _ = pair
  ids = alone(pair, [40, 41, 42], 40)
  text = tokenizer.detokenize(target.tokenizer, ids)
  stop = text[len(text) // 2:len(text) // 2 + 2]
  engine.add(Request([40, 41, 42], 40, stop=["\x00never", stop]), "s")
  engine.add(Request([40, 41, 42], 40, stop_ids=[ids[5]]), "t")
  out = drain(engine)
  streamed = "".join(d.text for d in out["s"])
  assert streamed == text[:text.index(stop)] and out["s"][-1].finish_reason == "stop"
  assert [t for d in out["t"] for t in d.token_ids] == ids[:ids.index(ids[5]) + 1]
  assert out["t"][-1].finish_reason == "stop"


def test_text_is_held_back_while_it_could_begin_a_stop_string():
  text = TextOutput(tokenizer.byte_tokenizer(), ["END"])
  enc = lambda s: tokenizer.encode(tokenizer.byte_tokenizer(), s)
  assert text.push(enc("abcE")) == ("abc", False)  # "E" could begin "END"
  assert text.push(enc("x")) == ("Ex", False)
  assert text.push(enc("yEN")) == ("y", False)
  assert text.push(enc("Dzz")) == ("", True)
  assert TextOutput(tokenizer.byte_tokenizer(), ["END"]).push(enc("xEN"), final=True) == ("xEN", False)


def test_a_request_may_turn_speculation_off(pair, engine):
  engine.add(Request([7, 7, 7], 24, speculate=False), "plain")
  engine.add(Request([7, 7, 7], 24), "spec")
  out = drain(engine)
  ids = lambda i: [t for d in out[i] for t in d.token_ids]
  assert ids("plain") == ids("spec") == alone(pair, [7, 7, 7], 24)
  assert out["plain"][-1].stats.drafted_tokens == 0 and out["spec"][-1].stats.drafted_tokens > 0


def test_no_retrace_across_requests_and_refusals_before_queueing(pair, engine):
  engine.add(Request([1] * 5, 6), "warm")
  drain(engine)
  before = dict(loop.trace_counts)
  for i in range(3):
    engine.add(Request([2 + i] * (3 + i), 5 + i, jspec.SamplingConfig(0.5 * i, 3 * i, 1.0 - 0.1 * i), seed=i,
                       stop_ids=[1] * i, ignore_eos=bool(i % 2), speculate=i != 1), i)
  drain(engine)
  assert dict(loop.trace_counts) == before
  for bad, message in [(Request([1] * 90, 7), "exceeds the model's context of 96 tokens"),
                       (Request([300], 4), "outside the vocabulary"), (Request([1], 0), "max_new_tokens"),
                       (Request([1], 4, stop_ids=list(range(9))), "at most 8 stop token ids"),
                       (Request([1], 4, seed=-1), "seeds must be")]:
    with pytest.raises(ValueError, match=message):
      engine.add(bad)
  assert engine.num_waiting == 0


def test_a_young_stream_runs_short_segments_unless_requests_wait(pair, engine):
  """A segment of one round right after a streamed request's prefill, then as many as it has run (at
  least `stream_rounds`, at most `segment_rounds`) while none waits; `segment_rounds` for batch work and
  once requests wait for a slot. The tokens are those alone."""
  kept = engine.stream_rounds, engine.segment_rounds
  try:
    rounds = []

    def run():
      out = {}
      while engine.has_work:
        for d in engine.step():
          out.setdefault(d.index, []).extend(d.token_ids)
        rounds.append(engine._unread[-1].rounds if engine._unread else None)
      return out

    for stream_rounds, expected in ((1, [1, 1, 2, 4, 8, 8, 8]), (3, [1, 3, 4, 8, 8, 8])):
      engine.stream_rounds, engine.segment_rounds = stream_rounds, 8
      engine.add(Request([5, 6], 48, stream=True), "s")
      assert run()["s"] == alone(pair, [5, 6], 48)
      seen = [r for r in rounds if r is not None]
      assert len(seen) >= 4 and seen == expected[:len(seen)], seen
      rounds.clear()
    engine.add(Request([5, 6], 12), "b")
    run()
    assert set(rounds) - {None} == {8}
    rounds.clear()
    for i in range(3):  # two slots: the third waits while the first two run
      engine.add(Request([7, i], 12, stream=True), i)
    out = run()
    assert rounds[0] == 8 and 1 in rounds and out[2] == alone(pair, [7, 2], 12)
  finally:
    engine.stream_rounds, engine.segment_rounds = kept


def test_a_request_whose_program_compiles_in_the_background_waits_while_others_run(pair, monkeypatch):
  """With background compiles, a request whose prefill program is not ready waits in its slot while one
  whose program is decodes; once it is ready the request gets its tokens alone."""
  target, draft = pair
  engine = jspec.make_engine(target, draft=draft, spec=FIXED_K, slots=2, max_len=96, segment_rounds=2)
  engine.prepare()
  engine.compile_in_background(ahead=False)
  release, compile = threading.Event(), engine.program_cache._compile

  def held(key, *args):
    if key[0] == "insert" and key[1][1] >= 48:  # the long prompt's prefill width
      release.wait(60)
    compile(key, *args)

  monkeypatch.setattr(engine.program_cache, "_compile", held)
  engine.add(Request([7, 8], 4), "first")  # compiles the short prompts' bucket
  drain(engine)
  engine.add(Request([9] * 40, 10), "long")
  engine.add(Request([5, 6], 12), "short")
  out = drain(engine, until="short")
  assert "long" not in out and [t for d in out["short"] for t in d.token_ids] == alone(pair, [5, 6], 12)
  release.set()
  out = drain(engine)
  assert [t for d in out["long"] for t in d.token_ids] == alone(pair, [9] * 40, 10)


def test_an_engine_prepared_plain_first_steps_plainly_until_speculation_is_compiled(pair, monkeypatch):
  """`prepare(plain_first=True)` (the server's): until the speculative segment compiles (held here), segments
  take only plain steps, the target's greedy tokens; once it is ready the engine speculates, the same tokens."""
  target, _ = pair
  engine = jspec.make_engine(target, draft=testing.random_draft("eagle", target), spec=jspec.SpecConfig(2), slots=2,
                             max_len=96, segment_rounds=2)
  release, compile = threading.Event(), engine.program_cache._compile

  def held(key, *args):
    if key[0] == "segment" and ("plain", True) not in key[3]:
      release.wait(60)
    compile(key, *args)

  monkeypatch.setattr(engine.program_cache, "_compile", held)
  engine.prepare(plain_first=True)
  engine.compile_in_background(ahead=False)
  assert engine.decodes_plainly_first
  expected = jspec.generate(target, [[5, 6, 7]], max_new_tokens=12).token_ids[0]
  engine.add(Request([5, 6, 7], 12), "plain")
  out = drain(engine)["plain"]
  assert [t for d in out for t in d.token_ids] == expected and out[-1].stats.drafts == 0
  release.set()
  for future in list(engine.program_cache._compiling.values()):
    future.result()
  engine.add(Request([5, 6, 7], 12), "speculative")
  out = drain(engine)["speculative"]
  assert [t for d in out for t in d.token_ids] == expected and out[-1].stats.drafts > 0


def test_stopping_cancels_the_background_compiles_not_yet_started(pair, monkeypatch):
  """A stopping server waits for the program compiling now, not for every one queued behind it."""
  target, draft = pair
  engine = jspec.make_engine(target, draft=draft, spec=FIXED_K, slots=2, max_len=96, segment_rounds=2)
  started, release, compile = threading.Event(), threading.Event(), engine.program_cache._compile

  def held(*args):
    started.set()
    release.wait(60)
    compile(*args)

  engine.prepare()
  monkeypatch.setattr(engine.program_cache, "_compile", held)
  futures = engine.compile_in_background()
  assert len(futures) > 1 and started.wait(60)
  engine.stop_compiling()
  release.set()
  futures[0].result()
  assert all(f.cancelled() for f in futures[1:]) and engine.num_compiling == 0
  engine.add(Request([5, 6, 7], 4), "late")  # its prefill program was cancelled: it waits, nothing fails
  assert engine.step() == [] and engine.num_compiling == 0
