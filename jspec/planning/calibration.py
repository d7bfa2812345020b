"""Calibration: the cost model (c, v, o) of a target and drafter measured on the devices at hand
(`jspec.speculation.costs` keeps it and picks the one a decoder uses).

c: what one more drafted token costs, over one target step; v: what each extra verified token adds to a
target forward; o: what a speculative round of K drafts costs beyond 1 + K (c + v) target steps (the
drafter's per-round work included; `jspec.speculation.adaptive`); and whole rounds of each draft length adaptive
speculation offers by default up to the longest draft (1, 2, 4, ... and the longest; the lengths between
are interpolated), which it reads first (`CostModel.round_costs`). Each is a ratio of interleaved
medians of jitted loops of 32 steps over the same decode state, at each batch asked.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jspec.core import registry
from jspec.core.settings import AdaptiveConfig, CostModel, SpecConfig
from jspec.core.timing import interleaved
from jspec.decoding import loop
from jspec.decoding.batches import make_batch
from jspec.decoding.decoder import Decoder, make_decoder
from jspec.model import cache as kvcache
from jspec.model import model
from jspec.model.config import ModelConfig, num_params
from jspec.speculation import costs

STEPS = 32  # steps per timed loop
USED = 200  # tokens in the cache while timing


def timed_loop(step: Callable[[jax.Array, Any], tuple[Any, jax.Array]], carry: Any, steps: int = STEPS,
               donate: bool = False) -> Callable[[], None]:
  """A call that runs `step(i, carry) -> (carry, value)` `steps` times in one jitted `fori_loop` and blocks
  until it is done. The values are summed into what the loop returns, so XLA can drop none of the work, and
  inputs that move with `i` keep anything from being hoisted. With `donate` the carry is donated and each
  call continues from the previous one's (caches, as in the decode loop: no call pays for a copy); else
  every call starts from `carry`."""
  @functools.partial(jax.jit, donate_argnums=0 if donate else ())
  def run(carry):
    def body(i, c):
      carry, total = c
      carry, value = step(i, carry)
      return carry, total + value.astype(jnp.float32)
    carry, total = lax.fori_loop(0, steps, body, (carry, jnp.zeros((), jnp.float32)))
    return carry if donate else None, total  # a carry not handed back is never written out

  held = [carry]

  def call():
    carry, total = run(held[0])
    if donate:
      held[0] = carry
    jax.block_until_ready(total)
  return call


def step_loop(params, config: ModelConfig, batch: int, capacity: int, used: int, seq: int, attention: bool = True,
              steps: int = STEPS):
  """`timed_loop` of `steps` forwards of `seq` tokens per row over a cache holding `used` tokens (donated)."""
  tokens = jnp.ones((batch, seq), jnp.int32)
  positions = used + jnp.broadcast_to(jnp.arange(seq), (batch, seq))

  def one(i, cache):
    if attention:
      logits, _, cache = model.forward(params, tokens, positions, cache, config)
      return cache.rewind(cache.lengths - seq), logits[0, 0, 0]
    hidden = model.trunk(params, tokens, positions, config, lambda i, q, k, v: q)
    return cache, model.logits_from_hidden(params, hidden, config)[0, 0, 0]

  cache = kvcache.init_cache(config, batch, capacity).rewind(jnp.full((batch,), used, jnp.int32))
  cache = cache.replace(kernel=Decoder(params, target_config=config).kernel(config.head_dim))  # as decoding reads
  return timed_loop(one, cache, steps, donate=True), steps


def started(target, draft, kind: str, draft_len: int, batch: int, used: int = USED, max_new: int = 10 ** 6):
  """A decoder and its state after prefilling `batch` random prompts of `used` tokens, greedy, in a cache of
  512 slots."""
  decoder = make_decoder(target, draft, SpecConfig(draft_len, drafter=kind, adaptive=None), batch)
  prompts = np.random.default_rng(0).integers(0, target.config.vocab_size, (batch, used)).tolist()
  prompts = make_batch(decoder, prompts, 1, ignore_eos=True, capacity_slots=512)
  return decoder, loop.start(decoder, prompts.replace(max_new_tokens_B=np.full((batch,), max_new, np.int32)))


def drafter_cost_ratio(target, draft, kind: str, repeats: int, used: int = USED, batch: int = 1) -> float:
  """c for any drafter: what a proposal of two tokens costs beyond one of one token, over one target step,
  `batch` rows of `used` tokens. What a proposal costs whatever its length (a draft model's catch-up of
  the tokens it trails by) is per round: o holds it.

  Each runs 32 times in a jitted loop whose inputs move with the loop index, so nothing is hoisted.
  """
  decoder, state = started(target, draft, kind, 2, batch, used)
  tparams, lens = decoder.target_params, state.seq_lens_B

  def propose(k: int):
    keys = jnp.zeros((k, batch, 2), jnp.uint32)

    def step(i, dstate):
      dstate, proposal = decoder.drafter.propose(decoder.weights, dstate,
                                                 state.context.replace(seq_lens_B=lens - i % 2), keys)
      return dstate, proposal.logits_BxKxV[0, -1, 0]
    return step

  def target_step(i, cache):
    pos = lens[:, None] - 1 - i % 2
    logits, _, cache = model.forward(tparams, state.tokens_BxT[:, :1], pos, cache.rewind(pos[:, 0]), target.config)
    return cache, logits[0, 0, 0]

  # Each loop carries (and donates) its own copy of the caches, as the decode loop does.
  own = lambda tree: jax.tree.map(jnp.copy, tree)
  loops = {"one": timed_loop(propose(1), own(state.drafter_state), donate=True),
           "two": timed_loop(propose(2), own(state.drafter_state), donate=True),
           "target": timed_loop(target_step, own(state.target_cache), donate=True)}
  t = interleaved(loops, repeats)
  return max(t["two"] - t["one"], 0.0) / t["target"]


def verify_ratio(target, batch: int, k: int, repeats: int, used: int = USED) -> float:
  """A forward of K+1 tokens per row over one of 1 token, batch rows, `used` tokens in the cache: 1 + K v
  in the cost model's terms."""
  tparams = model.with_head(target.params)
  one, _ = step_loop(tparams, target.config, batch, 512, used, 1)
  wide, _ = step_loop(tparams, target.config, batch, 512, used, k + 1)
  t = interleaved({"one": one, "wide": wide}, repeats)
  return t["wide"] / t["one"]


def round_ratios(target, draft, kind: str, draft_lens, repeats: int, batch: int = 1) -> dict[int, float]:
  """A speculative round of each of `draft_lens` drafts over a plain step, greedy, from the same prompt,
  each 32 times in a jitted loop, all interleaved: `CostModel.round_costs`, and 1 + o + K (c + v) in the
  line's terms."""
  loops = {}
  for k in draft_lens:
    both = round_and_step(*started(target, draft, kind, k, batch))
    loops[k], loops["step"] = both["round"], both["step"]
  t = interleaved(loops, repeats)
  return {k: t[k] / t["step"] for k in draft_lens}


def non_decreasing(xs: list[float]) -> list[float]:
  """The closest non-decreasing sequence in least squares (pool adjacent violators): a longer draft never
  costs less, so where timing noise says otherwise the two figures are averaged."""
  blocks: list[list[float]] = []  # [mean, count]
  for x in xs:
    blocks.append([x, 1])
    while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
      (m1, n1), (m2, n2) = blocks.pop(-2), blocks.pop()
      blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
  return [m for m, n in blocks for _ in range(n)]


def round_and_step(decoder, state, steps: int = STEPS) -> dict[str, Callable[[], None]]:
  """`timed_loop`s of a speculative round ("round") and of a plain step ("step"), both from `state`."""
  def timed(step):
    def one(i, s):
      s = step(decoder, s)
      return s, s.seq_lens_B.sum()
    return timed_loop(one, state, steps)
  return {"round": timed(loop.speculative_step), "step": timed(loop.autoregressive_step)}


def measure(target, draft, kind: str, batches: list[int] | tuple[int, ...] = (1,), repeats: int = 5,
            draft_len: int = 4) -> CostModel:
  """The cost model of `target` with this drafter on the default devices: batch 1's figures, the others as
  its `batches`, with the target's size and the backend and device kind they were measured on. Rounds of
  the draft lengths adaptive speculation offers by default up to `draft_len` (and the drafter's own limit,
  as Medusa's heads) are timed, the lengths between interpolated (`round_costs`); v and o are read at the
  longest."""
  longest = registry.drafter_class(kind).longest_draft(draft)
  draft_len = min(draft_len, longest or draft_len)
  lens = AdaptiveConfig().lens(draft_len)
  measured = {}
  for b in sorted({1, *batches}):
    c = drafter_cost_ratio(target, draft, kind, repeats, batch=b)
    v = (verify_ratio(target, b, draft_len, repeats) - 1) / draft_len
    rounds = round_ratios(target, draft, kind, lens, repeats, batch=b)
    o = rounds[draft_len] - 1 - draft_len * (c + v)
    timed = non_decreasing([rounds[k] for k in lens])
    every_k = np.interp(np.arange(1, draft_len + 1), lens, timed)
    measured[b] = CostModel(round(c, 4), round(max(v, 0.0), 4), round(max(o, 0.0), 4),
                            round_costs=tuple(round(max(float(x), 1.0), 4) for x in every_k))
  backend, kind_of_device = costs.device_kind()
  return dataclasses.replace(measured[1], target_params=num_params(target.config), backend=backend,
                             device_kind=kind_of_device,
                             batches=tuple((b, m) for b, m in measured.items() if b != 1))


