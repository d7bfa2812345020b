"""Medusa heads (Cai et al. 2024): K residual SiLU blocks on the target's last feature, sharing its LM head.

Head k (0-based) maps the feature at position t to a distribution over the token at t + 2 + k: the LM head
itself already gives t + 1, the token the round starts from. Each head proposes one token (a chain, no
tree), and q is that head's distribution under the request's sampling transform, so verification stays
exact. Weights: `w [heads, D, D]`, `b [heads, D]`, zero-initialized so an untrained head repeats the LM head.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jspec import model
from jspec.config import ModelConfig
from jspec.drafters.base import Features
from jspec.sampling import SamplingParams, next_token


@dataclasses.dataclass(frozen=True)
class MedusaDrafter:
  target_config: ModelConfig
  num_heads: int
  kind: str = "medusa"

  def init_params(self, key: jax.Array | None = None) -> dict:
    d, dtype = self.target_config.dim, self.target_config.jnp_dtype
    return {"w": jnp.zeros((self.num_heads, d, d), dtype), "b": jnp.zeros((self.num_heads, d), dtype)}

  def head_features(self, params: dict, feature_BxTxD: jax.Array, heads: int) -> jax.Array:
    """The first `heads` heads applied to every feature: [B,T,heads,D]."""
    x = feature_BxTxD[:, :, None, :]
    return x + jax.nn.silu(jnp.einsum("btd,kde->btke", feature_BxTxD, params["w"][:heads]) + params["b"][:heads])

  def init(self, batch: int, capacity: int, draft_len: int) -> Features:
    return Features.zeros(batch, draft_len + 1, self.target_config.dim, self.target_config.jnp_dtype)

  def prefill(self, params, target_params, state: Features, prompts_BxP, prompt_lens_B, hidden_BxPxD):
    return Features.from_prefill(hidden_BxPxD, prompt_lens_B, state.feats_BxCxD.shape[1])

  def propose(self, params, target_params, state: Features, tokens_BxL, seq_lens_B, keys_GxBx2,
              sampling: SamplingParams):
    num = keys_GxBx2.shape[0]
    heads_BxGxD = self.head_features(params, state.last(seq_lens_B)[:, None], num)[:, 0]
    logits_BxGxV = model.logits_from_hidden(target_params, heads_BxGxD)
    tokens_BxG = jnp.stack([next_token(keys_GxBx2[i], logits_BxGxV[:, i], sampling) for i in range(num)], 1)
    return state, tokens_BxG, logits_BxGxV, jnp.ones(seq_lens_B.shape, bool)

  def observe(self, params, target_params, state: Features, tokens_BxL, hidden_BxSxD, n_B, new_n_B) -> Features:
    return state.update(hidden_BxSxD, n_B)

  def loss(self, params: dict, hidden_BxSxD: jax.Array, target_logits_BxSxV: jax.Array,
           target_params: dict) -> jax.Array:
    """Self-distillation: head k at position t matches the target's own distribution at t + 1 + k."""
    seq = hidden_BxSxD.shape[1]
    heads = self.head_features(params, hidden_BxSxD, self.num_heads)
    total = 0.0
    for k in range(self.num_heads):
      shift = k + 1
      logq = jax.nn.log_softmax(model.logits_from_hidden(target_params, heads[:, :seq - shift, k]), -1)
      logp = jax.nn.log_softmax(target_logits_BxSxV[:, shift:], -1)
      total = total + jnp.mean(jnp.sum(jnp.exp(logp) * (logp - logq), -1))
    return total / self.num_heads
