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
from jspec.bench.parts import Models, shipped_pair
from jspec.bench.prompts import heldout_prompts
from jspec.core.settings import SpecConfig
from jspec.core.timing import interleaved
from jspec.decoding import program_cache
from jspec.text import automaton, constraints

PERMISSIVE = jspec.Regex(r"[\s\S]*")
FUNCTION_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40},
    "args": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 6},
    "returns": {"type": "string", "maxLength": 40}}, "required": ["name", "args", "returns"]}
JSON_PROMPT = "\n\n# The function above, described as JSON:\n# "


def table_sizes(vocab_size: int = 128_000) -> dict:
  """Compiled table sizes over a large vocabulary: a byte-level BPE of `vocab_size` tokens learned on the
  training corpus (the size of Llama 3's), for the benchmark's schema, JSON mode and a permissive regex."""
  import time

  from jspec.text.tokenizer import EOS_TOKEN, train_bpe
  from jspec.train import data
  begin = time.perf_counter()
  tok = train_bpe(data.read_texts("train"), vocab_size)
  out = {"vocab_size": tok.get_vocab_size(), "bpe_seconds": time.perf_counter() - begin, "constraints": {}}
  vocabulary = constraints.Vocabulary.of(tok, [tok.token_to_id(EOS_TOKEN)], tok.get_vocab_size())
  for name, constraint in [("function_schema", jspec.JsonSchema(FUNCTION_SCHEMA)),
                           ("json_object", constraints.JSON_OBJECT), ("permissive", PERMISSIVE)]:
    begin = time.perf_counter()
    tables = constraints.compile(constraint, vocabulary)
    shape = automaton.bucket([tables])
    out["constraints"][name] = {"states": tables.num_states, "classes": tables.num_classes,
                                "compile_seconds": time.perf_counter() - begin,
                                "bucket": shape, "device_bytes_per_row": automaton.nbytes(1, out["vocab_size"], shape)}
    print(json.dumps({name: out["constraints"][name]}), file=sys.stderr)
  return out


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
      last[f"free_{kind}"] = run(prompt + JSON_PROMPT, **spec(kind))  # acceptance without the constraint
    t = interleaved(fns, repeats)
    program_cache.release_executables()  # a few hundred programs in one process exhaust XLA:CPU's code mappings
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
