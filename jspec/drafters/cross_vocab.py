"""A draft model whose tokenizer differs from the target's, drafting by token-level intersection
(`jspec.vocab_map` builds the tables; they ride in the drafter's weights as `vocab_map`).

The draft proposes from its logits restricted to the intersection, laid out over the target's vocabulary
(-inf elsewhere), so drawing, constraint masks and verification all work in target ids and the rejection
rule keeps the target's distribution. The draft's cache holds the text as draft tokens: the spellings of the
target's tokens `[0, covered)`, in order (`SpelledCache`). A round first feeds the spellings of the tokens
the cache lacks, `[covered, n)`, in one forward of a fixed width (the narrowest of a few that holds them;
`max_lag` bounds how many target tokens that is, as for `ModelDrafter`), reads the logits after the last of
them, then drafts: each drafted token is one draft token (its counterpart), so after verification the cache
keeps the accepted drafts by rewinding one slot per rejected one.

The cache holds up to `spelling_len` draft tokens per target token, so it has that many times the target's
slots (plus a catch-up's width), and the longest text is the draft's context over `spelling_len`.
"""
from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp

from jspec import cache as kvcache
from jspec import model, vocab_map
from jspec.control import run_if
from jspec.drafters.base import DraftContext, DraftWeights, Proposal, draft_chain
from jspec.drafters.draft_model import ModelDrafter
from jspec.model import Model
from jspec.settings import TreeConfig


@flax.struct.dataclass
class SpelledCache:
  """The draft's KV cache over the text spelled in draft tokens: the spellings of target tokens
  `[0, covered_B)`, then (during a round) the drafts fed so far, one slot each."""
  cache: kvcache.KVCache
  covered_B: jax.Array  # int32


@dataclasses.dataclass(frozen=True)
class CrossVocabDrafter(ModelDrafter):
  spelling_len: int = 1  # draft tokens per target token at most (`VocabMap.spelling_len`)
  tables: vocab_map.VocabMap | None = dataclasses.field(default=None, compare=False, repr=False)

  @classmethod
  def for_tokenizers(cls, target: Model, draft: Model) -> CrossVocabDrafter:
    """The drafter for a draft whose tokenizer differs from the target's (both must have one)."""
    tables = vocab_map.vocab_map(target.tokenizer, draft.tokenizer, target.config.vocab_size,
                                 draft.config.vocab_size, target.config.eos_id, draft.config.eos_id)
    return cls(draft.config, vocab_size=target.config.vocab_size, spelling_len=tables.spelling_len,
               tables=tables)

  def loop_params(self, params):
    return {**params, "vocab_map": {k: jnp.asarray(v) for k, v in self.tables.arrays().items()}}

  @property
  def context_len(self) -> int:
    return self.config.max_seq_len // self.spelling_len

  def tree_shape(self, shape: TreeConfig, depth: int, nodes_asked: bool) -> TreeConfig:
    raise ValueError("a draft with another tokenizer than the target's drafts chains only")

  @property
  def _widths(self) -> tuple[int, ...]:
    """The catch-up forward's widths, narrowest first: a bonus token's spelling after a round that
    accepted everything, any spelling after such a round, then `max_lag + 1` spellings."""
    wide = (self.lag + 1) * self.spelling_len
    return tuple(sorted({min(3, wide), min(self.spelling_len + 1, wide), wide}))

  def init(self, batch: int, capacity: int, draft_len: int) -> SpelledCache:
    slots = kvcache.round_capacity(self.spelling_len * capacity + self._widths[-1] + draft_len)
    return SpelledCache(kvcache.init_cache(self.config, batch, slots), jnp.zeros((batch,), jnp.int32))

  def _logits(self, params, hidden_BxSxD: jax.Array) -> jax.Array:
    """The draft's logits on the intersection, over the target's vocabulary (-inf off it)."""
    logits = model.logits_from_hidden(params, hidden_BxSxD, self.config)
    tables = params["vocab_map"]
    out = jnp.full((*logits.shape[:-1], self.vocab_size), -jnp.inf, logits.dtype)
    return out.at[..., tables["target_ids"]].set(logits[..., tables["draft_ids"]])

  def _spell(self, tables, tokens_BxT: jax.Array, start_B: jax.Array, count_B: jax.Array,
             span: int) -> tuple[jax.Array, jax.Array]:
    """The spellings of target tokens `[start, start + count)` (count <= span), side by side from slot 0
    of a `[B, span * spelling_len]` array, and how many draft tokens that is per row."""
    batch, length = tokens_BxT.shape
    index_BxJ = jnp.minimum(start_B[:, None] + jnp.arange(span), length - 1)
    target_BxJ = jnp.take_along_axis(tokens_BxT, index_BxJ, axis=1)
    lens_BxJ = jnp.where(jnp.arange(span) < count_B[:, None], tables["spelling_lens"][target_BxJ], 0)
    offsets_BxJ = jnp.cumsum(lens_BxJ, axis=1) - lens_BxJ
    slot_L = jnp.arange(self.spelling_len)
    width = span * self.spelling_len
    dest_BxJxL = jnp.where(slot_L < lens_BxJ[..., None], offsets_BxJ[..., None] + slot_L, width)
    rows = jnp.broadcast_to(jnp.arange(batch)[:, None, None], dest_BxJxL.shape)
    spelled_BxW = jnp.zeros((batch, width), jnp.int32).at[rows, dest_BxJxL].set(
        tables["spelling"][target_BxJ], mode="drop")
    return spelled_BxW, lens_BxJ.sum(1)

  def prefill(self, weights: DraftWeights, state: SpelledCache, prompts_BxP, prompt_lens_B, hidden_BxPxD):
    # The cache holds the spellings of all but the last prompt token, which the first round feeds.
    params = weights.drafter
    covered = (prompt_lens_B - 1).astype(jnp.int32)
    spelled, count = self._spell(params["vocab_map"], prompts_BxP, jnp.zeros_like(covered), covered,
                                 prompts_BxP.shape[1])
    _, cache = model.prefill(params, self.config, state.cache, spelled, count)
    return SpelledCache(cache, covered)

  def _catch_up_spelled(self, params, state: SpelledCache,
                        context: DraftContext) -> tuple[jax.Array, kvcache.KVCache]:
    """Feeds the spellings of target tokens `[covered, n)`; returns the logits after the last of them (for
    position n) and the cache holding them."""
    cache, covered, n = state.cache, state.covered_B, context.seq_lens_B
    spelled_BxW, count_B = self._spell(params["vocab_map"], context.tokens_BxT, covered, n - covered,
                                       self.lag + 1)
    held = cache.lengths

    def catch_up(width, cache):
      span = held[:, None] + jnp.arange(width)
      _, hidden, c = model.forward(params, spelled_BxW[:, :width], span, cache, self.config)
      hidden_Bx1xD = jnp.take_along_axis(hidden, (count_B - 1)[:, None, None], axis=1)
      return self._logits(params, hidden_Bx1xD)[:, 0], c

    most, narrower = jnp.max(count_B), 0
    carry = (jnp.zeros((n.shape[0], self.vocab_size), jnp.float32), cache)
    for width in self._widths:  # exactly one runs: the narrowest that holds every row's spellings
      carry = run_if((most > narrower) & (most <= width), lambda c, w=width: catch_up(w, c[1]), carry)
      narrower = width
    logits_BxV, cache = carry
    return logits_BxV, cache.rewind(held + count_B)

  def propose(self, weights: DraftWeights, state: SpelledCache, context: DraftContext,
              keys_KxBx2: jax.Array) -> tuple[SpelledCache, Proposal]:
    params = weights.drafter
    logits_BxV, cache = self._catch_up_spelled(params, state, context)

    def step(cache, token_B):  # a drafted token is in the intersection: its spelling is its one counterpart
      draft_B = params["vocab_map"]["spelling"][token_B, 0]
      _, hidden, cache = model.forward(params, draft_B[:, None], cache.lengths[:, None], cache, self.config)
      return cache, self._logits(params, hidden)[:, 0]

    cache, proposal = draft_chain(step, cache, logits_BxV, keys_KxBx2, context)
    return SpelledCache(cache, context.seq_lens_B + keys_KxBx2.shape[0] - 1), proposal

  def observe(self, weights: DraftWeights, state: SpelledCache, context: DraftContext, hidden_BxSxD: jax.Array,
              n_B: jax.Array) -> SpelledCache:
    # Keep the drafts the accepted text shares (one slot each); a plain step leaves the cache as it was.
    covered = jnp.minimum(state.covered_B, context.seq_lens_B - 1)
    return SpelledCache(state.cache.rewind(state.cache.lengths - (state.covered_B - covered)), covered)
