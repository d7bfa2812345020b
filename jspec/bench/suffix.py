"""Suffix drafting across requests, against n-gram lookup and EAGLE on the same requests.

Requests are decoded one after another through one engine (`jspec.stream` with one slot), greedy, so the
suffix drafter's index holds the texts of the requests before each one; every timed pass starts a fresh
engine (an empty index) whose programs are already compiled. Two workloads: a repetitive one (JSON records
of one schema describing different held-out functions, constrained by that schema, as an agent's tool calls
are) and one without repetition (held-out code completions, unconstrained).
"""
from __future__ import annotations

import json
import sys

import jspec
from jspec.bench.parts import Models, shipped_pair
from jspec.bench.prompts import heldout_prompts
from jspec.bench.structured import FUNCTION_SCHEMA, JSON_PROMPT
from jspec.bench.timing import interleaved
from jspec.settings import SpecConfig


def workloads(count: int) -> dict[str, tuple[list[str], jspec.Constraint | None]]:
  code = heldout_prompts(count)
  return {"json_records": ([p + JSON_PROMPT for p in code], jspec.JsonSchema(FUNCTION_SCHEMA)),
          "code": (code, None)}


def suite_suffix(pair: Models, kinds: list[str], max_new: int, repeats: int, count: int) -> dict:
  """Per workload: each drafter's time, tokens per target forward (τ) and speedup against plain decoding,
  and suffix's τ and time against each other drafter's."""
  kinds = ["suffix", *(k for k in kinds if k != "suffix")]
  loaded = {kind: shipped_pair(pair, kind) for kind in kinds}
  target = loaded[kinds[0]][0]
  out = {"drafters": kinds, "max_new_tokens": max_new, "requests": count, "workloads": {}}
  for name, (prompts, constraint) in workloads(count).items():
    last = {}

    def run(kind: str | None) -> None:
      kw = {} if kind is None else dict(draft=loaded[kind][1], spec=SpecConfig(drafter=kind))
      stream = jspec.stream(target, prompts, batch_size=1, max_new_tokens=max_new, constraint=constraint, **kw)
      tokens = [[] for _ in prompts]
      for delta in stream:
        tokens[delta.index] += delta.token_ids
      last[kind or "plain"] = (tokens, stream.stats)
    fns = {kind or "plain": (lambda k=kind: run(k)) for kind in [None, *kinds]}
    seconds = interleaved(fns, repeats)  # after a first, untimed call of each (compiles)
    plain_tokens = last["plain"][0]
    row = {}
    for kind in kinds:
      tokens, stats = last[kind]
      row[kind] = {"seconds": seconds[kind], "tau": stats.mean_accepted_length,
                   "acceptance": stats.acceptance_rate, "speedup": seconds["plain"] / seconds[kind],
                   "identical": tokens == plain_tokens}
    row["plain"] = {"seconds": seconds["plain"],
                    "tokens_per_s": sum(map(len, plain_tokens)) / seconds["plain"]}
    for kind in kinds[1:]:
      row[f"suffix_over_{kind}"] = {"tau": row["suffix"]["tau"] / row[kind]["tau"],
                                    "speed": seconds[kind] / seconds["suffix"]}
    out["workloads"][name] = row
    print(json.dumps({name: row}), file=sys.stderr)
  return out
