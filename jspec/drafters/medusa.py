"""Medusa heads (Cai et al. 2024): K residual SiLU blocks on the target's last feature, sharing its LM head.

Head k (0-based) maps the feature at position t to a distribution over the token at t + 2 + k: the LM head
itself already gives t + 1, the token the round starts from. As a chain, each head proposes one token and
q is that head's distribution under the request's sampling transform, so verification stays exact. As a
static tree (Medusa's `tree_choices`), the node at path (r_1, ..., r_d) is head d's r_d-th most likely
token: children chosen deterministically, verified by `jspec.tree`'s top-k rule.
Weights: `w [heads, D, D]`, `b [heads, D]`, zero-initialized so an untrained head repeats the LM head.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from jspec import losses, model, tree
from jspec.config import ModelConfig
from jspec.drafters.base import Features, Proposal, TreeProposal
from jspec.sampling import SamplingParams, next_token


@dataclasses.dataclass(frozen=True)
class MedusaDrafter:
  config: ModelConfig  # the target's: the heads work at its width and share its LM head
  num_heads: int
  kind: str = "medusa"
  can_skip_rounds = False

  def init_params(self, key: jax.Array | None = None) -> dict:
    d, dtype = self.config.dim, self.config.jnp_dtype
    return {"w": jnp.zeros((self.num_heads, d, d), dtype), "b": jnp.zeros((self.num_heads, d), dtype)}

  def head_features(self, params: dict, feature_BxSxD: jax.Array, heads: int) -> jax.Array:
    """The first `heads` heads applied to every feature: [B,S,heads,D]."""
    x = feature_BxSxD[:, :, None, :]
    return x + jax.nn.silu(jnp.einsum("btd,kde->btke", feature_BxSxD, params["w"][:heads]) + params["b"][:heads])

  def init(self, batch: int, capacity: int, draft_len: int) -> Features:
    return Features.zeros(batch, draft_len + 1, self.config.dim, self.config.jnp_dtype)

  def prefill(self, params, target_params, state: Features, prompts_BxP, prompt_lens_B, hidden_BxPxD):
    return Features.from_prefill(hidden_BxPxD, prompt_lens_B, state.feats_BxCxD.shape[1])

  def propose(self, params, target_params, state: Features, tokens_BxT, seq_lens_B, keys_KxBx2,
              sampling: SamplingParams) -> tuple[Features, Proposal]:
    num = keys_KxBx2.shape[0]
    heads_BxKxD = self.head_features(params, state.last(seq_lens_B)[:, None], num)[:, 0]
    logits_BxKxV = model.logits_from_hidden(target_params, heads_BxKxD, self.config)
    tokens_BxK = jnp.stack([next_token(keys_KxBx2[i], logits_BxKxV[:, i], sampling) for i in range(num)], 1)
    return state, Proposal(tokens_BxK, logits_BxKxV, jnp.ones(seq_lens_B.shape, bool))

  def propose_tree(self, params, target_params, state: Features, tokens_BxT, seq_lens_B, spec, keys_Bx2,
                   sampling) -> tuple[Features, TreeProposal]:
    """The static tree `spec.tree.choices`: node (r1, .., rd) is head d's rank-rd token (top-k children)."""
    shape = tree.static_shape(spec.tree.choices)
    heads_BxLxD = self.head_features(params, state.last(seq_lens_B)[:, None], spec.draft_len)[:, 0]
    logits_BxLxV = model.logits_from_hidden(target_params, heads_BxLxD, self.config)
    top_BxLxR = lax.top_k(logits_BxLxV, spec.tree.top_k)[1].astype(jnp.int32)
    tokens_BxM = top_BxLxR[:, shape.depth_M - 1, shape.rank_M]
    parents_BxM = jnp.broadcast_to(jnp.asarray(shape.parent_M, jnp.int32), tokens_BxM.shape)
    return state, TreeProposal(tokens_BxM, parents_BxM, None, tree.TOP_K)

  def observe(self, params, target_params, state: Features, tokens_BxT, hidden_BxSxD, n_B, new_n_B) -> Features:
    return state.update(hidden_BxSxD, n_B)

  def loss(self, params: dict, hidden_BxSxD: jax.Array, target_logits_BxSxV: jax.Array,
           target_params: dict) -> jax.Array:
    """Self-distillation: head k at position t matches the target's own distribution at t + 1 + k."""
    seq = hidden_BxSxD.shape[1]
    heads = self.head_features(params, hidden_BxSxD, self.num_heads)
    total = 0.0
    for k in range(self.num_heads):
      shift = k + 1
      total = total + losses.kl(target_logits_BxSxV[:, shift:],
                                model.logits_from_hidden(target_params, heads[:, :seq - shift, k], self.config))
    return total / self.num_heads
