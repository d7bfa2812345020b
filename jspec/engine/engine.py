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

Off a mesh the caches are paged (`jspec.engine.pages`: admission, growth before each segment, preemption and
prefix caching), and long prompts may prefill in chunks between segments (`jspec.engine.prefills`).
"""
from __future__ import annotations

import collections
import concurrent.futures
import itertools
import math
import threading
import time
from collections.abc import Hashable

import jax
import numpy as np

from jspec.core import machine
from jspec.decoding import batches, programs
from jspec.decoding.decoder import Decoder
from jspec.decoding.program_cache import ProgramCache
from jspec.engine import segments
from jspec.engine.batcher import Batcher
from jspec.engine.pages import KVPages, pages_for
from jspec.engine.prefills import Prefills
from jspec.engine.requests import Delta, Request, Running
from jspec.engine.segments import SEGMENT_ROUNDS, STREAM_ROUNDS
from jspec.engine.text import TextOutput
from jspec.model import cache as kvcache
from jspec.model import sharding
from jspec.planning import memory
from jspec.speculation import logprobs
from jspec.speculation.stats import Stats
from jspec.text import constraints


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
    self.widths = segments.widths(slots, narrow and decoder.layout is None)
    # One capacity for the engine's life: blocks enough for max_len tokens, a round's headroom, and the
    # widest padded prompt, not rounded up to a power of two as one-off batches are; refused before
    # anything is allocated when it does not fit the device.
    layout = decoder.layout
    self.prompt_width, self.capacity = memory.shape(decoder, max_len, max_len - 1, serving=True)
    budget = machine.budget(layout and layout.mesh, memory_fraction)
    self.kv_pages: KVPages | None = None
    mesh = layout and layout.mesh
    # On a mesh the pools lie as the rows do (`jspec.model.sharding.pool_spec`): kv heads over "model", and
    # pages over "data" where it splits the slots, each data shard's slots holding its own pages.
    usable = memory.pool_pages(decoder, slots, max_len, pages, mesh, not (layout and layout.draft_replicated),
                               memory=budget)
    lookahead = 0 if decoder.drafter is None else decoder.drafter.prefix_lookahead
    self.kv_pages = KVPages(usable, slots, self.capacity // kvcache.PAGE_SIZE, prefix_caching, lookahead,
                            memory.page_shards(mesh, slots))
    self.num_preemptions = 0
    self.batcher = Batcher(decoder, tokenizer, max_len, self.prompt_width, self.capacity, max_logprobs, self.kv_pages)
    self._prefilling = Prefills(max_prefill_tokens, paged=self.kv_pages is not None)
    self._admissions = itertools.count()
    self.decode_seconds = 0.0  # running programs
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
    self._unread: collections.deque[segments.Segment] = collections.deque()  # set going, oldest first
    self._last_read = 0.0  # when the host last finished waiting for a segment (time.perf_counter)

  # --- requests in (any thread) ---

  def check(self, req: Request) -> None:
    """Raises a one-line ValueError for a request this engine cannot serve."""
    self.batcher.check(req)
    whole = pages_for(self._written(req, req.max_new_tokens))
    if self.kv_pages is not None and whole > self.kv_pages.shard_pages:
      raise ValueError(f"the request needs {whole} KV pages of {kvcache.PAGE_SIZE} tokens (its prompt, its "
                       f"max_tokens and a round's headroom); the pool holds {self.kv_pages.shard_pages}"
                       + " per data shard" * (self.kv_pages.shard_pages < self.kv_pages.pages))

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
        deltas.append(run.finish(b, "", [], "abort", None, self._device_stats))
        self._vacate(b)
    for b, run in self._prefilling.runs().items():
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

  def _dispatch(self) -> None:
    """Sets the next segment going on the device (asynchronously) for the rows running now."""
    rounds = segments.rounds(self._running, bool(self._waiting), self.segment_rounds, self.stream_rounds)
    self._grow(rounds)
    busy = max(b for b, r in enumerate(self._running) if r is not None)
    args = self._segment_args(rounds)
    # The narrowest width that holds the busy rows; while its program compiles in the background, the
    # narrowest wider one that is ready.
    fits = [w for w in self.widths if w > busy]
    narrowest = self.program_cache.get("segment", programs.segment, args, False, **self._static(fits[0]))
    ready = [w for w in fits if self.program_cache.has("segment", args, self._static(w))]
    static = self._static(fits[0] if narrowest is not None or not ready else ready[0])
    plain = self._static(self.slots, plain=True)
    if narrowest is None and not ready and self.program_cache.has("segment", args, plain):
      static = plain  # speculation's programs compile: step plainly with the program `prepare` compiled
    self._state, report = self._call("segment", programs.segment, *args, **static)
    self._retire_B[:] = False
    for run in self._running:
      if run is not None:
        run.rounds += rounds
        run.unread_rounds += rounds
    self._unread.append(segments.Segment(report, list(self._running), rounds, time.perf_counter()))

  def _read(self, in_flight: int = 0) -> list[Delta]:
    """Waits for the segments set going, all but the last `in_flight`, and turns their new tokens into
    deltas for the rows that still hold the requests they ran (a request aborted, preempted or stopped by a
    stop string since has had its last delta)."""
    deltas = []
    while len(self._unread) > in_flight:
      deltas += self._read_one(self._unread.popleft())
    return deltas

  def _read_one(self, segment: segments.Segment) -> list[Delta]:
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
      new_ids = tokens[b, len(run.request.prompt_ids) + run.sent:seq_lens[b]].tolist()
      run.unread_rounds -= segment.rounds
      delta = run.advance(b, new_ids, bool(done[b]), scores, stats)
      if delta is not None:
        deltas.append(delta)
      if delta is not None and delta.finished:
        self._vacate(b)
    return deltas

  def _static(self, width: int, plain: bool = False) -> dict:
    return segments.static(width, self.segment_rounds * (self.decoder.draft_len + 1), plain)

  def _segment_args(self, rounds: int) -> tuple:
    return (self.decoder, self._state, np.int32(rounds), np.asarray(bool(self._waiting)), self._retire_B.copy())

  def _vacate(self, b: int) -> None:
    """Ends slot b's row at the next segment and lets go of its pages, caching the full ones its text fills
    (with prefix caching)."""
    run = self._running[b]
    self._running[b] = None
    self._retire_B[b] = True
    if self.kv_pages is None:
      return
    if b in self._prefilling:  # its prompt not yet all in its pages: none is cached
      self._prefilling.end(b)
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
    runs out (of the same data shard's pages); then the device reads the new page table."""
    if self.kv_pages is None:
      return
    shard = self.kv_pages.shard
    holders = lambda b: {v: r for v, r in {**{v: r for v, r in enumerate(self._running) if r is not None},
                                           **self._prefilling.runs()}.items() if shard(v) == shard(b)}
    for _, b in sorted((r.admitted, b) for b, r in enumerate(self._running) if r is not None):
      run = self._running[b]
      while run is not None and not self.kv_pages.grow(b, self._written(run.request, run.sent,
                                                                        run.unread_rounds + rounds)):
        self._preempt(max((r.admitted, v) for v, r in holders(b).items())[1])
        run = self._running[b]
    table = self.kv_pages.changed_table(unready=list(self._prefilling))
    if table is not None:
      self._state = kvcache.with_page_table(self._state, table)

  def _preempt(self, b: int) -> None:
    """Frees slot b's pages; its request waits at the head of the queue to resume from its output so far."""
    run = self._running[b] if self._running[b] is not None else self._prefilling.run(b)
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
    budget = self._prefilling.max_tokens or math.inf
    pending = self._prefilling.pending()
    for b in range(self.slots):
      if self._running[b] is not None or b in self._prefilling or not self._waiting:
        continue
      if pending >= budget:
        break  # this step's prefill is spent
      with self._lock:
        request_id, req, run = self._waiting[0]
      prefilling = [run.request.prompt_ids for run in self._prefilling.runs().values()]
      if self.kv_pages is not None and self.kv_pages.shares_more(req.prompt_ids, prefilling):
        break  # it waits for pages that a prefill under way will cache, rather than prefill them again
      cached = self._place(b, req)
      if cached is None:
        break  # first come, first served: the head of the queue waits for pages
      with self._lock:
        self._waiting.popleft()
      if run is None:
        stops = frozenset(self.batcher.stop_ids(req))
        run = Running(request_id, req, TextOutput(self.tokenizer, req.stop), stops, next(self._admissions),
                       self.batcher.tables(req))
      self._prefilling.start(b, run, cached)
      pending += len(req.prompt_ids) - cached
    self._prefill(budget)

  def _prefill(self, budget: float) -> None:
    """Prefills up to `budget` prompt tokens of the admitted requests, oldest first: a prompt whose rest fits
    starts decoding (`insert`); else a chunk of whole pages goes into its pages (`prefill_pages`), its
    last two tokens kept for the insert (a head drafter reads the feature before the last)."""
    for b in self._prefilling.oldest_first():
      run, done = self._prefilling.run(b), self._prefilling.done(b)
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
        self._insert(b, run, args)
        budget -= rest
        continue
      chunk = self._prefilling.chunk(budget, rest)
      args = (self.decoder, self._state, self.batcher.batch([run.request], [run.tables], b, done, int(chunk)))
      if chunk > 0 and self.program_cache.get("chunk", programs.prefill_pages, args, wait=False) is not None:
        before = self.decode_seconds
        self._state = self._call("chunk", programs.prefill_pages, *args)
        self._prefilling.advanced(b, int(chunk), self.decode_seconds - before)
      return

  def _unshare(self, b: int, req: Request) -> bool:
    """Gives slot b fresh pages for `req` in place of the cached prefix's pages it shares (whose prefill
    program is not ready yet), if the pool has them besides those: True if it did."""
    if not self.kv_pages.unshare(b, self._written(req)):
      return False
    self._prefilling.restart(b)
    return True

  def _insert_args(self, b: int, req: Request, tables: constraints.Tables | None, cached: int) -> tuple:
    """The insert program's arguments that start `req` in slot b, the first `cached` tokens of its prompt in
    its pages."""
    width = None if self.kv_pages is None else batches.prompt_bucket(len(req.prompt_ids) - cached)
    return self.decoder, self._state, self.batcher.batch([req], [tables], b, cached, width), np.int32(b)

  def _insert(self, b: int, run: Running, args: tuple) -> None:
    """Starts `run`'s request decoding in slot b (`_insert_args`)."""
    req = run.request
    self._state = self._call("insert", programs.insert, *args)
    if req.prompt_logprobs is not None:
      width = min(batches.prompt_bucket(len(req.prompt_ids)), self.prompt_width)
      scores = self._call("score", logprobs.score, self.decoder.target_params,
                          logprobs.padded(req.prompt_ids, width), config=self.decoder.target_config)
      run.prompt_logprobs = logprobs.prompt_entries(req.prompt_ids, programs.fetch(scores), req.prompt_logprobs)
    self.last_prefill_seconds[-1] += self._prefilling.end(b)
    self._running[b] = run
    self._retire_B[b] = False
    if self.kv_pages is not None:
      self.kv_pages.started(b, req.prompt_ids, run.cached)

  def _place(self, b: int, req: Request) -> int | None:
    """Gives slot b the pages `req` starts with (`KVPages.allocate`); unpaged: 0."""
    return 0 if self.kv_pages is None else self.kv_pages.allocate(b, req.prompt_ids, self._written(req))

  def _fit_constraints(self, tables: constraints.Tables | None = None) -> None:
    """Sizes the running batch's automata for a request about to start with `tables` (`Batcher.fit_constraints`)."""
    constrained = any(r is not None and r.request.constraint is not None for r in self._running)
    self._state = self.batcher.fit_constraints(self._state, tables, constrained)

  def _key(self, name: str, args: tuple, static: dict) -> tuple:
    """What tells its executables apart beyond the engine's fixed shapes: a prefill's prompt shape and width,
    a prompt score's width, the automata's bucket, the static arguments."""
    if name in ("insert", "chunk"):
      shape = (args[2].prompts_BxP.shape, args[2].prefill_width)
    else:
      shape = args[1].shape if name == "score" else None
    return name, shape, self.batcher.constraint_shape, tuple(static.items())

  def compile_in_background(self, ahead: bool = True) -> list[concurrent.futures.Future]:
    """From now on a program the engine has not compiled compiles on a thread of its own, and the requests
    that need it wait while the others run: a segment runs at a wider width whose program is ready, and a
    request whose prefill program is not waits in its slot. Starts with every
    segment width and a prefill per prompt bucket (returned: their futures), unless not `ahead`. `prepare`
    first, which compiles what any request needs."""
    self.program_cache.compile_in_background()
    if not ahead:
      return []
    for n in self._prefilling.prompt_lens(self.max_len):
      warm = Request([0] * n, 1)
      if self.kv_pages is None or pages_for(self._written(warm, 1)) <= self.kv_pages.shard_pages:
        self.program_cache.get("insert", programs.insert, self._insert_args(0, warm, None, 0), False)
    for width in self._prefilling.chunk_widths:
      if width + 2 < self.max_len:
        args = (self.decoder, self._state, self.batcher.batch([Request([0] * (width + 2), 1)], None, 0, 0, width))
        self.program_cache.get("chunk", programs.prefill_pages, args, False)
    for width in self.widths:  # after the prefills, which every new request waits for
      self.program_cache.get("segment", programs.segment, self._segment_args(self.segment_rounds), False,
                       **self._static(width))
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
                     **self._static(self.slots, plain=self._plain_first))
    return len(self.program_cache) - before

  def _start(self) -> None:
    """The state of idle rows (ended by the first segment)."""
    idle = self.batcher.batch([Request([0], 1)] * self.slots)
    self._state = self._call("prefill", programs.start, self.decoder, idle)

  def _call(self, name: str, jitted, *args, **static):
    """Runs `jitted` (its executable from `programs`)."""
    executable = self.program_cache.get(name, jitted, args, **static)
    if self.decoder.layout is not None:  # a segment may return the state sharded otherwise than an insert takes it
      args = sharding.resharded(args, executable.input_shardings[0])
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
