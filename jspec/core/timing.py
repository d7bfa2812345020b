"""Interleaved timing: A, B, A, B, ... so that every contender sees the same machine, and medians of each.

Calibration, the benchmarks and the command line's `--baseline` all time this way. No JAX here: a call
blocks until its work is done.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def interleaved_runs(fns: dict[str, Callable[[], object]], repeats: int, warmup: bool = True,
                     warm_each: bool = False, reports_seconds: bool = False) -> dict[str, list[float]]:
  """Seconds of each call of each fn, calling them in turn `repeats` times (after one untimed call each
  with `warmup`). With `reports_seconds` each fn returns the seconds it measured itself (a decode's wall
  time, say, without the host's work around it); else each call is timed whole.

  `warm_each` times each call right after an untimed call of the same fn: for fns that share no weights,
  so that none is timed with the CPU caches full of the previous fn's data."""
  for f in fns.values() if warmup else ():
    f()
  times: dict[str, list[float]] = {k: [] for k in fns}
  for _ in range(repeats):
    for k, f in fns.items():
      if warm_each:
        f()
      begin = time.perf_counter()
      reported = f()
      times[k].append(float(reported) if reports_seconds else time.perf_counter() - begin)
  return times


def interleaved(fns: dict[str, Callable[[], object]], repeats: int, warmup: bool = True,
                warm_each: bool = False) -> dict[str, float]:
  """The median seconds of each fn over `interleaved_runs`."""
  return {k: statistics.median(v) for k, v in interleaved_runs(fns, repeats, warmup, warm_each).items()}
