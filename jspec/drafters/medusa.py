"""Medusa heads (Cai et al. 2024): K heads of residual SiLU blocks on the target's last feature.

Head k (0-based) maps the feature at position t to a distribution over the token at t + 2 + k: the LM head
itself already gives t + 1, the token the round starts from. Each head is `num_layers` blocks x + SiLU(x W
+ b) and an LM head: the target's (as jspec trains them), one of their own that all share (vLLM's
`original_lm_head`), or one each (as FasterDecoding's Medusa trains them). As a chain, each head proposes
one token and q is that head's distribution under the request's sampling transform, so verification stays
exact. As a static tree (Medusa's `tree_choices`), the node at path (r_1, ..., r_d) is head d's r_d-th most
likely token: children chosen deterministically, verified by `jspec.speculation.tree`'s top-k rule.
Weights: `w [heads, layers, D, D]`, `b [heads, layers, D]`, zero-initialized so an untrained head repeats
the LM head; with LM heads of their own, `lm_head [own_heads, D, V]`.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from jspec.core.settings import SpecConfig, TreeConfig
from jspec.drafters import losses, medusa_formats
from jspec.drafters.base import (
  DraftContext,
  Drafter,
  DraftWeights,
  Features,
  Proposal,
  TreeProposal,
  check_heads_fit,
  draw_path,
)
from jspec.model import model
from jspec.model.config import ModelConfig
from jspec.speculation import tree


@dataclasses.dataclass(frozen=True)
class MedusaDrafter(Drafter):
  config: ModelConfig  # the target's: the heads work at its width and read its features
  num_heads: int
  num_layers: int = 1  # residual blocks per head
  own_heads: int = 0  # LM heads of their own: 0 (they read the target's), 1 (one shared) or num_heads
  kind = "medusa"
  published = medusa_formats
  learning_rate = 1e-3
  supports_tree = True

  @classmethod
  def for_pair(cls, target, draft, spec: SpecConfig) -> MedusaDrafter:
    check_heads_fit(cls.kind, draft.drafter.config, target)
    if spec.draft_len > draft.drafter.num_heads:
      raise ValueError(f"draft_len {spec.draft_len} exceeds the {draft.drafter.num_heads} Medusa heads")
    return dataclasses.replace(draft.drafter, config=target.config)  # the target's head and dtype, whatever loaded

  @classmethod
  def longest_draft(cls, draft) -> int:
    return draft.drafter.num_heads

  def forwards(self, draft_len: int) -> int:
    return 1  # every head at once

  def tree_shape(self, shape: TreeConfig, depth: int, nodes_asked: bool) -> TreeConfig:
    """A static tree (Medusa's `tree_choices`): the given paths, else the likeliest `nodes` paths."""
    if shape.sampled:
      raise ValueError("the medusa drafter's tree is static: sampled children need a dynamic tree")
    if shape.choices is not None:
      return shape
    choices = tree.default_choices(depth, shape.top_k, shape.nodes)
    return dataclasses.replace(shape, choices=choices, nodes=len(choices))

  def metadata(self) -> dict:
    return {"num_heads": self.num_heads, "num_layers": self.num_layers, "own_heads": self.own_heads}

  @classmethod
  def from_metadata(cls, config: ModelConfig, metadata: dict) -> MedusaDrafter:
    if "num_layers" not in metadata:
      raise ValueError("Medusa heads in an earlier jspec layout: train them again")
    return cls(config, int(metadata["num_heads"]), int(metadata["num_layers"]), int(metadata["own_heads"]))

  @classmethod
  def for_training(cls, target_config: ModelConfig, options: dict) -> MedusaDrafter:
    return cls(target_config, options.get("num_heads", 5))

  def init_params(self, key: jax.Array | None = None) -> dict:
    d, dtype, shape = self.config.dim, self.config.jnp_dtype, (self.num_heads, self.num_layers)
    params = {"w": jnp.zeros((*shape, d, d), dtype), "b": jnp.zeros((*shape, d), dtype)}
    if self.own_heads:
      params["lm_head"] = jnp.zeros((self.own_heads, d, self.config.vocab_size), dtype)
    return params

  def head_features(self, params: dict, feature_BxSxD: jax.Array, heads: int) -> jax.Array:
    """The first `heads` heads' blocks applied to every feature: [B,S,heads,D]."""
    x = jnp.broadcast_to(feature_BxSxD[:, :, None, :], (*feature_BxSxD.shape[:2], heads, feature_BxSxD.shape[-1]))
    for j in range(self.num_layers):
      x = x + jax.nn.silu(jnp.einsum("btkd,kde->btke", x, params["w"][:heads, j]) + params["b"][:heads, j])
    return x

  def head_logits(self, weights: DraftWeights, x_BxSxKxD: jax.Array) -> jax.Array:
    """Each head's LM head on its blocks' output: [B,S,K,V] in fp32."""
    if not self.own_heads:
      batch, seq, heads, dim = x_BxSxKxD.shape
      flat = model.logits_from_hidden(weights.target, x_BxSxKxD.reshape(batch, seq * heads, dim), self.config)
      return flat.reshape(batch, seq, heads, -1)
    own = weights.drafter["lm_head"]
    if self.own_heads == 1:
      return jnp.einsum("btkd,dv->btkv", x_BxSxKxD, own[0], preferred_element_type=jnp.float32)
    return jnp.einsum("btkd,kdv->btkv", x_BxSxKxD, own[:x_BxSxKxD.shape[2]], preferred_element_type=jnp.float32)

  def init(self, batch: int, capacity: int, draft_len: int) -> Features:
    return Features.zeros(batch, draft_len + 1, self.config.dim, self.config.jnp_dtype)

  def prefill(self, weights: DraftWeights, state: Features, prompts_BxP, prompt_lens_B, hidden_BxWxD, start_B):
    return Features.from_prefill(hidden_BxWxD, prompt_lens_B, state.feats_BxCxD.shape[1], start_B)

  def _head_logits(self, weights: DraftWeights, state: Features, seq_lens_B: jax.Array, heads: int) -> jax.Array:
    """The first `heads` heads' logits at the row's last feature, [B, heads, V]."""
    return self.head_logits(weights, self.head_features(weights.drafter, state.last(seq_lens_B)[:, None], heads))[:, 0]

  def propose(self, weights: DraftWeights, state: Features, context: DraftContext,
              keys_KxBx2: jax.Array) -> tuple[Features, Proposal]:
    num = keys_KxBx2.shape[0]
    logits_BxKxV = self._head_logits(weights, state, context.seq_lens_B, num)
    tokens_BxK, logits_BxKxV = draw_path(keys_KxBx2, logits_BxKxV, context)
    return state, Proposal(tokens_BxK, logits_BxKxV, jnp.ones(context.seq_lens_B.shape, bool))

  def propose_tree(self, weights: DraftWeights, state: Features, context: DraftContext, spec: SpecConfig,
                   keys_Bx2: jax.Array) -> tuple[Features, TreeProposal]:
    """The static tree `spec.tree.choices`: node (r1, .., rd) is head d's rank-rd token (top-k children)."""
    shape = tree.static_shape(spec.tree.choices)
    logits_BxLxV = self._head_logits(weights, state, context.seq_lens_B, spec.draft_len)
    top_BxLxG = lax.top_k(logits_BxLxV, spec.tree.top_k)[1].astype(jnp.int32)
    tokens_BxM = top_BxLxG[:, shape.depth_M - 1, shape.rank_M]
    parents_BxM = jnp.broadcast_to(jnp.asarray(shape.parent_M, jnp.int32), tokens_BxM.shape)
    return state, TreeProposal(tokens_BxM, parents_BxM, None, tree.TOP_K)

  def observe(self, weights: DraftWeights, state: Features, context: DraftContext, hidden_BxSxD: jax.Array,
              n_B: jax.Array) -> Features:
    return state.update(hidden_BxSxD, n_B)

  def loss(self, weights: DraftWeights, hidden_BxSxD: jax.Array, target_logits_BxSxV: jax.Array,
           tokens_BxS: jax.Array, key: jax.Array, options: dict) -> jax.Array:
    """Self-distillation: head k at position t matches the target's own distribution at t + 1 + k."""
    seq = hidden_BxSxD.shape[1]
    heads = self.head_features(weights.drafter, hidden_BxSxD, self.num_heads)
    total = 0.0
    for k in range(self.num_heads):
      shift = k + 1
      logits = self.head_logits(weights, heads[:, :seq - shift, k:k + 1])[:, :, 0]
      total = total + losses.kl(target_logits_BxSxV[:, shift:], logits)
    return total / self.num_heads
