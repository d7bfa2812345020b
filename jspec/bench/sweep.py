"""Drafter x K x temperature x batch against plain decoding, each cell in one process, and draft trees
against chains."""
from __future__ import annotations

import dataclasses
import json
import sys

import jax.numpy as jnp

import jspec
from jspec.bench.harness import Progress, peak_memory_mb, reset_peak_memory
from jspec.bench.parts import Models, shipped_pair
from jspec.bench.prompts import heldout_prompts
from jspec.core.settings import CostModel, SpecConfig, TreeConfig
from jspec.core.timing import interleaved
from jspec.decoding import program_cache
from jspec.formats import checkpoint
from jspec.model.config import num_params
from jspec.planning.calibration import drafter_cost_ratio, verify_ratio
from jspec.speculation import adaptive


def cell(target, draft, kind: str, groups: list[list[str]], temperature: float, k: int, max_new: int,
         repeats: int, tree: TreeConfig | None = None) -> dict:
  """One sweep cell: AR and speculative decoding of each batch of prompts, interleaved; medians summed.

  Every row decodes `max_new` tokens (EOS ignored, as vLLM's benchmarks do), so both sides do the same work
  even when sampling, and row r of the cell samples with seed r: one unlucky draw (an early EOS) can neither
  end a request nor repeat across every prompt."""
  spec_kw = dict(draft=draft, spec=SpecConfig(drafter=kind, adaptive=None, tree=tree), draft_len=k)
  kw = dict(max_new_tokens=max_new, temperature=temperature, ignore_eos=True)
  first_kw = dict(max_new_tokens=1)  # a request of one token: prefill, one target step, the host's work
  walls, last, compile_s = {"ar": 0.0, "spec": 0.0, "first": 0.0}, {}, 0.0
  reset_peak_memory()
  for g, group in enumerate(groups):
    def run(name, extra):
      last[name, g] = jspec.generate(target, group, **{**kw, **extra}, seed=g * len(group))
    run("spec", spec_kw)  # the first call compiles (once per prompt bucket); AR compiled in an earlier cell
    compile_s += last["spec", g].stats.compile_seconds
    run("ar", {})
    run("first", first_kw)
    for name, t in interleaved({"ar": lambda: run("ar", {}), "spec": lambda: run("spec", spec_kw),
                                "first": lambda: run("first", first_kw)}, repeats, warmup=False).items():
      walls[name] += t
  stats = [last["spec", g].stats for g in range(len(groups))]
  ar_stats = [last["ar", g].stats for g in range(len(groups))]
  total = lambda key, st=stats: sum(getattr(s, key) for s in st)
  tokens, rounds, drafted = total("emitted_tokens"), total("rounds"), total("drafted_tokens")
  accepted = total("accepted_tokens")
  at_k = sum(s.per_position_acceptance[k - 1] * s.rounds for s in stats) if k else 0
  # alpha, the chance one proposal is accepted: accepted / tested, where the first rejection is tested too.
  tested = accepted + (drafted / k - at_k if k else 0)
  mismatches = sum(last["spec", g].token_ids != last["ar", g].token_ids for g in range(len(groups)))
  ar_rate, spec_rate = total("emitted_tokens", ar_stats) / walls["ar"], tokens / walls["spec"]
  # The decode phase, what Leviathan's bound speaks of: each wall less what every request spends before its
  # first decode step (prefill and host work, the same for both; the draft's own prefill stays in `spec`),
  # which is a one-token request less that token's AR step. Every row decodes max_new tokens.
  ar_step = (walls["ar"] - walls["first"]) / max(max_new - 1, 1)
  decode_ar, decode_spec = [walls[name] - (walls["first"] - ar_step) for name in ("ar", "spec")]
  return {  # sampled outputs differ between AR and speculative runs, so the speedup is a ratio of rates
      "ar_tokens_per_second": ar_rate, "spec_tokens_per_second": spec_rate, "speedup": spec_rate / ar_rate,
      "decode_speedup": decode_ar / decode_spec, "before_decode_seconds": walls["first"] - ar_step,
      "acceptance_rate": accepted / drafted if drafted else None, "alpha": accepted / tested if tested else None,
      "tau": tokens / rounds, "plain_forwards": total("plain_forwards"),
      "per_position_acceptance": [sum(s.per_position_acceptance[i] * s.rounds for s in stats) / rounds
                                  for i in range(k)],
      # the time of one speculative round in the decode phase, in AR steps (a batched target forward each)
      "round_cost_in_ar_steps": (decode_spec / total("target_forwards"))
                                / (decode_ar / total("target_forwards", ar_stats)),
      "compile_seconds": compile_s, "peak_memory_mb": peak_memory_mb(),
      "greedy_outputs_differing_from_ar": mismatches if temperature == 0 else None}


def suite_sweep(target, drafts: dict, prompts: list[str], draft_lens: list[int], temperatures: list[float],
                batches: list[int], max_new: int, repeats: int, save=lambda out: None) -> dict:
  """drafter x K x temperature x batch, each cell against AR in the same process, with the bound check.
  `save(out)` is called after every cell, so a long run that dies keeps what it measured."""
  target_params = num_params(target.config)
  out = {"prompts": len(prompts), "max_new_tokens": max_new, "target_params": target_params, "drafters": {},
         "verify_cost": {}, "cells": []}
  plan = [(kind, b, t, k) for kind in drafts for b in batches for t in temperatures for k in draft_lens
          if not (kind == "medusa" and k > drafts[kind].drafter.num_heads)]
  progress = Progress(len(plan) + len(drafts) * len(batches) + len(batches) * len(draft_lens))
  for kind, draft in drafts.items():
    size = 0 if draft is None else (num_params(draft.config) if kind == "model" else draft.num_params)
    out["drafters"][kind] = {"params": size, "params_percent_of_target": 100 * size / target_params, "c": {}}
    for b in batches:
      progress.step(f"c: {kind} b={b}")
      out["drafters"][kind]["c"][b] = drafter_cost_ratio(target, draft, kind, repeats, batch=b)
  for b in batches:
    out["verify_cost"][b] = {}
    for k in draft_lens:
      progress.step(f"verify cost: b={b} K={k}")
      out["verify_cost"][b][k] = verify_ratio(target, b, k, repeats)
  for kind, b, t, k in plan:
    progress.step(f"{kind} b={b} T={t} K={k}")
    rows = [prompts[(i + j) % len(prompts)] for i in range(0, max(len(prompts), b), b) for j in range(b)]
    row = {"drafter": kind, "batch": b, "temperature": t, "draft_len": k,
           **cell(target, drafts[kind], kind, [rows[i:i + b] for i in range(0, len(rows), b)], t, k, max_new,
                  repeats)}
    c, v = out["drafters"][kind]["c"][b], (out["verify_cost"][b][k] - 1) / k
    rounds_K = 1 + jnp.arange(1, k + 1) * (c + v)
    row["predicted_speedup"] = None if row["alpha"] is None else float(  # Leviathan's bound
        adaptive.expected_speedup(jnp.full((k,), row["alpha"]), rounds_K)[-1])
    row["engine_efficiency"] = None if row["alpha"] is None else row["decode_speedup"] / row["predicted_speedup"]
    row["round_cost_predicted"] = float(rounds_K[-1])
    out["cells"].append(row)
    save(out)
    program_cache.release_executables()
  progress.close()
  return out


def suite_tree(pair: Models, kinds: list[str], chain_lens: list[int], batches: list[int], max_new: int,
               repeats: int, prompts_per_set: int, write: bool, depth: int = 4,
               shapes: tuple[tuple[int, int], ...] = ((2, 8), (4, 16), (4, 32))) -> dict:
  """Draft trees of depth `depth` and shapes (top-k, nodes) against chains of `chain_lens` tokens, per
  drafter, greedy, held-out code: each cell against AR in the same process (see `cell`); and the verify
  cost curve (a target forward of N tokens over one of 1, batch 1, 200 tokens in the cache). `write`
  stores each drafter's fastest tree shape at the smallest batch in its checkpoint's cost model, the shape
  `--tree` then defaults to."""
  target = jspec.load(pair.target)
  prompts = heldout_prompts(prompts_per_set)
  out = {"depth": depth, "max_new_tokens": max_new, "prompts": len(prompts), "verify_cost": {}, "cells": []}
  for n in (2, 4, 8, 16, 24, 32, 48, 64):
    out["verify_cost"][n] = verify_ratio(target, 1, n - 1, repeats)
    print(json.dumps({"verify_n": n, "over_one": out["verify_cost"][n]}), file=sys.stderr)
  for kind in kinds:
    draft = shipped_pair(pair, kind)[1]
    for batch in batches:
      groups = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
      configs = [(k, None) for k in chain_lens] + [(depth, TreeConfig(top_k=t, nodes=n)) for t, n in shapes]
      for k, tree in configs:
        row = cell(target, draft, kind, groups, 0.0, k, max_new, repeats, tree)
        row.update(drafter=kind, batch=batch, draft_len=k, tree=tree and {"top_k": tree.top_k, "nodes": tree.nodes})
        out["cells"].append(row)
        print(json.dumps({key: row[key] for key in ("drafter", "batch", "draft_len", "tree", "tau", "speedup",
                                                    "decode_speedup", "round_cost_in_ar_steps")}), file=sys.stderr)
      program_cache.release_executables()
    trees = [c for c in out["cells"] if c["drafter"] == kind and c["tree"] and c["batch"] == min(batches)]
    out.setdefault("fastest_tree", {})[kind] = max(trees, key=lambda c: c["speedup"])["tree"]
    if write:
      where = pair.drafts[kind]
      models = checkpoint.read_cost_models(where)
      measured = models.get(kind, CostModel(CostModel.neutral(kind != "ngram").cost_ratio,
                                            target_params=num_params(target.config)))
      models[kind] = dataclasses.replace(measured, tree_top_k=out["fastest_tree"][kind]["top_k"],
                                         tree_nodes=out["fastest_tree"][kind]["nodes"])
      checkpoint.write_cost_models(where, models)
  return out
