"""What this process and its devices may hold: the host's free memory (or its cgroup's), an accelerator's
own limit, and a fraction of it reserved as a server does. The memory plan (`jspec.planning.memory`) weighs a batch's
needs against these figures."""
from __future__ import annotations

import os
import pathlib

import jax
import numpy as np


def _resident_bytes() -> int:
  try:
    return int(pathlib.Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
  except (OSError, ValueError, IndexError):
    return 0


def _cgroup_free() -> int | None:
  try:
    limit = pathlib.Path("/sys/fs/cgroup/memory.max").read_text().strip()
    used = int(pathlib.Path("/sys/fs/cgroup/memory.current").read_text())
  except (OSError, ValueError):
    return None
  return None if limit == "max" else int(limit) - used


def host_available() -> int:
  """Memory this process may use: what it holds, and what the host (or its cgroup) has free."""
  try:
    meminfo = dict(line.split(":", 1) for line in pathlib.Path("/proc/meminfo").read_text().splitlines())
    free = int(meminfo["MemAvailable"].split()[0]) * 1024
  except (OSError, KeyError, ValueError):
    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
  cgroup = _cgroup_free()
  return _resident_bytes() + min(free, cgroup if cgroup is not None else free)


def device_memory(mesh=None) -> tuple[int, str]:
  """Bytes one device of `mesh` (default: the first device) may hold, and what that figure is. CPU
  devices share the host's memory."""
  devices = list(np.asarray(mesh.devices).flat) if mesh is not None else jax.devices()[:1]
  device = devices[0]
  if device.platform != "cpu":
    limit = (device.memory_stats() or {}).get("bytes_limit")
    if limit:
      return int(limit), f"{device.device_kind} memory"
  return host_available() // len(devices), "memory available to this process"


def budget(mesh=None, fraction: float = 1.0) -> tuple[int, str]:
  """`fraction` of what one device may hold (`device_memory`), as a server reserves it."""
  if not (isinstance(fraction, (int, float)) and 0 < fraction <= 1):
    raise ValueError(f"the memory fraction must be in (0, 1], got {fraction}")
  available, source = device_memory(mesh)
  return int(available * fraction), source if fraction == 1 else f"{fraction:g} of the {source}"
