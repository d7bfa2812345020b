"""Decoding statistics: counters carried on device through the loop, and their summary on the host.

`DecodeStats` is a pytree the loop updates through its methods, one per kind of event; `Stats` is what a
request reports (`Result.stats`, and the CLI's JSON through `to_dict`).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jspec.core.settings import COST_FIELDS, SpecConfig
from jspec.speculation import adaptive


@flax.struct.dataclass
class DecodeStats:
  """Counters over active rows. A "round" is one row taking part in one target forward."""
  rounds: jax.Array
  target_forwards: jax.Array  # batched target forwards in the loop (prefill not counted)
  draft_forwards: jax.Array  # drafting steps in the loop (batched)
  plain_forwards: jax.Array  # target forwards in the speculative loop that verified no draft
  drafted: jax.Array
  accepted: jax.Array
  accepted_at_K: jax.Array  # rounds whose draft token at position i was accepted
  emitted: jax.Array
  draft_len_counts_K1: jax.Array  # batched rounds that drafted k tokens (k = 0: a plain step)
  fallback_rounds: jax.Array  # adaptive: plain steps chosen because acceptance fell below the threshold
  probe_rounds: jax.Array  # adaptive: speculative rounds run during fallback to re-measure
  acceptance: adaptive.Acceptance  # per-row EWMA and window of the per-token acceptance rate
  trace_Rx4: jax.Array  # per round: K, row 0's accepted drafts, its window and EWMA rates
  verifies: jax.Array  # row-rounds that verified proposals (vLLM's "drafts")
  row_rounds_B: jax.Array  # per row (request): target forwards it took part in
  row_verifies_B: jax.Array  # per row: rounds that verified its proposals
  row_drafted_B: jax.Array  # per row: proposals it tested
  row_accepted_B: jax.Array  # per row: proposals it accepted

  @classmethod
  def zeros(cls, batch: int, draft_len: int, window: int, trace_rounds: int = 0) -> DecodeStats:
    z = jnp.zeros((), jnp.int32)
    return cls(rounds=z, target_forwards=z, draft_forwards=z, plain_forwards=z, drafted=z, accepted=z,
               accepted_at_K=jnp.zeros((draft_len,), jnp.int32), emitted=z,
               draft_len_counts_K1=jnp.zeros((draft_len + 1,), jnp.int32), fallback_rounds=z, probe_rounds=z,
               acceptance=adaptive.Acceptance.zeros(batch, window, draft_len),
               trace_Rx4=jnp.full((trace_rounds, 4), jnp.nan, jnp.float32),
               verifies=z, row_rounds_B=jnp.zeros((batch,), jnp.int32),
               row_verifies_B=jnp.zeros((batch,), jnp.int32), row_drafted_B=jnp.zeros((batch,), jnp.int32),
               row_accepted_B=jnp.zeros((batch,), jnp.int32))

  def count_forward(self, active_B: jax.Array, num_new_B: jax.Array) -> DecodeStats:
    """One batched target forward in which the active rows emitted `num_new_B` tokens."""
    return self.replace(rounds=self.rounds + active_B.sum(), target_forwards=self.target_forwards + 1,
                        emitted=self.emitted + num_new_B.sum(), row_rounds_B=self.row_rounds_B + active_B)

  def count_verify(self, counted_B: jax.Array, n_accepted_B: jax.Array, draft_len: int,
                   forwards: int | None = None) -> DecodeStats:
    """A verify of `draft_len` proposals drafted in `forwards` draft forwards (default one each); rows not
    counted (done, or without a proposal) test nothing."""
    accepted_BxK = counted_B[:, None] & (jnp.arange(draft_len) < n_accepted_B[:, None])
    drafted_B, accepted_B = draft_len * counted_B, jnp.where(counted_B, n_accepted_B, 0)
    return self.replace(
        draft_forwards=self.draft_forwards + (draft_len if forwards is None else forwards),
        drafted=self.drafted + drafted_B.sum(),
        accepted=self.accepted + accepted_B.sum(), row_drafted_B=self.row_drafted_B + drafted_B,
        verifies=self.verifies + counted_B.sum(), row_verifies_B=self.row_verifies_B + counted_B,
        row_accepted_B=self.row_accepted_B + accepted_B,
        accepted_at_K=self.accepted_at_K.at[:draft_len].add(accepted_BxK.sum(0)),
        acceptance=self.acceptance.record(counted_B, n_accepted_B, draft_len))

  def count_plain(self) -> DecodeStats:
    """A target step in the speculative loop that verified no proposal."""
    return self.replace(plain_forwards=self.plain_forwards + 1, acceptance=self.acceptance.after_plain_round())

  def count_schedule(self, draft_len: jax.Array | int, probe: jax.Array | bool = False) -> DecodeStats:
    """The round's scheduled K (0: an adaptive plain step) and whether it was a probe during fallback."""
    return self.replace(draft_len_counts_K1=self.draft_len_counts_K1.at[draft_len].add(1),
                        fallback_rounds=self.fallback_rounds + (draft_len == 0),
                        probe_rounds=self.probe_rounds + probe)

  def record_trace(self, draft_len: jax.Array, row0_accepted: jax.Array) -> DecodeStats:
    """Writes this round's decision into the trace (a no-op once it is full)."""
    acc = self.acceptance
    row = jnp.stack([draft_len, jnp.where(draft_len > 0, row0_accepted, jnp.nan), acc.window_rate[0],
                     acc.ewma_rate[0]]).astype(jnp.float32)
    return self.replace(trace_Rx4=self.trace_Rx4.at[self.target_forwards - 1].set(row, mode="drop"))


@dataclasses.dataclass(frozen=True)
class Stats:
  """What one request reports. `to_dict()` is the `stats` object of the CLI's JSON."""
  drafter: str | None  # which drafter ran; None for plain decoding
  verify: str | None  # "exact rejection sampling", or "typical acceptance (lossy)"
  lossy: bool
  acceptance_rate: float | None  # accepted / drafted
  mean_accepted_length: float | None  # tau: tokens emitted per row per target forward
  rounds: int  # row-rounds: one row taking part in one target forward
  target_forwards: int  # batched target forwards in the loop (prefill not counted)
  draft_forwards: int
  plain_forwards: int  # target forwards in the speculative loop that verified nothing
  drafted_tokens: int
  accepted_tokens: int
  emitted_tokens: int
  per_position_acceptance: list[float]  # share of rounds whose i-th draft was accepted
  acceptance_ewma: float | None
  acceptance_window: float | None
  adaptive: bool
  # Adaptive K's cost model: {"source": "calibrated" | "checkpoint" | "neutral", "cost_ratio", "verify_cost",
  # "round_overhead", "round_costs": a round of K = 1, 2, ... in target steps} (at the batch's width;
  # `jspec.planning.calibration`); None without adaptive K.
  cost_model: dict[str, Any] | None
  tree: dict[str, int] | None  # the draft tree's depth, top_k and nodes; None: chains
  draft_len_counts: dict[int, int]  # batched rounds per scheduled K; 0: an adaptive plain step
  fallback_rounds: int
  probe_rounds: int
  trace: list[dict[str, Any]]  # per-round adaptive decisions (`SpecConfig.trace_rounds`)
  tokens_per_second: float | None
  wall_seconds: float  # decoding, compilation excluded
  compile_seconds: float

  @classmethod
  def from_device(cls, stats: DecodeStats, wall_seconds: float, compile_seconds: float,
                  spec: SpecConfig | None) -> Stats:
    """`spec`: the decoder's speculation settings (None: plain decoding)."""
    s = jax.tree.map(np.asarray, stats)
    drafter, speculative = spec and spec.drafter, spec is not None
    lossy = bool(spec and spec.typical_acceptance)
    tree = spec and spec.tree and {"depth": spec.draft_len, "top_k": spec.tree.top_k, "nodes": spec.tree.nodes}
    drafted, rounds, emitted = int(s.drafted), int(s.rounds), int(s.emitted)
    return cls(
        drafter=drafter,
        verify="typical acceptance (lossy)" if lossy else "exact rejection sampling" if speculative else None,
        lossy=lossy,
        acceptance_rate=float(s.accepted) / drafted if drafted else None,
        mean_accepted_length=emitted / rounds if rounds else None,
        rounds=rounds, target_forwards=int(s.target_forwards), draft_forwards=int(s.draft_forwards),
        plain_forwards=int(s.plain_forwards), drafted_tokens=drafted, accepted_tokens=int(s.accepted),
        emitted_tokens=emitted,
        per_position_acceptance=[float(a) / rounds for a in s.accepted_at_K] if speculative and rounds else [],
        acceptance_ewma=_mean_finite(s.acceptance.ewma_rate) if speculative else None,
        acceptance_window=_mean_finite(s.acceptance.window_rate) if speculative else None,
        adaptive=bool(spec and spec.adaptive), cost_model=_cost_model(spec), tree=tree or None,
        draft_len_counts={k: int(c) for k, c in enumerate(s.draft_len_counts_K1) if c} if speculative else {},
        fallback_rounds=int(s.fallback_rounds), probe_rounds=int(s.probe_rounds),
        trace=[dict(zip(("draft_len", "accepted", "acceptance_window", "acceptance_ewma"),
                        [None if np.isnan(v) else float(v) for v in row]))
               for row in s.trace_Rx4 if not np.isnan(row[0])],
        tokens_per_second=emitted / wall_seconds if wall_seconds > 0 else None,
        wall_seconds=wall_seconds, compile_seconds=compile_seconds)

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class RequestStats:
  """What one prompt's decoding reports (a row of the batch, or a slot's request under continuous
  batching); `to_dict()` is the `stats` of its output line."""
  emitted_tokens: int
  rounds: int  # target forwards the request took part in
  drafted_tokens: int
  accepted_tokens: int
  acceptance_rate: float | None  # accepted / drafted
  mean_accepted_length: float | None  # tau: tokens per target forward
  drafts: int = 0  # rounds that verified its proposals
  mean_acceptance_length: float | None = None  # vLLM's: 1 + accepted / drafts

  @classmethod
  def of_row(cls, stats: DecodeStats, row: int, emitted_tokens: int) -> RequestStats:
    """Row `row` of `DecodeStats`' per-row counters (fetched to the host)."""
    rounds, drafted, accepted = int(stats.row_rounds_B[row]), int(stats.row_drafted_B[row]), \
        int(stats.row_accepted_B[row])
    drafts = int(stats.row_verifies_B[row])
    return cls(emitted_tokens=emitted_tokens, rounds=rounds, drafted_tokens=drafted, accepted_tokens=accepted,
               acceptance_rate=accepted / drafted if drafted else None,
               mean_accepted_length=emitted_tokens / rounds if rounds else None, drafts=drafts,
               mean_acceptance_length=1 + accepted / drafts if drafts else None)

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


def _cost_model(spec: SpecConfig | None) -> dict[str, Any] | None:
  policy = spec and spec.adaptive
  if not policy:
    return None
  return {"source": policy.cost_source, **{name: getattr(policy, name) for name in COST_FIELDS},
          "round_costs": list(policy.costs_by_rows[-1]) if policy.costs_by_rows else None}


def _mean_finite(x: np.ndarray) -> float | None:
  """The mean over rows with data (NaN marks a row that never tested a proposal)."""
  x = x[np.isfinite(x)]
  return float(x.mean()) if x.size else None
