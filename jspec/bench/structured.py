"""Structured output: what a constraint costs, and what speculation gains under one.

Three questions, each answered on held-out code prompts in one process, interleaved, warm, medians:
what a permissive constraint (one that allows every text) costs plain and speculative decoding; how much
faster constrained speculative decoding is than constrained plain decoding, per drafter, under a JSON
Schema; and how many of the constrained tokens the automaton forces (one allowed token), against the
drafters' acceptance with and without the constraint.
"""
from __future__ import annotations

import json
import statistics
import sys

import numpy as np

import jspec
from jspec import automaton, constraints
from jspec.bench.parts import Models, shipped_pair
from jspec.bench.prompts import heldout_prompts
from jspec.bench.timing import interleaved
from jspec.settings import SpecConfig

PERMISSIVE = jspec.Regex(r"[\s\S]*")
FUNCTION_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40},
    "args": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 6},
    "returns": {"type": "string", "maxLength": 40}}, "required": ["name", "args", "returns"]}
JSON_PROMPT = "\n\n# The function above, described as JSON:\n# "


def forced_fraction(target, constraint, token_ids: list[int]) -> float:
  """The fraction of a constrained output's tokens that were the only token the automaton allowed."""
  vocabulary = constraints.Vocabulary.of(target.tokenizer, target.config.stop_ids, target.config.vocab_size)
  automata = automaton.stack([constraints.compile(constraint, vocabulary)], target.config.vocab_size)
  states = automata.path_states(np.asarray([token_ids], np.int32))[:, :-1]
  allowed = np.asarray(automata.allowed(states))[0]
  return float((allowed.sum(-1) == 1).mean())


def suite_structured(pair: Models, kinds: list[str], max_new: int, repeats: int, count: int) -> dict:
  prompts = heldout_prompts(count)
  drafts = {kind: shipped_pair(pair, kind) for kind in kinds}
  target = drafts[kinds[0]][0]
  schema = jspec.JsonSchema(FUNCTION_SCHEMA)
  run = lambda p, **kw: jspec.generate(target, [p], max_new_tokens=max_new, **kw)
  spec = lambda kind: dict(draft=drafts[kind][1], spec=SpecConfig(drafter=kind))
  rows = []
  for prompt in prompts:
    last = {}
    keep = lambda name, fn: lambda: last.__setitem__(name, fn())
    fns = {"plain": keep("plain", lambda: run(prompt)),
           "plain_permissive": keep("plain_permissive", lambda: run(prompt, constraint=PERMISSIVE)),
           "spec": keep("spec", lambda: run(prompt, **spec(kinds[0]))),
           "spec_permissive": keep("spec_permissive", lambda: run(prompt, constraint=PERMISSIVE, **spec(kinds[0]))),
           "plain_json": keep("plain_json", lambda: run(prompt + JSON_PROMPT, constraint=schema))}
    for kind in kinds:
      fns[f"json_{kind}"] = keep(f"json_{kind}", lambda k=kind: run(prompt + JSON_PROMPT, constraint=schema,
                                                                     **spec(k)))
      fns[f"free_{kind}"] = keep(f"free_{kind}", lambda k=kind: run(prompt + JSON_PROMPT, **spec(k)))
    t = interleaved(fns, repeats)
    tps = lambda name: last[name].stats.emitted_tokens / t[name]
    json_text = last["plain_json"].texts[0]
    row = {"permissive_plain_tps_ratio": tps("plain_permissive") / tps("plain"),
           "permissive_spec_tps_ratio": tps("spec_permissive") / tps("spec"),
           "permissive_identical": last["plain_permissive"].token_ids == last["plain"].token_ids
           and last["spec_permissive"].token_ids == last["plain"].token_ids,
           "json_valid": _valid(json_text), "json_tokens": len(last["plain_json"].token_ids[0]),
           "json_forced_fraction": forced_fraction(target, schema, last["plain_json"].token_ids[0])}
    for kind in kinds:
      row[f"json_speedup_{kind}"] = t["plain_json"] / t[f"json_{kind}"]
      row[f"json_tau_{kind}"] = last[f"json_{kind}"].stats.mean_accepted_length
      row[f"free_tau_{kind}"] = last[f"free_{kind}"].stats.mean_accepted_length
      row[f"json_identical_{kind}"] = last[f"json_{kind}"].token_ids == last["plain_json"].token_ids
    rows.append(row)
    print(json.dumps(row), file=sys.stderr)
  medians = {k: statistics.median(r[k] for r in rows) for k in rows[0] if isinstance(rows[0][k], float)}
  return {"drafters": kinds, "max_new_tokens": max_new, "prompts": len(prompts), "rows": rows, "medians": medians,
          "min": {k: min(r[k] for r in rows) for k in medians}, "schema": FUNCTION_SCHEMA}


def _valid(text: str) -> bool:
  try:
    value = json.loads(text)
  except json.JSONDecodeError:
    return False
  return set(value) == set(FUNCTION_SCHEMA["properties"])
