"""Paged KV caches (jspec/model/cache.py, jspec/engine/pages.py): decoding through page tables gives the tokens
contiguous caches give, for every drafter, chains and trees, greedy and sampled, and the loop holds no copy of the pool;
an engine short of pages preempts and resumes to the same tokens, constrained rows too, and leaks none."""
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec import testing
from jspec.core.settings import SamplingConfig, SpecConfig, TreeConfig
from jspec.decoding import batches, programs, rows
from jspec.decoding.batches import make_batch
from jspec.decoding.decoder import make_decoder
from jspec.engine.pages import NULL_PAGE, KVPages
from jspec.engine.requests import Request
from jspec.model import cache as kvcache
from jspec.text import automaton

PROMPTS = [[3, 1, 4, 1, 5], list(range(2, 124)), [7] * 200]  # rows that start, cross and fill pages
NEW_TOKENS = 40


def paged(batch, seed: int = 0, spare: int = 5):
  """The batch with each row's pages scattered over a pool larger than the rows needs."""
  rows, per_row = batch.prompt_lens_B.shape[0], batch.capacity // kvcache.PAGE_SIZE
  pages = rows * per_row + spare
  table = np.random.default_rng(seed).permutation(pages)[:rows * per_row].reshape(rows, per_row)
  return batch.replace(page_table_BxR=jnp.asarray(table, jnp.int32), pages=pages)


@pytest.fixture(scope="module")
def pair():
  return testing.random_pair()


def _models(kind: str, pair):
  """(draft, spec) of a kind of drafter: plain, model (a chain, adaptive or a tree), ngram, or heads."""
  target, draft = pair
  fixed = {"plain": (None, None), "model": (draft, testing.fixed_k(4)), "model-adaptive": (draft, SpecConfig(4)),
           "model-tree": (draft, SpecConfig(3, tree=TreeConfig(3, 8))),
           "ngram": (None, testing.fixed_k(3, drafter="ngram"))}
  if kind in fixed:
    return fixed[kind]
  heads_kind, _, shape = kind.partition("-")
  return testing.random_draft(heads_kind, target), (
      SpecConfig(3, drafter=heads_kind, tree=TreeConfig(3, 8)) if shape == "tree"
      else testing.fixed_k(3, drafter=heads_kind))


def test_kv_pages_split_over_data_shards_keep_each_shards_pages_and_prefixes_to_it():
  """Two data shards of 3 pages and 2 slots each: shard 1's slots hold pages numbered after shard 0's pool
  (its 3 pages and a scratch page), a slot grows only into its own shard's free pages, a cached prefix is
  found only by its shard's slots, and idle or unready rows point at their shard's scratch page."""
  size = kvcache.PAGE_SIZE
  pool = KVPages(pages=6, slots=4, pages_per_row=3, shards=2)
  assert (pool.pages, pool.shard_pages, pool.pool_size) == (6, 3, 8)
  assert pool.rows(None, 4)[:, 0].tolist() == [NULL_PAGE, NULL_PAGE, 4 + NULL_PAGE, 4 + NULL_PAGE]
  prompt = list(range(2 * size + 5))
  assert pool.allocate(2, prompt, 2 * size + 5) == 0 and set(pool.table[2].tolist()) <= {5, 6, 7}
  pool.started(2, prompt, 0)
  assert pool.allocate(0, prompt, 2 * size + 5) == 0  # shard 0 has none of shard 1's cached pages
  assert pool.allocate(3, prompt, 2 * size + 5) is None  # shard 1's 3 pages are slot 2's
  assert pool.allocate(3, prompt, 2 * size) == 2 * size and (pool.table[3, :2] == pool.table[2, :2]).all()
  assert not pool.grow(1, size) and pool.num_free == 0  # shard 0's pages are slot 0's
  table = pool.changed_table(unready=[3])
  assert table[3].tolist() == [4 + NULL_PAGE] * 3 and table[0].max() <= 3


def _decoder(kind: str, pair):
  return make_decoder(pair[0], *_models(kind, pair), len(PROMPTS))


def test_kv_pages_share_a_cached_prefix_and_free_what_no_slot_holds():
  """`KVPages`, the engine's one object for pages and the prefix cache: a prompt's full final pages are cached
  when its request starts, a later prompt with the same prefix is given those pages (its hits counted) and
  fresh ones for the rest, a slot grows only into free pages, and a freed slot's pages come back, the cached
  ones kept until a request needs them."""
  size = kvcache.PAGE_SIZE
  pool = KVPages(pages=4, slots=2, pages_per_row=4, lookahead=1)
  prompt, other = list(range(3 * size)), list(range(2 * size + 5)) + [7] * 60
  assert pool.allocate(0, prompt, 3 * size) == 0 and pool.held(0) == 3 and pool.num_free == 1
  pool.started(0, prompt, 0)  # its first two pages are final in every cache: cached
  assert pool.allocate(1, other, 3 * size) == 2 * size and pool.num_free == 0
  pool.started(1, other, 2 * size)
  assert pool.prefix_hits == 2 * size and pool.prefix_queries == len(prompt) + len(other)
  assert pool.table[1, :2].tolist() == pool.table[0, :2].tolist()
  assert not pool.grow(1, 4 * size) and pool.held(1) == 3  # no page free: none given
  pool.free(1)
  assert pool.num_free == 1  # its own page; the shared ones are still slot 0's
  pool.free(0, prompt + [1, 2, 3])  # its third page is final now: cached too
  assert pool.num_free == 4 and (pool.table == NULL_PAGE).all()
  assert pool.allocate(0, prompt + [1, 2, 3], 3 * size + 3) == 3 * size  # the cached pages outlived their slots
  pool.free(0)
  assert pool.num_free == 4
  assert pool.allocate(1, [9] * 4 * size, 4 * size) == 0 and pool.num_free == 0  # the cached pages evicted
  assert pool.allocate(0, prompt, 3 * size) is None and pool.held(0) == 0  # nothing cached, nothing free
  assert pool.changed_table(unready=[1])[1].tolist() == [NULL_PAGE] * 4 and pool.changed_table([]) is None


@pytest.mark.parametrize("kind,temperature", [
    *((k, 0.0) for k in ("plain", "model", "ngram", "eagle", "eagle-tree", "medusa-tree")),
    ("model", 1.0), ("eagle-tree", 1.0)])
def test_paged_decoding_gives_the_contiguous_tokens(pair, kind, temperature):
  decoder = _decoder(kind, pair)
  batch = make_batch(decoder, PROMPTS, NEW_TOKENS, sampling=SamplingConfig(temperature), seed=[1, 2, 3])
  tokens, lens, *_ = programs.run(decoder, batch)
  paged_tokens, paged_lens, *_ = programs.run(decoder, paged(batch))
  np.testing.assert_array_equal(paged_lens, lens)
  np.testing.assert_array_equal(paged_tokens, tokens)


def test_a_segment_over_narrow_rows_reads_the_whole_pool(pair):
  """The server's narrow segments slice per-row buffers: a page table is one, the pool is not."""
  decoder = _decoder("model", pair)
  batch = paged(make_batch(decoder, PROMPTS, NEW_TOKENS))
  state = programs.start(decoder, batch)
  done = state.done_B.at[1:].set(True)
  narrow = rows.run_rows(decoder, state.replace(done_B=done), width=1)
  whole, *_ = programs.run(decoder, batch)
  np.testing.assert_array_equal(narrow.tokens_BxT[0, :narrow.seq_lens_B[0]], whole[0, :narrow.seq_lens_B[0]])


@pytest.mark.slow  # compiled as users compile
@pytest.mark.parametrize("kind", ["model"])
def test_the_loop_holds_no_copy_of_the_pool(pair, kind):
  """Nor do the server's segments (every row, or the narrower program of a few), and an insert prefills into
  the donated state's pools."""
  decoder = _decoder(kind, pair)
  batch = paged(make_batch(decoder, PROMPTS, NEW_TOKENS))
  as_users_compile = lambda lowered: lowered.compile(compiler_options=testing.AS_USERS_COMPILE).as_text()
  state = programs.start(decoder, batch)
  texts = [as_users_compile(programs.lower(decoder, batch))] + [
      as_users_compile(programs.segment.lower(decoder, state, jnp.int32(8), jnp.asarray(True),
                                              jnp.zeros(len(PROMPTS), bool), width=width)) for width in (3, 1)]
  for config in [decoder.target_config] + ([decoder.drafter.config] if kind == "model" else []):
    pool = batch.pages * config.n_kv_heads * kvcache.PAGE_SIZE * config.head_dim
    for text in texts:
      assert testing.loop_cache_copies(text, pool) == []
  one = jax.tree.map(lambda x: x[:1], batch)
  insert = as_users_compile(programs.insert.lower(decoder, state, one, jnp.int32(2)))
  assert "input_output_alias" in insert.splitlines()[0]


# The engine: rows that start in one page and grow to three, a pool of six.
ENGINE_PROMPTS = {"a": [5] * 100, "b": list(range(30, 140)), "c": [9, 8, 7], "d": [11] * 60}
ENGINE_NEW = {"a": 150, "b": 100, "c": 180, "d": 120}


def _drain(engine) -> dict:
  out = {}
  while engine.has_work:
    for d in engine.step():
      out.setdefault(d.index, []).append(d)
  return out


@pytest.mark.parametrize("kind", ["eagle"])
def test_an_engine_short_of_pages_preempts_and_resumes_to_the_tokens_of_generate(pair, kind):
  target, _ = pair
  draft, spec = _models(kind, pair)
  engine = jspec.make_engine(target, draft=draft, spec=spec, slots=4, max_len=400, segment_rounds=2, pages=6)
  for i, prompt in ENGINE_PROMPTS.items():
    engine.add(Request(prompt, ENGINE_NEW[i]), i)
  out = _drain(engine)
  for i, prompt in ENGINE_PROMPTS.items():
    want = jspec.generate(target, [prompt], draft=draft, spec=spec, max_new_tokens=ENGINE_NEW[i]).token_ids[0]
    assert [t for d in out[i] for t in d.token_ids] == want, i
  assert engine.num_preemptions > 0
  assert engine.kv_pages.num_free == engine.kv_pages.pages  # every page back


def test_pages_never_leak_under_aborts_and_preemptions(pair):
  """A bounded load: 20 requests on 4 slots sharing 6 pages, 10% aborted mid-flight (running or waiting);
  at the end every page is free again."""
  target, draft = pair
  engine = jspec.make_engine(target, draft=draft, spec=testing.fixed_k(3), slots=4, max_len=400, segment_rounds=2,
                             pages=6)
  rng = np.random.default_rng(0)
  for i in range(20):
    engine.add(Request(rng.integers(0, 256, int(rng.integers(1, 120))).tolist(), int(rng.integers(1, 200))), i)
  aborted, finished, steps = {3, 17}, {}, 0
  while engine.has_work:
    steps += 1
    assert steps < 3000
    for d in engine.step():
      if d.finished:
        finished[d.index] = d.finish_reason
    if steps == 4:
      for i in aborted:
        engine.abort(i)
  assert {i for i, reason in finished.items() if reason == "abort"} == aborted and len(finished) == 20
  assert engine.num_preemptions > 0
  assert engine.kv_pages.num_free == engine.kv_pages.pages and not engine.kv_pages.table.any()


def test_a_constrained_request_resumes_inside_its_constraint(monkeypatch):
  """Preempted mid-output, a constrained row restarts from the automaton's state after what it emitted. A
  request larger than the pool is refused before it waits."""
  target, draft = testing.random_pair(testing.TINY)  # a constrained text ends at its EOS
  regex = jspec.Regex("[a-z]{20,60}( [0-9]+)?")
  engine = jspec.make_engine(target, draft=draft, spec=testing.fixed_k(3), slots=4, max_len=400, segment_rounds=2,
                             pages=3)
  with pytest.raises(ValueError, match="needs 4 KV pages of 128 tokens"):
    engine.add(Request([1] * 10, 380))
  advanced, resumed_after = automaton.advanced, []
  monkeypatch.setattr(automaton, "advanced", lambda tables, ids: resumed_after.append(len(ids)) or advanced(
      tables, ids))
  engine.add(Request([5] * 100, 200, ignore_eos=True), "free")
  engine.add(Request([7] * 100, 150, constraint=regex), "constrained")
  out = _drain(engine)
  assert engine.num_preemptions > 0 and max(resumed_after) > 0  # preempted with output emitted
  alone = lambda prompt, n, **kw: jspec.generate(target, [prompt], draft=draft, spec=testing.fixed_k(3),
                                                 max_new_tokens=n, **kw).token_ids[0]
  assert [t for d in out["free"] for t in d.token_ids] == alone([5] * 100, 200, ignore_eos=True)
  assert [t for d in out["constrained"] for t in d.token_ids] == alone([7] * 100, 150, constraint=regex)


# Prefix caching: a system prompt of two full pages and part of a third, shared by later requests.
SYSTEM = [(7 * i) % 200 + 3 for i in range(300)]


@pytest.mark.parametrize("kind", ["model", "eagle", "dflash"])  # the target's prefill from a cached prefix in each
def test_a_cached_prefix_gives_the_tokens_of_generate(pair, kind):
  """Later requests share the first request's full prompt pages (ending mid-page: the rest is prefilled) and
  get the tokens `generate` gives them; a drafter's cache shares the pages too (its drafts are `generate`'s),
  EAGLE's only where the text goes on with the same token (its entry at a page's end reads the next).
  Requests of one prompt that arrive together share the first one's prefill. Prompts go in chunks of a
  page (the first in three)."""
  target, _ = pair
  draft, spec = _models(kind, pair)
  engine = jspec.make_engine(target, draft=draft, spec=spec, slots=4, max_len=400, segment_rounds=2,
                             max_prefill_tokens=128)
  prompts = {"first": SYSTEM + [1, 2], "again": SYSTEM + [9] * 40, "short": SYSTEM[:140],
             "diverge": SYSTEM[:256] + [9] * 10}
  hits = {"first": 0, "again": 256, "short": 128, "diverge": 128 if kind == "eagle" else 256}
  for i, prompt in prompts.items():
    before = engine.kv_pages.prefix_hits
    engine.add(Request(prompt, 24), i)
    out = _drain(engine)
    want = jspec.generate(target, [prompt], draft=draft, spec=spec, max_new_tokens=24)
    assert [t for d in out[i] for t in d.token_ids] == want.token_ids[0], i
    assert engine.kv_pages.prefix_hits - before == hits[i], i
    # The drafter's cache from the shared pages is its own prefill's: it drafts the same tokens.
    assert out[i][-1].stats.accepted_tokens == want.request_stats[0].accepted_tokens, i
  # Two requests of one new prompt at once (`n` choices): the second waits a step for the first's pages.
  twin, before = [5] * 270, engine.kv_pages.prefix_hits
  engine.add(Request(twin, 24), "twin-0")
  engine.add(Request(twin, 24), "twin-1")
  out = _drain(engine)
  assert engine.kv_pages.prefix_hits - before == 256
  want = jspec.generate(target, [twin], draft=draft, spec=spec, max_new_tokens=24).token_ids[0]
  assert [[t for d in out[f"twin-{j}"] for t in d.token_ids] for j in range(2)] == [want, want]
  assert engine.kv_pages.prefix_queries == sum(map(len, prompts.values())) + 2 * len(twin)
  assert engine.kv_pages.num_free == engine.kv_pages.pages


def test_a_prefix_hit_whose_program_compiles_prefills_whole_meanwhile(pair, monkeypatch):
  """Compiling in the background, a request that hits a cached prefix but whose narrower prefill is not
  compiled yet takes fresh pages and prefills its whole prompt, rather than wait: `generate`'s tokens, no hit."""
  target, _ = pair
  draft, spec = _models("model", pair)
  engine = jspec.make_engine(target, draft=draft, spec=spec, slots=2, max_len=400, segment_rounds=2)
  engine.prepare()
  engine.compile_in_background(ahead=False)
  release, compile = threading.Event(), engine.program_cache._compile
  # The prefill from the cached prefix (84 tokens: a width of 96), not the whole prompts' (384).
  from_prefix = lambda key: key[0] == "insert" and key[1][1] < 256

  def held(key, *args):
    if from_prefix(key):
      release.wait(60)
    compile(key, *args)

  monkeypatch.setattr(engine.program_cache, "_compile", held)
  try:
    for i, prompt in {"first": SYSTEM + [1, 2], "again": SYSTEM + [9] * 40}.items():
      engine.add(Request(prompt, 16), i)
      out = _drain(engine)
      want = jspec.generate(target, [prompt], draft=draft, spec=spec, max_new_tokens=16).token_ids[0]
      assert [t for d in out[i] for t in d.token_ids] == want, i
    assert any(map(from_prefix, engine.program_cache._compiling))  # it was asked for
    assert engine.kv_pages.prefix_hits == 0 and engine.kv_pages.num_free == engine.kv_pages.pages
  finally:
    release.set()


def test_the_two_token_law_holds_through_a_prefix_hit():
  """Sampled rows whose prompt's first page is cached draw their first two tokens from the target's law."""
  target = testing.random_model(testing.SMALL_VOCAB, seed=2)
  draft = testing.perturbed(target, 0.5)
  prompt = [int(t) for t in np.random.default_rng(3).integers(0, 16, 131)]
  sp, n = (1.0, 0, 1.0), 1000
  engine = jspec.make_engine(target, draft=draft, spec=testing.fixed_k(2), slots=16, max_len=256, segment_rounds=1)
  engine.add(Request(prompt, 2), "first")
  _drain(engine)
  counts = np.zeros((16, 16))
  for i in range(n):
    engine.add(Request(prompt, 2, jspec.SamplingConfig(*sp), seed=i), i)
  for deltas in _drain(engine).values():
    a, b = [t for d in deltas for t in d.token_ids]
    counts[a, b] += 1
  assert engine.kv_pages.prefix_hits == n * 128
  want = testing.exact_two_token_law(target, prompt, *sp)
  assert 0.5 * np.abs(counts / n - want).sum() < testing.tv_bound(want, n)


def test_streams_keep_moving_while_a_long_prompt_goes_in_chunks(pair):
  """Two streams decode while a 360-token prompt is prefilled 100 tokens per step: every step of its prefill
  hands them tokens, and all three get the tokens of `generate`. The same requests again (a cached prefix: a
  prefill of another width, compiled once) and again, sampled, with other pages, compile nothing new. Every
  prefill program (whole, chunk, from a prefix) reads the prompt at one width and runs a prompt bucket."""
  target, draft = pair
  spec = testing.fixed_k(3)
  engine = jspec.make_engine(target, draft=draft, spec=spec, slots=4, max_len=400, segment_rounds=2,
                             max_prefill_tokens=100)
  prompts = {"s1": [4, 5, 6], "s2": [8] * 20, "long": [(3 * i) % 250 + 1 for i in range(360)]}
  engine.add(Request(prompts["s1"], 80), "s1")
  engine.add(Request(prompts["s2"], 80), "s2")
  out = {}
  collect = lambda deltas: [out.setdefault(d.index, []).append(d) for d in deltas]
  collect(engine.step())
  engine.add(Request(prompts["long"], 30), "long")
  chunk_steps = 0
  while engine.has_work:
    prefilling = "long" in {run.id for run in engine._prefilling.runs().values()}
    deltas = engine.step()
    collect(deltas)
    if prefilling and "long" not in out:
      chunk_steps += 1
      assert {"s1", "s2"} <= {d.index for d in deltas}
  assert chunk_steps >= 2
  for i, prompt in prompts.items():
    n = 30 if i == "long" else 80
    want = jspec.generate(target, [prompt], draft=draft, spec=spec, max_new_tokens=n).token_ids[0]
    assert [t for d in out[i] for t in d.token_ids] == want, i
  compiled = []
  for attempt in range(2):
    for i, prompt in prompts.items():
      engine.add(Request(prompt, 30 if i == "long" else 80, jspec.SamplingConfig(0.8), seed=attempt), (attempt, i))
    _drain(engine)
    compiled.append(len(engine.program_cache._executables))
  assert compiled[0] == compiled[1]
  prefills = [key[1] for key in engine.program_cache._executables if key[0] in ("insert", "chunk")]
  assert {shape for shape, _ in prefills} == {(1, engine.prompt_width)}
  assert {width for _, width in prefills} <= {batches.prompt_bucket(n) for n in range(1, 101)}
