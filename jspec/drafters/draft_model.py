"""A separate, smaller draft model with its own KV cache.

The draft cache holds `[0, d)` with d = n-1, or d = n-2 after a round that accepted every draft (the draft
never fed its own last proposal). Each round's first step feeds the two tokens at `[d, d+2)` and reads the
logits at slot n-1, which catches up in both cases with one fixed shape.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from jspec import cache as kvcache
from jspec import model
from jspec.config import ModelConfig
from jspec.sampling import SamplingParams, next_token


@dataclasses.dataclass(frozen=True)
class ModelDrafter:
  config: ModelConfig
  kind: str = "model"

  def init(self, batch: int, capacity: int, draft_len: int) -> kvcache.KVCache:
    return kvcache.init_cache(self.config, batch, capacity)

  def prefill(self, params, target_params, cache, prompts_BxP, prompt_lens_B, hidden_BxPxD):
    return model.prefill(params, self.config, cache, prompts_BxP, prompt_lens_B)[1]

  def propose(self, params, target_params, cache: kvcache.KVCache, tokens_BxL: jax.Array,
              seq_lens_B: jax.Array, keys_GxBx2: jax.Array, sampling: SamplingParams):
    n = seq_lens_B
    d = cache.lengths
    two = d[:, None] + jnp.arange(2)
    logits, _, cache = model.forward(params, jnp.take_along_axis(tokens_BxL, two, axis=1), two, cache,
                                     self.config)
    logits_BxV = jnp.take_along_axis(logits, (n - 1 - d)[:, None, None], axis=1)[:, 0]
    cache = cache.rewind(n)  # slot n may hold a stale token; the next step overwrites it

    def body(carry, key_Bx2):
      cache, logits_BxV = carry
      token = next_token(key_Bx2, logits_BxV, sampling)
      logits, _, cache = model.forward(params, token[:, None], cache.lengths[:, None], cache, self.config)
      return (cache, logits[:, 0]), (token, logits_BxV)

    # The last proposal needs no forward: the next round's two-token step feeds it if it is accepted.
    (cache, logits_BxV), (tokens_GxB, logits_GxBxV) = lax.scan(body, (cache, logits_BxV), keys_GxBx2[:-1])
    token = next_token(keys_GxBx2[-1], logits_BxV, sampling)
    tokens_BxG = jnp.concatenate([tokens_GxB.T, token[:, None]], axis=1)
    logits_BxGxV = jnp.concatenate([jnp.moveaxis(logits_GxBxV, 0, 1), logits_BxV[:, None]], axis=1)
    return cache, tokens_BxG, logits_BxGxV, jnp.ones(n.shape, bool)

  def observe(self, cache: kvcache.KVCache, hidden_BxSxD, n_B, new_n_B) -> kvcache.KVCache:
    # The draft fed proposals up to slot n+G-2; keep what the accepted text shares with them.
    return cache.rewind(jnp.minimum(new_n_B - 1, n_B + hidden_BxSxD.shape[1] - 2))
