"""A separate, smaller draft model with its own KV cache.

The draft cache holds `[0, d)` with d = n-1, or d = n-2 after a round that accepted every draft (the draft
never fed its own last proposal). Each round's first step feeds the two tokens at `[d, d+2)` and reads the
logits at slot n-1, which catches up in both cases with one fixed shape. Plain target steps (adaptive
fallback) run no draft forward at all and leave the draft behind by one more token each; the next round
then catches up with one wider forward of `max_lag + 1` tokens, so d >= n - 1 - max_lag must hold. A tree
round (`propose_tree`) keeps d = n and so trails by the accepted path, at most the tree's depth.

A parallel draft model (PARD's layout: a model whose config names a mask token, `ModelConfig.mask_id`) drafts
the K tokens of a round in one forward: the tokens its cache lacks, then K - 1 mask tokens, the logits at the
last real token and at each mask being the draft distributions of the K tokens (each drawn from its own, so
q is what it was drawn from). Its cache then holds the text `[0, n)` and, after verification, trails the new
text by the accepted drafts (at most K), which the next round's forward feeds.

The draft may pad its vocabulary to another size than the target's (same tokenizer): its logits are cut or
padded (with -inf) to the target's width, so it never proposes an id past the smaller of the two. A draft
with another tokenizer drafts as `CrossVocabDrafter`, by token-level intersection (`jspec.text.vocab_map` builds
the tables; they ride in the drafter's weights as `vocab_map`).

It proposes from its logits restricted to the intersection, laid out over the target's vocabulary
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
from typing import TYPE_CHECKING

import flax.struct
import jax
import jax.numpy as jnp

from jspec.core.settings import SpecConfig, TreeConfig
from jspec.drafters.base import (
  DraftContext,
  Drafter,
  DraftWeights,
  Proposal,
  TreeProposal,
  draft_chain,
  draw_path,
  dynamic_tree_shape,
  onto_vocab,
)
from jspec.model import cache as kvcache
from jspec.model import model
from jspec.model.attention import masked_attention
from jspec.model.config import ModelConfig
from jspec.model.model import Model
from jspec.speculation import tree
from jspec.speculation.control import run_if

if TYPE_CHECKING:
  from jspec.text.vocab_map import VocabMap


@dataclasses.dataclass(frozen=True)
class ModelDrafter(Drafter):
  config: ModelConfig
  lag: int = 1  # most tokens the cache may trail the text by at the start of a round
  vocab_size: int | None = None  # the target's; None: the draft's own
  parallel: int = 0  # drafts this many tokens in one forward from mask tokens (a parallel draft's chains); 0: one
  kind = "model"
  is_draft_model = True
  learning_rate = 1.5e-3
  supports_tree = True
  lags_plain_steps = True

  @classmethod
  def for_pair(cls, target: Model, draft: Model, spec: SpecConfig) -> ModelDrafter:
    # Embeddings may be padded to other sizes. Models without tokenizers are shapes for a memory plan.
    if None not in (draft.tokenizer, target.tokenizer):
      from jspec.text.tokenizer import same_vocab  # here: the decode loop itself never reads a tokenizer
      if not same_vocab(draft.tokenizer, target.tokenizer):
        return CrossVocabDrafter.for_tokenizers(target, draft)
    if draft.config.mask_id is None or spec.tree is not None:
      return cls(draft.config, vocab_size=target.config.vocab_size)
    # A parallel draft's cache trails the text by the accepted drafts.
    return cls(draft.config, spec.draft_len, target.config.vocab_size, parallel=spec.draft_len)

  @property
  def max_lag(self) -> int:
    return self.lag

  @property
  def writes_ahead(self) -> int:
    return self._parallel_widths[-1] - 1 if self.parallel else 0

  def forwards(self, draft_len: int) -> int:
    return 1 if self.parallel else draft_len

  @property
  def _parallel_widths(self) -> tuple[int, ...]:
    """A parallel forward's widths: the accepted drafts and the bonus token then K - 1 masks (2K), and the
    same after plain steps (`max_lag + K`)."""
    return tuple(sorted({2 * self.parallel, self.lag + self.parallel}))

  def with_max_lag(self, lag: int) -> ModelDrafter:
    # A parallel draft trails by `lag` more tokens than the K - 1 it may trail after a round already.
    return dataclasses.replace(self, lag=max(self.lag, lag + max(self.parallel - 1, 0)))

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

  def prefill(self, weights: DraftWeights, cache, prompts_BxP, prompt_lens_B, hidden_BxWxD, start_B):
    # Like the target's, the cache holds all but the last prompt token, which the first round feeds; a cached
    # prefix's pages hold its first tokens already.
    return model.prefill(weights.drafter, self.config, cache, prompts_BxP, prompt_lens_B, (), start_B,
                         hidden_BxWxD.shape[1])[1].rewind(prompt_lens_B - 1)

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

  def _parallel_logits(self, params, cache: kvcache.KVCache, tokens_BxT: jax.Array,
                       n_B: jax.Array) -> tuple[jax.Array, kvcache.KVCache]:
    """One forward of the tokens `[d, n)` the cache lacks and K - 1 masks after them: the K draft logits
    (at slots n-1 .. n+K-2), and the cache holding `[0, n)`."""
    d, k = cache.lengths, self.parallel

    def forward(width, carry):
      span = d[:, None] + jnp.arange(width)
      text = jnp.take_along_axis(tokens_BxT, jnp.minimum(span, tokens_BxT.shape[1] - 1), axis=1)
      tokens = jnp.where(span < n_B[:, None], text, self.config.mask_id)
      _, hidden, c = model.forward(params, tokens, span, carry[1], self.config)
      at = (n_B - 1 - d)[:, None] + jnp.arange(k)
      return self._logits(params, jnp.take_along_axis(hidden, at[..., None], axis=1)), c

    most, narrower = jnp.max(n_B - d), 0
    carry = (jnp.zeros((n_B.shape[0], k, self.vocab_size or self.config.vocab_size), jnp.float32), cache)
    for width in self._parallel_widths:  # exactly one runs: the narrowest that holds every row's tokens
      carry = run_if((most > narrower) & (most <= width - k + 1), lambda c, w=width: forward(w, c), carry)
      narrower = width - k + 1
    logits_BxKxV, cache = carry
    return logits_BxKxV, cache.rewind(n_B)

  def propose(self, weights: DraftWeights, cache: kvcache.KVCache, context: DraftContext,
              keys_KxBx2: jax.Array) -> tuple[kvcache.KVCache, Proposal]:
    params = weights.drafter
    if self.parallel:
      logits_BxKxV, cache = self._parallel_logits(params, cache, context.tokens_BxT, context.seq_lens_B)
      tokens_BxK, logits_BxKxV = draw_path(keys_KxBx2, logits_BxKxV[:, :keys_KxBx2.shape[0]], context)
      return cache, Proposal(tokens_BxK, logits_BxKxV, jnp.ones(tokens_BxK.shape[:1], bool))
    logits_BxV, cache = self._catch_up(params, cache, context.tokens_BxT, context.seq_lens_B)

    def step(cache, token_B):
      _, hidden, cache = model.forward(params, token_B[:, None], cache.lengths[:, None], cache, self.config)
      return cache, self._logits(params, hidden)[:, 0]

    return draft_chain(step, cache, logits_BxV, keys_KxBx2, context)

  def propose_tree(self, weights: DraftWeights, cache: kvcache.KVCache, context: DraftContext, spec: SpecConfig,
                   keys_Bx2: jax.Array) -> tuple[kvcache.KVCache, TreeProposal]:
    """The dynamic tree (`jspec.speculation.tree.grow`) from the draft's own distributions; the cache keeps only the
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


@flax.struct.dataclass
class SpelledCache:
  """The draft's KV cache over the text spelled in draft tokens: the spellings of target tokens
  `[0, covered_B)`, then (during a round) the drafts fed so far, one slot each."""
  cache: kvcache.KVCache
  covered_B: jax.Array  # int32


@dataclasses.dataclass(frozen=True)
class CrossVocabDrafter(ModelDrafter):
  spelling_len: int = 1  # draft tokens per target token at most (`VocabMap.spelling_len`)
  tables: VocabMap | None = dataclasses.field(default=None, compare=False, repr=False)

  @classmethod
  def for_tokenizers(cls, target: Model, draft: Model) -> CrossVocabDrafter:
    """The drafter for a draft whose tokenizer differs from the target's (both must have one)."""
    from jspec.text.vocab_map import vocab_map  # here: the decode loop itself never reads a tokenizer
    tables = vocab_map(target.tokenizer, draft.tokenizer, target.config.vocab_size, draft.config.vocab_size,
                       target.config.eos_id, draft.config.eos_id)
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
    """The catch-up forward's widths, narrowest first: the last accepted draft and a bonus token of up to
    two draft tokens (3), the same with any bonus token (L + 1), and `max_lag + 1` spellings."""
    wide = (self.lag + 1) * self.spelling_len
    return tuple(sorted({min(3, wide), min(self.spelling_len + 1, wide), wide}))

  def init(self, batch: int, capacity: int, draft_len: int) -> SpelledCache:
    slots = kvcache.round_capacity(self.spelling_len * capacity + self._widths[-1] + draft_len)
    return SpelledCache(kvcache.init_cache(self.config, batch, slots), jnp.zeros((batch,), jnp.int32))

  def _logits(self, params, hidden_BxSxD: jax.Array) -> jax.Array:
    """The draft's logits on the intersection, over the target's vocabulary (-inf off it)."""
    logits = model.logits_from_hidden(params, hidden_BxSxD, self.config)
    tables = params["vocab_map"]
    return onto_vocab(logits[..., tables["draft_ids"]], tables["target_ids"], self.vocab_size)

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

  def prefill(self, weights: DraftWeights, state: SpelledCache, prompts_BxP, prompt_lens_B, hidden_BxWxD, start_B):
    # The cache holds the spellings of all but the last prompt token, which the first round feeds: its own
    # positions, in a cache of its own, whatever prefix the target's holds.
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


def parallel_inputs(tokens_BxS: jax.Array, mask_id: int, copies: int, key: jax.Array, keep: float = 0.7,
                    keep_min: float = 0.2) -> tuple[jax.Array, jax.Array, jax.Array]:
  """PARD's training layout: the text (copy 0) and `copies - 1` copies of mask tokens, copy i at position t
  standing for the i-th mask after the text's token t - i. Copy i keeps a random max(keep^i, keep_min) of its
  positions (PARD's conditional drop), each kept position's chain (copy i-1 at t-1, ...) kept too. Returns the
  inputs [B,Q], their positions [B,Q] and copies [Q] (Q: the kept positions of every copy)."""
  batch, seq = tokens_BxS.shape
  counts = [seq] + [max(int(seq * max(keep ** i, keep_min)), 1) for i in range(1, copies)]
  keys = jax.random.split(key, batch)

  def chains(key):
    kept, previous = [jnp.arange(seq)], jnp.arange(seq)
    for i in range(1, copies):
      key, pick = jax.random.split(key)
      previous = (jax.random.permutation(pick, previous)[:counts[i]] + 1) % seq  # after a kept chain's end
      kept.append(previous)
    return jnp.concatenate(kept)

  positions_BxQ = jax.vmap(chains)(keys)
  copy_Q = jnp.concatenate([jnp.full((n,), i) for i, n in enumerate(counts)])
  inputs_BxQ = jnp.where(copy_Q == 0, jnp.take_along_axis(tokens_BxS, positions_BxQ, axis=1), mask_id)
  return inputs_BxQ, positions_BxQ, copy_Q


def parallel_logits(params, config: ModelConfig, tokens_BxS: jax.Array, copies: int, key: jax.Array):
  """The draft's logits over `parallel_inputs`' layout: query (copy i, position t) sees the text up to t - i and
  its own chain's masks at t - i + 1 .. t, and predicts token t + 1. Returns (logits [B,Q,V], positions [B,Q],
  copies [Q])."""
  inputs_BxQ, pos_BxQ, copy_Q = parallel_inputs(tokens_BxS, config.mask_id, copies, key)
  qpos, kpos = pos_BxQ[:, :, None], pos_BxQ[:, None, :]
  qcopy, kcopy = copy_Q[None, :, None], copy_Q[None, None, :]
  text = (kcopy == 0) & (kpos <= qpos - qcopy)
  chain = (kcopy >= 1) & (kcopy <= qcopy) & (kpos == qpos - (qcopy - kcopy))

  def attend(i, q, k, v):
    window = config.window(i)
    visible = (text | chain) & ((kpos > qpos - window) if window else True)
    options = model.attention_options(config, i)
    return masked_attention(q, k, v, visible, options["softcap"], options["scale"])

  x = model.layer_stack(params, model.embed(params, inputs_BxQ, config), pos_BxQ, config, attend)
  hidden = model.rms_norm(x, params["final_norm"], config)
  return model.logits_from_hidden(params, hidden, config), pos_BxQ, copy_Q


def parallel_loss(params, config: ModelConfig, batch_BxS1: jax.Array, teacher_logits_BxSxV: jax.Array,
                  copies: int, key: jax.Array, ce_weight: float) -> tuple[jax.Array, jax.Array]:
  """KL(teacher || draft) + `ce_weight` x cross-entropy over every kept query of `parallel_logits` on the
  batch's first S tokens that follows at least one text token, each scored on the token after its position
  (the teacher's logits are over those S tokens); returns (loss, cross-entropy)."""
  logits_BxQxV, pos_BxQ, copy_Q = parallel_logits(params, config, batch_BxS1[:, :-1], copies, key)
  valid = (pos_BxQ >= copy_Q[None]).astype(jnp.float32)
  logq = jax.nn.log_softmax(logits_BxQxV, -1)
  teacher = jax.nn.log_softmax(jnp.take_along_axis(teacher_logits_BxSxV, pos_BxQ[..., None], axis=1), -1)
  kl = jnp.sum(jnp.exp(teacher) * (teacher - logq), -1)
  nll = -jnp.take_along_axis(logq, jnp.take_along_axis(batch_BxS1[:, 1:], pos_BxQ, axis=1)[..., None], -1)[..., 0]
  mean = lambda x: jnp.sum(x * valid) / jnp.sum(valid)
  return mean(kl) + ce_weight * mean(nll), mean(nll)
