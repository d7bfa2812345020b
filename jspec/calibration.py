"""Calibration: the cost model (c, v, o) of a target and drafter measured on the devices at hand
(`jspec.costs` keeps it and picks the one a decoder uses).

c: what one more drafted token costs, over one target step; v: what each extra verified token adds to a
target forward; o: what a speculative round of K drafts costs beyond 1 + K (c + v) target steps (the
drafter's per-round work included; `jspec.adaptive`). Each is a ratio of interleaved medians of jitted
loops of 32 steps over the same decode state, at each batch asked.
"""
from __future__ import annotations

import dataclasses
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jspec import cache as kvcache
from jspec import costs, decode, model
from jspec.config import ModelConfig, num_params
from jspec.decoder import make_decoder
from jspec.request import make_requests
from jspec.settings import CostModel, SpecConfig

STEPS = 32  # steps per timed loop
USED = 200  # tokens in the cache while timing


def interleaved(fns: dict, repeats: int, warmup: bool = True, warm_each: bool = False) -> dict[str, float]:
  """Median seconds of each fn, calling them in turn `repeats` times (after one warm-up each).

  `warm_each` times each call right after an untimed call of the same fn: for fns that share no weights,
  so that none is timed with the CPU caches full of the previous fn's data.
  """
  for f in fns.values() if warmup else ():
    f()
  times = {k: [] for k in fns}
  for _ in range(repeats):
    for k, f in fns.items():
      if warm_each:
        f()
      t0 = time.perf_counter()
      f()
      times[k].append(time.perf_counter() - t0)
  return {k: statistics.median(v) for k, v in times.items()}


def step_loop(params, config: ModelConfig, batch: int, capacity: int, used: int, seq: int, attention: bool = True,
              steps: int = STEPS):
  """A jitted while-loop of `steps` forwards of `seq` tokens per row over a cache holding `used` tokens.

  The cache is donated and handed back, as in the decode loop, so no call pays for copying it.
  """
  tokens = jnp.ones((batch, seq), jnp.int32)
  positions = used + jnp.broadcast_to(jnp.arange(seq), (batch, seq))

  def one(cache):
    if attention:
      logits, _, cache = model.forward(params, tokens, positions, cache, config)
      return logits, cache.rewind(cache.lengths - seq)
    hidden = model.trunk(params, tokens, positions, config, lambda i, q, k, v: q)
    return model.logits_from_hidden(params, hidden, config), cache

  @functools.partial(jax.jit, donate_argnums=0)
  def run(cache):
    def body(i, c):
      acc, cache = c
      logits, cache = one(cache)
      return acc + logits[0, 0, 0], cache
    return lax.fori_loop(0, steps, body, (jnp.zeros(()), cache))

  state = [kvcache.init_cache(config, batch, capacity).rewind(jnp.full((batch,), used, jnp.int32))]

  def call():
    acc, state[0] = run(state[0])
    jax.block_until_ready(acc)
  return call, steps


def started(target, draft, kind: str, draft_len: int, batch: int, used: int = USED, max_new: int = 10 ** 6):
  """A decoder and its state after prefilling `batch` random prompts of `used` tokens, greedy, in a cache of
  512 slots."""
  decoder = make_decoder(target, draft, SpecConfig(draft_len, drafter=kind, adaptive=None), batch)
  prompts = np.random.default_rng(0).integers(0, target.config.vocab_size, (batch, used)).tolist()
  requests = make_requests(decoder, prompts, 1, ignore_eos=True, capacity_slots=512)
  return decoder, decode.start(decoder, requests.replace(max_new_tokens_B=np.full((batch,), max_new, np.int32)))


def drafter_cost_ratio(target, draft, kind: str, repeats: int, used: int = USED, batch: int = 1) -> float:
  """c for any drafter: what a proposal of two tokens costs beyond one of one token, over one target step,
  `batch` rows of `used` tokens. What a proposal costs whatever its length (a draft model's catch-up of
  the tokens it trails by) is per round: o holds it.

  Each runs 32 times in a jitted loop whose inputs move with the loop index, so nothing is hoisted.
  """
  decoder, state = started(target, draft, kind, 2, batch, used)
  tparams, lens = decoder.target_params, state.seq_lens_B

  def propose_loop(k: int):
    keys = jnp.zeros((k, batch, 2), jnp.uint32)

    # Caches are carried through the loop and donated, as in the decode loop, so no step pays a copy.
    @functools.partial(jax.jit, donate_argnums=0)
    def loop(dstate):
      def body(i, carry):
        acc, dstate = carry
        dstate, proposal = decoder.drafter.propose(decoder.weights, dstate,
                                                   state.context.replace(seq_lens_B=lens - i % 2), keys)
        return acc + proposal.logits_BxKxV[0, -1, 0], dstate
      return lax.fori_loop(0, STEPS, body, (jnp.zeros(()), dstate))
    return loop

  @functools.partial(jax.jit, donate_argnums=0)
  def target_loop(cache):
    def body(i, carry):
      acc, cache = carry
      pos = lens[:, None] - 1 - i % 2
      logits, _, cache = model.forward(tparams, state.tokens_BxT[:, :1], pos, cache.rewind(pos[:, 0]), target.config)
      return acc + logits[0, 0, 0], cache
    return lax.fori_loop(0, STEPS, body, (jnp.zeros(()), cache))

  loops = {"one": propose_loop(1), "two": propose_loop(2), "target": target_loop}
  carried = {name: jax.tree.map(jnp.copy, state.target_cache if name == "target" else state.drafter_state)
             for name in loops}  # each its own, to donate

  def run(name):
    acc, carried[name] = loops[name](carried[name])
    jax.block_until_ready(acc)

  t = interleaved({name: functools.partial(run, name) for name in loops}, repeats)
  return max(t["two"] - t["one"], 0.0) / t["target"]


def verify_ratio(target, batch: int, k: int, repeats: int, used: int = USED) -> float:
  """A forward of K+1 tokens per row over one of 1 token, batch rows, `used` tokens in the cache: 1 + K v
  in the cost model's terms."""
  tparams = model.with_head(target.params)
  one, _ = step_loop(tparams, target.config, batch, 512, used, 1)
  wide, _ = step_loop(tparams, target.config, batch, 512, used, k + 1)
  t = interleaved({"one": one, "wide": wide}, repeats)
  return t["wide"] / t["one"]


def round_ratio(target, draft, kind: str, draft_len: int, repeats: int, batch: int = 1) -> float:
  """A speculative round of `draft_len` drafts over a plain step, greedy, from the same decode state, each
  32 times in a jitted loop: 1 + o + K (c + v) in the cost model's terms."""
  decoder, state = started(target, draft, kind, draft_len, batch)

  def timed(step):
    def body(i, carry):
      s, acc = carry
      s = step(decoder, s)
      return s, acc + s.seq_lens_B.sum()
    run = jax.jit(lambda s: lax.fori_loop(0, STEPS, body, (s, jnp.zeros((), jnp.int32)))[1])
    return lambda: jax.block_until_ready(run(state))
  t = interleaved({"round": timed(decode.speculative_step), "step": timed(decode.autoregressive_step)}, repeats)
  return t["round"] / t["step"]


def measure(target, draft, kind: str, batches: list[int] | tuple[int, ...] = (1,), repeats: int = 5,
            draft_len: int = 4) -> CostModel:
  """The cost model of `target` with this drafter on the default devices: batch 1's figures, the others as
  its `batches`, with the target's size and the backend and device kind they were measured on."""
  measured = {}
  for b in sorted({1, *batches}):
    c = drafter_cost_ratio(target, draft, kind, repeats, batch=b)
    v = (verify_ratio(target, b, draft_len, repeats) - 1) / draft_len
    o = round_ratio(target, draft, kind, draft_len, repeats, batch=b) - 1 - draft_len * (c + v)
    measured[b] = CostModel(round(c, 4), round(max(v, 0.0), 4), round(max(o, 0.0), 4))
  backend, kind_of_device = costs.device_kind()
  return dataclasses.replace(measured[1], target_params=num_params(target.config), backend=backend,
                             device_kind=kind_of_device,
                             batches=tuple((b, m) for b, m in measured.items() if b != 1))


