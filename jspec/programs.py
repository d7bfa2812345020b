"""The compiled programs: jitted entry points (prefill + loop in one executable; its pieces for segmented
decoding), a compile cache keyed by shapes, and JAX's persistent compilation cache.

Executables are compiled ahead of time once per (decoder program and layout, batch, prompt bucket,
capacity), so requests that differ only in prompt text, seeds or sampling values reuse them, and compile
time can be reported apart from decode time.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import gc
import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
from jax._src import config as jax_config  # JAX's options as thread-local contexts (`_compile`)
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from jspec import decode, executables
from jspec.decoder import Decoder
from jspec.logprobs import Logprobs
from jspec.request import Batch
from jspec.rows import insert, prefill_pages, run_rows
from jspec.stats import DecodeStats

log = logging.getLogger("jspec")


class Decoded(NamedTuple):
  """A batch decoded: row b's new tokens are `tokens_BxT[b, prompt_len:seq_lens_B[b]]`; their
  log-probabilities at the same slots, if the requests asked (`jspec.logprobs`)."""
  tokens_BxT: jax.Array
  seq_lens_B: jax.Array
  stats: DecodeStats
  logprobs: Logprobs | None


def _run(decoder: Decoder, requests: Batch) -> Decoded:
  """Prefills and decodes a batch."""
  state = decode.run(decoder, decode.start(decoder, requests))
  return Decoded(state.tokens_BxT, state.seq_lens_B, state.stats, state.logprobs)


run = jax.jit(_run)


def lower(decoder: Decoder, requests: Batch) -> Any:
  """`run` lowered for these arguments. On a mesh (`decoder.layout`) its shardings are explicit, as
  `jax.jit(in_shardings=..., out_shardings=...)` (what pjit became): each argument keeps the sharding it
  was placed with (`jspec.sharding.place_decoder`, `place`) and the outputs are replicated. The decode
  state lives only inside the executable (the while loop updates it in place), so no state buffer crosses
  the boundary to donate."""
  if decoder.layout is None:
    return run.lower(decoder, requests)
  replicated = NamedSharding(decoder.layout.mesh, PartitionSpec())
  explicit = jax.jit(_run, out_shardings=replicated,
                     in_shardings=jax.tree.map(lambda x: x.sharding, (decoder, requests)))
  return explicit.lower(decoder, requests)


class Report(NamedTuple):
  """What a segment hands the host: every row's tokens and length, which rows are done, the statistics,
  and the log-probabilities of the tokens it committed (`window` slots from each row's length before it;
  None: no row can ask)."""
  tokens_BxT: jax.Array
  seq_lens_B: jax.Array
  done_B: jax.Array
  stats: DecodeStats
  logprobs: Logprobs | None


def _segment(decoder: Decoder, state: decode.DecodeState, max_rounds: jax.Array, stop_at_finish: jax.Array,
             retire_B: jax.Array, *, width: int, window: int = 1,
             plain: bool = False) -> tuple[decode.DecodeState, Report]:
  """A segment of the loop over the first `width` rows (`run_rows`), and the part of its state the host
  reads: buffers of their own, so the host can read them while the next segment updates the state. A
  segment commits at most `window` tokens a row (its rounds times a round's most). `plain`: every round the
  adaptive policy's plain step (`decode.run`)."""
  before_B = state.seq_lens_B
  state = run_rows(decoder, state, max_rounds, stop_at_finish, retire_B, width=width, plain=plain)
  scored = None if state.logprobs is None else state.logprobs.window(before_B, window)
  return state, Report(state.tokens_BxT, state.seq_lens_B, state.done_B, state.stats, scored)



# Jitted pieces for segmented decoding (streaming, continuous batching): the prefill of a batch, a segment
# of the loop, and the prefill of new rows into a running batch. The state is donated: it is updated in
# place on accelerators, and the caller holds only what each call returns.
start = jax.jit(decode.start, static_argnames="capacity")
segment = jax.jit(_segment, static_argnames=("width", "window", "plain"), donate_argnames="state")
insert = jax.jit(insert, donate_argnames="state")
prefill_pages = jax.jit(prefill_pages, donate_argnames="state")

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
  program loads it instead: the executables themselves (`jspec.executables`: no tracing either), and
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


def fetch(tree: Any) -> Any:
  """`tree`'s arrays on the host (numpy). Of an array over several processes' devices, a replicated one is
  read here, and a split one is gathered from all of them: a collective, so every process of a multi-process
  run fetches the same arrays in the same order."""
  def local(x):
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
      return x
    return x.addressable_data(0) if x.is_fully_replicated else multihost_utils.process_allgather(x, tiled=True)
  return jax.device_get(jax.tree.map(local, tree))


def compiled_run(decoder: Decoder, requests: Batch) -> tuple[Any, float]:
  """The executable of `run` for these argument shapes (call it with `(decoder, requests)`), and the
  seconds spent compiling it now (0 if cached)."""
  return compiled("decode", lambda: lower(decoder, requests), (decoder, requests))


def release_executables() -> None:
  """Frees every compiled executable. XLA:CPU maps each one's code, and a few hundred compiles in one
  process run out of memory mappings ("LLVM compilation error: Cannot allocate memory")."""
  _compiled.clear()
  executables.forget_run()
  jax.clear_caches()
  gc.collect()
