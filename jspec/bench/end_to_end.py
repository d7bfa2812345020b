"""What a user gets end to end: the defaults against plain decoding, adaptive K against fixed K, streaming's
cost, and continuous batching against static batches."""
from __future__ import annotations

import dataclasses
import json
import statistics
import sys

import numpy as np

import jspec
from jspec import testing
from jspec.bench.parts import Models, shipped_pair
from jspec.bench.prompts import PROMPT_SETS, heldout_prompts, prose_prompts, varied_heldout_prompts
from jspec.core import registry, shipped
from jspec.core.settings import AdaptiveConfig, CostModel, SpecConfig
from jspec.core.timing import interleaved
from jspec.decoding import program_cache
from jspec.decoding.decoder import make_decoder


def suite_adaptive(target, draft, kind: str, max_new: int, repeats: int, prompts_per_set: int) -> dict:
  """Adaptive K (K_max 6) against every fixed K on code, and fallback on prose, each against AR, batch 1,
  greedy, interleaved per prompt, with the drafter's measured cost model (from its checkpoint)."""
  variants = {f"fixed{k}": dict(draft_len=k, spec=SpecConfig(drafter=kind, adaptive=None)) for k in (2, 3, 4, 5, 6)}
  variants["adaptive"] = dict(draft_len=6, spec=SpecConfig(drafter=kind, adaptive=AdaptiveConfig()))
  variants["adaptive_no_fallback"] = dict(draft_len=6, spec=SpecConfig(
      drafter=kind, adaptive=AdaptiveConfig(fallback_threshold=0.0)))
  cost = make_decoder(target, draft, variants["adaptive"]["spec"], 1).spec.adaptive.cost
  costs = dict(cost_ratio=cost.cost_ratio, verify_cost=cost.verify_cost, round_overhead=cost.round_overhead)
  out = {"drafter": kind, **costs, "max_new_tokens": max_new, "sets": {}}
  for name, prompts in [("code", heldout_prompts(prompts_per_set)), ("prose", prose_prompts(prompts_per_set))]:
    walls = {k: 0.0 for k in ["ar", *variants]}
    stats = {k: [] for k in variants}
    for p in prompts:
      fns = {"ar": lambda: jspec.generate(target, [p], max_new_tokens=max_new)}
      for v, kw in variants.items():
        fns[v] = lambda kw=kw: jspec.generate(target, [p], draft=draft, max_new_tokens=max_new, **kw)
      for k, t in interleaved(fns, repeats).items():
        walls[k] += t
      for v, kw in variants.items():
        stats[v].append(jspec.generate(target, [p], draft=draft, max_new_tokens=max_new, **kw).stats)
    rows = {}
    for v in variants:
      st = stats[v]
      counts = {}
      for s in st:
        for k, n in s.draft_len_counts.items():
          counts[k] = counts.get(k, 0) + n
      rows[v] = {"speedup_over_ar": walls["ar"] / walls[v],
                 "tau": sum(s.emitted_tokens for s in st) / sum(s.rounds for s in st),
                 "fallback_rounds": sum(s.fallback_rounds for s in st),
                 "probe_rounds": sum(s.probe_rounds for s in st), "draft_len_counts": counts}
    best_fixed = max((v for v in variants if v.startswith("fixed")), key=lambda v: rows[v]["speedup_over_ar"])
    # The cost model's calibration: a round of K drafts took tau / speedup AR steps; fit 1 + o + K (c + v).
    ks = [int(v[5:]) for v in variants if v.startswith("fixed")]
    slope, intercept = np.polyfit(ks, [rows[f"fixed{k}"]["tau"] / rows[f"fixed{k}"]["speedup_over_ar"] for k in ks], 1)
    out["sets"][name] = {"rows": rows, "best_fixed": best_fixed, "fitted_round_overhead": intercept - 1,
                         "fitted_cost_per_draft_token": slope,
                         "adaptive_over_best_fixed": rows["adaptive"]["speedup_over_ar"]
                         / rows[best_fixed]["speedup_over_ar"]}
    print(json.dumps({name: out["sets"][name]}), file=sys.stderr)
  return out


def suite_defaults(pair: Models, max_new: int, repeats: int, count: int,
                   draft_lens: tuple[int, ...] = (), other_drafters: tuple[str, ...] = (),
                   other_cost: CostModel | None = None, fixed_lens: tuple[int, ...] = ()) -> dict:
  """What a user gets: `jspec.generate` with every default (the default drafter and its shipped weights,
  adaptive speculation with the checkpoint's cost model), greedy, against plain decoding, interleaved per
  batch of prompts: each held-out code and English prose prompt alone, and held-out code in batches of 4.
  Every row decodes `max_new` tokens (EOS ignored), so both sides do the same work. Each of `draft_lens`
  is also timed as the longest draft in the same interleaving (what another default `draft_len` would give),
  each of `fixed_lens` as a fixed draft length (adaptive K off; per row `adaptive_over_best_fixed`), each
  of `other_drafters` with its shipped weights and otherwise default settings (another default
  drafter), and `other_cost` as the default drafter's cost model instead of the one it finds (`cost`)."""
  target, draft = shipped_pair(pair, shipped.DEFAULT_DRAFTER)  # the CLI's default drafter
  kw = dict(max_new_tokens=max_new, ignore_eos=True)
  variants = {"spec": dict(draft=draft), **{f"spec_k{k}": dict(draft=draft, draft_len=k) for k in draft_lens},
              **{f"spec_fixed{k}": dict(draft=draft, draft_len=k,
                                        spec=SpecConfig(drafter=shipped.DEFAULT_DRAFTER, adaptive=None))
                 for k in fixed_lens},
              **{f"spec_{kind}": dict(draft=shipped_pair(pair, kind)[1], spec=SpecConfig(drafter=kind))
                 for kind in other_drafters}}
  if other_cost is not None:  # as if measured here, so the decoder takes it
    other_cost = dataclasses.replace(other_cost, target_params=None, **testing.measured_here())
    variants["spec_cost"] = dict(draft=dataclasses.replace(draft, cost_models={shipped.DEFAULT_DRAFTER: other_cost}))
  fixed = [f"fixed{k}" for k in fixed_lens]
  others = [f"k{k}" for k in draft_lens] + fixed + list(other_drafters) + ["cost"] * (other_cost is not None)
  out = {"drafter": shipped.DEFAULT_DRAFTER, "max_new_tokens": max_new, "runs": {}}
  for name, batch in (("code", 1), ("thirdparty", 1), ("prose", 1), ("code", 4)):
    prompts = PROMPT_SETS[name](count)
    rows, last = [], {}
    for group in (prompts[i:i + batch] for i in range(0, len(prompts), batch)):
      run = lambda name, g=group, **extra: last.__setitem__(name, jspec.generate(target, g, **kw, **extra))
      fns = {"ar": lambda: run("ar"), **{v: lambda v=v: run(v, **variants[v]) for v in variants}}
      t = interleaved(fns, repeats)
      ar, spec = last["ar"], last["spec"]
      best_fixed = {"adaptive_over_best_fixed": min(t[f"spec_{x}"] for x in fixed) / t["spec"]} if fixed else {}
      rows.append({"prompts": len(group), "speedup": t["ar"] / t["spec"], "tau": spec.stats.mean_accepted_length,
                   "acceptance_rate": spec.stats.acceptance_rate, "plain_forwards": spec.stats.plain_forwards,
                   "draft_len_counts": spec.stats.draft_len_counts,
                   "greedy_identical": all(last[v].token_ids == ar.token_ids for v in variants),
                   **{f"speedup_{x}": t["ar"] / t[f"spec_{x}"] for x in others}, **best_fixed,
                   **{f"tau_{kind}": last[f"spec_{kind}"].stats.mean_accepted_length for kind in other_drafters}})
      print(json.dumps({"set": name, "batch": batch, **rows[-1]}), file=sys.stderr)
    summary = lambda key: {f"median_{key}": statistics.median(r[key] for r in rows),
                           f"min_{key}": min(r[key] for r in rows), f"max_{key}": max(r[key] for r in rows)}
    program_cache.release_executables()  # a few hundred programs in one process exhaust XLA:CPU's code mappings
    out["runs"][f"{name}_batch{batch}"] = {"set": name, "batch": batch, "rows": rows, **summary("speedup"),
                                           **{k: v for x in others for k, v in summary(f"speedup_{x}").items()},
                                           **(summary("adaptive_over_best_fixed") if fixed else {})}
  return out


def priced_speedup(stats: jspec.Stats) -> float | None:
  """The speedup the cost model of a one-row run gives its own rounds: tokens emitted over the rounds
  priced at the cost model's rounds (`CostModel.round_cost`; a plain step at 1). Free of timing noise, so against the
  measured speedup it separates what the adaptive policy's choices cost from what the machine's timing
  adds. None without a cost model or for more than one row."""
  cost = stats.cost_model
  if not cost or not stats.emitted_tokens or stats.rounds != stats.target_forwards:
    return None
  steps = sum(n * (1 if k == 0 else cost["round_costs"][k - 1]) for k, n in stats.draft_len_counts.items())
  return stats.emitted_tokens / steps


def suite_drafters(pair: Models, kinds: list[str], draft_lens: list[int], sets: list[str], max_new: int,
                   repeats: int, count: int, temperatures: list[float] = (0.0,), batches: list[int] = (1,)) -> dict:
  """Every drafter with the CLI's defaults (adaptive K up to each of `draft_lens`, the checkpoint's cost
  model) against plain decoding, interleaved per batch of prompts, on each prompt set at each temperature and
  batch; every row decodes `max_new` tokens (EOS ignored). Per batch: speedup, the speedup its cost model
  prices its rounds at (`priced_speedup`), τ, and the rounds the fallback made plain. A name in `kinds` that
  is no drafter kind (`parallel`: a parallel draft model) is drafted by the kind its weights say."""
  target = jspec.load(pair.target)
  drafts = {kind: shipped_pair(pair, kind)[1] for kind in kinds}
  most = lambda kind: getattr(getattr(drafts[kind], "drafter", None), "num_heads", max(draft_lens))  # Medusa's heads
  variants = {f"{kind}_k{k}": dict(draft=drafts[kind], spec=SpecConfig(drafter=kind if kind in registry.kinds()
                                                                        else None), draft_len=k)
              for kind in kinds for k in draft_lens if k <= most(kind)}
  out = {"max_new_tokens": max_new, "sets": {}}
  cases = [(name, b, t) for name in sets for b in batches for t in temperatures]
  for name, batch, temperature in cases:
    prompts = PROMPT_SETS[name](count)
    rows = []
    for group in [prompts[i:i + batch] for i in range(0, len(prompts), batch)]:
      last = {}
      run = lambda v, **kw: last.__setitem__(v, jspec.generate(target, group, max_new_tokens=max_new,
                                                               ignore_eos=True, temperature=temperature, **kw))
      fns = {"ar": lambda: run("ar"), **{v: lambda v=v, kw=kw: run(v, **kw) for v, kw in variants.items()}}
      t = interleaved(fns, repeats)
      rows.append({v: {"speedup": t["ar"] / t[v], "priced_speedup": priced_speedup(last[v].stats),
                       "tau": last[v].stats.mean_accepted_length,
                       "fallback_rounds": last[v].stats.fallback_rounds, "rounds": last[v].stats.rounds,
                       "greedy_identical": last[v].token_ids == last["ar"].token_ids if not temperature else None}
                   for v in variants})
      print(json.dumps({"set": name, "batch": batch, "temperature": temperature,
                        **{v: [round(r["speedup"], 3), r["priced_speedup"] and round(r["priced_speedup"], 3),
                               round(r["tau"], 2)] for v, r in rows[-1].items()}}), file=sys.stderr)
      program_cache.release_executables()  # a few hundred programs in one process exhaust XLA:CPU's code mappings
    key = name if (batch, temperature) == (1, 0.0) else f"{name} b={batch} T={temperature:g}"
    out["sets"][key] = {v: {"median_speedup": statistics.median(r[v]["speedup"] for r in rows),
                             "min_speedup": min(r[v]["speedup"] for r in rows),
                             "max_speedup": max(r[v]["speedup"] for r in rows),
                             "median_priced_speedup": statistics.median(priced) if (priced := [
                                 r[v]["priced_speedup"] for r in rows if r[v]["priced_speedup"] is not None]) else None,
                             "median_tau": statistics.median(r[v]["tau"] for r in rows),
                             "greedy_identical": None if temperature else all(r[v]["greedy_identical"] for r in rows)}
                        for v in variants}
    out["sets"][key]["rows"] = rows
  return out


def suite_stream(pair: Models, kind: str, max_new: int, repeats: int, prompts_per_set: int) -> dict:
  """What streaming costs: the shipped pair with default settings, decoded in one loop (`jspec.generate`)
  against segments of R rounds (`jspec.stream`, every delta consumed), interleaved, at batch 1 and 4."""
  target, draft = shipped_pair(pair, kind)
  prompts = heldout_prompts(prompts_per_set)
  out = {"drafter": kind, "max_new_tokens": max_new, "batches": {}}
  for batch in (1, 4):
    groups = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
    fns = {"loop": lambda: [jspec.generate(target, g, draft=draft, max_new_tokens=max_new) for g in groups]}
    for rounds in (4, 8, 16, 32):
      fns[f"segments_of_{rounds}"] = lambda r=rounds: [
          list(jspec.stream(target, g, draft=draft, max_new_tokens=max_new, segment_rounds=r)) for g in groups]
    t = interleaved(fns, repeats)
    out["batches"][batch] = {f"{k}_throughput_vs_loop": t["loop"] / v for k, v in t.items() if k != "loop"}
    print(json.dumps({batch: out["batches"][batch]}), file=sys.stderr)
  return out


def suite_batching(pair: Models, kind: str, max_new: int, repeats: int, count: int, slots: int = 8) -> dict:
  """Continuous batching against static batches of `slots` prompts (both speculative, default settings)
  and static plain decoding: tokens/s over `count` held-out prompts that stop at their natural EOS."""
  target, draft = shipped_pair(pair, kind)
  prompts = varied_heldout_prompts(count)
  groups = [prompts[i:i + slots] for i in range(0, len(prompts), slots)]
  emitted = {}

  def static(**kw):
    return sum(r.stats.emitted_tokens for r in (jspec.generate(target, g, max_new_tokens=max_new, **kw)
                                                 for g in groups))

  def continuous():
    stream = jspec.stream(target, prompts, draft=draft, max_new_tokens=max_new, batch_size=slots)
    for _ in stream:
      pass
    return stream.stats.emitted_tokens

  fns = {"static_plain": lambda: emitted.__setitem__("static_plain", static()),
         "static_speculative": lambda: emitted.__setitem__("static_speculative", static(draft=draft)),
         "continuous_speculative": lambda: emitted.__setitem__("continuous_speculative", continuous())}
  t = interleaved(fns, repeats)
  tps = {k: emitted[k] / v for k, v in t.items()}
  out = {"drafter": kind, "prompts": count, "slots": slots, "max_new_tokens": max_new,
         "emitted_tokens": emitted, "tokens_per_second": tps,
         "continuous_over_static": tps["continuous_speculative"] / tps["static_speculative"],
         "static_speculative_over_plain": tps["static_speculative"] / tps["static_plain"],
         "continuous_over_static_plain": tps["continuous_speculative"] / tps["static_plain"]}
  print(json.dumps(out), file=sys.stderr)
  return out
