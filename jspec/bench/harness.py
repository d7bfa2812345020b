"""How the benchmarks run: peak memory, progress, and the machine (interleaved medians: `jspec.core.timing`)."""
from __future__ import annotations

import pathlib
import resource
import sys
import time

import jax


def peak_memory_mb() -> float | None:
  """Peak memory since the last `reset_peak_memory`: device memory on accelerators, RSS on the CPU."""
  stats = jax.devices()[0].memory_stats() or {}
  if "peak_bytes_in_use" in stats:
    return stats["peak_bytes_in_use"] / 2 ** 20
  try:
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
      if line.startswith("VmHWM:"):
        return int(line.split()[1]) / 1024
  except OSError:
    pass
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def reset_peak_memory() -> None:
  """Linux resets the RSS high-water mark on writing 5 to clear_refs; elsewhere the peak is process-wide."""
  try:
    pathlib.Path("/proc/self/clear_refs").write_text("5")
  except OSError:
    pass


class Progress:
  """A one-line progress bar on stderr: cells done, the current cell, and the time left at this pace."""

  def __init__(self, total: int):
    self.total, self.done, self.start = total, 0, time.perf_counter()

  def step(self, label: str) -> None:
    elapsed = time.perf_counter() - self.start
    eta = elapsed / self.done * (self.total - self.done) if self.done else 0.0
    bar = "#" * (20 * self.done // self.total)
    print(f"\r[{bar:<20}] {self.done}/{self.total} {label:<34} {elapsed / 60:5.1f} min, ~{eta / 60:.1f} left",
          end="", file=sys.stderr, flush=True)
    self.done += 1

  def close(self) -> None:
    print(file=sys.stderr)


def machine() -> dict:
  """What the numbers were measured on."""
  import os
  import platform
  cpu = platform.processor() or platform.machine()
  try:
    cpu = next(x.split(":", 1)[1].strip() for x in open("/proc/cpuinfo") if x.startswith("model name"))
  except (OSError, StopIteration):
    pass
  return {"platform": platform.platform(), "processor": cpu, "cpus": os.cpu_count(),
          "python": platform.python_version(), "backend": jax.default_backend(), "devices": len(jax.devices())}
