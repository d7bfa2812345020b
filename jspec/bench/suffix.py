"""Suffix drafting across requests, against n-gram lookup and EAGLE on the same requests.

Requests are decoded one after another through one engine (`jspec.stream` with one slot), greedy, so the
suffix drafter's index holds the texts of the requests before each one; every timed pass starts a fresh
engine (an empty index) whose programs are already compiled. Workloads: a repetitive one (JSON records of
one schema describing different held-out functions, constrained by that schema, as an agent's tool calls
are), the same four at a time (requests draft from the ones running beside them too), and one without
repetition (held-out code completions, unconstrained). Apart from those, the cost of a
round's proposal alone: suffix's (index and own context) against n-gram's (own context), at the default
index size and the engine's row width, per batch size.
"""
from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
from jax import lax

import jspec
from jspec.bench.parts import Models, shipped_pair
from jspec.bench.prompts import heldout_prompts
from jspec.bench.structured import FUNCTION_SCHEMA, JSON_PROMPT
from jspec.core.settings import SpecConfig
from jspec.core.timing import interleaved
from jspec.decoding.batches import GREEDY
from jspec.drafters.base import DraftContext
from jspec.drafters.ngram import NgramDrafter
from jspec.drafters.suffix import SuffixDrafter
from jspec.speculation.sampling import sampling_arrays

PROPOSALS_TIMED = 200  # proposals per timed call, in one jitted loop (a call's dispatch is not counted)


def workloads(count: int) -> dict[str, tuple[list[str], jspec.Constraint | None, int]]:
  """name: (prompts, constraint, slots)."""
  code = heldout_prompts(count)
  records = [p + JSON_PROMPT for p in code]
  schema = jspec.JsonSchema(FUNCTION_SCHEMA)
  return {"json_records": (records, schema, 1), "json_records_4_at_once": (records, schema, 4),
          "code": (code, None, 1)}


def suite_suffix(pair: Models, kinds: list[str], max_new: int, repeats: int, count: int) -> dict:
  """Per workload: each drafter's time, tokens per target forward (τ) and speedup against plain decoding,
  and suffix's τ and time against each other drafter's."""
  kinds = ["suffix", *(k for k in kinds if k != "suffix")]
  loaded = {kind: shipped_pair(pair, kind) for kind in kinds}
  target = loaded[kinds[0]][0]
  out = {"drafters": kinds, "max_new_tokens": max_new, "requests": count, "workloads": {}}
  for name, (prompts, constraint, slots) in workloads(count).items():
    last = {}

    def run(kind: str | None) -> None:
      kw = {} if kind is None else dict(draft=loaded[kind][1], spec=SpecConfig(drafter=kind))
      stream = jspec.stream(target, prompts, batch_size=slots, max_new_tokens=max_new, constraint=constraint, **kw)
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
  out["proposal_us"] = proposal_cost(target, SpecConfig(), repeats)
  print(json.dumps({"proposal_us": out["proposal_us"]}), file=sys.stderr)
  return out


def proposal_cost(target: jspec.Model, spec: SpecConfig, repeats: int, width: int = 2048,
                  batches: tuple[int, ...] = (1, 8)) -> dict:
  """Microseconds per round's proposed tokens (`spec.draft_len` a row), per batch size: n-gram's (a search
  of each row's `width` tokens), suffix's (that and the index's lookup, with a full index of random text),
  and their difference (what the index adds to a round)."""
  vocab = target.config.vocab_size
  suffix, ngram = SuffixDrafter.for_pair(target, None, spec), NgramDrafter.for_pair(target, None, spec)
  key = jax.random.PRNGKey(0)
  index = suffix.init(1, width, spec.draft_len)
  fill = jax.jit(suffix.retire)
  for _ in range(suffix.cache_tokens // width):
    key, sub = jax.random.split(key)
    index = fill(index, jax.random.randint(sub, (1, width), 0, vocab), jnp.asarray([width]))
  out = {}
  for batch in batches:
    context = DraftContext(jax.random.randint(key, (batch, width), 0, vocab), jnp.full((batch,), width // 2),
                           sampling_arrays(GREEDY, batch), jnp.ones((batch,), bool))
    keys = jnp.zeros((spec.draft_len, batch, 2), jnp.uint32)

    def timed(drafter, state):
      def body(i, total):  # each proposal reads a length that depends on i, so none is hoisted out of the loop
        ctx = context.replace(seq_lens_B=context.seq_lens_B + i % 2)
        return total + drafter.propose(None, state, ctx, keys)[1].tokens_BxK.sum()
      loop = jax.jit(lambda: lax.fori_loop(0, PROPOSALS_TIMED, body, jnp.int32(0)))
      return lambda: loop().block_until_ready()
    seconds = interleaved({"ngram": timed(ngram, None), "suffix": timed(suffix, index)}, repeats)
    us = {k: v / PROPOSALS_TIMED * 1e6 for k, v in seconds.items()}
    out[f"batch_{batch}"] = {**us, "index": us["suffix"] - us["ngram"]}
  return out
