"""The online engine: requests arrive at any time, decode in a running batch of slots, hand out their text as
rounds are accepted, and can be aborted. `jspec.stream`, the CLI's continuous batching and the server
(`jspec.serve`) all run on it.

The batch has a fixed number of rows (slots) and a fixed capacity (tokens a row may hold), set when the
engine starts, so nothing compiles per request. An online engine runs each segment over the first 1, 2, 4,
... rows that hold every busy one (`jspec.decoding.rows.run_rows`): an idle row would still cost its share of
every forward. The decode loop runs in segments (`jspec.decoding.loop.run` with `max_rounds`), each one
executable call that keeps the whole loop on the device; each host visit (`Engine.step`) ends aborted
rows, prefills waiting requests into free slots (`jspec.decoding.rows.insert`: their cache rows, drafter state,
sampling values, stop tokens and seed), sets the next segment going and, while the device runs it, reads
the previous segment's new tokens of every row as text deltas: the host's work overlaps the device's, and
what it learns (a row done, a stop string) acts one segment later. A segment runs `segment_rounds` rounds;
while a streamed request is young and none waits, as many as it has run so far (its text comes after 1,
2, 4, 8, ... rounds: soon, then in chunks that double, so host visits cost a shrinking share of the
time). First come, first served. A segment ends early when a row finishes while requests wait,
so a free slot does not idle. A request's tokens depend only on its own row, so they are those it would
get decoded alone (with a fixed K; adaptive K is chosen for the whole batch, which changes which tokens a
sampled row draws, never their distribution).

A server compiles in the background (`prepare`, then `compile_in_background`): it serves as soon as the
idle prefill and a segment over every row are ready, and a request whose program is still compiling waits
while the others run.

Off a mesh the caches are paged (`jspec.model.cache`, `jspec.engine.pages`): a pool of pages that the memory
budget sizes, shared by the slots. A request is admitted when pages for its prompt and a segment's tokens are
free; before each segment every running row is given the pages it may write into during it; when the pool runs out the
youngest request is preempted (its pages freed, it waits at the head of the queue, and later resumes from
its prompt and the tokens it has emitted, recomputed), as vLLM does. With prefix caching, a request shares
the cached pages of the longest prefix of its prompt that an earlier request left (`jspec.engine.pages`) and
prefills only the rest (a page keyed with the tokens after it that a drafter's cache reads there:
`Drafter.prefix_lookahead`); one whose prompt shares more with a request being prefilled waits a step for
those pages (the `n` choices of a prompt prefill it once).
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
import math
import threading
import time
from collections.abc import Hashable

import jax
import numpy as np

from jspec.core import machine
from jspec.core.settings import SamplingConfig
from jspec.decoding import batches, programs
from jspec.decoding.decoder import Decoder
from jspec.decoding.program_cache import ProgramCache
from jspec.engine.pages import KVPages, pages_for
from jspec.engine.requests import Delta, Request, Running
from jspec.engine.text import TextOutput
from jspec.model import cache as kvcache
from jspec.model import sharding
from jspec.planning import memory
from jspec.speculation import logprobs
from jspec.speculation.logprobs import TokenLogprob
from jspec.speculation.stats import RequestStats, Stats
from jspec.text import automaton, constraints

# Rounds per segment (one host visit): few enough host visits that they cost little throughput
# (BENCHMARKS.md, "Streaming"), often enough that text appears every few tens of milliseconds.
SEGMENT_ROUNDS = 16
STREAM_ROUNDS = 1  # the fewest rounds of a young streamed request's segments after its first (BENCHMARKS.md)
MAX_STOP_IDS = 8  # stop token ids a request may add to the target's EOS tokens (a compiled width)


@dataclasses.dataclass
class _Segment:
  """A segment set going on the device, not yet read: what it will report, and the requests its rows held."""
  report: programs.Report
  runs: list[Running | None]
  rounds: int
  dispatched: float  # when it was set going (time.perf_counter)


class Engine:
  """Requests in (`add`, from any thread), deltas out (`step`, from one thread).

  `slots` rows decode together; each holds up to `max_len` tokens (prompt and output; default the
  decoder's context). Off a mesh their caches are `pages` pages of a pool (default: as many as fit
  `memory_fraction` of the device, at most every slot's whole context), with `prefix_caching`, and a step
  prefills at most `max_prefill_tokens` prompt tokens (a longer prompt goes in chunks over several steps,
  between segments; None: whole prompts). A request that cannot fit (a row, or the pool) is refused by
  `add` with a ValueError, before it waits.
  `narrow` runs segments at narrower widths when few rows are busy (one program per width); False keeps
  one width, for batch jobs, whose narrow stretch is only their tail.
  Slots that do not fit `memory_fraction` of the device (`jspec.planning.memory`) are refused with a ValueError.
  """

  def __init__(self, decoder: Decoder, tokenizer, *, slots: int, max_len: int | None = None,
               segment_rounds: int = SEGMENT_ROUNDS, stream_rounds: int = STREAM_ROUNDS, narrow: bool = True,
               memory_fraction: float = 1.0,
               pages: int | None = None, prefix_caching: bool = True, max_prefill_tokens: int | None = None,
               max_logprobs: int = 0):
    for name, rounds in (("segment_rounds", segment_rounds), ("stream_rounds", stream_rounds)):
      if not (isinstance(rounds, int) and rounds >= 1):
        raise ValueError(f"{name} must be an integer >= 1, got {rounds}")
    context = decoder.context_len
    max_len = max_len or context
    if not (isinstance(max_len, int) and 2 <= max_len <= context):
      raise ValueError(f"max_len must be an integer in [2, {context}] (the model's context), got {max_len}")
    self.decoder, self.tokenizer, self.slots, self.max_len = decoder, tokenizer, slots, max_len
    self.segment_rounds, self.stream_rounds = segment_rounds, min(stream_rounds, segment_rounds)
    # A segment runs over the narrowest of these widths that holds every busy row (requests take the
    # lowest free slot, so the busy rows stay low); each is a program to compile. A mesh splits rows, so
    # it runs every row.
    self.widths = (slots,) if decoder.layout is not None or not narrow else \
        tuple(sorted({min(1 << k, slots) for k in range(slots.bit_length() + 1)}))
    # One capacity for the engine's life: blocks enough for max_len tokens, a round's headroom, and the
    # widest padded prompt, not rounded up to a power of two as one-off batches are; refused before
    # anything is allocated when it does not fit the device.
    layout = decoder.layout
    self.prompt_width, self.capacity = memory.shape(decoder, max_len, max_len - 1, serving=True)
    budget = machine.budget(layout and layout.mesh, memory_fraction)
    self.kv_pages: KVPages | None = None
    if layout is None:
      usable = memory.pool_pages(decoder, slots, max_len, pages, memory=budget)
      lookahead = 0 if decoder.drafter is None else decoder.drafter.prefix_lookahead
      self.kv_pages = KVPages(usable, slots, self.capacity // kvcache.PAGE_SIZE, prefix_caching, lookahead)
    elif pages is not None:
      raise ValueError("pages: a paged cache runs on one device (a mesh keeps whole rows)")
    else:
      memory.check(decoder, slots, max_len, max_len - 1, layout.mesh, not layout.draft_replicated, serving=True,
                   memory=budget)
    self.num_preemptions = 0
    if not (isinstance(max_logprobs, int) and 0 <= max_logprobs <= logprobs.MAX_TOP):
      raise ValueError(f"max_logprobs must be an integer in [0, {logprobs.MAX_TOP}], got {max_logprobs}")
    self.max_logprobs = max_logprobs
    if max_prefill_tokens is not None and not (isinstance(max_prefill_tokens, int) and max_prefill_tokens >= 1):
      raise ValueError(f"max_prefill_tokens must be an integer >= 1, got {max_prefill_tokens}")
    self.max_prefill_tokens = max_prefill_tokens if self.kv_pages is not None else None  # chunks go into pages
    # A paged prefill reads its prompt at `prompt_width` and runs a prompt bucket of it from where its pages
    # end (0, a cached prefix, or the chunks so far): its program depends on that bucket alone, so a prefix
    # hit or a chunk uses the programs whole prompts use. Chunks are whole pages where the budget allows.
    buckets = sorted({batches.prompt_bucket(n) for n in range(1, (max_prefill_tokens or 0) + 1)})
    buckets = [w for w in buckets if w <= (max_prefill_tokens or 0)]
    self._chunk_widths = [w for w in buckets if w % kvcache.PAGE_SIZE == 0] or buckets
    self._prefilling: dict[int, list] = {}  # slot -> [its Running, prompt tokens in its pages]
    self._chunk_seconds: dict[int, float] = {}  # slot -> its chunks' time, counted with its prefill
    self._admissions = itertools.count()
    eos = tuple(decoder.target_config.stop_ids)
    self.eos, self.stop_width = eos, len(eos) + MAX_STOP_IDS
    self.decode_seconds = 0.0  # running them
    self.last_prefill_seconds: list[float] = []  # the last step's prefills (one per request started)
    self.last_segment_seconds: float | None = None  # the last step's segment, with reading its tokens
    self.program_cache = ProgramCache(self._key)
    self.stalled = False  # the last step neither ran nor handed out anything
    self._lock = threading.Lock()
    # (id, request, its Running when it waits again after a preemption)
    self._waiting: collections.deque[tuple[Hashable, Request, Running | None]] = collections.deque()
    self._aborted: set[Hashable] = set()
    self._ids = itertools.count()
    self._running: list[Running | None] = [None] * slots
    self._retire_B = np.ones((slots,), bool)  # rows to end at the next segment (idle or aborted)
    self._state = None
    self._plain_first = False  # segments decode plainly until a speculative program is ready (`prepare`)
    self._device_stats = None  # the statistics after the last segment read, on the host
    self._unread: collections.deque[_Segment] = collections.deque()  # set going, oldest first
    self._last_read = 0.0  # when the host last finished waiting for a segment (time.perf_counter)
    # The running batch's constraint automata are (states, classes) tables of this bucket, or absent while
    # no row is constrained; a constrained request that needs a bigger bucket grows it (a new program).
    self._constraint_shape: tuple[int, int] | None = None

  # --- requests in (any thread) ---

  def check(self, req: Request) -> None:
    """Raises a one-line ValueError for a request this engine cannot serve."""
    batches.check_prompts(self.decoder, [req.prompt_ids], req.max_new_tokens, self.max_len)
    if not isinstance(req.sampling, SamplingConfig):
      raise ValueError("sampling must be a SamplingConfig")
    batches.seed_array([req.seed], 1)
    if len(req.stop_ids) > MAX_STOP_IDS:
      raise ValueError(f"at most {MAX_STOP_IDS} stop token ids, got {len(req.stop_ids)}")
    vocab = self.decoder.target_config.vocab_size
    if any(not 0 <= int(t) < vocab for t in req.stop_ids):
      raise ValueError(f"stop token ids must be in [0, {vocab})")
    whole = pages_for(self._written(req, req.max_new_tokens))
    if self.kv_pages is not None and whole > self.kv_pages.pages:
      raise ValueError(f"the request needs {whole} KV pages of {kvcache.PAGE_SIZE} tokens (its prompt, its "
                       f"max_tokens and a round's headroom); the pool holds {self.kv_pages.pages}")
    if not all(isinstance(s, str) for s in req.stop):
      raise ValueError("stop strings must be strings")
    for name in ("logprobs", "prompt_logprobs"):
      value = getattr(req, name)
      if value is not None and not self.max_logprobs:
        raise ValueError(f"{name}: this engine records no log-probabilities (max_logprobs=0)")
      if value is not None and not (isinstance(value, int) and 0 <= value <= self.max_logprobs):
        raise ValueError(f"{name} must be an integer in [0, {self.max_logprobs}] (the engine's max_logprobs), "
                         f"got {value}")
    self._tables(req)

  def _tables(self, req: Request) -> constraints.Tables | None:
    """The request's compiled constraint (cached), or None."""
    if req.constraint is None:
      return None
    config = self.decoder.target_config
    vocabulary = constraints.Vocabulary.of(self.tokenizer, config.stop_ids, config.vocab_size)
    return constraints.compile_rows([req.constraint], vocabulary, 1, req.ignore_eos)[0]

  def add(self, req: Request, request_id: Hashable | None = None) -> Hashable:
    """Queues a request (checked first); returns its id (`request_id`, else a new integer)."""
    self.check(req)
    with self._lock:
      request_id = next(self._ids) if request_id is None else request_id
      self._waiting.append((request_id, req, None))
    return request_id

  def abort(self, request_id: Hashable) -> None:
    """Ends a request, waiting or running; its last delta (finish_reason "abort") comes from the next
    `step`, and its slot is free for the segment after it."""
    with self._lock:
      self._aborted.add(request_id)

  @property
  def num_waiting(self) -> int:
    return len(self._waiting)

  @property
  def num_running(self) -> int:
    """Requests in a slot: decoding, or prefilling in chunks."""
    return sum(r is not None for r in self._running) + len(self._prefilling)

  @property
  def has_work(self) -> bool:
    return bool(self._waiting or self._aborted or self._unread) or self.num_running > 0

  @property
  def num_compiling(self) -> int:
    """Programs compiling in the background now (`compile_in_background`)."""
    return self.program_cache.num_compiling

  @property
  def compile_seconds(self) -> float:
    """Compiling (or loading) programs."""
    return self.program_cache.compile_seconds

  @property
  def decodes_plainly_first(self) -> bool:
    """Whether segments step plainly until a speculative program is ready (`prepare`)."""
    return self._plain_first

  @property
  def running_B(self) -> np.ndarray:
    """Which slots hold a request."""
    return np.asarray([r is not None for r in self._running])

  @property
  def device_stats(self):
    """The loop's statistics (`jspec.speculation.stats.DecodeStats`, on the host) after the last segment, or None."""
    return self._device_stats

  def _prompt_lens(self) -> list[int]:
    """A prompt length per prefill width: a prompt bucket, up to the widest a step prefills."""
    longest = batches.prompt_bucket(min(self.max_len - 1, self.max_prefill_tokens or self.max_len))
    return sorted({min(batches.prompt_bucket(n), self.max_len - 1) for n in range(1, longest + 1)})

  # --- deltas out (one thread) ---

  def step(self) -> list[Delta]:
    """Ends aborted requests, starts waiting ones in free slots, sets the next segment going and, while it
    runs, reads the one before it: returns the deltas since that segment's predecessor was read."""
    with self._lock:
      aborted, self._aborted = self._aborted, set()
      dropped = [i for i, _, _ in self._waiting if i in aborted]
      self._waiting = collections.deque(w for w in self._waiting if w[0] not in aborted)
    deltas = [Delta(i, "", [], True, None, "abort") for i in dropped]
    for b, run in enumerate(self._running):
      if run is not None and run.id in aborted:
        deltas.append(self._finish(b, "", [], "abort"))
    for b, (run, _) in list(self._prefilling.items()):
      if run.id in aborted:
        deltas.append(Delta(run.id, "", [], True, None, "abort"))
        self._vacate(b)
    self.last_prefill_seconds, self.last_segment_seconds = [], None
    ran = self.decode_seconds
    self._admit()
    running = any(r is not None for r in self._running)
    if running:
      self._dispatch()
    deltas += self._read(in_flight=int(running))
    # Nothing ran and nothing came out: what waits, waits for programs that compile in the background.
    self.stalled = not (running or deltas) and self.decode_seconds == ran
    return deltas

  def _rounds(self) -> int:
    """The next segment's rounds: while none waits for a slot and a streamed request is young (has run
    fewer than `segment_rounds` rounds), as many as the youngest has run so far, at least one (its first
    token comes right after its prefill) and after that at least `stream_rounds`: its text arrives after
    1, 2, 4, 8, ... rounds, the first soon and each host visit a smaller share of the time than the one
    before. Else `segment_rounds` (fewer host visits: batch work, a stream's later text, and a saturated
    batch, whose throughput the waiting requests need)."""
    streams = [r.rounds for r in self._running if r is not None and r.request.stream]
    if self._waiting or not streams:
      return self.segment_rounds
    youngest = min(streams)
    return 1 if youngest == 0 else min(self.segment_rounds, max(self.stream_rounds, youngest))

  def _dispatch(self) -> None:
    """Sets the next segment going on the device (asynchronously) for the rows running now."""
    rounds = self._rounds()
    self._grow(rounds)
    busy = max(b for b, r in enumerate(self._running) if r is not None)
    args = self._segment_args(rounds)
    # The narrowest width that holds the busy rows; while its program compiles in the background, the
    # narrowest wider one that is ready.
    fits = [w for w in self.widths if w > busy]
    narrowest = self.program_cache.get("segment", programs.segment, args, False, **self._segment_static(fits[0]))
    ready = [w for w in fits if self.program_cache.has("segment", args, self._segment_static(w))]
    static = self._segment_static(fits[0] if narrowest is not None or not ready else ready[0])
    plain = self._segment_static(self.slots, plain=True)
    if narrowest is None and not ready and self.program_cache.has("segment", args, plain):
      static = plain  # speculation's programs compile: step plainly with the program `prepare` compiled
    self._state, report = self._call("segment", programs.segment, *args, **static)
    self._retire_B[:] = False
    for run in self._running:
      if run is not None:
        run.rounds += rounds
        run.unread_rounds += rounds
    self._unread.append(_Segment(report, list(self._running), rounds, time.perf_counter()))

  def _read(self, in_flight: int = 0) -> list[Delta]:
    """Waits for the segments set going, all but the last `in_flight`, and turns their new tokens into
    deltas for the rows that still hold the requests they ran (a request aborted, preempted or stopped by a
    stop string since has had its last delta)."""
    deltas = []
    while len(self._unread) > in_flight:
      deltas += self._read_one(self._unread.popleft())
    return deltas

  def _read_one(self, segment: _Segment) -> list[Delta]:
    deltas = []
    report = segment.report
    tokens, seq_lens, done, stats = programs.fetch((report.tokens_BxT, report.seq_lens_B, report.done_B,
                                                    report.stats))
    asked = any(run is not None and run.request.logprobs is not None for run in segment.runs)
    scores = programs.fetch(report.logprobs) if asked else None
    now = time.perf_counter()
    # The device ran it from its dispatch or from the end of the segment before, whichever was later.
    self.last_segment_seconds = now - max(segment.dispatched, self._last_read)
    self._last_read = now
    self.decode_seconds += self.last_segment_seconds
    self._device_stats = stats
    for b, run in enumerate(segment.runs):
      if run is None or self._running[b] is not run:
        continue
      start = len(run.request.prompt_ids) + run.sent
      new_ids = tokens[b, start:seq_lens[b]].tolist()
      run.emitted.extend(new_ids)
      run.unread_rounds -= segment.rounds
      text, stopped = run.text.push(new_ids, final=bool(done[b]))
      top = run.request.logprobs
      scored = None if top is None else logprobs.read(scores, b, 0, new_ids, top)  # from `start`
      if stopped or done[b]:
        reason = "stop" if stopped or (new_ids and new_ids[-1] in run.stop_ids) else "length"
        deltas.append(self._finish(b, text, new_ids, reason, scored))
      elif new_ids:
        deltas.append(Delta(run.id, text, new_ids, logprobs=scored, prompt_logprobs=run.take_prompt_logprobs()))
    return deltas

  def _segment_static(self, width: int, plain: bool = False) -> dict:
    """The segment program's static arguments: its width, the most tokens a row commits in a longest
    segment (whose log-probabilities it hands back), and `plain` when it only takes plain steps."""
    static = {"width": width, "window": self.segment_rounds * (self.decoder.draft_len + 1)}
    return {**static, "plain": True} if plain else static

  def _segment_args(self, rounds: int) -> tuple:
    return (self.decoder, self._state, np.int32(rounds), np.asarray(bool(self._waiting)), self._retire_B.copy())

  def _finish(self, b: int, text: str, new_ids: list[int], reason: str,
              scored: list[TokenLogprob] | None = None) -> Delta:
    run = self._running[b]
    stats = None if self._device_stats is None else RequestStats.of_row(self._device_stats, b, run.sent)
    self._vacate(b)
    return Delta(run.id, text, new_ids, True, stats, reason, scored, run.take_prompt_logprobs())

  def _vacate(self, b: int) -> None:
    """Ends slot b's row at the next segment and lets go of its pages, caching the full ones its text fills
    (with prefix caching)."""
    run = self._running[b]
    self._running[b] = None
    self._retire_B[b] = True
    if self.kv_pages is None:
      return
    if b in self._prefilling:  # its prompt not yet all in its pages: none is cached
      del self._prefilling[b]
      self._chunk_seconds.pop(b, None)
      self.kv_pages.free(b)
      return
    self.kv_pages.free(b, [*run.request.prompt_ids, *run.emitted], self.decoder.headroom + 1)

  def _written(self, req: Request, emitted: int = 0, rounds: int | None = None) -> int:
    """Slots a request's row may write into in `rounds` more rounds (default: a longest segment's), having
    emitted `emitted` tokens: each round commits at most K + 1 tokens and writes up to a round's headroom
    past them."""
    rounds = self.segment_rounds if rounds is None else rounds
    headroom = self.decoder.headroom + 1
    return min(len(req.prompt_ids) + emitted + rounds * (self.decoder.draft_len + 1) + headroom,
               len(req.prompt_ids) + req.max_new_tokens + headroom, self.capacity)

  def _grow(self, rounds: int) -> None:
    """Gives every running row the pages it may write into by the end of a next segment of `rounds` (and of
    the segments set going whose tokens are unread), oldest first, preempting the youngest when the pool
    runs out; then the device reads the new page table."""
    if self.kv_pages is None:
      return
    holders = lambda: {**{b: r for b, r in enumerate(self._running) if r is not None},
                       **{b: run for b, (run, _) in self._prefilling.items()}}
    for _, b in sorted((r.admitted, b) for b, r in enumerate(self._running) if r is not None):
      run = self._running[b]
      while run is not None and not self.kv_pages.grow(b, self._written(run.request, run.sent,
                                                                        run.unread_rounds + rounds)):
        self._preempt(max((r.admitted, v) for v, r in holders().items())[1])
        run = self._running[b]
    table = self.kv_pages.changed_table(unready=list(self._prefilling))
    if table is not None:
      self._state = kvcache.with_page_table(self._state, table)

  def _preempt(self, b: int) -> None:
    """Frees slot b's pages; its request waits at the head of the queue to resume from its output so far."""
    run = self._running[b] if self._running[b] is not None else self._prefilling[b][0]
    self._vacate(b)
    self.num_preemptions += 1
    resumed = run.resumed()
    with self._lock:
      self._waiting.appendleft((run.id, resumed.request, resumed))

  def _admit(self) -> None:
    """Prefills waiting requests into free slots, first come first served."""
    self._fit_constraints()
    if self._state is None and self._waiting:
      self._start()
    budget = self.max_prefill_tokens or math.inf
    pending = sum(len(run.request.prompt_ids) - done for run, done in self._prefilling.values())
    for b in range(self.slots):
      if self._running[b] is not None or b in self._prefilling or not self._waiting:
        continue
      if pending >= budget:
        break  # this step's prefill is spent
      with self._lock:
        request_id, req, run = self._waiting[0]
      prefilling = [run.request.prompt_ids for run, _ in self._prefilling.values()]
      if self.kv_pages is not None and self.kv_pages.shares_more(req.prompt_ids, prefilling):
        break  # it waits for pages that a prefill under way will cache, rather than prefill them again
      cached = self._place(b, req)
      if cached is None:
        break  # first come, first served: the head of the queue waits for pages
      with self._lock:
        self._waiting.popleft()
      if run is None:
        stops = frozenset(() if req.ignore_eos else self.eos) | {int(t) for t in req.stop_ids}
        run = Running(request_id, req, TextOutput(self.tokenizer, req.stop), stops, next(self._admissions),
                       self._tables(req))
      run.cached = cached
      self._prefilling[b] = [run, cached]
      pending += len(req.prompt_ids) - cached
    self._prefill(budget)

  def _prefill(self, budget: float) -> None:
    """Prefills up to `budget` prompt tokens of the admitted requests, oldest first: a prompt whose rest fits
    starts decoding (`insert`); else a chunk of whole pages goes into its pages (`prefill_pages`), its
    last two tokens kept for the insert (a head drafter reads the feature before the last)."""
    for b in sorted(self._prefilling, key=lambda b: self._prefilling[b][0].admitted):
      run, done = self._prefilling[b]
      prompt = run.request.prompt_ids
      rest = len(prompt) - done
      if rest <= budget:
        self._fit_constraints(run.tables)
        args = self._insert_args(b, run.request, run.tables, done)
        if self.program_cache.get("insert", programs.insert, args, wait=False) is None:
          # Its program compiles in the background: meanwhile it waits, or a prefix hit prefills whole.
          if not (done and len(prompt) <= budget and self._unshare(b, run.request)):
            continue
          rest = len(prompt)
          args = self._insert_args(b, run.request, run.tables, 0)
          if self.program_cache.get("insert", programs.insert, args, wait=False) is None:
            continue
        del self._prefilling[b]
        self._insert(b, run, args)
        budget -= rest
        continue
      chunk = self._chunk(budget, rest)
      args = (self.decoder, self._state, self._requests([run.request], [run.tables], b, done, int(chunk)))
      if chunk > 0 and self.program_cache.get("chunk", programs.prefill_pages, args, wait=False) is not None:
        before = self.decode_seconds
        self._state = self._call("chunk", programs.prefill_pages, *args)
        self._chunk_seconds[b] = self._chunk_seconds.get(b, 0.0) + self.decode_seconds - before
        self._prefilling[b][1] += int(chunk)
      return

  def _chunk(self, budget: float, rest: int) -> int:
    """The width of a prompt's next chunk, its rest `rest` tokens: the widest chunk width within `budget` that
    leaves the last two tokens for the insert; failing that, all of that with a whole step's budget (a program of
    its own), else none this step."""
    limit = int(min(budget, rest - 2))
    fits = [w for w in self._chunk_widths if w <= limit]
    return fits[-1] if fits else limit if budget == self.max_prefill_tokens else 0

  def _unshare(self, b: int, req: Request) -> bool:
    """Gives slot b fresh pages for `req` in place of the cached prefix's pages it shares (whose prefill
    program is not ready yet), if the pool has them besides those: True if it did."""
    if not self.kv_pages.unshare(b, self._written(req)):
      return False
    self._prefilling[b][1] = self._prefilling[b][0].cached = 0
    return True

  def _insert_args(self, b: int, req: Request, tables: constraints.Tables | None, cached: int) -> tuple:
    """The insert program's arguments that start `req` in slot b, the first `cached` tokens of its prompt in
    its pages."""
    width = None if self.kv_pages is None else batches.prompt_bucket(len(req.prompt_ids) - cached)
    return self.decoder, self._state, self._requests([req], [tables], b, cached, width), np.int32(b)

  def _insert(self, b: int, run: Running, args: tuple) -> None:
    """Starts `run`'s request decoding in slot b (`_insert_args`)."""
    req = run.request
    self._state = self._call("insert", programs.insert, *args)
    if req.prompt_logprobs is not None:
      width = min(batches.prompt_bucket(len(req.prompt_ids)), self.prompt_width)
      scores = self._call("score", logprobs.score, self.decoder.target_params,
                          logprobs.padded(req.prompt_ids, width), config=self.decoder.target_config)
      run.prompt_logprobs = logprobs.prompt_entries(req.prompt_ids, programs.fetch(scores), req.prompt_logprobs)
    self.last_prefill_seconds[-1] += self._chunk_seconds.pop(b, 0.0)
    self._running[b] = run
    self._retire_B[b] = False
    if self.kv_pages is not None:
      self.kv_pages.started(b, req.prompt_ids, run.cached)

  def _place(self, b: int, req: Request) -> int | None:
    """Gives slot b the pages `req` starts with (`KVPages.allocate`); unpaged: 0."""
    return 0 if self.kv_pages is None else self.kv_pages.allocate(b, req.prompt_ids, self._written(req))

  def _fit_constraints(self, tables: constraints.Tables | None = None) -> None:
    """Sizes the running batch's automata for a request about to start with `tables`: grown to a bucket
    that holds them, or, with none and no constrained row running, dropped (the unconstrained program)."""
    shape = self._constraint_shape
    if tables is None and not any(r is not None and r.request.constraint is not None for r in self._running):
      shape = None
    elif tables is not None:
      shape = tuple(max(a, b) for a, b in zip(shape or (0, 0), automaton.bucket([tables])))
    if shape != self._constraint_shape and self._state is not None:
      self._state = self._state.replace(constraint=None if shape is None else automaton.pad(
          self._state.constraint, shape, self.slots, self.decoder.target_config.vocab_size))
    self._constraint_shape = shape

  def _requests(self, reqs: list[Request], tables: list[constraints.Tables | None] | None = None,
                slot: int | None = None, cached: int = 0, width: int | None = None) -> batches.Batch:
    """The batch of `reqs` (with `tables`, default none) for the rows from `slot` (default: idle rows); with
    `width`, one request's prefill runs `width` tokens from `cached` (those before are in its pages)."""
    stop_ids = [list(() if r.ignore_eos else self.eos) + [int(t) for t in r.stop_ids] for r in reqs]
    tables = tables or [None] * len(reqs)
    requests = batches.make_batch(
        self.decoder, [r.prompt_ids for r in reqs], max(r.max_new_tokens for r in reqs),
        sampling=[r.sampling for r in reqs], seed=[r.seed for r in reqs], stop_ids=stop_ids,
        capacity_slots=self.capacity, stop_width=self.stop_width, speculate=[r.speculate for r in reqs],
        share=[r.suffix_cache for r in reqs], constraints=tables if any(t is not None for t in tables) else None,
        constraint_shape=self._constraint_shape, width=self.prompt_width if width is not None else None,
        logprobs=[r.logprobs is not None for r in reqs] if self.max_logprobs else None,
        top_logprobs=self.max_logprobs)
    requests = requests.replace(max_new_tokens_B=np.asarray([r.max_new_tokens for r in reqs], np.int32))
    if self.kv_pages is not None:
      requests = requests.replace(page_table_BxR=self.kv_pages.rows(slot, len(reqs)), pages=self.kv_pages.pages + 1)
    if width is not None:
      requests = requests.replace(cached_B=np.full((1,), cached, np.int32), prefill_width=width)
    layout = self.decoder.layout
    return requests if layout is None else sharding.place(requests, layout.mesh)

  def _key(self, name: str, args: tuple, static: dict) -> tuple:
    """What tells its executables apart beyond the engine's fixed shapes: a prefill's prompt shape and width,
    a prompt score's width, the automata's bucket, the static arguments."""
    if name in ("insert", "chunk"):
      shape = (args[2].prompts_BxP.shape, args[2].prefill_width)
    else:
      shape = args[1].shape if name == "score" else None
    return name, shape, self._constraint_shape, tuple(static.items())

  def compile_in_background(self, ahead: bool = True) -> list[concurrent.futures.Future]:
    """From now on a program the engine has not compiled compiles on a thread of its own, and the requests
    that need it wait while the others run: a segment runs at a wider width whose program is ready, and a
    request whose prefill program is not waits in its slot. Starts with every
    segment width and a prefill per prompt bucket (returned: their futures), unless not `ahead`. `prepare`
    first, which compiles what any request needs."""
    self.program_cache.compile_in_background()
    if not ahead:
      return []
    for n in self._prompt_lens():
      warm = Request([0] * n, 1)
      if self.kv_pages is None or pages_for(self._written(warm, 1)) <= self.kv_pages.pages:
        self.program_cache.get("insert", programs.insert, self._insert_args(0, warm, None, 0), False)
    for width in self._chunk_widths:
      if width + 2 < self.max_len:
        args = (self.decoder, self._state, self._requests([Request([0] * (width + 2), 1)], None, 0, 0, width))
        self.program_cache.get("chunk", programs.prefill_pages, args, False)
    for width in self.widths:  # after the prefills, which every new request waits for
      self.program_cache.get("segment", programs.segment, self._segment_args(self.segment_rounds), False,
                       **self._segment_static(width))
    return self.program_cache.futures

  def stop_compiling(self) -> None:
    """Cancels the background compiles not yet started (`ProgramCache.stop`)."""
    self.program_cache.stop()

  def prepare(self, plain_first: bool = False) -> int:
    """Compiles (or loads) what every request needs: the idle rows' prefill and a segment over every row.
    With `plain_first`, where the adaptive policy's plain steps keep the drafter's state (an adaptive chain
    of a drafter that does not lag them), that segment only takes plain steps: a program a fraction of the
    speculative one's size, so the engine serves sooner, and until a speculative segment that holds the busy
    rows is ready (compiled in the background: `compile_in_background`), segments step plainly, the same
    tokens' law as speculation. Returns the programs it compiled or loaded."""
    before = len(self.program_cache)
    if self._state is None:
      self._start()
    decoder = self.decoder
    self._plain_first = plain_first and decoder.adaptive is not None and decoder.spec.tree is None and \
        decoder.drafter is not None and not decoder.drafter.lags_plain_steps
    self.program_cache.get("segment", programs.segment, self._segment_args(self.segment_rounds),
                     **self._segment_static(self.slots, plain=self._plain_first))
    return len(self.program_cache) - before

  def _start(self) -> None:
    """The state of idle rows (ended by the first segment)."""
    self._state = self._call("prefill", programs.start, self.decoder, self._requests([Request([0], 1)] * self.slots))

  def _call(self, name: str, jitted, *args, **static):
    """Runs `jitted` (its executable from `programs`)."""
    executable = self.program_cache.get(name, jitted, args, **static)
    if self.decoder.layout is not None:  # a segment may return the state sharded otherwise than an insert takes it
      args = _resharded(args, executable.input_shardings[0])
    begin = time.perf_counter()
    out = executable(*args)
    if name != "segment":
      jax.block_until_ready(out)
      self.decode_seconds += time.perf_counter() - begin
      if name == "insert":
        self.last_prefill_seconds.append(time.perf_counter() - begin)
    return out

  @property
  def stats(self) -> Stats | None:
    """The totals since the engine started (None before its first segment)."""
    if self._device_stats is None:
      return None
    spec = self.decoder.spec if self.decoder.drafter is not None else None
    return Stats.from_device(self._device_stats, self.decode_seconds, self.compile_seconds, spec)


def _resharded(args: tuple, shardings: tuple) -> tuple:
  """`args` placed as an executable takes them (`input_shardings`, None for an argument it does not read):
  only the arrays placed otherwise move, and host values become global arrays, on every process."""
  leaves, treedef = jax.tree.flatten(args)
  wanted = treedef.flatten_up_to(shardings)
  return jax.tree.unflatten(treedef, [x if s is None or getattr(x, "sharding", None) == s else jax.device_put(x, s)
                                      for x, s in zip(leaves, wanted)])
