"""Each row's constraint automaton in the decode loop: its tables and its current state, as arrays.

A row's tables (`Tables`, compiled by `jspec.text.constraints`, padded to the batch's bucket) map each token to
a class (`class_BxV`) and each (state, class) to the next state (`next_BxUxY`, -1: not allowed). A row without a
constraint has one state that allows every token. The state moves only when tokens are committed, so
rewinding the cache needs nothing here; proposals and verification read the states along a draft path
(`path_states`, `tree_states`) and mask logits by them (`mask`). A path that leaves the automaton (a token
it does not allow: a drafter's guess, never a committed token) is dead, -1, and masks nothing; the target
never accepts such a token, since its masked probability is 0.

Shapes (the package's legend): U states and Y classes, both padded to powers of two (`bucket`); I entries
looked up at once.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

MIN_BUCKET = 8


@dataclasses.dataclass(frozen=True)
class Tables:
  """A compiled constraint, on the host: `class_V[v]` is token v's class, `next_UxY[s, c]` the state after a
  token of class c in state s (-1: not allowed); state 0 is the start."""
  class_V: np.ndarray  # int32
  next_UxY: np.ndarray  # int32

  @property
  def num_states(self) -> int:
    return self.next_UxY.shape[0]

  @property
  def num_classes(self) -> int:
    return self.next_UxY.shape[1]

  @property
  def nbytes(self) -> int:
    return self.class_V.nbytes + self.next_UxY.nbytes


def advanced(tables: Tables, tokens: Sequence[int]) -> Tables:
  """The same constraint started after `tokens` (which it allows): the state they lead to renumbered as
  the start, 0 (swapped with it)."""
  state = 0
  for token in tokens:
    state = int(tables.next_UxY[state, tables.class_V[token]])
    if state < 0:
      raise ValueError("the tokens leave the constraint")
  swap = np.arange(tables.num_states)
  swap[[0, state]] = swap[[state, 0]]  # its own inverse
  next_UxY = tables.next_UxY[swap]
  return Tables(tables.class_V, np.where(next_UxY >= 0, swap[np.maximum(next_UxY, 0)], -1).astype(np.int32))


@flax.struct.dataclass
class Automata:
  class_BxV: jax.Array  # int32: token -> class
  next_BxUxY: jax.Array  # int32: (state, class) -> next state, -1 not allowed
  state_B: jax.Array  # int32: the state after the row's committed tokens; -1 dead

  @property
  def bucket(self) -> tuple[int, int]:
    return self.next_BxUxY.shape[1:]

  def step(self, state_BxI: jax.Array, token_BxI: jax.Array) -> jax.Array:
    """The states after `token` from `state`, for I tokens per row."""
    class_BxI = jnp.take_along_axis(self.class_BxV, token_BxI, axis=1)
    rows = jnp.arange(state_BxI.shape[0])[:, None]
    nxt = self.next_BxUxY[rows, jnp.maximum(state_BxI, 0), class_BxI]
    return jnp.where(state_BxI < 0, -1, nxt)

  def allowed(self, state_BxI: jax.Array) -> jax.Array:
    """[B, I, V] bool: the tokens allowed in each state (all of them in a dead one)."""
    rows = jnp.arange(state_BxI.shape[0])[:, None]
    next_BxIxY = self.next_BxUxY[rows, jnp.maximum(state_BxI, 0)]
    class_BxIxV = jnp.broadcast_to(self.class_BxV[:, None], (*state_BxI.shape, self.class_BxV.shape[1]))
    return (jnp.take_along_axis(next_BxIxY, class_BxIxV, axis=2) >= 0) | (state_BxI < 0)[..., None]

  def mask(self, logits_BxIxV: jax.Array, state_BxI: jax.Array) -> jax.Array:
    """The logits with every token not allowed in its position's state at -inf."""
    return jnp.where(self.allowed(state_BxI), logits_BxIxV, -jnp.inf)

  def path_states(self, tokens_BxK: jax.Array) -> jax.Array:
    """[B, K+1]: the state before each token of a path from the current state, and after the last."""
    states = [self.state_B]
    for i in range(tokens_BxK.shape[1]):
      states.append(self.step(states[-1][:, None], tokens_BxK[:, i:i + 1])[:, 0])
    return jnp.stack(states, axis=1)

  def tree_states(self, tokens_BxM: jax.Array, parents_BxM: jax.Array, depth: int) -> jax.Array:
    """[B, M+1]: the state at each entry of a tree chunk (entry 0 the root; node m at entry m+1, its parent
    at entry `parents[m]`), after the tokens on its path; `depth` passes reach every node."""
    states_BxM1 = jnp.broadcast_to(self.state_B[:, None], (tokens_BxM.shape[0], tokens_BxM.shape[1] + 1))
    for _ in range(depth):
      parent_states = jnp.take_along_axis(states_BxM1, parents_BxM, axis=1)
      states_BxM1 = states_BxM1.at[:, 1:].set(self.step(parent_states, tokens_BxM))
    return states_BxM1

  def commit(self, tokens_BxS: jax.Array, num_new_B: jax.Array) -> Automata:
    """Moves each row's state past its first `num_new` tokens."""
    path = self.path_states(tokens_BxS)
    return self.replace(state_B=jnp.take_along_axis(path, num_new_B[:, None], axis=1)[:, 0])


def unconstrained(vocab_size: int) -> Tables:
  """The tables of a row without a constraint: one state, one class, every token allowed."""
  return Tables(np.zeros((vocab_size,), np.int32), np.zeros((1, 1), np.int32))


def bucket(tables: Sequence[Tables | None]) -> tuple[int, int]:
  """The smallest (states, classes) bucket, powers of two, that holds every row's tables."""
  round_up = lambda n: max(MIN_BUCKET, 1 << (n - 1).bit_length())
  real = [t for t in tables if t is not None] or [unconstrained(1)]
  return round_up(max(t.num_states for t in real)), round_up(max(t.num_classes for t in real))


def stack(tables: Sequence[Tables | None], vocab_size: int, shape: tuple[int, int] | None = None) -> Automata:
  """The automata of a batch at their start states: row b follows `tables[b]` (None: no constraint), padded
  to `shape` (default: `bucket(tables)`); padded states and classes allow nothing and are never reached."""
  states, classes = shape or bucket(tables)
  class_BxV = np.zeros((len(tables), vocab_size), np.int32)
  next_BxUxY = np.full((len(tables), states, classes), -1, np.int32)
  for b, t in enumerate(tables):
    t = t or unconstrained(vocab_size)
    if t.num_states > states or t.num_classes > classes:
      raise ValueError(f"a constraint of {t.num_states} states and {t.num_classes} token classes does not fit "
                       f"tables of {states} states and {classes} classes")
    class_BxV[b] = t.class_V
    next_BxUxY[b, :t.num_states, :t.num_classes] = t.next_UxY
  return Automata(class_BxV, next_BxUxY, np.zeros((len(tables),), np.int32))


def pad(automata: Automata | None, shape: tuple[int, int], batch: int, vocab_size: int) -> Automata:
  """A running batch's automata grown to tables of `shape` (rows keep their states), or, for a batch
  without any, free rows' automata."""
  if automata is None:
    return stack([None] * batch, vocab_size, shape)
  states, classes = automata.bucket
  widths = ((0, 0), (0, shape[0] - states), (0, shape[1] - classes))
  return automata.replace(next_BxUxY=jnp.pad(automata.next_BxUxY, widths, constant_values=-1))


def nbytes(batch: int, vocab_size: int, shape: tuple[int, int]) -> int:
  """Device bytes of a batch's automata of bucket `shape`."""
  return 4 * batch * (vocab_size + shape[0] * shape[1] + 1)
