"""The interface every drafter implements, the proposals it makes, trained heads, and the target features
that head drafters read.

A drafter is a frozen (hashable) dataclass: it is a static part of the jitted loop, and its weights, if
any, are a separate pytree. Its per-request state (a KV cache, the target's last features) rides in the
loop's carried state. Each round the loop calls:

  propose(...)  -> a `Proposal`: K tokens per row and the logits each was sampled from (q for rejection
                   sampling);
  observe(...)  -> after the target forward and the commit: learn the target's features of the round and
                   roll back to the accepted text. A round may also be a plain target step (no proposals:
                   n-gram misses, adaptive fallback), which observe sees as S = 1.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

import flax.struct
import jax
import jax.numpy as jnp
from jax import lax

from jspec.config import ModelConfig
from jspec.sampling import SamplingParams, next_token
from jspec.settings import CostModel

DrafterState = Any  # a pytree; None for stateless drafters


@flax.struct.dataclass
class Proposal:
  """K proposed tokens per row, for positions `seq_lens[b] + i`, and the logits each was drawn from."""
  tokens_BxK: jax.Array
  logits_BxKxV: jax.Array
  has_draft_B: jax.Array  # False: the row has no real proposal (its tokens are placeholders)


@flax.struct.dataclass
class TreeProposal:
  """A draft tree per row, flattened as `jspec.tree` describes: node m's token, the chunk index of its
  parent, and (for children drawn from q) the logits q came from at each chunk entry."""
  tokens_BxM: jax.Array
  parents_BxM: jax.Array
  logits_BxM1xV: jax.Array | None
  rule: str = flax.struct.field(pytree_node=False)  # jspec.tree.TOP_K or SAMPLED


class Drafter(Protocol):
  kind: str  # one of `jspec.settings.DRAFTERS`
  config: ModelConfig | None  # the shape its weights and cache follow (Medusa: the target's); None: no weights
  can_skip_rounds: bool  # rows may lack a proposal, and a round where none has one is a plain target step

  def init(self, batch: int, capacity: int, draft_len: int) -> DrafterState:
    """Empty state for a batch, with room for `capacity` positions per row."""

  def prefill(self, params: Any, target_params: Any, state: DrafterState, prompts_BxP: jax.Array,
              prompt_lens_B: jax.Array, hidden_BxPxD: jax.Array) -> DrafterState:
    """Reads the prompts; `hidden` is the target's prefill output (final-normed features)."""

  def propose(self, params: Any, target_params: Any, state: DrafterState, tokens_BxT: jax.Array,
              seq_lens_B: jax.Array, keys_KxBx2: jax.Array,
              sampling: SamplingParams) -> tuple[DrafterState, Proposal]:
    """K proposals per row. Token i of row b is drawn with `keys[i, b]` from the distribution that its
    logits give under `sampling`. A row without a real proposal still returns well-formed tokens and
    logits; when no row has one, the loop runs a plain target step.
    """

  def observe(self, params: Any, target_params: Any, state: DrafterState, tokens_BxT: jax.Array,
              hidden_BxSxD: jax.Array, n_B: jax.Array, new_n_B: jax.Array) -> DrafterState:
    """After a target forward over S tokens at positions `[n-1, n-1+S)`, with `new_n` tokens now held.
    After a tree round, `hidden` holds the accepted path's features in that order."""

  # Drafters that branch also have
  #   propose_tree(params, target_params, state, tokens_BxT, seq_lens_B, spec, keys_Bx2, sampling)
  #     -> (state, TreeProposal)
  # with the tree's shape from `spec` (`SpecConfig.tree`, depth `spec.draft_len`); the keys and the rows'
  # sampling draw children from q when `spec.tree.sampled`.


@dataclasses.dataclass(frozen=True)
class Heads:
  """Trained Medusa or EAGLE weights, the drafter they belong to, and the cost models measured with them
  (by drafter kind; see `jspec.settings.CostModel`)."""
  drafter: Any  # MedusaDrafter | EagleDrafter
  params: dict
  cost_models: dict[str, CostModel] = dataclasses.field(default_factory=dict)

  @property
  def num_params(self) -> int:
    return sum(x.size for x in jax.tree.leaves(self.params))


@flax.struct.dataclass
class Features:
  """The target's final-normed features of the last target forward: feats[b, i] is at position start[b] + i.

  Head drafters read the feature that predicted the last committed token (position seq_len - 2).
  """
  feats_BxCxD: jax.Array
  start_B: jax.Array

  @classmethod
  def zeros(cls, batch: int, width: int, dim: int, dtype) -> Features:
    return cls(jnp.zeros((batch, width, dim), dtype), jnp.zeros((batch,), jnp.int32))

  @classmethod
  def from_prefill(cls, hidden_BxPxD: jax.Array, prompt_lens_B: jax.Array, width: int) -> Features:
    """Keeps the feature at position len-2 (clamped to 0 for one-token prompts, whose draft is then
    uninformed but still verified)."""
    start = jnp.maximum(prompt_lens_B - 2, 0).astype(jnp.int32)
    last = jnp.take_along_axis(hidden_BxPxD, start[:, None, None], axis=1)
    feats = jnp.zeros((hidden_BxPxD.shape[0], width, hidden_BxPxD.shape[2]), hidden_BxPxD.dtype)
    return cls(feats.at[:, :1].set(last), start)

  def update(self, hidden_BxSxD: jax.Array, n_B: jax.Array) -> Features:
    """Stores a target forward's features (S <= width) starting at position n-1."""
    feats = self.feats_BxCxD.at[:, :hidden_BxSxD.shape[1]].set(hidden_BxSxD.astype(self.feats_BxCxD.dtype))
    return Features(feats, (n_B - 1).astype(jnp.int32))

  def last(self, seq_lens_B: jax.Array) -> jax.Array:
    """The feature at position seq_len - 2, [B,D]."""
    idx = jnp.clip(seq_lens_B - 2 - self.start_B, 0, self.feats_BxCxD.shape[1] - 1)
    return jnp.take_along_axis(self.feats_BxCxD, idx[:, None, None], axis=1)[:, 0]


def draft_chain(step: Callable[[Any, jax.Array], tuple[Any, jax.Array]], carry: Any, logits_BxV: jax.Array,
                keys_KxBx2: jax.Array, sampling: SamplingParams) -> tuple[Any, Proposal]:
  """Samples K tokens autoregressively: token i from the logits so far, then `step(carry, token)` gives
  the next logits. The last token needs no step: the next round feeds it if it is accepted.
  """
  def body(c, key_Bx2):
    carry, logits_BxV = c
    token = next_token(key_Bx2, logits_BxV, sampling)
    carry, next_logits = step(carry, token)
    return (carry, next_logits), (token, logits_BxV)

  (carry, logits_BxV), (tokens_KxB, logits_KxBxV) = lax.scan(body, (carry, logits_BxV), keys_KxBx2[:-1])
  token = next_token(keys_KxBx2[-1], logits_BxV, sampling)
  tokens_BxK = jnp.concatenate([tokens_KxB.T, token[:, None]], axis=1)
  logits_BxKxV = jnp.concatenate([jnp.moveaxis(logits_KxBxV, 0, 1), logits_BxV[:, None]], axis=1)
  return carry, Proposal(tokens_BxK, logits_BxKxV, jnp.ones(tokens_BxK.shape[:1], bool))
