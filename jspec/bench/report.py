"""The sweep's Markdown tables and PNG plots (matplotlib), from the JSON that `python -m jspec.bench` writes.

  python -m jspec.bench.report bench-out/bench.json --out docs/bench   # again, from a saved run
  python -m jspec.bench.report a/bench.json b/bench.json --out docs/bench   # runs merged; b's cells win
"""
from __future__ import annotations

import pathlib
import statistics


def _f(x, digits: int = 2) -> str:
  return "—" if x is None else f"{x:.{digits}f}"


def best_cells(cells: list[dict]) -> list[dict]:
  """The fastest K of each (drafter, batch, temperature)."""
  best: dict = {}
  for c in cells:
    key = (c["drafter"], c["batch"], c["temperature"])
    if key not in best or c["speedup"] > best[key]["speedup"]:
      best[key] = c
  return list(best.values())


COLUMNS = [("drafter", "drafter", str), ("batch", "batch", str), ("T", "temperature", str), ("K", "draft_len", str),
           ("AR tok/s", "ar_tokens_per_second", lambda x: _f(x, 0)),
           ("spec tok/s", "spec_tokens_per_second", lambda x: _f(x, 0)), ("speedup", "speedup", _f),
           ("decode speedup", "decode_speedup", _f),
           ("accept", "acceptance_rate", _f), ("α", "alpha", _f), ("τ", "tau", _f),
           ("predicted", "predicted_speedup", _f), ("efficiency", "engine_efficiency", _f),
           ("round cost (pred.)", None, None), ("compile s", "compile_seconds", lambda x: _f(x, 1)),
           ("peak MB", "peak_memory_mb", lambda x: _f(x, 0))]


# A cell whose AR rate is this far below the median AR rate of its batch had a slow baseline (noise on a
# shared machine): its speedup is flagged, not to be read as a gain.
AR_OUTLIER = 0.8


def slow_baselines(cells: list[dict]) -> set[int]:
  """`id`s of the cells whose AR tokens/s fell below AR_OUTLIER x the median of their batch."""
  median = {b: statistics.median(c["ar_tokens_per_second"] for c in cells if c["batch"] == b)
            for b in {c["batch"] for c in cells}}
  return {id(c) for c in cells if c["ar_tokens_per_second"] < AR_OUTLIER * median[c["batch"]]}


def table(cells: list[dict], all_cells: list[dict] | None = None) -> str:
  """One row per cell; speedups over a slow AR baseline (see `slow_baselines`, over `all_cells`) get a †."""
  slow = slow_baselines(cells if all_cells is None else all_cells)
  lines = ["| " + " | ".join(name for name, _, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
  for c in cells:
    row = [f"{_f(c['round_cost_in_ar_steps'])} ({_f(c['round_cost_predicted'])})" if key is None
           else fmt(c.get(key)) + (" †" if key == "speedup" and id(c) in slow else "") for _, key, fmt in COLUMNS]
    lines.append("| " + " | ".join(row) + " |")
  return "\n".join(lines)


def round_cost_fit(cells: list[dict]) -> dict[str, tuple[float, float]]:
  """Per drafter, at the smallest batch and temperature: a least-squares line through the measured round
  cost in AR steps against K, as (o, slope): a round costs 1 + o + K * slope, the adaptive cost model."""
  fits = {}
  for kind in dict.fromkeys(c["drafter"] for c in cells):
    cs = [c for c in cells if c["drafter"] == kind]
    cs = [c for c in cs if c["batch"] == min(x["batch"] for x in cs) and
          c["temperature"] == min(x["temperature"] for x in cs)]
    ks = [c["draft_len"] for c in cs]
    if len(set(ks)) >= 2:
      ys = [c["round_cost_in_ar_steps"] for c in cs]
      mk, my = statistics.fmean(ks), statistics.fmean(ys)
      slope = sum((k - mk) * (y - my) for k, y in zip(ks, ys)) / sum((k - mk) ** 2 for k in ks)
      fits[kind] = (my - slope * mk - 1, slope)
  return fits


def markdown(result: dict) -> str:
  m = result["machine"]
  out = [f"Measured on {m['processor']}, {m['cpus']} CPUs, {m['platform']}; JAX {result['jax']} "
         f"({m['backend']}, {result['device']}). Command: `{result['command']}`.", ""]
  for name, sweep in result["sets"].items():
    out += [f"### Prompt set `{name}`: {sweep['prompts']} prompts, {sweep['max_new_tokens']} new tokens", "",
            "| drafter | parameters | % of target | c (draft step / target step) by batch |", "|---|---|---|---|"]
    for kind, d in sweep["drafters"].items():
      cs = ", ".join(f"b{b}: {c:.3f}" for b, c in d["c"].items())
      out.append(f"| {kind} | {d['params']:,} | {d['params_percent_of_target']:.1f} | {cs} |")
    out += ["", "Verify cost v (a forward of K+1 tokens over one of 1 token):", "",
            "| batch | " + " | ".join(f"K={k}" for k in next(iter(sweep["verify_cost"].values()))) + " |",
            "|---|" + "---|" * len(next(iter(sweep["verify_cost"].values())))]
    for b, vs in sweep["verify_cost"].items():
      out.append(f"| {b} | " + " | ".join(f"{v:.2f}" for v in vs.values()) + " |")
    fits = round_cost_fit(sweep["cells"])
    if fits:
      out += ["", "A speculative round's measured cost in AR steps, fitted as 1 + o + K·s (smallest batch, "
              "greedy); the adaptive cost model's o, and s = c + v:", "", "| drafter | o | s |", "|---|---|---|"]
      out += [f"| {kind} | {o:.2f} | {slope:.3f} |" for kind, (o, slope) in fits.items()]
    out += ["", "Best K of each drafter, batch and temperature:", "",
            table(best_cells(sweep["cells"]), sweep["cells"]), "",
            "<details><summary>Every cell</summary>", "", table(sweep["cells"]), "", "</details>", ""]
  out += ["Columns: tokens/s are end to end (host work included, compilation excluded), medians of interleaved "
          "repeats; speedup = AR time / speculative time; decode speedup = the same for the decode phase (each time "
          "less a one-token request's, plus that token's AR step: prefill and host work are left out); "
          "accept = accepted / drafted; α = accepted / tested "
          "(the first rejection of a round counts as tested); τ = tokens per row per target forward; predicted "
          "= Leviathan's (1 − α^(K+1)) / ((1 − α)(K c + v)); efficiency = decode speedup / predicted; round cost = "
          "measured time of one speculative round of the decode phase in AR steps (predicted K c + v in "
          "brackets); peak MB = peak "
          "RSS during the cell on the CPU, peak device memory on an accelerator; † = the cell's AR rate was under "
          f"{AR_OUTLIER:.0%} of its batch's median AR rate (a slow baseline on a noisy machine), so its speedup is "
          "not a measured gain.", ""]
  if "hf" in result:
    h = result["hf"]
    out += ["### Hugging Face transformers, the same pair (greedy, batch 1)", "",
            "| | tokens/s |", "|---|---|",
            f"| HF `generate(assistant_model=draft)` | {h['hf_assisted_tokens_per_second']:.1f} |",
            f"| HF `generate` (plain) | {h['hf_plain_tokens_per_second']:.1f} |",
            f"| jspec, model drafter, K = {h['jspec_draft_len']} | {h['jspec_spec_tokens_per_second']:.1f} |",
            f"| jspec, plain | {h['jspec_plain_tokens_per_second']:.1f} |", "",
            f"jspec ÷ HF assisted: **{h['jspec_over_hf_assisted']:.1f}×**; greedy tokens identical in all four: "
            f"{h['greedy_tokens_identical']} prompts (transformers {h['transformers']}, torch {h['torch']}, "
            f"{h['torch_threads']} threads).", ""]
  return "\n".join(out)


def plots(result: dict, out_dir: pathlib.Path) -> list[pathlib.Path]:
  """Speedup vs K per drafter (one panel per temperature, batch 1), per-position acceptance (batch 1,
  greedy, largest K), and tokens/s vs batch (greedy, each drafter at its best K, and AR)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  def save(fig, path: pathlib.Path) -> pathlib.Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

  written = []
  for name, sweep in result["sets"].items():
    cells = sweep["cells"]
    kinds = list(sweep["drafters"])
    batch1 = min(c["batch"] for c in cells)
    temps = sorted({c["temperature"] for c in cells})
    greedy = min(temps)

    fig, axes = plt.subplots(1, len(temps), figsize=(4.2 * len(temps), 3.4), sharey=True, squeeze=False)
    for ax, t in zip(axes[0], temps):
      for kind in kinds:
        cs = sorted((c for c in cells if c["drafter"] == kind and c["batch"] == batch1 and c["temperature"] == t),
                    key=lambda c: c["draft_len"])
        ax.plot([c["draft_len"] for c in cs], [c["speedup"] for c in cs], marker="o", label=kind)
      ax.axhline(1.0, color="gray", lw=0.8, ls="--")
      ax.set(title=f"temperature {t}, batch {batch1}", xlabel="K (draft length)")
    axes[0][0].set_ylabel("speedup over AR")
    axes[0][-1].legend()
    written.append(save(fig, out_dir / f"{name}-speedup_vs_k.png"))

    fig, ax = plt.subplots(figsize=(5, 3.4))
    for kind in kinds:
      cs = [c for c in cells if c["drafter"] == kind and c["batch"] == batch1 and c["temperature"] == greedy]
      if cs:
        c = max(cs, key=lambda c: c["draft_len"])
        ax.plot(range(1, c["draft_len"] + 1), c["per_position_acceptance"], marker="o",
                label=f"{kind} (K={c['draft_len']})")
    ax.set(xlabel="draft position", ylabel="share of rounds accepted", ylim=(0, 1),
           title=f"per-position acceptance, batch {batch1}, T={greedy}")
    ax.legend()
    written.append(save(fig, out_dir / f"{name}-per_position_acceptance.png"))

    fig, ax = plt.subplots(figsize=(5, 3.4))
    best = [c for c in best_cells(cells) if c["temperature"] == greedy]
    batches = sorted({c["batch"] for c in best})
    ar = {b: statistics.median(c["ar_tokens_per_second"] for c in cells
                                 if c["batch"] == b and c["temperature"] == greedy) for b in batches}
    ax.plot(batches, [ar[b] for b in batches], marker="s", color="black", label="AR")
    for kind in kinds:
      cs = sorted((c for c in best if c["drafter"] == kind), key=lambda c: c["batch"])
      ax.plot([c["batch"] for c in cs], [c["spec_tokens_per_second"] for c in cs], marker="o", label=f"{kind} (best K)")
    ax.set(xlabel="batch size", ylabel="tokens/s", title=f"throughput, T={greedy}", xticks=batches)
    ax.legend()
    written.append(save(fig, out_dir / f"{name}-tokens_per_second_vs_batch.png"))
  return written



def _cell_key(c: dict) -> tuple:
  return c["drafter"], c["batch"], c["temperature"], c["draft_len"]


def merge(results: list[dict]) -> dict:
  """Sweeps of the same prompt sets run in separate processes (for example one per drafter), as one. A cell
  (drafter, batch, temperature, K) measured again in a later run replaces the earlier measurement."""
  out = {**results[0], "sets": {}}
  out["command"] = " && ".join(r["command"] for r in results)
  for r in results:
    for name, sweep in r["sets"].items():
      if name not in out["sets"]:
        out["sets"][name] = {**sweep, "drafters": {}, "cells": []}
      merged = out["sets"][name]
      merged["drafters"].update(sweep["drafters"])
      again = {_cell_key(c) for c in sweep["cells"]}
      merged["cells"] = [c for c in merged["cells"] if _cell_key(c) not in again] + sweep["cells"]
    if "hf" in r:
      out["hf"] = r["hf"]
  for sweep in out["sets"].values():
    order = {kind: i for i, kind in enumerate(sweep["drafters"])}
    sweep["cells"].sort(key=lambda c: (order[c["drafter"]], *_cell_key(c)[1:]))
  return out


def main() -> int:
  """`python -m jspec.bench.report BENCH_JSON --out DIR`: the tables and plots again, from a saved run."""
  import argparse
  import json
  ap = argparse.ArgumentParser(description=main.__doc__)
  ap.add_argument("json", nargs="+")
  ap.add_argument("--out", required=True)
  args = ap.parse_args()
  result = merge([json.loads(pathlib.Path(p).read_text()) for p in args.json])
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  (out / "bench.md").write_text(markdown(result))
  for path in plots(result, out):
    print(path)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
