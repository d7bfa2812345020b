"""The engine on its own thread, and the bridge to the asyncio side of the server.

HTTP handlers `submit` requests (and `abort` them) and read their deltas from an asyncio queue; the engine
thread hands what they submitted to the engine before each step (and, serving from several processes, to
every process: `jspec.serve.hosts`), steps the engine whenever it has work and hands each delta to its
request's queue (`call_soon_threadsafe`), so no response waits on another's and the event loop never waits
on the device.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Sequence

from jspec.engine.engine import Engine
from jspec.engine.requests import Delta, Request
from jspec.serve.hosts import Commands, Leader
from jspec.serve.metrics import Metrics
from jspec.serve.protocol import APIError

log = logging.getLogger("jspec")
IDLE_WAIT = 0.1  # seconds the idle engine thread sleeps between looks at its queue (a submit wakes it)


@dataclasses.dataclass
class _Route:
  """Where a request's deltas go, and its timings."""
  loop: asyncio.AbstractEventLoop
  queue: asyncio.Queue
  index: int  # its choice in the response
  arrival: float
  first_token: float | None = None
  tokens: int = 0


class EngineLoop:
  """Steps `engine` on a thread while it has work; `max_queue` requests may wait for a slot. With `leader`,
  process 0 of several: each step's commands go to every process first, and when a follower asks to stop,
  `stop_server` is called."""

  def __init__(self, engine: Engine, metrics: Metrics, max_queue: int, leader: Leader | None = None,
               stop_server=None):
    self.engine, self.metrics, self.max_queue = engine, metrics, max_queue
    self.leader, self._stop_server = leader, stop_server
    self._routes: dict[int, _Route] = {}
    self._ids = itertools.count()
    self._inbox = Commands()  # what the next step adds and aborts (under `_inbox_lock`)
    self._inbox_lock = threading.Lock()
    self._wake = threading.Event()
    self._closing = self._stopped = False
    self.error: str | None = None  # set if a step failed: the engine's state can no longer be trusted
    self._thread = threading.Thread(target=self._run, name="jspec-engine", daemon=True)

  def start(self) -> None:
    self._thread.start()

  def submit(self, requests: Sequence[Request]) -> tuple[list[int], asyncio.Queue]:
    """Queues the requests of one response (on the event loop's thread). Returns their ids and the queue
    their `(choice index, Delta)`s arrive on. A ValueError for a request the engine cannot serve; APIError
    503 when the queue is full or the server is stopping."""
    if self._closing or self.error is not None:
      raise APIError(503, "the server is shutting down" if self._closing else f"the engine failed: {self.error}")
    if self.engine.num_waiting + len(self._inbox.add) + len(requests) > self.max_queue:
      raise APIError(503, f"too many requests waiting (--max-queue {self.max_queue}); retry later",
                     headers={"Retry-After": "1"})
    for r in requests:
      self.engine.check(r)
    loop, queue = asyncio.get_running_loop(), asyncio.Queue()
    ids = []
    for index, r in enumerate(requests):
      request_id = next(self._ids)
      self._routes[request_id] = _Route(loop, queue, index, time.perf_counter())
      with self._inbox_lock:
        self._inbox.add.append((request_id, r))
      ids.append(request_id)
      self.metrics.prompt_tokens.inc(len(r.prompt_ids))
    self.metrics.waiting.set(self.engine.num_waiting + len(self._inbox.add))
    self._wake.set()
    return ids, queue

  def abort(self, ids: Sequence[int]) -> None:
    """Ends these requests (a client left): their slots are free by the next segment."""
    with self._inbox_lock:
      self._inbox.abort += [i for i in ids if i in self._routes]
    self._wake.set()

  def shutdown(self, timeout: float) -> None:
    """Stops taking requests, aborts those left, waits up to `timeout` seconds for the thread, and cancels
    the background compiles not yet started."""
    self._closing = True
    self.abort(list(self._routes))
    self._stopped = True
    self._wake.set()
    self._thread.join(timeout)
    self.engine.stop_compiling()

  def _run(self) -> None:
    engine = self.engine
    while True:
      with self._inbox_lock:
        commands, self._inbox = self._inbox, Commands()
      commands.stop = self._stopped and not (commands.add or commands.abort or engine.has_work)
      if commands.stop or commands.add or commands.abort or engine.has_work:
        if self.leader is not None:
          self.leader.publish(commands)
        if commands.stop:
          return
        commands.apply(engine)  # each message but the last is one step
      if self.leader is not None and not self._closing and self.leader.stop_asked():
        log.info("a follower process asked the server to stop")
        self._closing = True
        self._stop_server()
      if not engine.has_work:
        self._wake.wait(IDLE_WAIT)
        self._wake.clear()
        continue
      try:
        self._step()
      except Exception as e:  # the device (or the host's side) failed: end every request with the error
        log.exception("the engine failed")
        self.error = f"{type(e).__name__}: {e}"
        for route in self._routes.values():
          route.loop.call_soon_threadsafe(route.queue.put_nowait, (route.index, APIError(500, self.error)))
        self._routes.clear()
        if self.leader is not None:  # the followers' engines can no longer be trusted either
          self.leader.publish(Commands(stop=True))
        return

  def _step(self) -> None:
    engine = self.engine
    deltas = engine.step()
    if engine.stalled:  # its requests wait for programs that compile in the background
      self._wake.wait(IDLE_WAIT)
      self._wake.clear()
    for delta in deltas:
      self._deliver(delta)
    for seconds in engine.last_prefill_seconds:
      self.metrics.prefill.observe(seconds)
    if engine.last_segment_seconds is not None:
      self.metrics.segment.observe(engine.last_segment_seconds)
    self.metrics.observe_engine(engine)
    if engine.device_stats is not None:
      self.metrics.observe_segment(engine.device_stats, engine.running_B)

  def _deliver(self, delta: Delta) -> None:
    route = self._routes.get(delta.index)
    if route is None:
      return
    now, m = time.perf_counter(), self.metrics
    if delta.token_ids:
      if route.first_token is None:
        route.first_token = now
        m.ttft.observe(now - route.arrival)
      route.tokens += len(delta.token_ids)
      m.generation_tokens.inc(len(delta.token_ids))
    if delta.finished:
      del self._routes[delta.index]
      m.finished.labels(m.model_name, delta.finish_reason).inc()
      m.e2e.observe(now - route.arrival)
      if route.tokens > 1:
        m.tpot.observe((now - route.first_token) / (route.tokens - 1))
    route.loop.call_soon_threadsafe(route.queue.put_nowait, (route.index, delta))
