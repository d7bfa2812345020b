"""Constraints on what a row may output (`Regex`, `JsonSchema`, `Choice`), compiled to token automata.

`outlines-core` turns a regular expression (a JSON Schema and a list of choices become one) and the model's
vocabulary, read from its own `tokenizer.json`, into a deterministic automaton over token ids. `compile`
lays it out as device tables with a compressed alphabet: tokens that lead to the same state from every state
share a class, so a row's tables are a `[V]` class map and a `[states, classes]` next-state table
(`jspec.text.automaton` holds and walks them in the loop). The model's stop tokens are allowed exactly in
accepting states, and in any state where nothing else is (which then ends the text). Compiled tables are
kept in an LRU cache keyed by the constraint and the vocabulary.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Sequence

import numpy as np
from tokenizers import Tokenizer

from jspec.text.automaton import Tables
from jspec.text.tokenizer import token_bytes

# JSON Schema whitespace between tokens: at most one space, so a valid object completes within a small
# budget of tokens (an unbounded whitespace pattern lets a sampled row pad forever).
JSON_WHITESPACE = r"[ ]?"


@dataclasses.dataclass(frozen=True)
class Regex:
  """The output must match `pattern` in full (Rust `regex` syntax, as outlines-core reads it)."""
  pattern: str

  def regex(self) -> str:
    return self.pattern


@dataclasses.dataclass(frozen=True)
class JsonSchema:
  """The output must be one JSON value valid under `schema` (a dict, or its JSON text)."""
  schema: str

  def __init__(self, schema: dict | str):
    if isinstance(schema, str):
      try:
        schema = json.loads(schema)
      except json.JSONDecodeError as e:
        raise ValueError(f"the JSON Schema is not valid JSON ({e})") from None
    if not isinstance(schema, dict):
      raise ValueError("a JSON Schema must be a dict or its JSON text")
    object.__setattr__(self, "schema", json.dumps(schema))  # properties keep their order: the output's

  def regex(self) -> str:
    from outlines_core.json_schema import build_regex_from_schema
    try:
      return build_regex_from_schema(self.schema, JSON_WHITESPACE)
    except Exception as e:  # outlines-core raises ValueError and its own errors for schemas it cannot read
      raise ValueError(f"cannot compile the JSON Schema: {e}") from None


@dataclasses.dataclass(frozen=True)
class Choice:
  """The output must be exactly one of `choices`."""
  choices: tuple[str, ...]

  def __init__(self, choices: Sequence[str]):
    if isinstance(choices, str) or not choices or not all(isinstance(c, str) and c for c in choices):
      raise ValueError("choices must be a non-empty list of non-empty strings")
    object.__setattr__(self, "choices", tuple(choices))

  def regex(self) -> str:
    return "|".join(_escape(c) for c in self.choices)


Constraint = Regex | JsonSchema | Choice

# JSON mode (`{"type": "json_object"}`): any JSON object.
JSON_OBJECT = JsonSchema({"type": "object"})


def _escape(text: str) -> str:
  """`text` as a literal in Rust regex syntax."""
  return "".join("\\" + ch if ch in r"\.+*?()|[]{}^$#&-~" else ch for ch in text)


@dataclasses.dataclass(frozen=True)
class Vocabulary:
  """A model's tokens as constraints see them: token id -> its bytes (empty: never allowed, as special
  tokens and a padded embedding's extra ids are), and the stop tokens that end a text."""
  tokens: tuple[bytes, ...]
  stop_ids: tuple[int, ...]

  @classmethod
  def of(cls, tokenizer: Tokenizer, stop_ids: Sequence[int], vocab_size: int) -> Vocabulary:
    """The vocabulary of a model's tokenizer (`vocab_size` ids, the embedding's); cached."""
    return _vocabulary(tokenizer.to_str(), tuple(int(i) for i in stop_ids), vocab_size)

  def outlines(self):
    from outlines_core import Vocabulary as OutlinesVocabulary
    tokens: dict[bytes, list[int]] = {}
    for i, b in enumerate(self.tokens):
      if b and i not in self.stop_ids:
        tokens.setdefault(b, []).append(i)
    return OutlinesVocabulary(self.stop_ids[0], tokens)


@functools.lru_cache(maxsize=4)
def _vocabulary(tokenizer_json: str, stop_ids: tuple[int, ...], vocab_size: int) -> Vocabulary:
  spelled = token_bytes(Tokenizer.from_str(tokenizer_json))
  return Vocabulary(tuple(spelled.get(i, b"") for i in range(vocab_size)), stop_ids)


@functools.lru_cache(maxsize=64)
def compile(constraint: Constraint, vocabulary: Vocabulary) -> Tables:
  """`constraint`'s tables over a vocabulary; a one-line ValueError for one that cannot be compiled or
  satisfied. Cached (LRU) by the constraint and the vocabulary."""
  from outlines_core import Index
  if not vocabulary.stop_ids:
    raise ValueError("a constraint needs the model's EOS token to end the text")
  pattern = constraint.regex()
  try:
    index = Index(pattern, vocabulary.outlines())
  except Exception as e:  # outlines-core raises ValueError, or its own errors, for a regex it cannot build
    reason = str(e).split(". This may be")[0]
    raise ValueError(f"cannot compile the constraint {_short(pattern)}: {reason}") from None
  moves_U, final_U = _moves(index, vocabulary.stop_ids)
  stuck_U = np.asarray([len(ids) == 0 for ids, _ in moves_U])  # nothing allowed: the text can only end here
  if stuck_U[0] and not final_U[0]:
    raise ValueError(f"no token of this vocabulary can start the constraint {_short(pattern)}")
  # Stop tokens keep the state where they are allowed (the row ends there anyway).
  stop_ids = np.asarray(vocabulary.stop_ids, np.int64)
  moves_U = [(np.concatenate([ids, stop_ids]), np.concatenate([to, np.full(len(stop_ids), u, np.int32)]))
             if final_U[u] or stuck_U[u] else (ids, to) for u, (ids, to) in enumerate(moves_U)]
  tables = _compress(moves_U, len(vocabulary.tokens))
  if not _reaches_final(tables.next_UxY, np.flatnonzero(final_U)):
    raise ValueError(f"the constraint {_short(pattern)} cannot be completed with this vocabulary")
  return tables


def _moves(index, stop_ids: tuple[int, ...]) -> tuple[list[tuple[np.ndarray, np.ndarray]], np.ndarray]:
  """Each state's allowed ordinary tokens and the states they lead to, as arrays, with states numbered
  from 0 (the start; the others in outlines-core's order), and which states accept."""
  transitions = index.get_transitions()
  initial = index.get_initial_state()
  raw = {}
  for state, table in transitions.items():
    ids = np.fromiter(table.keys(), np.int64, len(table))
    to = np.fromiter(table.values(), np.int64, len(table))
    ordinary = ~np.isin(ids, stop_ids)
    raw[state] = (ids[ordinary], to[ordinary])
  reached = np.unique(np.concatenate([to for _, to in raw.values()] + [np.asarray([initial], np.int64)]))
  order = np.asarray([initial] + sorted((set(raw) | set(reached.tolist())) - {initial}), np.int64)
  sorted_states, number_of_sorted = np.sort(order), np.argsort(order).astype(np.int32)
  renumber = lambda states: number_of_sorted[np.searchsorted(sorted_states, states)]
  empty = (np.zeros(0, np.int64), np.zeros(0, np.int64))
  moves = [(ids, renumber(to)) for ids, to in (raw.get(state, empty) for state in order.tolist())]
  final = np.isin(order, np.asarray(sorted(index.get_final_states()), np.int64))
  return moves, final


def _compress(moves_U: list[tuple[np.ndarray, np.ndarray]], vocab_size: int, seed: int = 0) -> Tables:
  """The tables of an automaton given as each state's (tokens, next states): tokens with the same next
  state from every state share a class. Columns are grouped by a random 64-bit hash of the column (no
  `[states, V]` table is ever built), and every token is checked against its class's representative:
  a collision, never seen, rehashes with another seed."""
  weight_U = np.random.default_rng(seed).integers(1, 2 ** 63, len(moves_U), dtype=np.uint64) | np.uint64(1)
  hash_V = np.zeros(vocab_size, np.uint64)
  for (ids, to), weight in zip(moves_U, weight_U):
    hash_V[ids] += (to.astype(np.uint64) + np.uint64(1)) * weight  # wraps modulo 2**64
  _, representative_Y, class_V = np.unique(hash_V, return_index=True, return_inverse=True)
  class_V = class_V.reshape(-1).astype(np.int32)
  next_UxY = np.full((len(moves_U), len(representative_Y)), -1, np.int32)
  row_V = np.empty(vocab_size, np.int32)
  for u, (ids, to) in enumerate(moves_U):
    row_V.fill(-1)
    row_V[ids] = to
    next_UxY[u] = row_V[representative_Y]
    if not np.array_equal(next_UxY[u, class_V], row_V):
      return _compress(moves_U, vocab_size, seed + 1)
  return Tables(class_V, next_UxY)


def _reaches_final(next_UxY: np.ndarray, final_U: np.ndarray) -> bool:
  """Whether an accepting state (of those listed) is reachable from the start."""
  seen, frontier = {0}, [0]
  while frontier:
    u = frontier.pop()
    for t in np.unique(next_UxY[u][next_UxY[u] >= 0]).tolist():
      if t not in seen:
        seen.add(t)
        frontier.append(t)
  return bool(seen & set(final_U.tolist()))


def compile_rows(constraint: Constraint | Sequence[Constraint | None] | None, vocabulary: Vocabulary,
                 rows: int, ignore_eos: bool = False) -> list[Tables | None] | None:
  """Each row's tables from one constraint for every row or one per row (None: a free row); None when
  no row is constrained. A constrained text ends at its EOS, so `ignore_eos` refuses any constraint."""
  if constraint is None:
    return None
  if ignore_eos:
    raise ValueError("ignore_eos cannot be combined with a constraint: a constrained text ends at its EOS")
  listed = constraint if isinstance(constraint, list | tuple) else [constraint] * rows
  if len(listed) != rows:
    raise ValueError(f"got constraints for {len(listed)} prompts, not {rows}")
  if not all(c is None or isinstance(c, Regex | JsonSchema | Choice) for c in listed):
    raise ValueError("a constraint must be a jspec.Regex, jspec.JsonSchema or jspec.Choice")
  if all(c is None for c in listed):
    return None
  return [None if c is None else compile(c, vocabulary) for c in listed]


def _short(pattern: str, limit: int = 60) -> str:
  return repr(pattern if len(pattern) <= limit else pattern[:limit] + "...")
