"""Adaptive speculation, decided inside the loop from carried acceptance statistics.

Per row we carry the per-token acceptance rate two ways: an EWMA (weight 0.1) and a rolling window of the
last W speculative rounds. A round that accepts a of K proposals tested a + [a < K] of them (the first
rejection is a test too; nothing after it is), so the rate estimates alpha, the chance that one proposal
is accepted, whatever K was. We also carry, per draft position i, r_i, the chance that proposal i is
accepted given that it was tested: acceptance is correlated (easy stretches accept long runs), so r_i grows
with i, and Leviathan's i.i.d. alpha^i underestimates what long drafts gain. r_i is an EWMA over rounds
shrunk toward 1 by a prior worth one round (every round ages every position), optimism that keeps the
estimate of a position no round tests from going stale: short drafts test only the first positions, so
a rate that stayed low would pin K short for good (a single early rejection, or a bursty text, code that
repeats, whose rounds either fail at once or accept the whole draft, where the first positions' rejections
say nothing of the deep ones). One rejection moves a position's rate halfway to 0; untested for a few
dozen rounds any rate is back near 1, a longer draft is tried, and what it measures decides. A position
tested every round outweighs the prior ten to one.
The batch shares one target forward, so the policy is per batch:

- K: among the policy's draft lengths (`AdaptiveConfig.lens`: 1, 2, 4, ... and K_max unless set), the one
  that maximizes the mean over active rows of the expected speedup E[tokens | K] / cost(K),
  with E[tokens | K] = 1 + sum_{j<=K} r_1 ... r_j (1 where position i has no data yet) and cost(K)
  what a round of K drafts costs in target steps at the batch's size (`CostModel.round_cost`): as
  measured by `python -m jspec.calibrate`, else 1 + o + K (c + v), where c is the drafter's cost ratio,
  v what each extra verified token adds to the target forward, and o what a speculative round costs
  beyond its forwards (verification, bookkeeping, the draft's catch-up). With r_i = alpha and o = v = 0
  this is Leviathan's (1 - alpha^(K+1)) / ((1 - alpha)(K c + 1)); on a CPU a round is far from that line
  (a verify of a few tokens costs well over one step: docs/cpu-performance.md), and ignoring it picks
  drafts of the wrong length. `initial_draft_len` (the longest length up to it) until any row has data.
- Stepping aside: a plain step whatever the acceptance when no running row speculates (a request may turn
  speculation off), or when `disable_at_rows` rows or more run. The fallback below also takes plain steps
  when no K would beat a plain step even at full acceptance, at the costs for the batch's width (a
  loaded batch). The serving engine runs each segment at the narrowest width that holds its busy rows
  (`jspec.decoding.rows.run_rows`), so a server decodes plainly under load and speculates when quiet.
- Fallback: when the mean windowed rate of the active rows whose window is full (W speculative rounds) is
  below `fallback_threshold`, or no K is expected to beat a plain step (a large batch, whose verify costs
  more), the round is a plain target step (branch 0); a rate from fewer rounds is too noisy to stop on
  (one unlucky first round would cost a good prompt `probe_interval` plain steps). Every `probe_interval`
  plain rounds, one speculative round
  (a probe) re-measures, so speculation resumes when the text turns predictable again.
"""
from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from jspec.core.settings import AdaptiveConfig

EWMA_WEIGHT = 0.1  # weight of the newest round, as in the seed's scheduler
PRIOR_WEIGHT = 0.1  # how much the optimistic prior (1) counts in each per-position rate (one round: 0.1)


@flax.struct.dataclass
class Acceptance:
  ewma_accepted_B: jax.Array
  ewma_tested_B: jax.Array
  window_accepted_BxW: jax.Array
  window_tested_BxW: jax.Array
  ewma_hit_BxK: jax.Array  # per draft position: EWMA over rounds of "tested and accepted"
  ewma_tested_BxK: jax.Array  # the same EWMA of "tested" (0 = no data)
  slot: jax.Array  # [] int32: the window slot the next speculative round writes
  plain_since_spec: jax.Array  # [] int32: plain rounds since the last speculative round

  @classmethod
  def zeros(cls, batch: int, window: int, max_draft_len: int) -> Acceptance:
    f = lambda *shape: jnp.zeros(shape, jnp.float32)
    z = jnp.zeros((), jnp.int32)
    return cls(f(batch), f(batch), f(batch, window), f(batch, window), f(batch, max_draft_len),
               f(batch, max_draft_len), z, z)

  def record(self, counted_B: jax.Array, n_accepted_B: jax.Array, draft_len) -> Acceptance:
    """One speculative round; rows not counted (done, or without a proposal) keep their statistics."""
    accepted = n_accepted_B.astype(jnp.float32)
    tested = accepted + (n_accepted_B < draft_len)
    ewma = lambda old, new: jnp.where(counted_B, (1 - EWMA_WEIGHT) * old + EWMA_WEIGHT * new, old)
    window = lambda buf, new: buf.at[:, self.slot].set(jnp.where(counted_B, new, buf[:, self.slot]))
    position_K = jnp.arange(self.ewma_hit_BxK.shape[1])
    tested_BxK = counted_B[:, None] & (position_K <= n_accepted_B[:, None]) & (position_K < draft_len)
    per_position = lambda old, new: jnp.where(counted_B[:, None], (1 - EWMA_WEIGHT) * old + EWMA_WEIGHT * new,
                                              old)
    return Acceptance(ewma(self.ewma_accepted_B, accepted), ewma(self.ewma_tested_B, tested),
                      window(self.window_accepted_BxW, accepted), window(self.window_tested_BxW, tested),
                      per_position(self.ewma_hit_BxK, tested_BxK & (position_K < n_accepted_B[:, None])),
                      per_position(self.ewma_tested_BxK, tested_BxK),
                      (self.slot + 1) % self.window_tested_BxW.shape[1], jnp.zeros_like(self.plain_since_spec))

  def after_plain_round(self) -> Acceptance:
    return self.replace(plain_since_spec=self.plain_since_spec + 1)

  @property
  def ewma_rate(self) -> jax.Array:
    """[B] per-token acceptance rate from the EWMA; NaN where nothing was tested yet."""
    return self.ewma_accepted_B / jnp.where(self.ewma_tested_B > 0, self.ewma_tested_B, jnp.nan)

  @property
  def position_rates(self) -> jax.Array:
    """[B, K] r_i: the chance proposal i is accepted once tested, shrunk toward 1 (optimism)."""
    return (self.ewma_hit_BxK + PRIOR_WEIGHT) / (self.ewma_tested_BxK + PRIOR_WEIGHT)

  @property
  def window_full(self) -> jax.Array:
    """[B] whether the window holds W speculative rounds (each tests at least one proposal)."""
    return (self.window_tested_BxW > 0).all(1)

  @property
  def window_rate(self) -> jax.Array:
    """[B] per-token acceptance rate over the window; NaN where nothing was tested yet."""
    tested = self.window_tested_BxW.sum(1)
    return self.window_accepted_BxW.sum(1) / jnp.where(tested > 0, tested, jnp.nan)


def expected_speedup(rates_BxK: jax.Array, round_costs_K) -> jax.Array:
  """[B, K]: the expected speedup of drafting k = 1..K tokens, from per-position acceptance rates r_1..r_K
  and what a round of k drafts costs in target steps. With every r_i = alpha and rounds of 1 + K c it is
  Leviathan et al.'s."""
  tokens_BxK = 1 + jnp.cumsum(jnp.cumprod(jnp.clip(rates_BxK, 0.0, 1.0), axis=-1), axis=-1)
  return tokens_BxK / jnp.asarray(round_costs_K, jnp.float32)


def _masked_mean(x_B: jax.Array, mask_B: jax.Array) -> jax.Array:
  return jnp.sum(jnp.where(mask_B, x_B, 0.0), -1) / jnp.maximum(jnp.sum(mask_B, -1), 1)


def choose(acceptance: Acceptance, active_B: jax.Array, policy: AdaptiveConfig, max_draft_len: int,
           speculating_B: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """Returns (draft_len, probe): draft_len 0 means a plain target step. `policy` has its cost model set
  (`AdaptiveConfig.with_costs`, for drafts of up to `max_draft_len`; without `costs_by_rows` its c, v and
  o give the line); its costs are those at the batch's width (every row, done or not, rides
  in the verify); acceptance is read from the active rows that speculate (`speculating_B`, default all)."""
  rows = active_B.sum()
  costs = policy.costs_by_rows or (tuple(policy.cost.round_cost(k) for k in range(1, max_draft_len + 1)),)
  round_costs_K = costs[min(active_B.shape[0], len(costs)) - 1]
  active_B = active_B if speculating_B is None else active_B & speculating_B
  alpha_B = acceptance.ewma_rate
  has_data = active_B & ~jnp.isnan(alpha_B)
  rates_BxK = acceptance.position_rates
  gain_BxK = expected_speedup(rates_BxK, round_costs_K)
  lens = policy.lens(max_draft_len)
  gain_K = jnp.where(jnp.isin(jnp.arange(1, max_draft_len + 1), jnp.asarray(lens)),
                     _masked_mean(gain_BxK.T, has_data[None, :]), -jnp.inf)
  initial = max(k for k in lens if k <= policy.initial_draft_len)
  best = jnp.where(has_data.any(), 1 + jnp.argmax(gain_K), initial)

  window_B = acceptance.window_rate
  windowed = active_B & acceptance.window_full
  low = _masked_mean(jnp.nan_to_num(window_B), windowed) < policy.fallback_threshold
  # Or whatever the acceptance, when no K would pay even if every proposal were accepted (a loaded batch,
  # whose verify costs more than it gains).
  ceiling = jnp.max(expected_speedup(jnp.ones((1, max_draft_len)), round_costs_K))
  fallback = (policy.fallback_threshold > 0) & ((windowed.any() & (low | (jnp.max(gain_K) < 1))) | (ceiling < 1))
  # Stepping aside: no running row speculates, or too many rows run.
  disabled = policy.disable_at_rows is not None and rows >= (policy.disable_at_rows or 0)
  aside = ~active_B.any() | disabled
  # Probes run even then: one round of K = 1 every `probe_interval` plain steps keeps a drafter that
  # plain steps leave behind (`Drafter.lags_plain_steps`) within its catch-up reach.
  probe = (fallback | aside) & (acceptance.plain_since_spec >= policy.probe_interval)
  draft_len = jnp.where(aside, 1, best)
  return jnp.where((fallback | aside) & ~probe, 0, draft_len).astype(jnp.int32), probe
