"""A separate, smaller draft model with its own KV cache.

The draft cache holds `[0, d)` with d = n-1, or d = n-2 after a round that accepted every draft (the draft
never fed its own last proposal). Each round's first step feeds the two tokens at `[d, d+2)` and reads the
logits at slot n-1, which catches up in both cases with one fixed shape. Plain target steps (adaptive
fallback) run no draft forward at all and leave the draft behind by one more token each; the next round
then catches up with one wider forward of `max_lag + 1` tokens, so d >= n - 1 - max_lag must hold. A tree
round (`propose_tree`) keeps d = n and so trails by the accepted path, at most the tree's depth.

The draft may pad its vocabulary to another size than the target's (same tokenizer): its logits are cut or
padded (with -inf) to the target's width, so it never proposes an id past the smaller of the two. A draft
with another tokenizer drafts as `jspec.drafters.cross_vocab.CrossVocabDrafter`.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jspec import cache as kvcache
from jspec import model, tree
from jspec.config import ModelConfig
from jspec.control import run_if
from jspec.drafters.base import (
  DraftContext,
  Drafter,
  DraftWeights,
  Proposal,
  TreeProposal,
  draft_chain,
  dynamic_tree_shape,
)
from jspec.model import Model
from jspec.settings import SpecConfig, TreeConfig


@dataclasses.dataclass(frozen=True)
class ModelDrafter(Drafter):
  config: ModelConfig
  lag: int = 1  # most tokens the cache may trail the text by at the start of a round
  vocab_size: int | None = None  # the target's; None: the draft's own
  kind = "model"
  supports_tree = True
  lags_plain_steps = True

  @classmethod
  def for_pair(cls, target: Model, draft: Model, spec: SpecConfig) -> ModelDrafter:
    # Embeddings may be padded to other sizes. Models without tokenizers are shapes for a memory plan.
    if None not in (draft.tokenizer, target.tokenizer):
      # Both imported here: the decode loop itself never reads a tokenizer (tests/test_package.py).
      from jspec.drafters.cross_vocab import CrossVocabDrafter  # it builds on this class
      from jspec.tokenizer import same_vocab
      if not same_vocab(draft.tokenizer, target.tokenizer):
        return CrossVocabDrafter.for_tokenizers(target, draft)
    return cls(draft.config, vocab_size=target.config.vocab_size)

  @property
  def max_lag(self) -> int:
    return self.lag

  def with_max_lag(self, lag: int) -> ModelDrafter:
    return dataclasses.replace(self, lag=max(self.lag, lag))

  @property
  def context_len(self) -> int:
    return self.config.max_seq_len

  def tree_shape(self, shape: TreeConfig, depth: int, nodes_asked: bool) -> TreeConfig:
    return dynamic_tree_shape(self.kind, shape, depth, nodes_asked)

  def _logits(self, params, hidden_BxSxD: jax.Array) -> jax.Array:
    """The draft's logits over the target's vocabulary."""
    logits = model.logits_from_hidden(params, hidden_BxSxD, self.config)
    if self.vocab_size is None or self.vocab_size == self.config.vocab_size:
      return logits
    if self.vocab_size < self.config.vocab_size:
      return logits[..., :self.vocab_size]
    pad = [(0, 0)] * (logits.ndim - 1) + [(0, self.vocab_size - self.config.vocab_size)]
    return jnp.pad(logits, pad, constant_values=-jnp.inf)

  def init(self, batch: int, capacity: int, draft_len: int) -> kvcache.KVCache:
    return kvcache.init_cache(self.config, batch, capacity)

  def prefill(self, weights: DraftWeights, cache, prompts_BxP, prompt_lens_B, hidden_BxPxD):
    # Like the target's, the cache holds all but the last prompt token, which the first round feeds.
    return model.prefill(weights.drafter, self.config, cache, prompts_BxP,
                         prompt_lens_B)[1].rewind(prompt_lens_B - 1)

  def _catch_up(self, params, cache: kvcache.KVCache, tokens_BxT: jax.Array,
                n_B: jax.Array) -> tuple[jax.Array, kvcache.KVCache]:
    """Feeds the tokens the cache lacks; returns the logits at slot n-1 and the cache holding `[0, n)`."""
    n, d = n_B, cache.lengths

    def catch_up(width, cache):
      span = d[:, None] + jnp.arange(width)
      _, hidden, c = model.forward(params, jnp.take_along_axis(tokens_BxT, span, axis=1), span, cache,
                                   self.config)
      # Only slot n-1's logits are needed: the LM head runs on one row (its unused logits are dropped).
      hidden_Bx1xD = jnp.take_along_axis(hidden, (n - 1 - d)[:, None, None], axis=1)
      return self._logits(params, hidden_Bx1xD)[:, 0], c

    if self.lag <= 1:
      logits_BxV, cache = catch_up(2, cache)
    else:  # the wide forward only when the cache trails by more than one token
      narrow = jnp.all(n - 1 - d <= 1)
      logits_BxV = jnp.zeros((n.shape[0], self.vocab_size or self.config.vocab_size), jnp.float32)
      carry = run_if(narrow, lambda c: catch_up(2, c[1]), (logits_BxV, cache))
      logits_BxV, cache = run_if(~narrow, lambda c: catch_up(self.lag + 1, c[1]), carry)
    return logits_BxV, cache.rewind(n)  # slot n may hold a stale token; the next step overwrites it

  def propose(self, weights: DraftWeights, cache: kvcache.KVCache, context: DraftContext,
              keys_KxBx2: jax.Array) -> tuple[kvcache.KVCache, Proposal]:
    params = weights.drafter
    logits_BxV, cache = self._catch_up(params, cache, context.tokens_BxT, context.seq_lens_B)

    def step(cache, token_B):
      _, hidden, cache = model.forward(params, token_B[:, None], cache.lengths[:, None], cache, self.config)
      return cache, self._logits(params, hidden)[:, 0]

    return draft_chain(step, cache, logits_BxV, keys_KxBx2, context)

  def propose_tree(self, weights: DraftWeights, cache: kvcache.KVCache, context: DraftContext, spec: SpecConfig,
                   keys_Bx2: jax.Array) -> tuple[kvcache.KVCache, TreeProposal]:
    """The dynamic tree (`jspec.tree.grow`) from the draft's own distributions; the cache keeps only the
    text, so after the round it trails by the accepted tokens, which the next round feeds (`max_lag`)."""
    params, n = weights.drafter, context.seq_lens_B
    logits_BxV, cache = self._catch_up(params, cache, context.tokens_BxT, n)

    def expand(cache, _, tokens_BxG, tree_BxGxA, level):
      positions = jnp.broadcast_to((n - 1 + level)[:, None], tokens_BxG.shape)
      _, hidden, cache = model.forward(params, tokens_BxG, positions, cache, self.config, tree_BxGxA)
      return cache, self._logits(params, hidden), None

    cache, tokens_BxM, parents_BxM, q_logits = tree.grow(expand, cache, None, logits_BxV, spec.draft_len,
                                                         spec.tree.top_k, spec.tree.nodes,
                                                         tree.children(spec, keys_Bx2, context.sampling),
                                                         context.constraint)
    return cache.rewind(n), TreeProposal(tokens_BxM, parents_BxM, q_logits, tree.rule(spec))

  def observe(self, weights: DraftWeights, cache: kvcache.KVCache, context: DraftContext, hidden_BxSxD: jax.Array,
              n_B: jax.Array) -> kvcache.KVCache:
    # After a round the draft holds its proposals up to slot n+K-2: keep what the accepted text shares with
    # them. After a plain step it holds what it held, which now trails the text by one more token.
    return cache.rewind(jnp.minimum(cache.lengths, context.seq_lens_B - 1))
