"""Multi-token prediction (MTP) layers as a drafter: the extra layers GLM-4.5 and DeepSeek-V3 ship inside their
checkpoints (`num_nextn_predict_layers`), drafting the way vLLM and SGLang run them.

An MTP layer at position p reads the target's final-normed hidden state h_p and the next token t_{p+1}:
`x = eh_proj([enorm(embed(t_{p+1})) ; hnorm(h_p)])` (the embedding is zeroed at position 0, as vLLM does),
then a whole decoder layer of the target's kind (an MoE layer for an MoE target), whose output is its hidden
state for position p + 1; `shared_head.norm` and the LM head turn that into the distribution of t_{p+2}.
A draft of K tokens chains the first MTP layer on its own outputs, as vLLM does when K exceeds the number of
MTP layers (vLLM's drafting loop always runs the first; jspec reads only the first).

It is EAGLE-1's drafting with other inputs and a normed head, so everything else (the cache that trails the
real features, catch-up, chains and dynamic trees) is `jspec.drafters.eagle`'s. Embedding and LM head are the
target's unless the checkpoint's copies in the MTP layer differ (`own_embed`, `own_head`).
Training (`python -m jspec.train drafter --kind mtp`) gives a target without MTP layers one, teacher-forced on
real features and scored by KL to the target's distribution of the token after next (no feature regression).
"""
from __future__ import annotations

import dataclasses
import pathlib

import jax
import jax.numpy as jnp

from jspec.drafters.base import Heads
from jspec.drafters.eagle import EagleDrafter
from jspec.model import hf, model
from jspec.model.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class MtpDrafter(EagleDrafter):
  own_head: bool = False  # it carries its own LM head (`lm_head`) instead of reading the target's
  kind = "mtp"
  published = None

  def metadata(self) -> dict:
    return {"own_embed": self.own_embed, "own_head": self.own_head}

  @classmethod
  def from_metadata(cls, config: ModelConfig, metadata: dict) -> MtpDrafter:
    return cls(config, own_embed=bool(metadata["own_embed"]), own_head=bool(metadata["own_head"]))

  @classmethod
  def for_training(cls, target_config: ModelConfig, options: dict) -> MtpDrafter:
    return cls.for_target(target_config, options.get("mlp_dim"))

  @classmethod
  def for_target(cls, target_config: ModelConfig, mlp_dim: int | None = None, feature_layers: tuple[int, ...] = (),
                 draft_vocab: int | None = None) -> MtpDrafter:
    """One MTP layer for a target: a layer like its last, sparse for a mixture of experts."""
    moe = target_config.moe and dataclasses.replace(target_config.moe, dense_layers=())
    config = dataclasses.replace(target_config, n_layers=1, mlp_dim=mlp_dim or target_config.mlp_dim,
                                 sliding_windows=target_config.sliding_windows[-1:], moe=moe)
    return cls(config)

  def init_params(self, key: jax.Array) -> dict:
    layer_key, proj_key, embed_key, head_key = jax.random.split(key, 4)
    c, d, dtype = self.config, self.config.dim, self.config.jnp_dtype
    dense = lambda k, shape: (jax.random.normal(k, shape) * shape[0] ** -0.5).astype(dtype)
    params = dict(layers=model.init_params(c, layer_key)["layers"], enorm=jnp.ones((d,), dtype),
                  hnorm=jnp.ones((d,), dtype), eh_proj=dense(proj_key, (2 * d, d)), final_norm=jnp.ones((d,), dtype))
    if self.own_embed:
      params["embed"] = dense(embed_key, (c.vocab_size, d))
    if self.own_head:
      params["lm_head"] = dense(head_key, (d, c.vocab_size))
    return params

  def _inputs(self, params, target_params, feature_BxSxD, tokens_BxS, positions_BxS):
    embedded = (params if self.own_embed else target_params)["embed"][tokens_BxS]
    embedded = jnp.where((positions_BxS == 0)[..., None], 0, embedded)
    feature = feature_BxSxD.astype(self.config.jnp_dtype)
    both = jnp.concatenate([model.rms_norm(embedded, params["enorm"], self.config),
                            model.rms_norm(feature, params["hnorm"], self.config)], -1)
    return both @ params["eh_proj"], None

  def logits(self, params, target_params, feature_BxSxD: jax.Array) -> jax.Array:
    head = params if self.own_head else target_params
    return model.logits_from_hidden(head, model.rms_norm(feature_BxSxD, params["final_norm"], self.config),
                                    self.config)

  def loss(self, weights, hidden_BxSxD, target_logits_BxSxV, tokens_BxS, key, options: dict) -> jax.Array:
    """KL(target || MTP) on the token after next, teacher-forced on real features (EAGLE-1's loss without its
    feature regression: an MTP layer's output is not the target's feature)."""
    return super().loss(weights, hidden_BxSxD, target_logits_BxSxV, tokens_BxS, key,
                        {**options, "feature_weight": 0.0})


def read_mtp(path: str | pathlib.Path, dtype: str = "float32") -> Heads:
  """The first MTP layer of a Hugging Face checkpoint, as heads of the mtp drafter on that checkpoint's model."""
  config, params = hf.load_mtp_layer(path, dtype)
  return Heads(MtpDrafter(config, own_embed="embed" in params, own_head="lm_head" in params), params,
               source="the checkpoint's MTP layer")
