"""The programs: jitted entry points (prefill + loop in one executable; its pieces for segmented decoding), each
compiled ahead of time once per shape through `jspec.decoding.program_cache`, so requests that differ only in
prompt text, seeds or sampling values reuse them, and compile time can be reported apart from decode time.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from jspec.decoding import loop, program_cache
from jspec.decoding.batches import Batch
from jspec.decoding.decoder import Decoder
from jspec.decoding.rows import insert, prefill_pages, run_rows
from jspec.speculation.logprobs import Logprobs
from jspec.speculation.stats import DecodeStats


class Decoded(NamedTuple):
  """A batch decoded: row b's new tokens are `tokens_BxT[b, prompt_len:seq_lens_B[b]]`; their
  log-probabilities at the same slots, if the requests asked (`jspec.speculation.logprobs`)."""
  tokens_BxT: jax.Array
  seq_lens_B: jax.Array
  stats: DecodeStats
  logprobs: Logprobs | None


def _run(decoder: Decoder, batch: Batch) -> Decoded:
  """Prefills and decodes a batch."""
  state = loop.run(decoder, loop.start(decoder, batch))
  return Decoded(state.tokens_BxT, state.seq_lens_B, state.stats, state.logprobs)


run = jax.jit(_run)


def lower(decoder: Decoder, batch: Batch) -> Any:
  """`run` lowered for these arguments. On a mesh (`decoder.layout`) its shardings are explicit, as
  `jax.jit(in_shardings=..., out_shardings=...)` (what pjit became): each argument keeps the sharding it
  was placed with (`jspec.model.sharding.place_decoder`, `place`) and the outputs are replicated. The decode
  state lives only inside the executable (the while loop updates it in place), so no state buffer crosses
  the boundary to donate."""
  if decoder.layout is None:
    return run.lower(decoder, batch)
  replicated = NamedSharding(decoder.layout.mesh, PartitionSpec())
  explicit = jax.jit(_run, out_shardings=replicated,
                     in_shardings=jax.tree.map(lambda x: x.sharding, (decoder, batch)))
  return explicit.lower(decoder, batch)


class Report(NamedTuple):
  """What a segment hands the host: every row's tokens and length, which rows are done, the statistics,
  and the log-probabilities of the tokens it committed (`window` slots from each row's length before it;
  None: no row can ask)."""
  tokens_BxT: jax.Array
  seq_lens_B: jax.Array
  done_B: jax.Array
  stats: DecodeStats
  logprobs: Logprobs | None


def _segment(decoder: Decoder, state: loop.DecodeState, max_rounds: jax.Array, stop_at_finish: jax.Array,
             retire_B: jax.Array, *, width: int, window: int = 1,
             plain: bool = False) -> tuple[loop.DecodeState, Report]:
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
start = jax.jit(loop.start, static_argnames="capacity")
segment = jax.jit(_segment, static_argnames=("width", "window", "plain"), donate_argnames="state")
insert = jax.jit(insert, donate_argnames="state")
prefill_pages = jax.jit(prefill_pages, donate_argnames="state")

def fetch(tree: Any) -> Any:
  """`tree`'s arrays on the host (numpy). Of an array over several processes' devices, a replicated one is
  read here, and a split one is gathered from all of them: a collective, so every process of a multi-process
  run fetches the same arrays in the same order."""
  def local(x):
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
      return x
    return x.addressable_data(0) if x.is_fully_replicated else multihost_utils.process_allgather(x, tiled=True)
  return jax.device_get(jax.tree.map(local, tree))


def compiled_run(decoder: Decoder, batch: Batch) -> tuple[Any, float]:
  """The executable of `run` for these argument shapes (call it with `(decoder, batch)`), and the
  seconds spent compiling it now (0 if cached)."""
  return program_cache.compiled("decode", lambda: lower(decoder, batch), (decoder, batch))
