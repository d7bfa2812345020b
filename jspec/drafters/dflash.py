"""DFlash (arXiv 2602.06036; z-lab/dflash): a small block-diffusion transformer that drafts a whole block in
one forward pass, conditioned on the target's hidden states, in the layout z-lab publishes its drafters in.

The context: the residual streams after `feature_layers` of the target (0-based), side by side, projected by
`fc [F,D]` and normed (`hidden_norm`). Each draft layer is a Qwen3 decoder layer (q/k norms) whose keys and
values come from the context (as it is, no input norm) and from the block (normed), and whose queries come
from the block alone. The block is `block_size` positions from the row's pending token n-1: that token, then
`mask_token` at every other position, embedded with the target's embedding; it attends to the whole context
before it and to every position of the block (no causal mask inside it). Its output, normed (`final_norm`),
through the target's LM head gives the distribution of the token at each position: position i (i >= 1)
drafts token n-1+i, so one forward drafts up to `block_size - 1` tokens, each drawn from its own logits
(q of rejection sampling, independent of the tokens drawn before it).

Cache invariant: at the start of a round the drafter's cache holds the context's keys and values for positions
`[0, start)`, and `Features` the last target forward's features from `start` on (valid up to n-1). A round
first writes those (no queries: keys and values of projections only), rewinds to n-1, then runs the block
at `[n-1, n-1+block_size)` and rewinds to n-1 again, so drafted positions never stay in the cache. A plain
target step writes the pending features the same way before keeping its one new feature.

Training (`python -m jspec.train drafter --kind dflash`): SpecForge's recipe. Blocks anchored at random
positions of the data, the anchor's token then masks, each seeing the context strictly before its anchor and
its own block; position k >= 1 is scored by KL to the target's distribution of token anchor + k, weighted
exp(-(k-1)/gamma) (`loss_gamma`; SpecForge suggests 7 for blocks of 16, 5 for 10, 4 for 8).
"""
from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp

from jspec.core.settings import SpecConfig
from jspec.drafters import dflash_formats
from jspec.drafters.base import DraftContext, Drafter, DraftWeights, Features, Proposal, check_heads_fit, draw_path
from jspec.drafters.dflash_formats import default_feature_layers
from jspec.model import cache as kvcache
from jspec.model import model
from jspec.model.attention import masked_attention
from jspec.model.config import ModelConfig

DEFAULT_BLOCK = 8


@flax.struct.dataclass
class DFlashState:
  cache: kvcache.KVCache  # the context's keys and values, positions [0, features.start)
  features: Features  # the last target forward's features from `start` on, not yet in the cache


@dataclasses.dataclass(frozen=True)
class DFlashDrafter(Drafter):
  config: ModelConfig  # its layers: Qwen3-shaped (q/k norms) at the target's width
  feature_layers: tuple[int, ...] = ()
  block_size: int = DEFAULT_BLOCK
  mask_token: int = 0
  kind = "dflash"
  learning_rate = 6e-4
  published = dflash_formats

  @classmethod
  def for_pair(cls, target, draft, spec: SpecConfig) -> DFlashDrafter:
    drafter = draft.drafter
    check_heads_fit(cls.kind, drafter.config, target)
    if max(drafter.feature_layers) >= target.config.n_layers:
      raise ValueError(f"this DFlash drafter reads target layers {list(drafter.feature_layers)} (0-based); the "
                       f"target has {target.config.n_layers}")
    if spec.draft_len > drafter.block_size - 1:
      raise ValueError(f"draft_len {spec.draft_len} exceeds the {drafter.block_size - 1} tokens a DFlash block of "
                       f"{drafter.block_size} drafts")
    # The block is embedded as the target embeds tokens (scaled, for Gemma).
    config = dataclasses.replace(drafter.config, scale_embeddings=target.config.scale_embeddings)
    return dataclasses.replace(drafter, config=config)

  @classmethod
  def longest_draft(cls, draft) -> int:
    return draft.drafter.block_size - 1

  @property
  def writes_ahead(self) -> int:
    return self.block_size - 1

  def forwards(self, draft_len: int) -> int:
    return 1

  def metadata(self) -> dict:
    return {"feature_layers": list(self.feature_layers), "block_size": self.block_size,
            "mask_token": self.mask_token}

  @classmethod
  def from_metadata(cls, config: ModelConfig, metadata: dict) -> DFlashDrafter:
    return cls(config, tuple(int(i) for i in metadata["feature_layers"]), int(metadata["block_size"]),
               int(metadata["mask_token"]))

  @classmethod
  def for_training(cls, target_config: ModelConfig, options: dict) -> DFlashDrafter:
    """`options`: `draft_layers` (1), `block_size` (8), `mask_token` (the target's EOS, else 0), `mlp_dim`
    (the target's), `feature_layers` (a list, or absent or "eagle3": `default_feature_layers`)."""
    layers = int(options.get("draft_layers") or 1)
    block = int(options.get("block_size") or DEFAULT_BLOCK)
    chosen = options.get("feature_layers")
    features = (default_feature_layers(target_config.n_layers, layers) if chosen in (None, "eagle3")
                else tuple(chosen))
    mask = options.get("mask_token")
    mask = (target_config.eos_id or 0) if mask is None else int(mask)
    if layers < 1 or block < 2:
      raise ValueError(f"a DFlash drafter needs at least 1 layer and a block of 2 (got {layers} and {block})")
    if any(not 0 <= i < target_config.n_layers for i in features):
      raise ValueError(f"feature layers {list(features)} outside the target's {target_config.n_layers} layers")
    if not 0 <= mask < target_config.vocab_size:
      raise ValueError(f"mask token {mask} outside the target's vocabulary of {target_config.vocab_size}")
    config = dataclasses.replace(target_config, n_layers=layers, sliding_windows=(), moe=None, qk_norm=True,
                                 mlp_dim=options.get("mlp_dim") or target_config.mlp_dim, quantization=None)
    return cls(config, features, block, mask)

  @property
  def feature_width(self) -> int:
    return len(self.feature_layers) * self.config.dim

  def init_params(self, key: jax.Array) -> dict:
    layer_key, fc_key = jax.random.split(key)
    d, dtype = self.config.dim, self.config.jnp_dtype
    ones = jnp.ones((d,), dtype)
    fc = (jax.random.normal(fc_key, (self.feature_width, d)) * self.feature_width ** -0.5).astype(dtype)
    return dict(layers=model.init_params(self.config, layer_key)["layers"], fc=fc, hidden_norm=ones, final_norm=ones)

  # -- the forward -------------------------------------------------------------------------------------------
  def context(self, params: dict, features_BxSxF: jax.Array) -> jax.Array:
    """Target features as the draft layers' context, [B,S,D]."""
    projected = features_BxSxF.astype(self.config.jnp_dtype) @ params["fc"]
    return model.rms_norm(projected, params["hidden_norm"], self.config)

  def _write_context(self, params: dict, cache: kvcache.KVCache, features_BxCxF: jax.Array,
                     start_B: jax.Array) -> kvcache.KVCache:
    """The cache with the context's keys and values of C features from position `start` written, and its
    length at start + C."""
    ctx = self.context(params, features_BxCxF)
    positions = start_B[:, None] + jnp.arange(ctx.shape[1])
    cache = cache.rewind(start_B)
    ks, vs = list(cache.k), list(cache.v)
    for i, layer in enumerate(params["layers"]):
      k, v = model.keys_values(layer, i, ctx, positions, self.config, cache.rope_len)
      ks[i], vs[i] = kvcache.write(cache, ks[i], k), kvcache.write(cache, vs[i], v)
    return cache.replace(k=tuple(ks), v=tuple(vs), lengths=start_B + ctx.shape[1])

  def _flush(self, params: dict, state: DFlashState, n_B: jax.Array) -> kvcache.KVCache:
    """The cache holding the context up to n-1: the pending features written."""
    feats = state.features
    return self._write_context(params, state.cache, feats.feats_BxCxD, feats.start_B).rewind(n_B - 1)

  def block_logits(self, weights: DraftWeights, cache: kvcache.KVCache, tokens_BxT: jax.Array,
                   n_B: jax.Array) -> jax.Array:
    """The block from the pending token n-1 over a cache holding the context up to n-1: its draft logits for
    positions n .. n + block_size - 2, [B, block_size - 1, V] (fp32)."""
    batch, width = n_B.shape[0], self.block_size
    first = jnp.take_along_axis(tokens_BxT, (n_B - 1)[:, None], axis=1)
    block = jnp.concatenate([first, jnp.full((batch, width - 1), self.mask_token, first.dtype)], axis=1)
    x = model.embed(weights.target, block, self.config)
    everywhere = jnp.ones((batch, width, width), bool)  # each position sees the whole block
    out, _ = model.cached_layer_stack(weights.drafter, x, (n_B - 1)[:, None] + jnp.arange(width), cache,
                                      self.config, everywhere)
    return self._logits(weights, out[:, 1:])

  def _logits(self, weights: DraftWeights, out_BxSxD: jax.Array) -> jax.Array:
    normed = model.rms_norm(out_BxSxD, weights.drafter["final_norm"], self.config)
    return model.logits_from_hidden(weights.target, normed, self.config)

  # -- the loop's calls ------------------------------------------------------------------------------------
  def init(self, batch: int, capacity: int, draft_len: int) -> DFlashState:
    return DFlashState(kvcache.init_cache(self.config, batch, capacity),
                       Features.zeros(batch, draft_len + 1, self.feature_width, self.config.jnp_dtype))

  def prefill(self, weights: DraftWeights, state: DFlashState, prompts_BxP, prompt_lens_B, hidden_BxWxD, start_B):
    # The context of every prompt token but the last (pending); a cached prefix's entries hold.
    cache = self._write_context(weights.drafter, state.cache, hidden_BxWxD, start_B)
    kept = jnp.maximum(prompt_lens_B - 1, 0).astype(jnp.int32)
    return DFlashState(cache.rewind(kept), Features(jnp.zeros_like(state.features.feats_BxCxD), kept))

  def propose(self, weights: DraftWeights, state: DFlashState, context: DraftContext,
              keys_KxBx2: jax.Array) -> tuple[DFlashState, Proposal]:
    n = context.seq_lens_B
    cache = self._flush(weights.drafter, state, n)
    logits_BxKxV = self.block_logits(weights, cache, context.tokens_BxT, n)[:, :keys_KxBx2.shape[0]]
    tokens_BxK, logits_BxKxV = draw_path(keys_KxBx2, logits_BxKxV, context)
    return DFlashState(cache, Features(state.features.feats_BxCxD, n - 1)), Proposal(
        tokens_BxK, logits_BxKxV, jnp.ones(n.shape, bool))

  def observe(self, weights: DraftWeights, state: DFlashState, context: DraftContext, hidden_BxSxD: jax.Array,
              n_B: jax.Array) -> DFlashState:
    cache = state.cache
    if hidden_BxSxD.shape[1] == 1:  # a plain step: nothing was proposed, so write what is pending first
      cache = self._flush(weights.drafter, state, n_B)
    return DFlashState(cache, state.features.update(hidden_BxSxD, n_B))

  # -- training ---------------------------------------------------------------------------------------------
  def loss(self, weights: DraftWeights, hidden_BxSxF: jax.Array, target_logits_BxSxV: jax.Array,
           tokens_BxS: jax.Array, key: jax.Array, options: dict) -> jax.Array:
    """KL(target || draft) over blocks anchored at `anchors` random positions per row (default: one per
    block's width of the window), each block's position k >= 1 weighted exp(-(k-1)/gamma)."""
    batch, seq = tokens_BxS.shape
    width = self.block_size
    if seq < width + 1:
      raise ValueError(f"training windows of {seq} tokens are shorter than a DFlash block of {width} + 1")
    anchors = min(int(options.get("anchors") or seq // width), seq - width + 1)
    gamma = float(options.get("loss_gamma") or 7.0)
    params = weights.drafter
    # Anchors: distinct positions a in [0, S - width], sorted; block n's positions a_n .. a_n + width - 1.
    scores = jax.random.uniform(key, (batch, seq - width + 1))
    anchor_BxN = jnp.sort(jax.lax.top_k(scores, anchors)[1], axis=1)
    positions_BxNxW = anchor_BxN[:, :, None] + jnp.arange(width)
    first = jnp.take_along_axis(tokens_BxS, anchor_BxN, axis=1)
    block = jnp.where(jnp.arange(width) == 0, first[:, :, None], self.mask_token).reshape(batch, anchors * width)
    positions = positions_BxNxW.reshape(batch, anchors * width)
    ctx = self.context(params, hidden_BxSxF)
    ctx_positions = jnp.broadcast_to(jnp.arange(seq), (batch, seq))
    # Query (block n, k) sees context positions < a_n and its own block.
    sees_ctx = jnp.arange(seq)[None, None, :] < jnp.repeat(anchor_BxN, width, axis=1)[:, :, None]
    block_id = jnp.arange(anchors * width) // width
    sees_block = jnp.broadcast_to(block_id[:, None] == block_id[None, :], (batch, anchors * width, anchors * width))
    visible_BxQxK = jnp.concatenate([sees_ctx, sees_block], axis=2)
    layers = params["layers"]

    def attend(i, q, k, v):
      k_ctx, v_ctx = model.keys_values(layers[i], i, ctx, ctx_positions, self.config)
      options = model.attention_options(self.config, i)
      return masked_attention(q, jnp.concatenate([k_ctx, k], 1), jnp.concatenate([v_ctx, v], 1), visible_BxQxK,
                              options["softcap"], options["scale"])

    out = model.layer_stack(params, model.embed(weights.target, block, self.config), positions, self.config, attend)
    logq = jax.nn.log_softmax(self._logits(weights, out).reshape(batch, anchors, width, -1)[:, :, 1:], -1)
    teacher_at = positions_BxNxW[:, :, 1:] - 1  # the target's distribution of token a + k is at a + k - 1
    teacher = jax.nn.log_softmax(jnp.take_along_axis(
        target_logits_BxSxV, teacher_at.reshape(batch, -1)[:, :, None], axis=1), -1)
    kl_BxNxK = jnp.sum(jnp.exp(teacher) * (teacher - logq.reshape(teacher.shape)), -1).reshape(batch, anchors, -1)
    decay_K = jnp.exp(-jnp.arange(width - 1) / gamma)
    return jnp.sum(kl_BxNxK * decay_K) / (batch * anchors * jnp.sum(decay_K))

