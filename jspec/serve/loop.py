"""The engine on its own thread, and the bridge to the asyncio side of the server.

HTTP handlers `submit` requests and read their deltas from an asyncio queue; the engine thread steps the
engine whenever it has work and hands each delta to its request's queue (`call_soon_threadsafe`), so no
response waits on another's and the event loop never waits on the device.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Sequence

from jspec.scheduler import Delta, Engine, Request
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
  """Steps `engine` on a thread while it has work; `max_queue` requests may wait for a slot."""

  def __init__(self, engine: Engine, metrics: Metrics, max_queue: int):
    self.engine, self.metrics, self.max_queue = engine, metrics, max_queue
    self._routes: dict[int, _Route] = {}
    self._ids = itertools.count()
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
    if self.engine.num_waiting + len(requests) > self.max_queue:
      raise APIError(503, f"too many requests waiting (--max-queue {self.max_queue}); retry later",
                     headers={"Retry-After": "1"})
    for r in requests:
      self.engine.check(r)
    loop, queue = asyncio.get_running_loop(), asyncio.Queue()
    ids = []
    for index, r in enumerate(requests):
      request_id = next(self._ids)
      self._routes[request_id] = _Route(loop, queue, index, time.perf_counter())
      self.engine.add(r, request_id)
      ids.append(request_id)
      self.metrics.prompt_tokens.inc(len(r.prompt_ids))
    self.metrics.waiting.set(self.engine.num_waiting)
    self._wake.set()
    return ids, queue

  def abort(self, ids: Sequence[int]) -> None:
    """Ends these requests (a client left): their slots are free by the next segment."""
    for request_id in ids:
      if request_id in self._routes:
        self.engine.abort(request_id)
    self._wake.set()

  def shutdown(self, timeout: float) -> None:
    """Stops taking requests, aborts those left, and waits up to `timeout` seconds for the thread."""
    self._closing = True
    self.abort(list(self._routes))
    self._stopped = True
    self._wake.set()
    self._thread.join(timeout)

  def _run(self) -> None:
    engine = self.engine
    while not (self._stopped and not engine.has_work):
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
