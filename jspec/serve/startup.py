"""The server's start, on a thread of its own while HTTP already answers (`/health`: 503 and the phase):
load the models, compile what every request needs (`Engine.prepare`), serve; then compile the other
programs in the background (`Engine.compile_in_background`) and, when no cost model is kept for these
models on this device, measure one for the next start. Served from several processes, every process
compiles a program where a step first needs it instead (`jspec.serve.hosts`)."""
from __future__ import annotations

import argparse
import concurrent.futures
import logging
import sys
import threading
import time
from collections.abc import Callable

from tqdm import tqdm

import jspec
from jspec import flags
from jspec.engine.pages import pages_for
from jspec.serve import hosts
from jspec.serve.loop import EngineLoop
from jspec.serve.metrics import Metrics

log = logging.getLogger("jspec")


class Startup:
  """What the server is doing until it can serve (`phase`), then its engine loop and target model."""

  def __init__(self, args: argparse.Namespace, metrics: Metrics, url: str):
    self.args, self.metrics, self.url = args, metrics, url
    self.phase = "loading the models"
    self.loop: EngineLoop | None = None
    self.target = None
    self.error: str | None = None  # why the start failed (a user error: the process exits 2)
    self._progress: tqdm | None = None  # the background compiles' bar
    self._progress_ended = False  # a stop ended it (before it began, perhaps)
    self._progress_lock = threading.Lock()

  def run(self, stop: Callable[[], None]) -> None:
    """Starts the server (on its own thread); `stop` ends the HTTP server (when the start fails, or a
    follower process asks)."""
    try:
      self._start(stop)
    except ValueError as e:
      self.error = str(e)
      print(f"error: {e}", file=sys.stderr)
      stop()
    except Exception as e:  # noqa: BLE001 - the device or a file failed: say so, and stop serving
      log.exception("the server failed to start")
      self.error = f"{type(e).__name__}: {e}"
      stop()

  def end_progress(self) -> None:
    """Closes the background compiles' bar where it stands, so that the status lines after it (a stop)
    come below it, not above a copy that they redraw."""
    with self._progress_lock:
      self._progress_ended = True
      if self._progress is not None:
        self._progress.close()

  def _start(self, stop: Callable[[], None]) -> None:
    args, begin = self.args, time.perf_counter()
    several = (args.num_processes or 1) > 1
    target, models, engine = build_engine(args, lambda phase: setattr(self, "phase", phase), plain_first=not several)
    self.target = target
    adaptive = engine.decoder.adaptive if engine.decoder.drafter is not None else None
    source = adaptive and adaptive.cost_source
    self.metrics.cost_model(source)
    # Served from one process, the programs a request needs and the engine lacks compile in the background
    # from the first step on.
    compiling = [] if several else engine.compile_in_background(ahead=not args.lazy_compile)
    self.metrics.compiling.set_function(lambda: engine.num_compiling)  # those asked later too
    self.loop = EngineLoop(engine, self.metrics, args.max_queue, hosts.Leader() if several else None, stop)
    self.loop.start()
    self.phase = "ready"
    log.info("ready in %.1f s: serving %s at %s/v1", time.perf_counter() - begin, self.metrics.model_name, self.url)
    if engine.decodes_plainly_first:
      log.info("decoding plainly until speculation's programs are compiled (in the background)")
    if several:
      return
    with self._progress_lock:
      self._progress = tqdm(concurrent.futures.as_completed(compiling), total=len(compiling), unit="program",
                           file=sys.stderr, desc="compiling the other programs in the background",
                           disable=not compiling or self._progress_ended)
    for future in self._progress:
      future.result()
    self._progress.close()
    if args.no_calibrate:
      return
    self.metrics.calibrating.set(1)
    try:
      if calibrate(target, models, engine.slots, source):
        log.info("calibrated: the next start uses the measured cost model")
    finally:
      self.metrics.calibrating.set(0)



def build_engine(args: argparse.Namespace, say: Callable[[str], None] = lambda _: None,
                 plain_first: bool = False) -> tuple:
  """(target, the model keywords of `flags.load_models`, an engine with what every request needs compiled),
  as the flags ask; `say` hears each phase. `plain_first`: see `Engine.prepare`."""
  say("loading the models")
  log.info("loading the models")
  target, models = flags.load_models(args, flags.speculation(args))
  engine = jspec.make_engine(target, slots=args.batch_size, max_len=args.max_model_len,
                             segment_rounds=args.segment_rounds, stream_rounds=args.stream_rounds,
                             memory_fraction=args.memory_fraction,
                             pages=args.max_total_tokens and pages_for(args.max_total_tokens),
                             prefix_caching=not args.no_prefix_caching,
                             max_prefill_tokens=args.max_prefill_tokens or None,
                             max_logprobs=args.max_logprobs, **models)
  engine.program_cache.quiet = True  # the server says its phases instead
  say("compiling the programs every request needs")
  log.info("compiling the programs every request needs (%d slots of %d tokens)", engine.slots, engine.max_len)
  engine.prepare(plain_first)
  return target, models, engine


def calibrate(target, models: dict, slots: int, using: str | None = None) -> bool:
  """Measures the cost model adaptive speculation reads (at batch 1 and the slots) when none is kept for
  these models on this device, as vLLM profiles at start-up, and keeps it: it applies from the next start
  (the running programs were compiled with the `using` figures: the checkpoint's or neutral ones). Meshes
  keep the figures they have. True when it measured."""
  from jspec.decoding.decoder import drafter_kind
  from jspec.planning import calibration
  from jspec.speculation import costs

  spec, draft = models["spec"], models["draft"]
  if spec is None or spec.adaptive is None or spec.tree is not None or models["mesh"] is not None:
    return False
  kind = spec.drafter or drafter_kind(draft)
  if costs.stored(target, draft, kind) is not None:
    return False
  log.info("calibrating the %s drafter's cost model while serving (kept for the next start; until then the "
           "%s figures; --no-calibrate skips)", kind, using or "checkpoint's or neutral")
  costs.store(target, draft, kind, calibration.measure(target, draft, kind, sorted({1, slots}),
                                                        draft_len=spec.draft_len))
  return True
