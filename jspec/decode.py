"""The decode loops: autoregressive (the baseline) and speculative, each ONE `lax.while_loop`.

Invariants at the top of every iteration, for each row b with `n = seq_lens[b]` tokens (prompt + emitted):
the target cache holds tokens `[0, n-1)`, and token n-1 is fed by the next target forward. What the
drafter holds is its own business (see `jspec.drafters`); the loop only asks it for proposals and tells it
what the target saw. Done rows still ride along in the batched forwards, but their lengths no longer move,
so they write only into slots they already own.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from jax import lax

from jspec import adaptive
from jspec import cache as kvcache
from jspec import model
from jspec.config import ModelConfig
from jspec.control import run_if, run_switch
from jspec.drafters.base import Drafter, DrafterState
from jspec.sampling import SamplingParams, is_greedy, next_token, probabilities
from jspec.verify import verify, verify_greedy, verify_typical

# How many times each loop was traced; tests assert this does not grow across requests of one bucket.
trace_counts: collections.Counter = collections.Counter()


@dataclasses.dataclass(frozen=True)
class Speculation:
  """How the speculative loop runs; static (hashable), part of the compiled shape."""
  draft_len: int  # K, or K_max when adaptive
  typical_acceptance: bool = False  # Medusa's typical acceptance: LOSSY, opt-in (see verify.verify_typical)
  adaptive: adaptive.Policy | None = None  # None: every round drafts `draft_len`
  trace_rounds: int = 0  # record (K, row 0's accepted, window rate, EWMA rate) for this many rounds


@flax.struct.dataclass
class DecodeStats:
  """Counters over active rows. A "round" is one row taking part in one target forward."""
  rounds: jax.Array
  target_forwards: jax.Array  # batched target forwards in the loop (prefill not counted)
  draft_forwards: jax.Array  # drafting steps in the loop (batched)
  plain_forwards: jax.Array  # target forwards in the speculative loop that verified no draft
  drafted: jax.Array
  accepted: jax.Array
  accepted_at: jax.Array  # [G]: rounds whose draft token at position i was accepted
  emitted: jax.Array
  draft_len_counts: jax.Array  # [G+1]: batched rounds that drafted K tokens (K = 0: a plain step)
  fallback_rounds: jax.Array  # adaptive: plain steps chosen because acceptance fell below the threshold
  probe_rounds: jax.Array  # adaptive: speculative rounds run during fallback to re-measure
  acceptance: adaptive.Acceptance  # per-row EWMA and window of the per-token acceptance rate
  trace_Rx4: jax.Array  # per round: K, row 0's accepted drafts, its window and EWMA rates (Speculation.trace_rounds)

  @classmethod
  def zeros(cls, batch: int, draft_len: int, window: int = 8, trace_rounds: int = 0) -> "DecodeStats":
    z = jnp.zeros((), jnp.int32)
    return cls(rounds=z, target_forwards=z, draft_forwards=z, plain_forwards=z, drafted=z, accepted=z,
               accepted_at=jnp.zeros((draft_len,), jnp.int32), emitted=z,
               draft_len_counts=jnp.zeros((draft_len + 1,), jnp.int32), fallback_rounds=z, probe_rounds=z,
               acceptance=adaptive.Acceptance.zeros(batch, window, draft_len),
               trace_Rx4=jnp.full((trace_rounds, 4), jnp.nan, jnp.float32))


@flax.struct.dataclass
class DecodeState:
  tokens: jax.Array  # [B, L] int32: prompt then emitted tokens; slots past seq_lens are stale
  seq_lens: jax.Array  # [B] int32
  prompt_lens: jax.Array  # [B] int32
  max_new_tokens: jax.Array  # [B] int32
  done: jax.Array  # [B] bool
  keys: jax.Array  # [B, 2] uint32: one PRNG key per row
  sampling: SamplingParams
  target_cache: kvcache.KVCache
  drafter_state: DrafterState
  stats: DecodeStats
  eos_B: jax.Array  # [B] int32: the token that ends row b; -1 for none (no EOS, or EOS ignored)
  layout: Any = flax.struct.field(pytree_node=False, default=None)  # jspec.sharding.Layout on a mesh

  @property
  def num_emitted(self) -> jax.Array:
    return self.seq_lens - self.prompt_lens


def init_state(prompts_BxP: jax.Array, prompt_lens_B: jax.Array, max_new_tokens_B: jax.Array,
               sampling: SamplingParams, seeds_B: jax.Array, capacity: int, target_config: ModelConfig,
               drafter: Drafter | None = None, spec: Speculation | None = None,
               eos_B: jax.Array | None = None) -> DecodeState:
  """A state holding right-padded prompts and empty caches of `capacity` slots (see `required_capacity`).

  Row b stops at token `eos_B[b]` (-1: never); by default at the target's EOS.
  """
  batch, prompt_width = prompts_BxP.shape
  tokens = jnp.zeros((batch, capacity), jnp.int32).at[:, :prompt_width].set(prompts_BxP)
  if eos_B is None:
    eos_B = eos_ids(target_config, batch)
  return DecodeState(
      tokens=tokens, seq_lens=prompt_lens_B.astype(jnp.int32), prompt_lens=prompt_lens_B.astype(jnp.int32),
      max_new_tokens=max_new_tokens_B.astype(jnp.int32), done=jnp.zeros((batch,), bool),
      keys=jax.vmap(jax.random.PRNGKey)(seeds_B.astype(jnp.uint32)), sampling=sampling,
      target_cache=kvcache.init_cache(target_config, batch, capacity),
      drafter_state=None if drafter is None else drafter.init(batch, capacity, spec.draft_len),
      stats=DecodeStats.zeros(batch, spec.draft_len if spec else 1,
                              spec.adaptive.window if spec and spec.adaptive else 8,
                              spec.trace_rounds if spec else 0),
      eos_B=jnp.asarray(eos_B, jnp.int32))


def eos_ids(target_config: ModelConfig, batch: int, ignore_eos: bool = False) -> jax.Array:
  """Each row's stop token, `init_state`'s `eos_B`: the target's EOS, or -1 (never) when it has none or
  `ignore_eos` is set."""
  return jnp.full((batch,), -1 if ignore_eos or target_config.eos_id is None else target_config.eos_id,
                  jnp.int32)


def required_capacity(prompt_width: int, max_new_tokens: int, headroom: int) -> int:
  """Slots a request needs: the padded prompt, every new token, and `headroom` + 1 more for the widest
  chunk a round writes past the text (a verify of K+1 tokens, or a drafter's catch-up)."""
  return prompt_width + max_new_tokens + headroom + 1


def _split_keys(state: DecodeState, num: int) -> tuple[DecodeState, jax.Array]:
  """Advances each row's key; returns `num` fresh keys per row as [num, B, 2]."""
  keys = jax.vmap(lambda k: jax.random.split(k, num + 1))(state.keys)  # [B, num+1, 2]
  return state.replace(keys=keys[:, 0]), jnp.moveaxis(keys[:, 1:], 1, 0)


def _gather(tokens_BxL: jax.Array, index_BxC: jax.Array) -> jax.Array:
  return jnp.take_along_axis(tokens_BxL, index_BxC, axis=1)


def _commit(state: DecodeState, candidates_BxC: jax.Array, num_candidates_B: jax.Array) -> tuple[DecodeState, jax.Array]:
  """Appends each active row's first `num_candidates` tokens, cut after EOS and at max_new_tokens.

  Returns the new state and the number of tokens each row emitted.
  """
  width = candidates_BxC.shape[1]
  idx_C = jnp.arange(width)
  is_eos = (candidates_BxC == state.eos_B[:, None]) & (idx_C < num_candidates_B[:, None])
  upto_eos = jnp.where(is_eos.any(1), jnp.argmax(is_eos, axis=1) + 1, width)
  room = state.max_new_tokens - state.num_emitted
  num_new = jnp.where(state.done, 0, jnp.minimum(jnp.minimum(num_candidates_B, upto_eos), room))
  cols = jnp.where(idx_C < num_new[:, None], state.seq_lens[:, None] + idx_C, state.tokens.shape[1])
  rows = jnp.broadcast_to(jnp.arange(candidates_BxC.shape[0])[:, None], cols.shape)
  tokens = state.tokens.at[rows, cols].set(candidates_BxC, mode="drop")
  hit_eos = is_eos.any(1) & (upto_eos <= num_new)
  done = state.done | hit_eos | (num_new >= room)
  return state.replace(tokens=tokens, seq_lens=state.seq_lens + num_new, done=done), num_new


def _count_round(stats: DecodeStats, active_B: jax.Array, num_new_B: jax.Array) -> DecodeStats:
  return stats.replace(rounds=stats.rounds + active_B.sum(), target_forwards=stats.target_forwards + 1,
                       emitted=stats.emitted + num_new_B.sum())


def _autoregressive_step(params: model.Params, config: ModelConfig, state: DecodeState) -> DecodeState:
  state, keys = _split_keys(state, 1)
  return _target_step(params, config, state, keys[0])


def _target_step(params: model.Params, config: ModelConfig, state: DecodeState, keys_Bx2: jax.Array,
                 drafter: Drafter | None = None, drafter_params=None) -> DecodeState:
  """One target forward, one token per row; a drafter, if any, sees the target's features."""
  n = state.seq_lens
  logits, hidden, cache = model.forward(params, _gather(state.tokens, n[:, None] - 1), n[:, None] - 1,
                                        state.target_cache, config)
  token = next_token(keys_Bx2, logits[:, 0], state.sampling)
  active = ~state.done
  state, num_new = _commit(state, token[:, None], jnp.ones_like(token))
  state = state.replace(target_cache=cache.rewind(state.seq_lens - 1),
                        stats=_count_round(state.stats, active, num_new))
  if drafter is not None:
    state = _observe(drafter, drafter_params, params, state, hidden, n)
  return state


def _observe(drafter: Drafter, drafter_params, target_params, state: DecodeState, hidden, n_B) -> DecodeState:
  """Tells the drafter what the target saw in a forward that started at lengths n_B."""
  with jax.named_scope("drafter"):  # names the drafter's ops in the HLO (tests count its collectives)
    return state.replace(drafter_state=drafter.observe(drafter_params, target_params, state.drafter_state,
                                                       state.tokens, hidden, n_B, state.seq_lens))


def _verify_step(target_params: model.Params, target_config: ModelConfig, drafter: Drafter, drafter_params,
                 state: DecodeState, draft_BxG: jax.Array, draft_logits: jax.Array, has_draft_B: jax.Array,
                 verify_keys_Bx2: jax.Array, typical_acceptance: bool = False) -> DecodeState:
  """The target scores the pending token and the G proposals in one forward and keeps an accepted prefix."""
  draft_len = draft_BxG.shape[1]
  n = state.seq_lens
  chunk = jnp.concatenate([_gather(state.tokens, n[:, None] - 1), draft_BxG], axis=1)
  positions = n[:, None] - 1 + jnp.arange(draft_len + 1)
  logits, hidden, target_cache = model.forward(target_params, chunk, positions, state.target_cache,
                                               target_config)
  if typical_acceptance:
    n_accepted, token = verify_typical(verify_keys_Bx2, draft_BxG, probabilities(logits, state.sampling))
  else:  # q and p go through the same transform; an all-greedy batch needs only argmaxes.
    n_accepted, token = lax.cond(
        is_greedy(state.sampling), lambda: verify_greedy(draft_BxG, logits),
        lambda: verify(verify_keys_Bx2, draft_BxG, probabilities(draft_logits, state.sampling),
                       probabilities(logits, state.sampling)))
  if getattr(drafter, "can_skip_rounds", False):
    # A row without a proposal draws exactly what a plain target step would, with the same key, so its
    # tokens do not depend on whether another row's proposal turned this round into a verify.
    n_accepted = jnp.where(has_draft_B, n_accepted, 0)
    token = jnp.where(has_draft_B, token, next_token(verify_keys_Bx2, logits[:, 0], state.sampling))

  candidates = jnp.concatenate([draft_BxG, token[:, None]], axis=1)
  candidates = jnp.where(jnp.arange(draft_len + 1) == n_accepted[:, None], token[:, None], candidates)
  active = ~state.done
  state, num_new = _commit(state, candidates, n_accepted + 1)
  new_n = state.seq_lens

  counted = active & has_draft_B
  st = _count_round(state.stats, active, num_new)
  stats = st.replace(
      draft_forwards=st.draft_forwards + draft_len, drafted=st.drafted + draft_len * counted.sum(),
      accepted=st.accepted + jnp.where(counted, n_accepted, 0).sum(),
      accepted_at=st.accepted_at.at[:draft_len].add(
          jnp.sum(counted[:, None] & (jnp.arange(draft_len) < n_accepted[:, None]), 0)),
      acceptance=st.acceptance.record(counted, n_accepted, draft_len))
  state = state.replace(target_cache=target_cache.rewind(new_n - 1), stats=stats)
  return _observe(drafter, drafter_params, target_params, state, hidden, n)


def _plain_step(target_params, drafter_params, target_config, drafter, state, keys_Bx2) -> DecodeState:
  """A target step inside the speculative loop: no proposals; the drafter still sees the target."""
  s = _target_step(target_params, target_config, state, keys_Bx2, drafter, drafter_params)
  return s.replace(stats=s.stats.replace(plain_forwards=s.stats.plain_forwards + 1,
                                         acceptance=s.stats.acceptance.after_plain_round()))


def _draft_and_verify(target_params, drafter_params, target_config, drafter, spec: Speculation, draft_len: int,
                      state: DecodeState, keys) -> DecodeState:
  with jax.named_scope("drafter"):
    drafter_state, draft_BxG, draft_logits, has_draft = drafter.propose(
        drafter_params, target_params, state.drafter_state, state.tokens, state.seq_lens, keys[:draft_len],
        state.sampling)
  if state.layout is not None:
    draft_logits = state.layout.pin_draft_logits(draft_logits)
  state = state.replace(drafter_state=drafter_state)
  verify_keys = keys[spec.draft_len]
  verify_step = lambda s: _verify_step(target_params, target_config, drafter, drafter_params, s, draft_BxG,
                                       draft_logits, has_draft, verify_keys, spec.typical_acceptance)
  if not getattr(drafter, "can_skip_rounds", False):
    return verify_step(state)
  has_any = jnp.any(has_draft & ~state.done)
  state = run_if(has_any, verify_step, state)
  return run_if(~has_any, lambda s: _plain_step(target_params, drafter_params, target_config, drafter, s,
                                                verify_keys), state)


def _speculative_step(target_params: model.Params, drafter_params, target_config: ModelConfig,
                      drafter: Drafter, spec: Speculation, state: DecodeState) -> DecodeState:
  state, keys = _split_keys(state, spec.draft_len + 1)
  count = lambda s, k: s.replace(stats=s.stats.replace(draft_len_counts=s.stats.draft_len_counts.at[k].add(1)))
  if spec.adaptive is None:
    return count(_draft_and_verify(target_params, drafter_params, target_config, drafter, spec, spec.draft_len,
                                   state, keys), spec.draft_len)
  # One branch per K (and a plain step for K = 0), chosen at run time: nothing recompiles as K changes.
  draft_len, probe = adaptive.choose(state.stats.acceptance, ~state.done, spec.adaptive, spec.draft_len)
  branches = [lambda s: _plain_step(target_params, drafter_params, target_config, drafter, s, keys[spec.draft_len])]
  branches += [lambda s, k=k: _draft_and_verify(target_params, drafter_params, target_config, drafter, spec, k, s,
                                                keys) for k in range(1, spec.draft_len + 1)]
  before = state.seq_lens[0]
  state = count(run_switch(draft_len, branches, state), draft_len)
  st = state.stats
  if spec.trace_rounds:
    acc = st.acceptance
    row = jnp.stack([draft_len, jnp.where(draft_len > 0, state.seq_lens[0] - before - 1, jnp.nan),
                     acc.window_rate[0], acc.ewma_rate[0]]).astype(jnp.float32)
    st = st.replace(trace_Rx4=st.trace_Rx4.at[st.target_forwards - 1].set(row, mode="drop"))
  return state.replace(stats=st.replace(fallback_rounds=st.fallback_rounds + (draft_len == 0),
                                        probe_rounds=st.probe_rounds + probe))


def _loop(step, state: DecodeState) -> DecodeState:
  return lax.while_loop(lambda s: ~jnp.all(s.done), step, state)


def autoregressive(params: model.Params, config: ModelConfig, state: DecodeState) -> DecodeState:
  """Plain decoding until every row is done: one target forward per token. Pure; jit it yourself or use
  `jspec.api`."""
  trace_counts["autoregressive"] += 1
  params = model.with_head(params)
  return _loop(lambda s: _autoregressive_step(params, config, s), state)


def speculative(target_params: model.Params, drafter_params, target_config: ModelConfig, drafter: Drafter,
                spec: Speculation, state: DecodeState) -> DecodeState:
  """Speculative decoding with any drafter until every row is done. Pure, like `autoregressive`."""
  trace_counts["speculative"] += 1
  target_params = model.with_head(target_params)
  return _loop(lambda s: _speculative_step(target_params, drafter_params, target_config, drafter, spec, s),
               state)
