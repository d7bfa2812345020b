"""Plot adaptive speculation over one generation: the K chosen each round and the acceptance behind it.

  python tools/adaptive_plot.py --out docs/adaptive.png
The default prompt opens a docstring with English prose, which the code model continues as prose before it
returns to code, so acceptance drops, decoding falls back to plain steps, and probes bring speculation back.
"""
from __future__ import annotations

import argparse
import json
import pathlib

import jspec
from jspec.core import shipped
from jspec.core.settings import DRAFTERS, AdaptiveConfig, SpecConfig

PROMPT = ('def load_settings(path):\n    """Read the settings file.\n\n    This paragraph is plain English, the '
          'kind of long explanation a careful author writes when the behaviour is surprising. Settings come '
          'from three places, and the order matters: the defaults that ship with the program, then the file '
          'that the administrator keeps,')


def main() -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--prompt", default=PROMPT)
  ap.add_argument("--drafter", default="model", choices=DRAFTERS)
  ap.add_argument("--draft-len", type=int, default=6, help="K_max")
  ap.add_argument("--max-new-tokens", type=int, default=400)
  ap.add_argument("--probe-interval", type=int, default=16)
  ap.add_argument("--temperature", type=float, default=0.8)
  ap.add_argument("--top-p", type=float, default=0.95)
  ap.add_argument("--seed", type=int, default=2)
  ap.add_argument("--out", default="docs/adaptive.png")
  args = ap.parse_args()
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  target = jspec.load(shipped.TARGET)
  draft = jspec.load(shipped.DRAFTS[args.drafter]) if args.drafter in shipped.DRAFTS else None
  # The drafter's measured cost model comes from its checkpoint.
  policy = AdaptiveConfig(probe_interval=args.probe_interval)
  spec = SpecConfig(args.draft_len, drafter=args.drafter, trace_rounds=args.max_new_tokens, adaptive=policy)
  r = jspec.generate(target, [args.prompt], draft=draft, spec=spec, max_new_tokens=args.max_new_tokens,
                     temperature=args.temperature, top_p=args.top_p, seed=args.seed)
  trace = r.stats.trace
  tokens, x = 0, []
  for row in trace:  # x: tokens emitted before the round
    x.append(tokens)
    tokens += 1 if row["accepted"] is None else int(row["accepted"]) + 1
  k = [row["draft_len"] for row in trace]
  fig, (ax_k, ax_a) = plt.subplots(2, 1, figsize=(10, 5.5), sharex=True)
  ax_k.step(x, k, where="post", color="tab:blue")
  ax_k.scatter([xi for xi, ki in zip(x, k) if ki == 0], [0] * k.count(0), s=6, color="tab:red",
               label="plain step (fallback)")
  ax_k.set_ylabel("K this round")
  ax_k.legend(loc="upper right")
  ax_a.plot(x, [row["acceptance_window"] for row in trace], label="window (fallback rule)")
  ax_a.plot(x, [row["acceptance_ewma"] for row in trace], label="EWMA (choice of K)")
  ax_a.axhline(policy.fallback_threshold, color="gray", linestyle="--", linewidth=1, label="fallback threshold")
  ax_a.set_ylabel("per-token acceptance")
  ax_a.set_xlabel("tokens generated")
  ax_a.legend(loc="upper right")
  fig.suptitle(f"Adaptive speculation: {args.drafter} drafter, K_max {args.draft_len}, "
               f"temperature {args.temperature}, top-p {args.top_p}")
  fig.tight_layout()
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(out, dpi=110)
  s = r.stats
  print(json.dumps({"out": str(out), "text": r.texts[0], "draft_len_counts": s.draft_len_counts,
                    "fallback_rounds": s.fallback_rounds, "probe_rounds": s.probe_rounds,
                    "tau": s.mean_accepted_length}, indent=1))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
