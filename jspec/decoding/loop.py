"""The decode loop, its state, and its steps: autoregressive (the baseline) and speculative.

A `Decoder` (`jspec.decoding.decoder`) bundles what the loop runs (weights, and the static program: configs, drafter,
speculation settings); `Batch` holds a batch's per-row inputs as arrays; `start` builds the `DecodeState` and runs
both prefills; `run` is ONE `lax.while_loop` of `step` until every row is done. The steps are public, for
research code that drives rounds itself; `jspec.decoding.rows` decodes and refills rows of a running batch.

Invariants at the top of every round, for each row b with `n = seq_lens[b]` tokens (prompt + emitted):
the target cache holds tokens `[0, n-1)`, and token n-1 is fed by the next target forward, so every round
looks alike. What the drafter holds is its own business (see `jspec.drafters`); the loop only asks it for
proposals and tells it what the target saw. Done rows still ride along in the batched forwards, but their
lengths no longer move, so they write only into slots they already own. A constrained row's automaton state
(`jspec.text.automaton`) is the state after its committed tokens; every target distribution the round reads is
masked by the state along the draft path before it, so argmax, sampling and rejection all work on the
constrained target.
"""
from __future__ import annotations

import collections

import flax.struct
import jax
import jax.numpy as jnp
from jax import lax

from jspec.core.settings import AdaptiveConfig
from jspec.decoding.batches import Batch
from jspec.decoding.decoder import Decoder
from jspec.drafters.base import DraftContext, DrafterState, Proposal, TreeProposal
from jspec.model import cache as kvcache
from jspec.model import model
from jspec.speculation import adaptive, tree
from jspec.speculation.control import run_if, run_switch
from jspec.speculation.logprobs import Logprobs
from jspec.speculation.sampling import SamplingParams, is_greedy, next_token, probabilities
from jspec.speculation.stats import DecodeStats
from jspec.speculation.verify import verify, verify_greedy, verify_typical
from jspec.text.automaton import Automata

# A debugging counter: how many times `run` was traced in this process, by kind of loop. A count that grows
# across requests of one shape means they recompile (the tests assert it does not).
trace_counts: collections.Counter = collections.Counter()


@flax.struct.dataclass
class DecodeState:
  """What the loop carries from round to round (`jspec.decoding.loop` states its invariants)."""
  tokens_BxT: jax.Array  # int32: prompt then emitted tokens; slots past seq_lens are stale
  seq_lens_B: jax.Array  # int32: tokens held (prompt + emitted)
  prompt_lens_B: jax.Array  # int32
  max_new_tokens_B: jax.Array  # int32
  done_B: jax.Array  # bool
  keys_Bx2: jax.Array  # uint32: one PRNG key per row
  sampling: SamplingParams
  target_cache: kvcache.KVCache
  drafter_state: DrafterState
  stats: DecodeStats
  stop_BxE: jax.Array  # int32: the tokens that end row b, -1 padded (none: no EOS, or EOS ignored)
  speculate_B: jax.Array  # bool: row b's drafts may be accepted (else it decodes plainly in every round)
  share_B: jax.Array  # bool: row b's text is shared across requests (`Batch.share_B`)
  constraint: Automata | None = None  # each row's constraint and its state (None: no row is constrained)
  logprobs: Logprobs | None = None  # each committed token's log-probabilities (None: no row can ask)

  @property
  def num_emitted(self) -> jax.Array:
    return self.seq_lens_B - self.prompt_lens_B

  @property
  def context(self) -> DraftContext:
    """What a drafter reads of the rows."""
    return DraftContext(self.tokens_BxT, self.seq_lens_B, self.sampling, self.share_B, self.constraint)


def init_state(decoder: Decoder, batch: Batch, capacity: int | None = None,
               pools: DecodeState | None = None) -> DecodeState:
  """A state holding the right-padded prompts and empty caches of `capacity` slots (default: the batch's
  own, `Batch.capacity`); paged caches (`batch.page_table_BxR`) in `pools`' pools when given (a
  running state's), else in empty ones."""
  capacity = _capacity(batch, capacity)
  rows, prompt_width = batch.prompts_BxP.shape
  tokens = jnp.zeros((rows, capacity), jnp.int32).at[:, :prompt_width].set(batch.prompts_BxP)
  drafter, spec = decoder.drafter, decoder.spec
  adaptive_config = decoder.adaptive or AdaptiveConfig()
  state = DecodeState(
      tokens_BxT=tokens, seq_lens_B=batch.prompt_lens_B.astype(jnp.int32),
      prompt_lens_B=batch.prompt_lens_B.astype(jnp.int32),
      max_new_tokens_B=batch.max_new_tokens_B.astype(jnp.int32), done_B=jnp.zeros((rows,), bool),
      keys_Bx2=jax.vmap(jax.random.PRNGKey)(batch.seeds_B.astype(jnp.uint32)), sampling=batch.sampling,
      target_cache=kvcache.init_cache(decoder.target_config, rows, capacity),
      drafter_state=None if drafter is None else drafter.init(rows, capacity, spec.draft_len),
      stats=DecodeStats.zeros(rows, decoder.draft_len, adaptive_config.window,
                              spec.trace_rounds if drafter is not None else 0),
      stop_BxE=batch.stop_BxE.astype(jnp.int32), speculate_B=batch.speculate_B.astype(bool),
      share_B=batch.share_B.astype(bool), constraint=batch.constraint,
      logprobs=None if batch.logprobs_B is None else Logprobs.zeros(batch.logprobs_B, capacity,
                                                                    batch.top_logprobs))
  # Every cache rotates positions for the row's final length (only dynamic-NTK RoPE reads it), and attends
  # with the kernel of the platform the program is for (a mesh's devices may be another machine's).
  final_len_B = (batch.prompt_lens_B + batch.max_new_tokens_B).astype(jnp.int32)
  # With a page table, every cache of the batch's capacity is a pool of pages read through it (a drafter's
  # cache of another length, as a cross-tokenizer draft's, stays contiguous).
  kernel = lambda c: decoder.kernel(c.k[0].shape[-1])
  pages, table_BxR = batch.pages, batch.page_table_BxR
  pool = lambda c: (kvcache.paged(c, table_BxR, pages) if table_BxR is not None and c.capacity == capacity
                    else c).replace(kernel=kernel(c))
  is_cache = lambda x: isinstance(x, kvcache.KVCache)
  with_len = lambda x: pool(x).replace(rope_len=final_len_B) if is_cache(x) else x
  state = state.replace(target_cache=with_len(state.target_cache),
                        drafter_state=jax.tree.map(with_len, state.drafter_state, is_leaf=is_cache))
  return state if pools is None else kvcache.take_pools(state, pools)


def _capacity(batch: Batch, capacity: int | None) -> int:
  capacity = capacity or batch.capacity
  if capacity is None:
    raise ValueError("no capacity: build the batch with jspec.decoding.batches.make_batch, or pass capacity")
  return capacity


def start(decoder: Decoder, batch: Batch, capacity: int | None = None,
          pools: DecodeState | None = None) -> DecodeState:
  """The state after both prefills, ready for `run` or `step`, with caches of `capacity` slots (default:
  `batch.capacity`), laid out by `decoder.layout` on a mesh; paged caches prefilled into `pools`' pools
  when given (`init_state`)."""
  state = init_state(decoder, batch, capacity, pools)
  if decoder.layout is not None:
    state = decoder.layout.constrain_caches(state)
  prompts_BxP, lens_B = batch.prompts_BxP, batch.prompt_lens_B
  start_B = jnp.zeros_like(lens_B) if batch.cached_B is None else batch.cached_B
  hidden_BxWxD, target_cache = model.prefill(decoder.target_params, decoder.target_config, state.target_cache,
                                             prompts_BxP, lens_B, decoder.feature_layers, start_B,
                                             batch.prefill_width)
  state = state.replace(target_cache=target_cache.rewind(lens_B - 1))  # the last prompt token is pending
  if decoder.drafter is not None:
    state = state.replace(drafter_state=decoder.drafter.prefill(decoder.weights, state.drafter_state, prompts_BxP,
                                                                lens_B, hidden_BxWxD, start_B))
  return state


def _split_keys(state: DecodeState, num: int) -> tuple[DecodeState, jax.Array]:
  """Advances each row's key; returns `num` fresh keys per row as [num, B, 2]."""
  keys = jax.vmap(lambda k: jax.random.split(k, num + 1))(state.keys_Bx2)  # [B, num+1, 2]
  return state.replace(keys_Bx2=keys[:, 0]), jnp.moveaxis(keys[:, 1:], 1, 0)


def _gather(tokens_BxT: jax.Array, index_BxS: jax.Array) -> jax.Array:
  return jnp.take_along_axis(tokens_BxT, index_BxS, axis=1)


def _commit(state: DecodeState, candidates_BxS: jax.Array, num_candidates_B: jax.Array,
            logits_BxSxV: jax.Array) -> tuple[DecodeState, jax.Array]:
  """Appends each active row's first `num_candidates` tokens, cut after EOS and at max_new_tokens, and
  records their log-probabilities from `logits_BxSxV`, the target's for each candidate, where asked.

  Returns the new state and the number of tokens each row emitted.
  """
  width = candidates_BxS.shape[1]
  idx_S = jnp.arange(width)
  is_stop_BxS = (candidates_BxS[:, :, None] == state.stop_BxE[:, None, :]).any(-1)
  is_eos = is_stop_BxS & (idx_S < num_candidates_B[:, None])
  upto_eos = jnp.where(is_eos.any(1), jnp.argmax(is_eos, axis=1) + 1, width)
  room = state.max_new_tokens_B - state.num_emitted
  num_new = jnp.where(state.done_B, 0, jnp.minimum(jnp.minimum(num_candidates_B, upto_eos), room))
  cols = jnp.where(idx_S < num_new[:, None], state.seq_lens_B[:, None] + idx_S, state.tokens_BxT.shape[1])
  rows = jnp.broadcast_to(jnp.arange(candidates_BxS.shape[0])[:, None], cols.shape)
  tokens = state.tokens_BxT.at[rows, cols].set(candidates_BxS, mode="drop")
  hit_eos = is_eos.any(1) & (upto_eos <= num_new)
  done = state.done_B | hit_eos | (num_new >= room)
  constraint = None if state.constraint is None else state.constraint.commit(candidates_BxS, num_new)
  logprobs = None if state.logprobs is None else state.logprobs.record(cols, candidates_BxS, logits_BxSxV,
                                                                       state.sampling, ~state.done_B)
  return state.replace(tokens_BxT=tokens, seq_lens_B=state.seq_lens_B + num_new, done_B=done,
                       constraint=constraint, logprobs=logprobs), num_new


def _target_step(decoder: Decoder, state: DecodeState, keys_Bx2: jax.Array) -> DecodeState:
  """One target forward, one token per row; a drafter, if any, sees the target's features."""
  n = state.seq_lens_B
  logits, hidden, cache = model.forward(decoder.target_params, _gather(state.tokens_BxT, n[:, None] - 1),
                                        n[:, None] - 1, state.target_cache, decoder.target_config,
                                        feature_layers=decoder.feature_layers)
  if state.constraint is not None:
    logits = state.constraint.mask(logits, state.constraint.state_B[:, None])
  token = next_token(keys_Bx2, logits[:, 0], state.sampling)
  active = ~state.done_B
  state, num_new = _commit(state, token[:, None], jnp.ones_like(token), logits)
  state = state.replace(target_cache=cache.rewind(state.seq_lens_B - 1),
                        stats=state.stats.count_forward(active, num_new))
  if decoder.drafter is not None:
    state = _observe(decoder, state, hidden, n)
  return state


def _observe(decoder: Decoder, state: DecodeState, hidden_BxSxD: jax.Array, n_B: jax.Array) -> DecodeState:
  """Tells the drafter what the target saw in a forward that started at lengths n_B."""
  with jax.named_scope("drafter"):  # names the drafter's ops in the HLO (tests count its collectives)
    return state.replace(drafter_state=decoder.drafter.observe(decoder.weights, state.drafter_state, state.context,
                                                               hidden_BxSxD, n_B))


def autoregressive_step(decoder: Decoder, state: DecodeState) -> DecodeState:
  """One plain decoding step: one target forward, one token per row."""
  state, keys = _split_keys(state, 1)
  return _target_step(decoder, state, keys[0])


def plain_step(decoder: Decoder, state: DecodeState, keys_Bx2: jax.Array) -> DecodeState:
  """A target step inside the speculative loop: no proposals; the drafter still sees the target."""
  state = _target_step(decoder, state, keys_Bx2)
  return state.replace(stats=state.stats.count_plain())


def _accept(decoder: Decoder, state: DecodeState, drafts_BxL: jax.Array, n_accepted_B: jax.Array,
            token_B: jax.Array, counted_B: jax.Array, target_cache: kvcache.KVCache, hidden_BxL1xD: jax.Array,
            n_B: jax.Array, logits_BxL1xV: jax.Array) -> DecodeState:
  """The end of every verify, chain or tree: commits each row's first `n_accepted` drafts and the token
  after them (the target's logits for each: `logits_BxL1xV`), counts the round (rows in `counted` as
  verified), rewinds the target's cache (whose first L1 entries past n-1 hold the pending token and the
  drafts) to the new text, and tells the drafter what the target saw at those entries."""
  depth = drafts_BxL.shape[1]
  candidates_BxL1 = jnp.concatenate([drafts_BxL, token_B[:, None]], axis=1)
  candidates_BxL1 = jnp.where(jnp.arange(depth + 1) == n_accepted_B[:, None], token_B[:, None], candidates_BxL1)
  active = ~state.done_B
  state, num_new = _commit(state, candidates_BxL1, n_accepted_B + 1, logits_BxL1xV)
  stats = state.stats.count_forward(active, num_new).count_verify(active & counted_B, n_accepted_B, depth,
                                                                  decoder.drafter.forwards(depth))
  state = state.replace(target_cache=target_cache.rewind(state.seq_lens_B - 1), stats=stats)
  return _observe(decoder, state, hidden_BxL1xD, n_B)


def verify_step(decoder: Decoder, state: DecodeState, proposal: Proposal, keys_Bx2: jax.Array) -> DecodeState:
  """The target scores the pending token and the K proposals in one forward, keeps an accepted prefix and
  one more token, and tells the drafter what it saw."""
  draft_BxK = proposal.tokens_BxK
  draft_len = draft_BxK.shape[1]
  n = state.seq_lens_B
  chunk_BxK1 = jnp.concatenate([_gather(state.tokens_BxT, n[:, None] - 1), draft_BxK], axis=1)
  positions_BxK1 = n[:, None] - 1 + jnp.arange(draft_len + 1)
  logits_BxK1xV, hidden, target_cache = model.forward(decoder.target_params, chunk_BxK1, positions_BxK1,
                                                      state.target_cache, decoder.target_config,
                                                      feature_layers=decoder.feature_layers)
  if state.constraint is not None:  # each entry masked by the state its draft prefix reaches
    logits_BxK1xV = state.constraint.mask(logits_BxK1xV, state.constraint.path_states(draft_BxK))
  if decoder.spec.typical_acceptance:
    n_accepted, token = verify_typical(keys_Bx2, draft_BxK, probabilities(logits_BxK1xV, state.sampling))
  else:  # q and p go through the same transform; an all-greedy batch needs only argmaxes.
    n_accepted, token = lax.cond(
        is_greedy(state.sampling), lambda: verify_greedy(draft_BxK, logits_BxK1xV),
        lambda: verify(keys_Bx2, draft_BxK, probabilities(proposal.logits_BxKxV, state.sampling),
                       probabilities(logits_BxK1xV, state.sampling)))
  has_draft = proposal.has_draft_B & state.speculate_B
  n_accepted, token = _plain_where_no_draft(has_draft, n_accepted, token, keys_Bx2, logits_BxK1xV, state)
  return _accept(decoder, state, draft_BxK, n_accepted, token, has_draft, target_cache, hidden, n, logits_BxK1xV)


def _plain_where_no_draft(has_draft_B: jax.Array, n_accepted_B: jax.Array, token_B: jax.Array, keys_Bx2: jax.Array,
                          logits_BxSxV: jax.Array, state: DecodeState) -> tuple[jax.Array, jax.Array]:
  """A row without a proposal (or that does not speculate) accepts nothing and draws exactly what a plain
  target step would, with the same key, so its tokens do not depend on whether other rows' proposals
  turned this round into a verify."""
  return (jnp.where(has_draft_B, n_accepted_B, 0),
          jnp.where(has_draft_B, token_B, next_token(keys_Bx2, logits_BxSxV[:, 0], state.sampling)))


def tree_verify_step(decoder: Decoder, state: DecodeState, proposal: TreeProposal,
                     keys_Bx2: jax.Array) -> DecodeState:
  """The target scores the pending token and a draft tree in one forward (each node sees its ancestors),
  keeps the accepted path and one more token, moves the path's K/V into place, and tells the drafter."""
  depth, width = decoder.spec.draft_len, decoder.spec.tree.top_k
  n = state.seq_lens_B
  mask_BxM1xM1 = tree.ancestors(proposal.parents_BxM, depth)
  chunk_BxM1 = jnp.concatenate([_gather(state.tokens_BxT, n[:, None] - 1), proposal.tokens_BxM], axis=1)
  logits_BxM1xV, hidden, target_cache = model.forward(
      decoder.target_params, chunk_BxM1, n[:, None] - 1 + tree.depths(mask_BxM1xM1), state.target_cache,
      decoder.target_config, mask_BxM1xM1, decoder.feature_layers)
  if state.constraint is not None:  # each node masked by the state its path reaches
    states_BxM1 = state.constraint.tree_states(proposal.tokens_BxM, proposal.parents_BxM, depth)
    logits_BxM1xV = state.constraint.mask(logits_BxM1xV, states_BxM1)
  q_BxM1xV = None if proposal.logits_BxM1xV is None else probabilities(proposal.logits_BxM1xV, state.sampling)
  path_BxL1, n_accepted, token = lax.cond(
      is_greedy(state.sampling),
      lambda: tree.verify_greedy(proposal.tokens_BxM, proposal.parents_BxM, logits_BxM1xV, depth, width),
      lambda: tree.verify(keys_Bx2, proposal.tokens_BxM, proposal.parents_BxM,
                          probabilities(logits_BxM1xV, state.sampling), q_BxM1xV, depth, width, proposal.rule))
  n_accepted, token = _plain_where_no_draft(state.speculate_B, n_accepted, token, keys_Bx2, logits_BxM1xV, state)
  target_cache = tree.compact(target_cache, n - 1, path_BxL1)
  hidden_BxL1xD = jnp.take_along_axis(hidden, path_BxL1[:, :, None], axis=1)
  return _accept(decoder, state, _gather(chunk_BxM1, path_BxL1[:, 1:]), n_accepted, token, state.speculate_B,
                 target_cache, hidden_BxL1xD, n, jnp.take_along_axis(logits_BxM1xV, path_BxL1[:, :, None], axis=1))


def _draft_tree_and_verify(decoder: Decoder, state: DecodeState) -> DecodeState:
  """A tree round: the drafter's tree of depth `spec.draft_len`, then its verification."""
  state, keys = _split_keys(state, 2)
  with jax.named_scope("drafter"):
    drafter_state, proposal = decoder.drafter.propose_tree(decoder.weights, state.drafter_state, state.context,
                                                           decoder.spec, keys[0])
  state = tree_verify_step(decoder, state.replace(drafter_state=drafter_state), proposal, keys[1])
  return state.replace(stats=state.stats.count_schedule(decoder.spec.draft_len))


def _draft_and_verify(decoder: Decoder, draft_len: int, state: DecodeState, keys_K1xBx2: jax.Array) -> DecodeState:
  """A round of `draft_len` proposals; `keys` has spec.draft_len + 1 keys, the last one verify's."""
  with jax.named_scope("drafter"):
    drafter_state, proposal = decoder.drafter.propose(decoder.weights, state.drafter_state, state.context,
                                                      keys_K1xBx2[:draft_len])
  if decoder.layout is not None:
    proposal = proposal.replace(logits_BxKxV=decoder.layout.pin_draft_logits(proposal.logits_BxKxV))
  state = state.replace(drafter_state=drafter_state)
  verify_keys = keys_K1xBx2[-1]
  if not decoder.drafter.can_skip_rounds:
    return verify_step(decoder, state, proposal, verify_keys)
  has_any = jnp.any(proposal.has_draft_B & state.speculate_B & ~state.done_B)
  state = run_if(has_any, lambda s: verify_step(decoder, s, proposal, verify_keys), state)
  return run_if(~has_any, lambda s: plain_step(decoder, s, verify_keys), state)


def speculative_step(decoder: Decoder, state: DecodeState, plain: bool = False) -> DecodeState:
  """One speculative round: propose, verify and commit (or, adaptively, a plain step). `plain` (adaptive
  chains): always the adaptive policy's plain step, with its keys: a program without the drafter's rounds."""
  spec = decoder.spec
  if spec.tree is not None:
    return _draft_tree_and_verify(decoder, state)
  state, keys = _split_keys(state, spec.draft_len + 1)
  if plain:
    state = plain_step(decoder, state, keys[-1])
    return state.replace(stats=state.stats.count_schedule(0))
  if spec.adaptive is None:
    state = _draft_and_verify(decoder, spec.draft_len, state, keys)
    return state.replace(stats=state.stats.count_schedule(spec.draft_len))
  # One branch per draft length the policy offers (and a plain step for K = 0), chosen at run time: nothing
  # recompiles as K changes.
  draft_len, probe = adaptive.choose(state.stats.acceptance, ~state.done_B, spec.adaptive, spec.draft_len,
                                     state.speculate_B)
  lens = spec.adaptive.lens(spec.draft_len)
  branches = [lambda s: plain_step(decoder, s, keys[-1])]
  branches += [lambda s, k=k: _draft_and_verify(decoder, k, s, keys) for k in lens]
  before = state.seq_lens_B[0]
  state = run_switch(jnp.sum(draft_len >= jnp.asarray(lens)), branches, state)
  stats = state.stats.count_schedule(draft_len, probe)
  if spec.trace_rounds:
    stats = stats.record_trace(draft_len, state.seq_lens_B[0] - before - 1)
  return state.replace(stats=stats)


def step(decoder: Decoder, state: DecodeState, plain: bool = False) -> DecodeState:
  """One round: a speculative one when the decoder has a drafter (`plain`: see `speculative_step`), else a
  plain step."""
  return autoregressive_step(decoder, state) if decoder.drafter is None else speculative_step(decoder, state, plain)


def run(decoder: Decoder, state: DecodeState, max_rounds: jax.Array | int | None = None,
        stop_at_finish: jax.Array | bool = False, plain: bool = False) -> DecodeState:
  """Decodes until every row is done, in one `lax.while_loop`. Pure: jit it yourself or use
  `jspec.decoding.programs`.

  A segment: with `max_rounds` it also stops after that many rounds, and with `stop_at_finish` as soon as
  a row that was running finishes; both are runtime values, so one executable serves every segment, and
  the host continues the returned state (streaming, refilling finished rows with `insert`). The segments of
  a request decode exactly what one call would: nothing but the state carries over between rounds.
  `plain` (adaptive chains): every round the adaptive policy's plain step (`speculative_step`)."""
  trace_counts["speculative" if decoder.drafter is not None else "autoregressive"] += 1
  max_rounds = jnp.iinfo(jnp.int32).max if max_rounds is None else max_rounds
  running_B = ~state.done_B

  def more(carry):
    state, rounds = carry
    finished = jnp.any(running_B & state.done_B) & stop_at_finish
    return ~jnp.all(state.done_B) & (rounds < max_rounds) & ~finished

  return lax.while_loop(more, lambda c: (step(decoder, c[0], plain), c[1] + 1), (state, jnp.int32(0)))[0]
