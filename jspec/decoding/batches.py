"""A `Batch`: requests as the decode loop takes them (per-row arrays on the device), and `make_batch`, the one
constructor every caller uses.

`make_batch` validates the prompts against the decoder (vocabulary, context), pads them to a prompt
bucket, sizes the KV cache (`capacity`), and turns seeds, stop tokens and sampling settings into per-row
arrays, so that new values never recompile. `jspec.generate`, `jspec.stream`, the benchmarks and the tests
all build their requests here.
"""
from __future__ import annotations

import numbers
from collections.abc import Sequence

import flax.struct
import jax
import numpy as np

from jspec.core.settings import SamplingConfig
from jspec.decoding.decoder import Decoder
from jspec.model import cache as kvcache
from jspec.speculation.sampling import SamplingParams, sampling_arrays
from jspec.text import automaton
from jspec.text.automaton import Automata, Tables

GREEDY = SamplingConfig()


@flax.struct.dataclass
class Batch:
  """A batch's inputs, one row each; arrays, so new values never recompile. `capacity` (static: a compiled
  shape) is the slots each row's caches and token buffer hold."""
  prompts_BxP: jax.Array  # int32, right-padded
  prompt_lens_B: jax.Array  # int32
  max_new_tokens_B: jax.Array  # int32
  sampling: SamplingParams
  seeds_B: jax.Array  # uint32: row b's PRNG seed
  stop_BxE: jax.Array  # int32: the tokens that end row b, -1 padded (see `stop_table`)
  speculate_B: jax.Array  # bool: row b may accept drafts (False: it decodes plainly, in speculative rounds)
  # bool: row b's text is shared across requests (the suffix drafter indexes it, and its drafts read the
  # index); False keeps it to itself
  share_B: jax.Array
  constraint: Automata | None = None  # each row's constraint automaton (None: no row is constrained)
  capacity: int | None = flax.struct.field(pytree_node=False, default=None)
  # Paged caches (`jspec.model.cache`): each row's pages in a pool of `pages` (static); None: contiguous rows.
  page_table_BxR: jax.Array | None = None  # int32 [B, capacity / PAGE_SIZE]
  pages: int | None = flax.struct.field(pytree_node=False, default=None)
  # A cached prefix: row b's pages already hold its first cached_B[b] tokens, and the prefill runs only
  # `prefill_width` (static) tokens from there (paged caches only).
  cached_B: jax.Array | None = None  # int32
  prefill_width: int | None = flax.struct.field(pytree_node=False, default=None)
  # Log-probabilities (`jspec.speculation.logprobs`): row b's are recorded if logprobs_B[b], with the `top_logprobs`
  # (static) most likely tokens at each position; None: no buffers.
  logprobs_B: jax.Array | None = None  # bool
  top_logprobs: int = flax.struct.field(pytree_node=False, default=0)


def prompt_bucket(length: int) -> int:
  """Padded prompt width: a power of two or 1.5 times one, at least 16, so nearby prompt lengths share an
  executable. Prefill runs over the whole width, so two buckets an octave keep the padding to a third of
  the prompt at most, for twice the executables of powers of two alone."""
  width = max(16, 1 << (length - 1).bit_length())
  return width * 3 // 4 if width >= 32 and width * 3 // 4 >= length else width


def capacity(prompt_width: int, max_new_tokens: int, headroom: int) -> int:
  """The cache slots a request needs, rounded to a capacity bucket (`jspec.model.cache.round_capacity`): the
  padded prompt, every new token, and `headroom` + 1 more for the widest chunk a round writes past the
  text (`Decoder.headroom`)."""
  return kvcache.round_capacity(prompt_width + max_new_tokens + headroom + 1)


def stop_table(stop_ids: Sequence[int] | Sequence[Sequence[int]], batch: int,
               width: int | None = None) -> np.ndarray:
  """`Batch.stop_BxE`: the tokens that end each row, -1 padded (a row of -1: none) to `width` (default:
  the longest list), from one list for every row or a list per row."""
  rows = [list(stop_ids)] * batch if not stop_ids or isinstance(stop_ids[0], numbers.Integral) else \
      [list(r) for r in stop_ids]
  if len(rows) != batch:
    raise ValueError(f"got stop ids for {len(rows)} rows, not {batch}")
  longest = max(1, *(len(r) for r in rows))
  if width is not None and longest > width:
    raise ValueError(f"at most {width} stop token ids, got {longest}")
  width = width or longest
  return np.asarray([r + [-1] * (width - len(r)) for r in rows], np.int32).reshape(batch, width)


def seed_array(seed: int | Sequence[int], batch: int) -> np.ndarray:
  """Row b's seed: `seed + b`, or `seed[b]` from a list."""
  seeds = [seed + b for b in range(batch)] if isinstance(seed, numbers.Integral) else [int(s) for s in seed]
  if len(seeds) != batch:
    raise ValueError(f"got {len(seeds)} seeds for {batch} prompts")
  if not all(0 <= s < 2 ** 32 for s in seeds):
    raise ValueError("seeds must be in [0, 2**32)")
  return np.asarray(seeds, np.uint32)


def check_prompts(decoder: Decoder, prompt_ids: Sequence[Sequence[int]], max_new_tokens: int,
                  context: int | None = None) -> None:
  """Raises a one-line ValueError for anything the loop cannot serve: no prompts, an empty one, ids outside
  the vocabulary, or a prompt that with `max_new_tokens` exceeds `context` (default: the context of the
  target, or the drafter's if shorter)."""
  if not prompt_ids:
    raise ValueError("no prompts given")
  if not isinstance(max_new_tokens, numbers.Integral) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens}")
  vocab, context = decoder.target_config.vocab_size, context or decoder.context_len
  for i, ids in enumerate(prompt_ids):
    if not len(ids):
      raise ValueError(f"prompt {i} is empty")
    if min(ids) < 0 or max(ids) >= vocab:
      raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {vocab})")
    if len(ids) + max_new_tokens > context:
      raise ValueError(f"prompt {i} has {len(ids)} tokens; with max_new_tokens={max_new_tokens} it exceeds "
                       f"the model's context of {context} tokens")


def make_batch(decoder: Decoder, prompt_ids: Sequence[Sequence[int]], max_new_tokens: int, *,
                  sampling: SamplingConfig | Sequence[SamplingConfig] = GREEDY,
                  seed: int | Sequence[int] = 0, ignore_eos: bool = False,
                  stop_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
                  width: int | None = None, capacity_slots: int | None = None, stop_width: int | None = None,
                  speculate: bool | Sequence[bool] = True, share: bool | Sequence[bool] = True,
                  constraints: Sequence[Tables | None] | None = None,
                  constraint_shape: tuple[int, int] | None = None,
                  logprobs: Sequence[bool] | None = None, top_logprobs: int = 1) -> Batch:
  """The requests for `prompt_ids` (token-id lists), checked against `decoder` (`check_prompts`).

  Prompts are right-padded to their bucket (`prompt_bucket`, or `width`); the capacity is what the widest
  needs (`capacity`), or `capacity_slots` (a running batch's, for rows inserted into it). Rows stop at the
  target's EOS tokens, or at `stop_ids` (one list, or one per row), or at none with `ignore_eos`; the stop
  table is `stop_width` wide when given (a running batch's, for inserted rows). `speculate` (one value, or
  one per row) False makes a row decode plainly; `share` False keeps a row's text out of what the engine
  keeps across requests (`Batch.share_B`). `constraints` (compiled `jspec.text.constraints` tables, or None
  for a free row) constrain what each row outputs, in automata of `constraint_shape` (states, classes; a
  running batch's, for inserted rows; default: the smallest bucket that holds them); with neither, no row
  is constrained and the loop has no automata. `logprobs` (one per row) records a row's log-probabilities
  with the `top_logprobs` most likely tokens at each position (`jspec.speculation.logprobs`); None: none are."""
  check_prompts(decoder, prompt_ids, max_new_tokens)
  batch, longest = len(prompt_ids), max(len(p) for p in prompt_ids)
  width = width or prompt_bucket(longest)
  if width < longest:
    raise ValueError(f"a prompt of {longest} tokens does not fit a width of {width}")
  prompts_BxP = np.zeros((batch, width), np.int32)
  for b, ids in enumerate(prompt_ids):
    prompts_BxP[b, :len(ids)] = ids
  stops = () if ignore_eos else decoder.target_config.stop_ids if stop_ids is None else stop_ids
  slots = capacity_slots or capacity(width, max_new_tokens, decoder.headroom)
  automata = None
  if constraints is not None or constraint_shape is not None:
    automata = automaton.stack(list(constraints or [None] * batch), decoder.target_config.vocab_size,
                               constraint_shape)
    if automata.class_BxV.shape[0] != batch:
      raise ValueError(f"got constraints for {automata.class_BxV.shape[0]} rows, not {batch}")
  return Batch(prompts_BxP=prompts_BxP, prompt_lens_B=np.asarray([len(p) for p in prompt_ids], np.int32),
                  max_new_tokens_B=np.full((batch,), max_new_tokens, np.int32),
                  sampling=sampling_arrays(sampling, batch), seeds_B=seed_array(seed, batch),
                  stop_BxE=stop_table(stops, batch, stop_width),
                  speculate_B=np.broadcast_to(np.asarray(speculate, bool), (batch,)).copy(),
                  share_B=np.broadcast_to(np.asarray(share, bool), (batch,)).copy(), constraint=automata,
                  capacity=slots, logprobs_B=None if logprobs is None else np.asarray(logprobs, bool),
                  top_logprobs=top_logprobs if logprobs is not None else 0)

