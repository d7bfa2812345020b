"""Compiled executables kept on disk, so a later process runs a program without tracing, lowering or
compiling it again.

JAX's persistent compilation cache skips only XLA's compile: every process still traces and lowers the
program to find its cache key, which for the adaptive decode program (one branch per draft length) takes
longer than the decode itself. Here an executable is stored under a key of everything its program depends
on: the program's name and static values, the arguments' tree (which holds the decoder's configs) and
their shapes, dtypes and shardings, the devices and the process's index among several, the versions of jax
and jaxlib, XLA's options (`XLA_FLAGS`), and the digest of jspec's own source. Files are the user's own
cache (like JAX's, loading one runs its code); one that cannot be read is compiled again.

A command run again starts loading the executables it used last time while it imports and loads its models
(loading one releases the GIL): `prefetch` names the run, `take` hands over a prefetched executable only when
the caller's own key leads to the same file, and `remember` keeps the names of each run's files.
"""
from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import json
import logging
import os
import pickle
import tempfile
import threading
from pathlib import Path
from typing import Any

import jax
import jaxlib
from jax.experimental import serialize_executable

log = logging.getLogger("jspec")
SUBDIR = "jspec-executables"
RUNS_FILE = "recent-runs.json"  # in SUBDIR: the files each recent run used, by a digest of its settings
MAX_RUNS = 64
MAX_FILES = 32
_lock = threading.Lock()
_prefetched: dict[Path, concurrent.futures.Future] = {}
_run: str | None = None  # the digest of this process's run, once `prefetch` named it
_used: set[str] = set()  # the files this process's run used


@functools.cache
def source_digest() -> str:
  """The digest of jspec's Python source: a changed program never loads a stale executable."""
  root = Path(__file__).parent.parent  # jspec/
  digest = hashlib.sha256()
  for file in sorted(root.rglob("*.py")):
    digest.update(str(file.relative_to(root)).encode() + b"\0" + file.read_bytes())
  return digest.hexdigest()


def path(cache_dir: str, name: str, args: tuple, static: dict[str, Any]) -> Path:
  """Where the executable of program `name` for these arguments is kept."""
  leaves = tuple((x.shape, str(x.dtype), str(getattr(x, "sharding", None))) for x in jax.tree.leaves(args))
  identity = repr((name, sorted(static.items()), str(jax.tree.structure(args)), leaves, jax.__version__,
                   jaxlib.__version__, [str(d) for d in jax.devices()], jax.process_index(), jax.config.jax_enable_x64,
                   jax.config.jax_default_matmul_precision, os.environ.get("XLA_FLAGS", ""), source_digest()))
  return Path(cache_dir) / SUBDIR / f"{name}-{hashlib.sha256(identity.encode()).hexdigest()[:32]}.bin"


def load(file: Path) -> Any | None:
  """The executable stored in `file`, or None if there is none (or it cannot be loaded: then it is removed)."""
  try:
    payload, in_tree, out_tree = pickle.loads(file.read_bytes())
    return serialize_executable.deserialize_and_load(payload, in_tree, out_tree)
  except FileNotFoundError:
    return None
  except Exception as error:  # noqa: BLE001 - a stale or partial file: compile instead
    log.debug("cannot load %s (%s); compiling", file, error)
    file.unlink(missing_ok=True)
    return None


def store(file: Path, executable: Any) -> None:
  """Writes `executable` to `file` atomically; a program that cannot be serialized is not stored."""
  try:
    data = pickle.dumps(serialize_executable.serialize(executable))
  except Exception as error:  # noqa: BLE001 - e.g. a backend without serialization
    log.debug("cannot store the executable (%s)", error)
    return
  file.parent.mkdir(parents=True, exist_ok=True)
  _replace(file, data)


def _replace(file: Path, data: bytes) -> None:
  """Writes `file` whole or not at all: a reader sees the old file or the new one."""
  with tempfile.NamedTemporaryFile(dir=file.parent, delete=False) as out:
    out.write(data)
  os.replace(out.name, file)


def prefetch(cache_dir: str, settings: str) -> None:
  """Starts loading, on a thread, the executables in `cache_dir` that a run with these `settings` (any string
  that tells runs apart, such as its command line) used last time."""
  global _run
  _run = hashlib.sha256(settings.encode()).hexdigest()[:32]
  folder = Path(cache_dir) / SUBDIR
  names = _runs(folder).get(_run, [])
  files = [folder / n for n in names if isinstance(n, str) and Path(n).name == n and (folder / n).is_file()]
  if not files:
    return
  pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jspec-prefetch")
  with _lock:
    for file in files:
      _prefetched.setdefault(file, pool.submit(load, file))
  pool.shutdown(wait=False)


def take(file: Path) -> Any | None:
  """`load(file)`, or what `prefetch` loaded from it."""
  with _lock:
    prefetched = _prefetched.pop(file, None)
  return prefetched.result() if prefetched else load(file)


def forget_run() -> None:
  """Drops what `prefetch` loaded and the run it named: what a new process has."""
  global _run
  with _lock:
    _prefetched.clear()
    _used.clear()
    _run = None


def remember(file: Path) -> None:
  """Keeps `file` among the files of the run `prefetch` named: the files this process uses replace those of
  the run before (a program no longer used is not loaded again), and the most recent runs are kept."""
  if _run is None:
    return
  with _lock:
    runs = _runs(file.parent)
    names = runs.pop(_run, []) if _used else []
    _used.add(file.name)
    runs[_run] = [*(n for n in names if n != file.name), file.name][-MAX_FILES:]
    try:
      _replace(file.parent / RUNS_FILE, json.dumps(dict(list(runs.items())[-MAX_RUNS:])).encode())
    except OSError as error:  # a read-only cache still serves
      log.debug("cannot keep the run's programs in %s (%s)", file.parent, error)


def _runs(folder: Path) -> dict:
  try:
    runs = json.loads((folder / RUNS_FILE).read_text())
  except (OSError, ValueError):
    return {}
  return runs if isinstance(runs, dict) else {}
