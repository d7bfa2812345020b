"""The parts of a decode, timed: forward steps, the loop, prefill, a round's pieces, and the cost models
(c, v, o) that adaptive speculation reads."""
from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
from jax import lax

import jspec
from jspec import testing
from jspec.core import registry, shipped
from jspec.core.timing import interleaved
from jspec.decoding import loop
from jspec.drafters import Proposal
from jspec.model import cache as kvcache
from jspec.model import model
from jspec.model.config import ModelConfig, num_params
from jspec.planning.calibration import started, step_loop, timed_loop

# ~31M parameters: a target large enough that a step is dominated by reading its weights.
MID = ModelConfig(vocab_size=8192, dim=512, n_layers=8, n_heads=8, n_kv_heads=8, head_dim=64, mlp_dim=1536,
                  max_seq_len=8192)


# The model of the decode-step measurements (docs/cpu-performance.md): 6 layers, width 384, heads of 64.
STEP_MODEL = ModelConfig(vocab_size=4096, dim=384, n_layers=6, n_heads=6, n_kv_heads=6, head_dim=64,
                         mlp_dim=1024, max_seq_len=8192)


def naive_step_loop(params, config: ModelConfig, batch: int, capacity: int, used: int, steps: int = 32):
  """The layout jspec/model/cache.py avoids: one stacked `[N, B, T, J, Dh]` cache, a vmapped per-row update, and
  attention over the whole capacity. XLA on the CPU copies the written buffer every step."""
  tokens = jnp.ones((batch, 1), jnp.int32)
  positions = jnp.full((batch, 1), used, jnp.int32)
  lengths = jnp.full((batch,), used, jnp.int32)
  write_row = jax.vmap(lambda buf, new, n: lax.dynamic_update_slice(buf, new, (n, 0, 0)))

  def one(k_NxBxTxJxDh, v_NxBxTxJxDh):
    caches = [k_NxBxTxJxDh, v_NxBxTxJxDh]

    def attend(i, q, k, v):
      caches[0] = caches[0].at[i].set(write_row(caches[0][i], k, lengths))
      caches[1] = caches[1].at[i].set(write_row(caches[1][i], v, lengths))
      keys = jnp.repeat(caches[0][i], config.n_heads // config.n_kv_heads, axis=2)
      values = jnp.repeat(caches[1][i], config.n_heads // config.n_kv_heads, axis=2)
      s = jnp.einsum("bqhd,bthd->bhqt", q, keys) * config.head_dim ** -0.5
      s = jnp.where(jnp.arange(capacity) <= used, s, -jnp.inf)
      return jnp.einsum("bhqt,bthd->bqhd", jax.nn.softmax(s, axis=-1), values)

    hidden = model.trunk(params, tokens, positions, config, attend)
    return model.logits_from_hidden(params, hidden, config), caches

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def run(k, v):
    def body(i, c):
      acc, k, v = c
      logits, (k, v) = one(k, v)
      return acc + logits[0, 0, 0], k, v
    return lax.fori_loop(0, steps, body, (jnp.zeros(()), k, v))

  shape = (config.n_layers, batch, capacity, config.n_kv_heads, config.head_dim)
  state = [jnp.zeros(shape), jnp.zeros(shape)]

  def call():
    acc, state[0], state[1] = run(*state)
    jax.block_until_ready(acc)
  return call, steps


def suite_step(repeats: int) -> dict:
  config = STEP_MODEL
  params = model.init_params(config, jax.random.PRNGKey(0))
  draft_config = dataclasses.replace(config, dim=128, n_layers=1, n_heads=2, n_kv_heads=2, mlp_dim=384)
  draft_params = model.init_params(draft_config, jax.random.PRNGKey(1))
  out = {"model_params": num_params(config), "rows": []}
  for capacity in (1024, 4096):
    for batch in (1, 8):
      used = 256
      fns, steps = {}, 0
      for name, seq, attn in [("step", 1, True), ("no_attention", 1, False), ("verify5", 5, True),
                              ("verify5_no_attention", 5, False)]:
        fns[name], steps = step_loop(params, config, batch, capacity, used, seq, attn)
      fns["draft_step"], _ = step_loop(draft_params, draft_config, batch, capacity, used, 1, True)
      fns["before_step"], _ = naive_step_loop(params, config, batch, capacity, used)
      t = {k: v / steps for k, v in interleaved(fns, repeats).items()}
      out["rows"].append({
          "capacity": capacity, "batch": batch, "used": used, "step_ms": t["step"] * 1e3,
          "no_attention_ms": t["no_attention"] * 1e3, "step_over_no_attention": t["step"] / t["no_attention"],
          "before_step_ms": t["before_step"] * 1e3,
          "before_over_no_attention": t["before_step"] / t["no_attention"],
          "verify5_over_step": t["verify5"] / t["step"],
          # Above 1.3 here, the matmuls of 5 tokens per row are compute-bound: attention cannot fix that.
          "verify5_over_step_no_attention": t["verify5_no_attention"] / t["no_attention"],
          "c_draft_over_target": t["draft_step"] / t["step"],
          "param_ratio": num_params(draft_config) / num_params(config)})
      print(json.dumps(out["rows"][-1]), file=sys.stderr)
  return out


def suite_loop(repeats: int) -> dict:
  """Loop overhead (AR loop vs one jitted forward) and the verify cost curve, on a ~31M model."""
  target = testing.random_model(MID)
  prompts = [list(range(1, 33))]
  new = 64
  single, _ = step_loop(target.params, MID, 1, 256, 32, 1, True, steps=1)
  t = interleaved({"single": single,
                   "ar": lambda: jspec.generate(target, prompts, max_new_tokens=new)}, repeats)
  ar = jspec.generate(target, prompts, max_new_tokens=new)
  out = {"model_params": num_params(MID), "single_forward_ms": t["single"] * 1e3,
         "ar_tokens_per_second": ar.stats.tokens_per_second,
         "loop_overhead_ratio": ar.stats.tokens_per_second * t["single"]}
  fns = {f"verify{k + 1}": step_loop(target.params, MID, 1, 256, 32, k + 1, True)[0] for k in range(0, 9)}
  tv = interleaved(fns, repeats)
  out["verify_cost_over_step"] = {k: tv[f"verify{k + 1}"] / tv["verify1"] for k in range(1, 9)}
  copy = jspec.generate(target, prompts, draft=target, max_new_tokens=5 * 8, draft_len=4)
  out["draft_equals_target_tokens_per_forward"] = copy.stats.mean_accepted_length
  return out


def suite_prefill(pair: Models, repeats: int, widths: tuple[int, ...] = (96, 128, 192, 256, 384, 512)) -> dict:
  """The shipped target's prefill of one prompt as wide as each prompt bucket: prefill runs over the whole
  padded width, so its cost follows the bucket, not the prompt."""
  target = jspec.load(pair.target)
  tparams = model.with_head(target.params)
  prefill = jax.jit(lambda c, t, n: model.prefill(tparams, target.config, c, t, n)[0].sum())
  fns = {}
  for width in widths:
    args = (kvcache.init_cache(target.config, 1, kvcache.round_capacity(width + 1)),
            jnp.ones((1, width), jnp.int32), jnp.full((1,), width, jnp.int32))
    fns[width] = lambda args=args: jax.block_until_ready(prefill(*args))
  t = interleaved(fns, repeats)
  return {"prefill_ms": {w: t[w] * 1e3 for w in widths},
          "prefill_us_per_token": {w: t[w] * 1e6 / w for w in widths}}


@dataclasses.dataclass(frozen=True)
class Models:
  """What a suite measures: a target directory and drafter weights by kind (n-gram needs none), a shipped
  pair's (`shipped_models`) or the user's own."""
  target: pathlib.Path
  drafts: dict[str, pathlib.Path]


def shipped_models(name: str) -> Models:
  pair = shipped.PAIRS[name]
  return Models(pair.target, pair.drafts)


def shipped_pair(pair: Models, kind: str):
  """The target and the weights of a drafter for it (None for n-gram)."""
  return jspec.load(pair.target), jspec.load(pair.drafts[kind]) if kind in pair.drafts else None


def suite_round(pair: Models, repeats: int, kind: str = "model", draft_len: int = 4, used: int = 200,
                batch: int = 1) -> dict:
  """Where a speculative round's time goes, shipped pair, greedy: the whole round, its parts (the proposal
  of K tokens, the target forward of K+1), and a plain AR step, each 32 times in a jitted loop from the same
  decode state; the rest of the round is its overhead, attributed to the verify's logic and to the proposal
  run cold (after reading as many floats as the target's weights, as it runs after a target forward). A `kind`
  that is no drafter kind (`parallel`) is drafted by the kind its weights say."""
  target, draft = shipped_pair(pair, kind)
  decoder, state = started(target, draft, kind if kind in registry.kinds() else None, draft_len, batch, used)
  tparams, config = decoder.target_params, target.config
  keys = jnp.zeros((draft_len, batch, 2), jnp.uint32)
  chunk = jnp.ones((batch, draft_len + 1), jnp.int32)
  fixed = Proposal(chunk[:, 1:], jnp.zeros((batch, draft_len, config.vocab_size), jnp.float32),
                   jnp.ones((batch,), bool))

  def propose(s, i):
    context = s.context.replace(seq_lens_B=s.seq_lens_B - i % 2)
    dstate, proposal = decoder.drafter.propose(decoder.weights, s.drafter_state, context, keys)
    return s.replace(drafter_state=dstate), proposal.logits_BxKxV.sum()

  def verify_forward(s, i):
    logits, _, cache = model.forward(tparams, chunk, s.seq_lens_B[:, None] - 1 + jnp.arange(draft_len + 1),
                                     s.target_cache, config)
    return s.replace(target_cache=cache.rewind(s.seq_lens_B - 1)), logits.sum()

  def propose_and_ar_step(s, i):
    """A proposal and an AR step that do not depend on each other: what they cost together beyond their
    sum is what the draft's weights and cache cost the target in evicted CPU caches."""
    s, value = propose(s, i)
    s = loop.autoregressive_step(decoder, s)
    return s, value + s.seq_lens_B.sum()

  def sweep(s, i, floats):
    """Reads as many floats as the target has weights: what the CPU's caches hold of the drafter after a
    target forward."""
    return s, lax.dynamic_slice_in_dim(floats, i % 2, floats.shape[0] - 2).sum()

  def propose_cold(s, i, floats):
    s, read = sweep(s, i, floats)
    s, value = propose(s, i)
    return s, value + read

  # Each part returns (state, a value that depends on all its work), so XLA cannot drop any of it; the
  # parts rewind to where they started, so every iteration does the same work.
  with_lengths = lambda s: (s, s.seq_lens_B.sum())
  parts = {
      "round": lambda s, i: with_lengths(loop.speculative_step(decoder, s)),
      "ar_step": lambda s, i: with_lengths(loop.autoregressive_step(decoder, s)),
      "verify_step": lambda s, i: with_lengths(loop.verify_step(decoder, s, fixed, keys[0])),
      "propose": propose, "verify_forward": verify_forward, "propose_and_ar_step": propose_and_ar_step}
  reading = {"sweep": sweep, "propose_cold": propose_cold}  # parts that also read the carried floats

  def timed(fn, reads: bool):
    def one(i, carry):
      s, value = fn(carry[0], i, carry[1]) if reads else fn(carry[0], i)
      return (s, carry[1]), value
    return timed_loop(one, (state, jnp.ones((num_params(config),), jnp.float32)), steps=32)
  loops = {**{k: timed(f, False) for k, f in parts.items()}, **{k: timed(f, True) for k, f in reading.items()}}
  t = {k: v / 32 * 1e3 for k, v in interleaved(loops, repeats).items()}
  rest = t["round"] - t["propose"] - t["verify_forward"]
  steps = lambda ms: ms / t["ar_step"]
  parts_ms = {"verify_logic": t["verify_step"] - t["verify_forward"],  # acceptance, commit, statistics, observe
              # the proposal slowed by the target's weights having evicted the drafter's from the CPU's caches
              "cold_proposal": t["propose_cold"] - t["sweep"] - t["propose"],
              "interference": t["propose_and_ar_step"] - t["propose"] - t["ar_step"]}
  return {"drafter": kind, "draft_len": draft_len, "batch": batch, "used": used, "ms": t,
          "round_in_ar_steps": steps(t["round"]), "overhead_ms": rest, "overhead_in_ar_steps": steps(rest),
          **{f"{k}_ms": v for k, v in parts_ms.items()}, **{f"{k}_in_ar_steps": steps(v) for k, v in parts_ms.items()},
          # what neither the verify's logic nor the measured interference accounts for (the cold proposal is
          # an upper bound on the latter: the LM head the verify read last is still warm in a real round)
          "unattributed_in_ar_steps": steps(rest - parts_ms["verify_logic"] - parts_ms["interference"])}
