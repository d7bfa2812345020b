"""Draft token trees: their attention mask and their lossless verification.

A round's tree is flattened in topological order into the chunk the target verifies: chunk index 0 is the
row's pending token (the last one emitted, whose K/V is not in the cache yet) and index m + 1 is draft
node m. `parents_BxM[b, m]` is the chunk index of node m's parent (0 for a child of the pending token),
always smaller than m + 1, so a node's ancestors come before it. Siblings are tried in node order.

Each chunk entry sees the row's cache and its own ancestors (itself included); its position is the row's
length plus its depth. After verification the accepted path's K/V entries are gathered into the slots
right after the old length (`compact`), as EAGLE and Medusa do, and the cache rewound past them.

Verification walks down from the pending token. Greedy rows follow the target's argmax. Sampled rows use
one of two rules, by how the children were chosen:
- `TOP_K` (chosen deterministically, e.g. the draft's top-k, as EAGLE-2 and SGLang): child x is accepted
  with probability p(x) / (mass of p not yet rejected); a rejected child's probability is set to 0; if every
  child is rejected the token is drawn from what is left of p.
- `SAMPLED` (children drawn independently from q, SpecInfer's multi-draft rule): child x is accepted with
  probability min(1, p(x) / q(x)); on rejection p becomes norm(max(0, p - q)); if every child is rejected
  the token is drawn from that residual.
Either way the emitted tokens follow the target's distribution exactly; the p - q residual is wrong for
top-k children, so the two must not be mixed up.

Shapes: the package legend's M (draft nodes; M1 = M + 1 chunk entries), L (depth), G (children per node),
Z (candidate nodes a dynamic tree grows before the best M are kept) and A (entries fed so far).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jspec.model import cache as kvcache
from jspec.model.cache import KVCache
from jspec.speculation.sampling import SamplingParams, argmax, probabilities, sample
from jspec.speculation.verify import residual

TOP_K, SAMPLED = "top_k", "sampled"


@dataclasses.dataclass(frozen=True)
class StaticShape:
  """A tree given as paths of child ranks, flattened: node m's parent (chunk index), depth and rank."""
  parent_M: np.ndarray
  depth_M: np.ndarray
  rank_M: np.ndarray


def static_shape(choices: tuple[tuple[int, ...], ...]) -> StaticShape:
  """Flattens paths of ranks (Medusa's `tree_choices`) in topological order: by depth, then path."""
  ordered = sorted(choices, key=lambda c: (len(c), c))
  entry = {path: m + 1 for m, path in enumerate(ordered)}
  return StaticShape(parent_M=np.asarray([entry.get(c[:-1], 0) for c in ordered], np.int32),
                     depth_M=np.asarray([len(c) for c in ordered], np.int32),
                     rank_M=np.asarray([c[-1] for c in ordered], np.int32))


# The chance that the r-th ranked candidate at a depth is the target's token, assumed when no measured
# acceptance is at hand: rank 0 half the time, each later rank a third as often as the one before.
PRIOR_TOP, PRIOR_DECAY = 0.5, 1 / 3


def default_choices(depth: int, top_k: int, nodes: int) -> tuple[tuple[int, ...], ...]:
  """The `nodes` paths (ranks below `top_k`, at most `depth` long) likeliest to be accepted whole under
  the prior above: a path's score is the product of its ranks' chances. Scores fall along a path, so the
  kept set holds every kept path's parent."""
  def paths(prefix, score):
    yield score, prefix
    if len(prefix) < depth:
      for rank in range(top_k):
        yield from paths(prefix + (rank,), score * PRIOR_TOP * PRIOR_DECAY ** rank)
  ranked = sorted((-score, len(p), p) for score, p in paths((), 1.0) if p)
  return tuple(p for _, _, p in ranked[:nodes])


def ancestors(parents_BxM: jax.Array, depth: int) -> jax.Array:
  """[B, M1, M1] bool: entry [b, i, j] when chunk entry j is entry i or one of its ancestors. `depth`
  (static) bounds the number of levels below the pending token."""
  batch, nodes = parents_BxM.shape
  parent_BxM1 = jnp.concatenate([jnp.zeros((batch, 1), parents_BxM.dtype), parents_BxM], axis=1)
  step_BxM1xM1 = jax.nn.one_hot(parent_BxM1, nodes + 1, dtype=jnp.bool_).at[:, 0, 0].set(False)
  seen = jnp.broadcast_to(jnp.eye(nodes + 1, dtype=jnp.bool_), (batch, nodes + 1, nodes + 1))
  hop = seen
  for _ in range(depth):  # hop = parent relation to the power d; seen = union over d
    hop = jnp.einsum("bij,bjk->bik", hop.astype(jnp.int32), step_BxM1xM1.astype(jnp.int32)) > 0
    seen = seen | hop
  return seen


def depths(tree_BxM1xM1: jax.Array) -> jax.Array:
  """[B, M1] int32: each chunk entry's depth below the pending token (its number of proper ancestors)."""
  return jnp.sum(tree_BxM1xM1, axis=-1).astype(jnp.int32) - 1


def _children(parents_BxM: jax.Array, at_B: jax.Array, rank: int) -> tuple[jax.Array, jax.Array]:
  """(node index [B], exists [B]) of the rank-th child (in node order) of chunk entry `at` of each row."""
  is_child_BxM = parents_BxM == at_B[:, None]
  order_BxM = jnp.cumsum(is_child_BxM, axis=1) - 1
  pick_BxM = is_child_BxM & (order_BxM == rank)
  return jnp.argmax(pick_BxM, axis=1).astype(jnp.int32), pick_BxM.any(axis=1)


def _walk(tokens_BxM: jax.Array, parents_BxM: jax.Array, depth: int, width: int, carry: Any, try_child,
          descend) -> tuple[jax.Array, jax.Array, jax.Array, Any]:
  """Walks down each row's tree from the pending token, trying each node's children in node order:
  `try_child(carry, at_B, x_B, trying_B, level, rank) -> (hit_B, carry)` decides whether child token x (of
  chunk entry `at`) is accepted, for the rows `trying` it; after each level, `descend(carry, found_B, at_B)`
  moves the carry to the accepted child. Returns `(path_BxL1, n_accepted_B, at_B, carry)`: the chunk
  indices of the pending token and the accepted nodes (entries past n_accepted + 1 repeat the last), how
  many nodes were accepted, and where the walk stopped."""
  batch = tokens_BxM.shape[0]
  at_B, walking_B = jnp.zeros((batch,), jnp.int32), jnp.ones((batch,), jnp.bool_)
  path = [at_B]
  for level in range(depth):
    found_B, next_B = jnp.zeros_like(walking_B), at_B
    for rank in range(width):
      node_B, exists_B = _children(parents_BxM, at_B, rank)
      x_B = jnp.take_along_axis(tokens_BxM, node_B[:, None], axis=1)[:, 0]
      hit_B, carry = try_child(carry, at_B, x_B, walking_B & exists_B & ~found_B, level, rank)
      next_B, found_B = jnp.where(hit_B, node_B + 1, next_B), found_B | hit_B
    walking_B = walking_B & found_B
    at_B = jnp.where(walking_B, next_B, at_B)
    carry = descend(carry, found_B, at_B)
    path.append(at_B)
  path_BxL1 = jnp.stack(path, axis=1)
  n_accepted = jnp.sum(path_BxL1[:, 1:] != path_BxL1[:, :-1], axis=1).astype(jnp.int32)
  return path_BxL1, n_accepted, at_B, carry


def verify_greedy(tokens_BxM: jax.Array, parents_BxM: jax.Array, logits_BxM1xV: jax.Array,
                  depth: int, width: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Follows the target's argmax down each row's tree. Returns `(path_BxL1, n_accepted_B, next_token_B)`
  (see `_walk`) with the token emitted after the accepted nodes. `width` (static) bounds how many children
  a node has."""
  best_BxM1 = argmax(logits_BxM1xV)
  best_at = lambda at_B: jnp.take_along_axis(best_BxM1, at_B[:, None], axis=1)[:, 0]
  try_child = lambda carry, at_B, x_B, trying_B, level, rank: (trying_B & (x_B == best_at(at_B)), carry)
  path_BxL1, n_accepted, at_B, _ = _walk(tokens_BxM, parents_BxM, depth, width, None, try_child,
                                         lambda carry, found_B, at_B: carry)
  return path_BxL1, n_accepted, best_at(at_B)


def verify(keys_Bx2: jax.Array, tokens_BxM: jax.Array, parents_BxM: jax.Array, p_BxM1xV: jax.Array,
           q_BxM1xV: jax.Array | None, depth: int, width: int,
           rule: str) -> tuple[jax.Array, jax.Array, jax.Array]:
  """`verify_greedy` for sampled rows: p (and, for `SAMPLED` children, the q they were drawn from) per
  chunk entry, after the sampling transform. `q_BxM1xV[b, i]` is the distribution node i's children were
  drawn from (unused for `TOP_K`)."""
  if rule not in (TOP_K, SAMPLED):
    raise ValueError(f"unknown tree rule {rule!r}")
  batch = tokens_BxM.shape[0]
  accept_key, residual_key = jnp.moveaxis(jax.vmap(lambda k: jax.random.split(k, 2))(keys_Bx2), 1, 0)
  u_BxLxG = jax.vmap(lambda k: jax.random.uniform(k, (depth, width)))(accept_key)
  take = lambda x_BxV, t_B: jnp.take_along_axis(x_BxV, t_B[:, None], axis=1)[:, 0]
  row_of = lambda x_BxM1xV, at_B: jnp.take_along_axis(x_BxM1xV, at_B[:, None, None], axis=1)[:, 0]

  def try_child(p_BxV, at_B, x_B, trying_B, level, rank):
    u_B = u_BxLxG[:, level, rank]
    if rule == TOP_K:  # accept with p(x) / mass left; on rejection p(x) = 0
      hit_B = trying_B & (u_B * p_BxV.sum(-1) < take(p_BxV, x_B))
      rejected = p_BxV.at[jnp.arange(batch), x_B].set(0.0)
    else:  # accept with min(1, p(x) / q(x)); on rejection p = norm(max(0, p - q))
      q_BxV = row_of(q_BxM1xV, at_B)
      hit_B = trying_B & (u_B * take(q_BxV, x_B) < take(p_BxV, x_B))
      rejected = residual(p_BxV, q_BxV)
    return hit_B, jnp.where((trying_B & ~hit_B)[:, None], rejected, p_BxV)

  descend = lambda p_BxV, found_B, at_B: jnp.where(found_B[:, None], row_of(p_BxM1xV, at_B), p_BxV)
  path_BxL1, n_accepted, _, p_BxV = _walk(tokens_BxM, parents_BxM, depth, width, row_of(p_BxM1xV, jnp.zeros(
      (batch,), jnp.int32)), try_child, descend)
  return path_BxL1, n_accepted, sample(residual_key, p_BxV / p_BxV.sum(-1, keepdims=True))


def compact(cache: KVCache, base_B: jax.Array, path_BxL1: jax.Array) -> KVCache:
  """Moves each row's accepted path, written at slots `base + path`, into the contiguous slots
  `base + 0..L` of every layer: a gather of L1 entries per row, then the cache's in-place row update.
  Returns the cache with the lengths it had (the caller rewinds it)."""
  slots_BxL1 = base_B[:, None] + path_BxL1
  at_base = cache.rewind(base_B)
  move = lambda buf: kvcache.write(at_base, buf, cache.read(buf, slots_BxL1))
  return cache.replace(k=tuple(map(move, cache.k)), v=tuple(map(move, cache.v)))


def top_k_children(logits_BxSxV: jax.Array, top_k: int, level: int) -> tuple[jax.Array, jax.Array]:
  """Each of S nodes' children: the draft's top-k tokens, and their log-probabilities."""
  return lax.top_k(jax.nn.log_softmax(logits_BxSxV.astype(jnp.float32)), top_k)


def sampled_children(keys_Bx2: jax.Array, sampling: SamplingParams):
  """A `grow` child chooser: each node's children drawn independently from q, the draft's distribution
  under the rows' sampling (SpecInfer's multi-draft proposal, verified with the `SAMPLED` rule), with their
  log-probabilities under q. Greedy rows take the top-k (their one-hot q makes either rule exact)."""
  def choose(logits_BxSxV: jax.Array, top_k: int, level: int) -> tuple[jax.Array, jax.Array]:
    logq_BxSxV = jnp.log(probabilities(logits_BxSxV, sampling))
    keys = jax.vmap(lambda k: jax.random.fold_in(k, level))(keys_Bx2)
    draws_BxSxG = jax.vmap(lambda k, lq: jax.random.categorical(k, lq, shape=(top_k, lq.shape[0])).T)(
        keys, logq_BxSxV).astype(jnp.int32)
    score_BxSxG = jnp.take_along_axis(logq_BxSxV, draws_BxSxG, axis=-1)
    top_score, top_token = top_k_children(logits_BxSxV, top_k, level)
    greedy = (sampling.temperature == 0)[:, None, None]
    return jnp.where(greedy, top_score, score_BxSxG), jnp.where(greedy, top_token, draws_BxSxG)
  return choose


def children(spec, keys_Bx2: jax.Array, sampling: SamplingParams):
  """The child chooser `spec.tree` asks for: `sampled_children` or `top_k_children`."""
  return sampled_children(keys_Bx2, sampling) if spec.tree.sampled else top_k_children


def rule(spec) -> str:
  """The verification rule for the children `spec.tree` makes."""
  return SAMPLED if spec.tree.sampled else TOP_K


def grow(expand, carry, parent_state, logits_BxV: jax.Array, depth: int, top_k: int, nodes: int,
         choose=top_k_children, automata=None) -> tuple[Any, jax.Array, jax.Array, jax.Array | None]:
  """EAGLE-2's dynamic tree from a drafter's distributions. The root's top-k tokens are the first
  frontier; each further level expands the frontier (the top-k nodes of the level by cumulative draft
  log-probability) into top-k children each. Every node made is a candidate; the `nodes` candidates of
  highest cumulative log-probability are kept (scores fall along a path, and ties go to the shallower, so
  every kept node's parent is kept) and flattened in topological order.

  With `choose=sampled_children(...)` each node's children are drawn from q instead. Then which of them
  are kept must not depend on their own values (a kept sample must still be a draw from q): the first
  `nodes` candidates are kept, level by level, children of the likelier frontier nodes first, in the
  order drawn; and the logits each chunk entry's children were drawn from are returned for verification
  (None with top-k children).

  `expand(carry, parent_state_BxG, tokens_BxG, tree_BxGxA, level)` feeds a level's frontier to the drafter:
  the frontier's tokens, what their parents' expansion left (`parent_state`, a pytree of [B, K, ...]
  leaves), and each frontier entry's ancestors among the A = level * K entries fed this round (itself
  included). It returns `(carry, logits_BxGxV, state_BxG)`: each frontier node's children's logits and the
  state its children will get. Returns `(carry, tokens_BxM, parents_BxM, logits_BxM1xV or None)`.

  With `automata` (the rows' constraints, `jspec.text.automaton.Automata`), each node's children come from its
  logits masked by the automaton state its path reaches.
  """
  batch = logits_BxV.shape[0]
  sampled = choose is not top_k_children
  if automata is not None:
    logits_BxV = automata.mask(logits_BxV[:, None], automata.state_B[:, None])[:, 0]
  score_BxG, token_BxG = (x[:, 0] for x in choose(logits_BxV[:, None], top_k, 0))
  if automata is not None:
    fsm_BxG = automata.step(jnp.broadcast_to(automata.state_B[:, None], token_BxG.shape), token_BxG)
  scores, tokens, parents = [score_BxG], [token_BxG.astype(jnp.int32)], [jnp.full((batch, top_k), -1, jnp.int32)]
  expanded = []  # (candidate indices, the logits their children came from), per level
  frontier_BxG = jnp.broadcast_to(jnp.arange(top_k, dtype=jnp.int32), (batch, top_k))  # candidate indices
  frontier_tokens_BxG, frontier_score_BxG = tokens[0], score_BxG
  seen_BxGxA = jnp.broadcast_to(jnp.eye(top_k, dtype=jnp.bool_), (batch, top_k, top_k))
  for level in range(1, depth):
    carry, logits_BxGxV, state = expand(carry, parent_state, frontier_tokens_BxG, seen_BxGxA, level)
    if automata is not None:
      logits_BxGxV = automata.mask(logits_BxGxV, fsm_BxG)
    expanded.append((frontier_BxG, logits_BxGxV))
    child_score_BxGxG, child_BxGxG = choose(logits_BxGxV, top_k, level)
    child_score_BxGG = (frontier_score_BxG[:, :, None] + child_score_BxGxG).reshape(batch, top_k * top_k)
    offset = sum(s.shape[1] for s in scores)
    scores.append(child_score_BxGG)
    tokens.append(child_BxGxG.reshape(batch, -1).astype(jnp.int32))
    parents.append(jnp.repeat(frontier_BxG, top_k, axis=1))
    frontier_score_BxG, best_BxG = lax.top_k(child_score_BxGG, top_k)
    slot_BxG = best_BxG // top_k  # which frontier node each new frontier node hangs from
    frontier_tokens_BxG = jnp.take_along_axis(tokens[-1], best_BxG, axis=1)
    if automata is not None:
      parent_fsm_BxG = jnp.take_along_axis(fsm_BxG, slot_BxG, axis=1)
      fsm_BxG = automata.step(parent_fsm_BxG, frontier_tokens_BxG)
    frontier_BxG = (offset + best_BxG).astype(jnp.int32)
    parent_state = jax.tree.map(lambda x: jnp.take_along_axis(
        x, slot_BxG.reshape(batch, top_k, *([1] * (x.ndim - 2))), axis=1), state)
    rows = jnp.take_along_axis(seen_BxGxA, slot_BxG[:, :, None], axis=1)
    seen_BxGxA = jnp.concatenate([rows, jnp.broadcast_to(jnp.eye(top_k, dtype=jnp.bool_), (batch, top_k, top_k))],
                                 axis=2)
  score_BxZ, token_BxZ, parent_BxZ = (jnp.concatenate(x, axis=1) for x in (scores, tokens, parents))
  if sampled:
    kept_BxM = jnp.broadcast_to(jnp.arange(nodes), (batch, nodes))
  else:  # the best `nodes` by score, shallower first on ties, then back in candidate (topological) order
    level_Z = jnp.concatenate([jnp.full((s.shape[1],), i) for i, s in enumerate(scores)])
    order_BxZ = jax.vmap(lambda s: jnp.lexsort((level_Z, -s)))(score_BxZ)
    kept_BxM = jnp.sort(order_BxZ[:, :nodes], axis=1)
  entry_BxZ = jnp.zeros_like(parent_BxZ).at[jnp.arange(batch)[:, None], kept_BxM].set(
      jnp.arange(1, nodes + 1, dtype=jnp.int32))
  parent_BxM = jnp.take_along_axis(parent_BxZ, kept_BxM, axis=1)
  parent_entry_BxM = jnp.where(parent_BxM < 0, 0, jnp.take_along_axis(entry_BxZ, jnp.maximum(parent_BxM, 0), axis=1))
  q_logits = None
  if sampled:  # entry 0's children came from the root's logits, a kept node's from its expansion (if any)
    rows = jnp.arange(batch)[:, None]
    all_BxZxV = jnp.zeros((batch, score_BxZ.shape[1], logits_BxV.shape[-1]), logits_BxV.dtype)
    for frontier_BxG, logits_BxGxV in expanded:
      all_BxZxV = all_BxZxV.at[rows, frontier_BxG].set(logits_BxGxV.astype(logits_BxV.dtype))
    q_logits = jnp.concatenate([logits_BxV[:, None], jnp.take_along_axis(all_BxZxV, kept_BxM[:, :, None], axis=1)],
                               axis=1)
  return carry, jnp.take_along_axis(token_BxZ, kept_BxM, axis=1), parent_entry_BxM, q_logits
