"""The one cache of compiled programs, which `jspec.generate`, the engine and the server all go through: the
process's most recently used executables in memory (`compiled`, keyed by the program's name, its static
values and the arguments' shapes), executables kept on disk (`jspec.decoding.executables`: a later process
loads them without tracing), and JAX's persistent compilation cache for what else compiles; an engine's view
of it (`ProgramCache`) finds its programs by a cheaper key and compiles in the background.
"""
from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import functools
import gc
import logging
import math
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any

import jax
from jax._src import config as jax_config  # JAX's options as thread-local contexts (`_compile`)

from jspec.decoding import executables

log = logging.getLogger("jspec")

# Most recently used executables. Bounded: each XLA executable holds memory mappings of its own.
MAX_EXECUTABLES = 32
_compiled: collections.OrderedDict[Any, Any] = collections.OrderedDict()
_lock = threading.Lock()


def compiled(name: str, lowering: Callable[[], Any], args: tuple, quiet: bool = False,
             **static: Any) -> tuple[Any, float]:
  """The executable `lowering()` compiles, cached by `name`, the static values and the argument shapes,
  and the seconds spent compiling (or loading) it now (0 if cached in this process). Logged at INFO, at
  DEBUG if `quiet`. Threads may call it at once."""
  key = (name, tuple(sorted(static.items())), jax.tree.structure(args),
         tuple((x.shape, x.dtype) for x in jax.tree.leaves(args)))
  with _lock:
    if key in _compiled:
      _compiled.move_to_end(key)
      return _compiled[key], 0.0
  say = functools.partial(log.log, logging.DEBUG if quiet else logging.INFO)
  cache_dir = jax.config.jax_compilation_cache_dir
  stored = executables.path(cache_dir, name, args, static) if cache_dir else None
  if stored and stored.exists():
    say("loading the %s program", name)
  else:
    say("compiling the %s program (the first run of a shape: up to a minute for adaptive speculation's "
             "branches)%s", name, f"; it is kept in {cache_dir} for later runs" if cache_dir else "")
  begin = time.perf_counter()
  executable = executables.take(stored) if stored else None
  loaded = executable is not None
  if executable is None:
    lowered = lowering()
    executable, seen = _compile(lowered, in_jax_cache=not stored)
    if stored and seen[CACHE_HIT]:
      # XLA:CPU's executable loaded from JAX's cache fails to run once serialized again, and JAX's cache would
      # answer every later process alike (it holds what an earlier jspec, whose store had another key,
      # compiled): compile it once more under an option only this store's key carries (how many buffers a
      # debug print of the buffer assignment shows: nothing the program does), and store that.
      unshared = {"xla_debug_buffer_assignment_show_max": int(stored.stem[-8:], 16) + 1}
      executable, seen = _compile(lowered, unshared, in_jax_cache=False)
    loaded = bool(seen[CACHE_HIT])
    # Stored only when XLA compiled it now (not one JAX loaded from its cache, nor one it loaded earlier in
    # this process, which `compile()` returns with no event).
    if stored and seen[BACKEND_COMPILE] and not loaded:
      executables.store(stored, executable)
  with _lock:
    _compiled[key] = executable
    if len(_compiled) > MAX_EXECUTABLES:
      _compiled.popitem(last=False)
  if stored and stored.exists():
    executables.remember(stored)
  seconds = time.perf_counter() - begin
  say("%s the %s program in %.1f s", "loaded" if loaded else "compiled", name, seconds)
  return executable, seconds


def _compile(lowered: Any, options: dict | None = None, in_jax_cache: bool = True
             ) -> tuple[Any, collections.Counter]:
  """`lowered` compiled, and the JAX events it raised (whether XLA compiled it, or JAX's cache held it).
  Unless `in_jax_cache`, JAX's persistent cache may answer but is not written: a program jspec's own store
  keeps would only be serialized there a second time (0.1 s for a test's tiny decode program), and an
  executable JAX's cache answers is compiled again before jspec stores it (above). The option is
  thread-local, so other threads' compiles still write."""
  before = _jax_events().copy()
  never_written = jax_config.persistent_cache_min_compile_time_secs(math.inf)
  with contextlib.nullcontext() if in_jax_cache else never_written:
    executable = lowered.compile(compiler_options=options)
  return executable, _jax_events() - before


def use_compile_cache(directory: str) -> None:
  """Keeps every program compiled from now on in `directory`, so a later process that needs the same
  program loads it instead: the executables themselves (`jspec.decoding.executables`: no tracing either), and
  JAX's persistent compilation cache for what jspec does not compile through `compiled`."""
  jax.config.update("jax_compilation_cache_dir", directory)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


# JAX's events, counted per thread (a thread's compile reports them on that thread): a program compiled by
# XLA (or loaded from the persistent compilation cache), and loaded from that cache.
BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
CACHE_HIT = "/jax/compilation_cache/cache_hits"
_events = threading.local()


def _jax_events() -> collections.Counter:
  if not hasattr(_events, "counts"):
    _events.counts = collections.Counter()
  return _events.counts


def _count(event: str, *_, **__) -> None:
  if event in (BACKEND_COMPILE, CACHE_HIT):
    _jax_events()[event] += 1


jax.monitoring.register_event_listener(_count)
jax.monitoring.register_event_duration_secs_listener(_count)


def release_executables() -> None:
  """Frees every compiled executable. XLA:CPU maps each one's code, and a few hundred compiles in one
  process run out of memory mappings ("LLVM compilation error: Cannot allocate memory")."""
  _compiled.clear()
  executables.forget_run()
  jax.clear_caches()
  gc.collect()


class ProgramCache:
  """An engine's programs (through `compiled`), found by `key(name, args, static)` (a tuple whose first item is
  the name): what tells them apart beyond the engine's fixed shapes, cheaper to compute than hashing every
  argument's shape and static field, which costs more than a segment's call. After `compile_in_background`,
  a program not ready compiles on a thread of its own and `get(..., wait=False)` answers None meanwhile.
  `quiet` logs compiles at DEBUG."""

  def __init__(self, key: Callable[[str, tuple, dict], Hashable]):
    self._key = key
    self._executables: dict = {}
    self._compiler: concurrent.futures.ThreadPoolExecutor | None = None
    self._stopped = False  # `stop`
    self._compiling: dict[Hashable, concurrent.futures.Future] = {}
    self._lock = threading.Lock()
    self.quiet = False
    self.compile_seconds = 0.0  # compiling (or loading) programs

  def __len__(self) -> int:
    return len(self._executables)

  def ready(self, name: str) -> list:
    """The executables ready for program `name` (keys begin with the program's name)."""
    with self._lock:
      return [e for key, e in self._executables.items() if key[0] == name]

  def has(self, name: str, args: tuple, static: dict) -> bool:
    """Whether the program is ready."""
    return self._key(name, args, static) in self._executables

  def get(self, name: str, jitted, args: tuple, wait: bool = True, **static):
    """`jitted`'s executable for these arguments. With `wait` False while compiling in the background: None
    if it is not ready yet, and it compiles there."""
    key = self._key(name, args, static)
    if key in self._executables:
      return self._executables[key]
    with self._lock:
      compiling = self._compiling.get(key)
      if compiling is None and not wait and self._compiler is not None:
        if self._stopped:  # a stopping engine: what needs this program waits
          return None
        shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                              if isinstance(x, jax.Array) else x, args)
        self._compiling[key] = self._compiler.submit(self._compile, key, name, jitted, shapes, static)
        return None
    if compiling is not None:
      if not wait and not compiling.done():
        return None
      compiling.result()
    else:
      self._compile(key, name, jitted, args, static)
    return self._executables[key]

  def _compile(self, key: Hashable, name: str, jitted, args: tuple, static: dict) -> None:
    executable, seconds = compiled(name, lambda: jitted.lower(*args, **static), args, self.quiet, **static)
    with self._lock:
      self._executables[key] = executable
      self.compile_seconds += seconds

  def compile_in_background(self) -> None:
    """From now on a program not ready compiles on a thread of its own (one at a time)."""
    self._compiler = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jspec-compile")

  @property
  def futures(self) -> list[concurrent.futures.Future]:
    """The background compiles asked for, done or not."""
    with self._lock:
      return list(self._compiling.values())

  @property
  def num_compiling(self) -> int:
    """Programs compiling in the background now."""
    with self._lock:
      return sum(not f.done() for f in self._compiling.values())

  def stop(self) -> None:
    """Cancels the background compiles not yet started, so that a process stopping waits only for the one
    running (not for every program left to compile: minutes on a first start)."""
    if self._compiler is not None:
      with self._lock:  # no thread submits a compile after the executor has shut down
        self._stopped = True
        self._compiler.shutdown(wait=False, cancel_futures=True)
        self._compiling = {key: f for key, f in self._compiling.items() if not f.cancelled()}
