"""EAGLE (Li et al. 2024) and EAGLE-3 (Li et al. 2025): a small transformer that drafts on the target's
features, in the layouts the published heads use (the EAGLE repository's `cnets1.py` and `cnets.py`,
vLLM's speculators format), so a head trained anywhere drafts here and a head trained here exports.

EAGLE-1 reads the target's final-normed hidden state. Its input at position p is `fc([embed(token_{p+1}) ;
feature_p]) (+ bias)`; its first layer has no norm before attention, and its output, with no final norm, is
its feature of position p + 1, which the target's LM head turns into the distribution of token p + 2.
(`extra_norms`: the layout jspec first trained, with both norms; it exports to no published format.)

EAGLE-3 reads the residual streams after a low, a middle and a high target layer, projected by `fuse
[3D, D]` (the formats' `fc`) into its feature. Its first layer's q/k/v read `[norm(embed(token)) ;
norm(feature)]` (2D wide) while the residual stream carries the feature itself; its output (before its own
`final_norm`) is the next position's feature, and its own LM head maps the normed output to a draft
vocabulary of `draft_vocab` tokens, entry w being target token `target_ids[w]` (the formats' d2t), so q
is zero off that set. It is trained by "training-time test": unrolled for `ttt_steps` steps on its own
output features, as it drafts, each step's position seeing the real features' keys up to where its chain
began and its own earlier steps' keys (`unrolled_attention`), each step's KL weighted by 0.8^step.

Embedding: the target's, or the head's own (`own_embed`, when its checkpoint carries one).

Cache invariant: at the start of a round the cache holds positions `[0, start)` where `start` is the first
position of the target features kept in `Features` (the last target forward's). The round first feeds those
real features (a fixed C = K+1 of them, the valid ones being `[start, n-1)`), reads the prediction at n-2,
rewinds to n-1, and then continues on its own features. After verification it rewinds to the new `start`,
so drafted positions are always recomputed from real features. A plain target step feeds the pending real
features the same way (one C-wide forward, no proposals) before keeping the step's one new feature.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jspec.core.settings import SpecConfig, TreeConfig
from jspec.drafters import eagle_formats, losses
from jspec.drafters.base import (
  DraftContext,
  Drafter,
  DraftWeights,
  Features,
  Proposal,
  TreeProposal,
  check_heads_fit,
  draft_chain,
  dynamic_tree_shape,
  onto_vocab,
)
from jspec.drafters.eagle_formats import default_feature_layers
from jspec.model import cache as kvcache
from jspec.model import model
from jspec.model.config import ModelConfig
from jspec.speculation import tree


@flax.struct.dataclass
class EagleState:
  cache: kvcache.KVCache
  features: Features


TTT_DECAY = 0.8  # EAGLE-3's weight of unrolled step j's loss: 0.8^j


def unrolled_attention(q_BxSxHxDh: jax.Array, keys: list[jax.Array], values: list[jax.Array],
                       scale: float, softcap: float | None = None) -> jax.Array:
  """Attention of unrolled step j = len(keys) - 1 of training-time test. The query at position t continues
  a chain that began on real features at t - j: it sees step 0's keys (real features) at positions <= t - j
  and step i's key at position t - j + i, for i = 1..j (its own chain's earlier steps, and itself).
  keys/values: one [B,S,J,Dh] per step. Rows t < j have no chain and are garbage (the loss skips them)."""
  j, seq = len(keys) - 1, q_BxSxHxDh.shape[1]
  group = q_BxSxHxDh.shape[2] // keys[0].shape[2]
  expand = lambda x: jnp.repeat(x, group, axis=2)
  q = q_BxSxHxDh.astype(jnp.float32) * scale
  cap = (lambda x: x) if softcap is None else (lambda x: softcap * jnp.tanh(x / softcap))
  scores0 = cap(jnp.einsum("bqhd,bkhd->bhqk", q, expand(keys[0]).astype(jnp.float32)))
  visible = jnp.arange(seq)[None, :] <= jnp.arange(seq)[:, None] - j
  scores0 = jnp.where(visible, scores0, -jnp.inf)
  shifted = lambda x, i: jnp.roll(expand(x), j - i, axis=1)  # position t holds step i's entry at t - (j - i)
  diag = [cap(jnp.einsum("bqhd,bqhd->bhq", q, shifted(keys[i], i).astype(jnp.float32))) for i in range(1, j + 1)]
  scores = jnp.concatenate([scores0] + [d[..., None] for d in diag], -1)
  weights = jax.nn.softmax(scores, -1)
  out = jnp.einsum("bhqk,bkhd->bqhd", weights[..., :seq], expand(values[0]).astype(jnp.float32))
  for i in range(1, j + 1):
    out = out + weights[..., seq + i - 1].transpose(0, 2, 1)[..., None] * shifted(values[i], i)
  return out.astype(q_BxSxHxDh.dtype)


@dataclasses.dataclass(frozen=True)
class EagleDrafter(Drafter):
  config: ModelConfig  # its layers: the target's shape with its own layer count (and mlp_dim)
  # EAGLE-3: the target layers fused; empty: `default_feature_layers` of the target it is paired with
  feature_layers: tuple[int, ...] = ()
  draft_vocab: int = 0  # EAGLE-3: the size of its own LM head's vocabulary; 0: EAGLE-1
  fc_bias: bool = False  # EAGLE-1: a bias on `fc` (the EAGLE repository's `bias`)
  norm_before_residual: bool = False  # EAGLE-3: the residual stream starts from the normed feature
  extra_norms: bool = False  # EAGLE-1: a norm before the first attention and a final norm (jspec's first layout)
  own_embed: bool = False  # it carries its own embedding instead of reading the target's
  kind = "eagle"
  learning_rate = 2e-3
  supports_tree = True
  prefix_lookahead = 1
  published = eagle_formats

  @classmethod
  def for_pair(cls, target, draft, spec: SpecConfig) -> EagleDrafter:
    drafter = draft.drafter
    check_heads_fit(cls.kind, drafter.config, target)
    if drafter.is_eagle3 and not drafter.feature_layers:
      drafter = dataclasses.replace(drafter, feature_layers=default_feature_layers(target.config.n_layers))
    if drafter.feature_layers and max(drafter.feature_layers) >= target.config.n_layers:
      raise ValueError(f"this EAGLE-3 head reads target layers {list(drafter.feature_layers)} (0-based, the "
                       f"residual after each); the target has {target.config.n_layers}")
    return drafter

  def tree_shape(self, shape: TreeConfig, depth: int, nodes_asked: bool) -> TreeConfig:
    return dynamic_tree_shape(self.kind, shape, depth, nodes_asked)

  @property
  def is_eagle3(self) -> bool:
    return self.draft_vocab > 0

  @property
  def version(self) -> int:
    return 3 if self.is_eagle3 else 1

  def metadata(self) -> dict:
    return {"feature_layers": list(self.feature_layers), "draft_vocab": self.draft_vocab, "fc_bias": self.fc_bias,
            "norm_before_residual": self.norm_before_residual, "extra_norms": self.extra_norms,
            "own_embed": self.own_embed}

  @classmethod
  def from_metadata(cls, config: ModelConfig, metadata: dict) -> EagleDrafter:
    if "extra_norms" not in metadata:
      raise ValueError("an EAGLE head in an earlier jspec layout: train it again")
    return cls(config, tuple(int(i) for i in metadata["feature_layers"]), int(metadata["draft_vocab"]),
               bool(metadata["fc_bias"]), bool(metadata["norm_before_residual"]), bool(metadata["extra_norms"]),
               bool(metadata["own_embed"]))

  @classmethod
  def for_training(cls, target_config: ModelConfig, options: dict) -> EagleDrafter:
    """`options["feature_layers"]`: "eagle3" (the default layers), a list of layers, or absent (EAGLE-1);
    `options["draft_vocab"]`: EAGLE-3's vocabulary size (0 or absent: the target's)."""
    layers = options.get("feature_layers", ())
    layers = default_feature_layers(target_config.n_layers) if layers == "eagle3" else tuple(layers)
    if any(not 0 <= i < target_config.n_layers for i in layers):
      raise ValueError(f"feature layers {list(layers)} outside the target's {target_config.n_layers} layers")
    vocab = options.get("draft_vocab") or target_config.vocab_size
    if layers and not 0 < vocab <= target_config.vocab_size:
      raise ValueError(f"--draft-vocab {vocab}: choose at most the target's {target_config.vocab_size} tokens")
    return cls.for_target(target_config, options.get("mlp_dim"), layers, vocab if layers else 0)

  @classmethod
  def for_target(cls, target_config: ModelConfig, mlp_dim: int | None = None,
                 feature_layers: tuple[int, ...] = (), draft_vocab: int | None = None) -> EagleDrafter:
    """An EAGLE head for a target: one layer like the target's last, at its width, with a dense MLP (as the
    published heads of mixture-of-experts targets have); EAGLE-1 with a bias on `fc` as the EAGLE repository
    trains it, EAGLE-3 over `draft_vocab` tokens (default: all)."""
    config = dataclasses.replace(target_config, n_layers=1, mlp_dim=mlp_dim or target_config.mlp_dim,
                                 sliding_windows=target_config.sliding_windows[-1:], moe=None)
    if feature_layers:
      return cls(config, tuple(feature_layers), draft_vocab or target_config.vocab_size)
    return cls(config, fc_bias=True)

  @property
  def fused_layers(self) -> int:
    """How many target layers EAGLE-3 fuses (the defaults are three)."""
    return len(self.feature_layers) or 3

  def init_params(self, key: jax.Array) -> dict:
    layer_key, fc_key, head_key, embed_key, wide_key = jax.random.split(key, 5)
    c, d, dtype = self.config, self.config.dim, self.config.jnp_dtype
    dense = lambda k, shape: (jax.random.normal(k, shape) * shape[0] ** -0.5).astype(dtype)
    layers = model.init_params(c, layer_key)["layers"]
    if not self.extra_norms:  # the first layer attends from its input (EAGLE-1) or from [embed ; feature] (EAGLE-3)
      layers[0] = {k: v for k, v in layers[0].items() if k != "attn_norm"}
    params = {"layers": layers}
    if self.own_embed:
      params["embed"] = dense(embed_key, (c.vocab_size, d))
    if self.is_eagle3:
      q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
      wide = jax.random.split(wide_key, 3)
      layers[0].update(wq=dense(wide[0], (2 * d, q)), wk=dense(wide[1], (2 * d, kv)), wv=dense(wide[2], (2 * d, kv)))
      params.update(fuse=dense(fc_key, (self.feature_width, d)), embed_norm=jnp.ones((d,), dtype),
                    hidden_norm=jnp.ones((d,), dtype), final_norm=jnp.ones((d,), dtype),
                    lm_head=dense(head_key, (d, self.draft_vocab)),
                    target_ids=jnp.arange(self.draft_vocab, dtype=jnp.int32))
      return params
    params["fc"] = dense(fc_key, (2 * d, d))
    if self.fc_bias:
      params["fc_bias"] = jnp.zeros((d,), dtype)
    if self.extra_norms:
      params["final_norm"] = jnp.ones((d,), dtype)
    return params

  def training_init(self, key: jax.Array, target_params: Any, token_counts: np.ndarray) -> tuple[dict, dict]:
    """EAGLE-3's draft vocabulary is the data's `draft_vocab` most frequent tokens (frozen, in id order, as
    the formats keep d2t), its LM head starting from the target's rows for them."""
    params = self.init_params(key)
    if not self.is_eagle3:
      return params, {}
    ids = np.sort(np.argsort(-np.asarray(token_counts), kind="stable")[:self.draft_vocab]).astype(np.int32)
    params["lm_head"] = model.with_head(target_params)["lm_head"][:, ids].astype(self.config.jnp_dtype)
    del params["target_ids"]
    return params, {"target_ids": jnp.asarray(ids)}

  @property
  def feature_width(self) -> int:
    """The width of the target features it reads."""
    return (self.fused_layers if self.is_eagle3 else 1) * self.config.dim

  def _fused(self, params, feature_BxSxF):
    """A target feature in the head's own feature space: EAGLE-3's fused layers, or EAGLE-1's as it is."""
    if not self.is_eagle3:
      return feature_BxSxF
    return feature_BxSxF.astype(self.config.jnp_dtype) @ params["fuse"]

  def _inputs(self, params, target_params, feature_BxSxD, tokens_BxS, positions_BxS):
    """The first layer's residual stream and, for EAGLE-3, what its q/k/v read instead of its norm."""
    embedded = (params if self.own_embed else target_params)["embed"][tokens_BxS]
    feature = feature_BxSxD.astype(self.config.jnp_dtype)
    if self.is_eagle3:
      normed = model.rms_norm(feature, params["hidden_norm"], self.config)
      first = jnp.concatenate([model.rms_norm(embedded, params["embed_norm"], self.config), normed], -1)
      return (normed if self.norm_before_residual else feature), first
    x = jnp.concatenate([embedded, feature], -1) @ params["fc"]
    return (x + params["fc_bias"] if self.fc_bias else x), None

  def unrolled(self, params, target_params, feature_BxSxD, tokens_BxS, positions_BxS, attend: model.AttendFn):
    """Its output features over whole sequences without a cache, attention given by `attend` (training)."""
    x, first = self._inputs(params, target_params, feature_BxSxD, tokens_BxS, positions_BxS)
    return self._features(params, model.layer_stack(params, x, positions_BxS, self.config, attend,
                                                    first_input_BxSxA=first))

  def _features(self, params, x_BxSxD):
    """The feature its layers' output stands for: the output itself, or normed (`extra_norms`)."""
    return model.rms_norm(x_BxSxD, params["final_norm"], self.config) if self.extra_norms else x_BxSxD

  def logits(self, params, target_params, feature_BxSxD: jax.Array) -> jax.Array:
    """The draft distribution after each feature, over the target's vocabulary (fp32)."""
    if not self.is_eagle3:
      return model.logits_from_hidden(target_params, feature_BxSxD, self.config)
    return onto_vocab(self._draft_logits(params, feature_BxSxD), params["target_ids"], self.config.vocab_size)

  def _draft_logits(self, params, feature_BxSxD: jax.Array) -> jax.Array:
    """EAGLE-3's own LM head on its normed output: logits over its draft vocabulary [B,S,W] (fp32)."""
    normed = model.rms_norm(feature_BxSxD, params["final_norm"], self.config)
    return jnp.einsum("bsd,dw->bsw", normed, params["lm_head"], preferred_element_type=jnp.float32)

  def step(self, params, target_params, cache, feature_BxSxD, next_tokens_BxS, positions_BxS,
           tree_BxSxA: jax.Array | None = None):
    """Predicted features of positions+1 for S (feature, next token) pairs; the cache advances by S. With a
    tree mask, each entry sees the cache and its ancestors among this round's entries."""
    x, first = self._inputs(params, target_params, feature_BxSxD, next_tokens_BxS, positions_BxS)
    x, cache = model.cached_layer_stack(params, x, positions_BxS, cache, self.config, tree_BxSxA,
                                        first_input_BxSxA=first)
    return self._features(params, x), cache

  def init(self, batch: int, capacity: int, draft_len: int) -> EagleState:
    return EagleState(kvcache.init_cache(self.config, batch, capacity),
                      Features.zeros(batch, draft_len + 1, self.feature_width, self.config.jnp_dtype))

  def prefill(self, weights: DraftWeights, state: EagleState, prompts_BxP, prompt_lens_B, hidden_BxWxD, start_B):
    # Entry t reads feature t and token t + 1: a cached prefix's entries hold, the rest run from `start`.
    params, target_params = weights.drafter, weights.target
    prompt_width, width = prompts_BxP.shape[1], hidden_BxWxD.shape[1]
    positions = start_B[:, None] + jnp.arange(width)
    next_BxW = jnp.where(positions + 1 < prompt_width, jnp.take_along_axis(
        prompts_BxP, jnp.minimum(positions + 1, prompt_width - 1), axis=1), 0)
    _, cache = self.step(params, target_params, state.cache.rewind(start_B), self._fused(params, hidden_BxWxD),
                         next_BxW, positions)
    features = Features.from_prefill(hidden_BxWxD, prompt_lens_B, state.features.feats_BxCxD.shape[1], start_B)
    return EagleState(cache.rewind(features.start_B), features)

  def _catch_up(self, params, target_params, state: EagleState, tokens_BxT, n_B):
    """Feeds the kept real features; returns the predicted feature of position n-1 and the cache at n-1."""
    feats = state.features
    width = feats.feats_BxCxD.shape[1]
    positions = feats.start_B[:, None] + jnp.arange(width)
    next_tokens = jnp.take_along_axis(tokens_BxT, jnp.minimum(positions + 1, tokens_BxT.shape[1] - 1), axis=1)
    pred_BxCxD, cache = self.step(params, target_params, state.cache, self._fused(params, feats.feats_BxCxD),
                                  next_tokens, positions)
    at = jnp.clip(n_B - 2 - feats.start_B, 0, width - 1)
    return jnp.take_along_axis(pred_BxCxD, at[:, None, None], axis=1)[:, 0], cache.rewind(jnp.maximum(n_B - 1, 0))

  def propose(self, weights: DraftWeights, state: EagleState, context: DraftContext,
              keys_KxBx2: jax.Array) -> tuple[EagleState, Proposal]:
    params, target_params = weights.drafter, weights.target
    feature_BxD, cache = self._catch_up(params, target_params, state, context.tokens_BxT, context.seq_lens_B)
    logits_BxV = self.logits(params, target_params, feature_BxD[:, None])[:, 0]

    def step(carry, token_B):
      cache, feature_BxD = carry
      feature, cache = self.step(params, target_params, cache, feature_BxD[:, None], token_B[:, None],
                                 cache.lengths[:, None])
      return (cache, feature[:, 0]), self.logits(params, target_params, feature)[:, 0]

    (cache, _), proposal = draft_chain(step, (cache, feature_BxD), logits_BxV, keys_KxBx2, context)
    return EagleState(cache, state.features), proposal

  def propose_tree(self, weights: DraftWeights, state: EagleState, context: DraftContext, spec: SpecConfig,
                   keys_Bx2: jax.Array) -> tuple[EagleState, TreeProposal]:
    """EAGLE-2's dynamic tree (`jspec.speculation.tree.grow`): each level feeds the frontier's (parent feature, token)
    pairs at once, each entry seeing the cache and its ancestors; the next round recomputes from real
    features, so nothing fed here needs to be kept."""
    params, target_params, n = weights.drafter, weights.target, context.seq_lens_B
    feature_BxD, cache = self._catch_up(params, target_params, state, context.tokens_BxT, n)
    logits_BxV = self.logits(params, target_params, feature_BxD[:, None])[:, 0]

    def expand(cache, feature_BxGxD, tokens_BxG, tree_BxGxA, level):
      positions = jnp.broadcast_to((n - 2 + level)[:, None], tokens_BxG.shape)
      feature, cache = self.step(params, target_params, cache, feature_BxGxD, tokens_BxG, positions, tree_BxGxA)
      return cache, self.logits(params, target_params, feature), feature

    top_k = spec.tree.top_k
    parent_feature = jnp.broadcast_to(feature_BxD[:, None], (n.shape[0], top_k, feature_BxD.shape[-1]))
    cache, tokens_BxM, parents_BxM, q_logits = tree.grow(expand, cache, parent_feature, logits_BxV, spec.draft_len,
                                                         top_k, spec.tree.nodes,
                                                         tree.children(spec, keys_Bx2, context.sampling),
                                                         context.constraint)
    proposal = TreeProposal(tokens_BxM, parents_BxM, q_logits, tree.rule(spec))
    return EagleState(cache.rewind(jnp.maximum(n - 1, 0)), state.features), proposal

  def observe(self, weights: DraftWeights, state: EagleState, context: DraftContext, hidden_BxSxD: jax.Array,
              n_B: jax.Array) -> EagleState:
    cache = state.cache
    if hidden_BxSxD.shape[1] == 1:  # a plain step: nothing was proposed, so feed what is pending first
      cache = self._catch_up(weights.drafter, weights.target, state, context.tokens_BxT, n_B)[1]
    features = state.features.update(hidden_BxSxD, n_B)
    return EagleState(cache.rewind(features.start_B), features)

  def loss(self, weights: DraftWeights, hidden_BxSxD: jax.Array, target_logits_BxSxV: jax.Array,
           tokens_BxS: jax.Array, key: jax.Array, options: dict) -> jax.Array:
    """EAGLE-1: teacher-forced on real features (with optional uniform noise of width
    `options["feature_noise"]`, as EAGLE trains), smooth-L1 feature regression (weighted by
    `options["feature_weight"]`) plus KL(target || draft) on the next-next token. EAGLE-3: `ttt_loss`."""
    if self.is_eagle3:
      return self.ttt_loss(weights, hidden_BxSxD, target_logits_BxSxV, tokens_BxS, options.get("ttt_steps", 4))
    params, target_params = weights.drafter, weights.target
    feature_weight, noise = options.get("feature_weight", 1.0), options.get("feature_noise", 0.0)
    inputs = hidden_BxSxD[:, :-1]
    if noise:
      inputs = inputs + jax.random.uniform(key, inputs.shape, inputs.dtype, -noise / 2, noise / 2)
    positions = jnp.broadcast_to(jnp.arange(inputs.shape[1]), inputs.shape[:2])
    pred = self.unrolled(params, target_params, inputs, tokens_BxS[:, 1:], positions,
                         model.full_attention(self.config)).astype(jnp.float32)
    regression = jnp.mean(losses.smooth_l1(pred, hidden_BxSxD[:, 1:].astype(jnp.float32)))
    return feature_weight * regression + losses.kl(target_logits_BxSxV[:, 1:],
                                                   self.logits(params, target_params, pred))

  def ttt_loss(self, weights: DraftWeights, features_BxSxF: jax.Array, target_logits_BxSxV: jax.Array,
               tokens_BxS: jax.Array, steps: int) -> jax.Array:
    """Training-time test: step 0 reads the fused real features; step j reads step j-1's output one
    position back (what drafting feeds it), with the data's tokens; at position t step j predicts token
    t + 2 and is scored by KL to the target's distribution there (over the draft vocabulary, renormalized
    on it), over positions t >= j, weighted 0.8^j."""
    params, target_params = weights.drafter, weights.target
    seq = tokens_BxS.shape[1] - 1
    positions = jnp.broadcast_to(jnp.arange(seq), (tokens_BxS.shape[0], seq))
    tokens = tokens_BxS[:, 1:]
    teacher = jax.nn.log_softmax(target_logits_BxSxV[:, 1:, params["target_ids"]], -1)
    feature = self._fused(params, features_BxSxF[:, :-1])
    keys, values, total, norm = [], [], 0.0, 0.0
    options = model.attention_options(self.config, 0)
    for j in range(steps):
      def attend(i, q, k, v):
        keys.append(k)
        values.append(v)
        return unrolled_attention(q, keys, values, options["scale"] or self.config.head_dim ** -0.5,
                                  options["softcap"])
      out = self.unrolled(params, target_params, feature, tokens, positions, attend)
      logq = jax.nn.log_softmax(self._draft_logits(params, out), -1)
      kl_BxS = jnp.sum(jnp.exp(teacher) * (teacher - logq), -1)
      valid = (jnp.arange(seq) >= j).astype(jnp.float32)
      total = total + TTT_DECAY ** j * jnp.sum(kl_BxS * valid) / (jnp.sum(valid) * kl_BxS.shape[0])
      norm = norm + TTT_DECAY ** j
      feature = jnp.roll(out, 1, axis=1)  # position t reads its chain's previous output, at t - 1
    return total / norm
