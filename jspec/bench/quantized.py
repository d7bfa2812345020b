"""Quantized targets against the float one: how close they compute, what the drafters' τ becomes, and what a
plain step and a round cost on this machine."""
from __future__ import annotations

import json
import statistics
import sys

import numpy as np

import jspec
from jspec import testing
from jspec.bench.parts import Models, shipped_pair
from jspec.bench.prompts import heldout_prompts
from jspec.core.settings import WEIGHT_FORMATS, SpecConfig
from jspec.core.timing import interleaved
from jspec.formats import loading


def agreement(float_target: jspec.Model, quantized: jspec.Model, texts: list[list[int]], scored: int) -> dict:
  """Teacher-forced over `texts` (a prompt and the float target's greedy continuation each): at each of the last
  `scored` positions, whether both models' argmax agree, and KL(float || quantized) of their next-token laws."""
  same, kls = [], []
  for text in texts:
    p_logits, q_logits = (np.asarray(testing.full_logits(m, [text])[0, -scored - 1:-1], np.float64)
                          for m in (float_target, quantized))
    log_p = p_logits - np.logaddexp.reduce(p_logits, axis=-1, keepdims=True)
    log_q = q_logits - np.logaddexp.reduce(q_logits, axis=-1, keepdims=True)
    same += (p_logits.argmax(-1) == q_logits.argmax(-1)).tolist()
    kls += (np.exp(log_p) * (log_p - log_q)).sum(-1).tolist()
  return {"tokens": len(same), "top1_agreement": float(np.mean(same)), "mean_kl": float(np.mean(kls))}


def suite_quantized(pair: Models, kinds: list[str], max_new: int, repeats: int, count: int,
                    draft_len: int = 4) -> dict:
  """The shipped target in each weight format against float: `agreement` over `count` held-out code prompts
  continued `max_new` tokens; each drafter's τ (greedy, K = `draft_len` every round, batch 1) on each target;
  and, interleaved per prompt, a plain decode and an EAGLE decode of `max_new` tokens per target, timed end to
  end (prefill included) per token and per EAGLE round."""
  float_target = jspec.load(pair.target)
  targets = {"float": float_target, **{f: loading.quantized(float_target, f) for f in WEIGHT_FORMATS}}
  drafts = {kind: shipped_pair(pair, kind)[1] for kind in kinds}
  prompts = heldout_prompts(count)
  plain = jspec.generate(float_target, prompts, max_new_tokens=max_new, ignore_eos=True)
  ids = [float_target.tokenizer.encode(p).ids for p in prompts]
  texts = [p + out for p, out in zip(ids, plain.token_ids)]
  out = {"max_new_tokens": max_new, "prompts": count, "draft_len": draft_len, "formats": {}}
  for name, target in targets.items():
    row = agreement(float_target, target, texts, max_new) if name != "float" else {}
    row["tau"] = {kind: jspec.generate(target, prompts, draft=drafts[kind], max_new_tokens=max_new, ignore_eos=True,
                                       draft_len=draft_len, spec=SpecConfig(drafter=kind, adaptive=None)
                                       ).stats.mean_accepted_length for kind in kinds}
    out["formats"][name] = row
    print(json.dumps({name: row}), file=sys.stderr)
  eagle = drafts.get("eagle")
  step_ms, round_ms = {n: [] for n in targets}, {n: [] for n in targets}
  for prompt in prompts[:max(1, count // 4)]:
    runs = {}
    fns = {}
    for n, target in targets.items():
      fns[f"{n}/plain"] = lambda t=target: jspec.generate(t, [prompt], max_new_tokens=max_new, ignore_eos=True)
      if eagle is not None:
        fns[f"{n}/eagle"] = lambda t=target, n=n: runs.__setitem__(n, jspec.generate(
            t, [prompt], draft=eagle, max_new_tokens=max_new, ignore_eos=True, draft_len=draft_len,
            spec=SpecConfig(drafter="eagle", adaptive=None)))
    t = interleaved(fns, repeats)
    for n in targets:
      step_ms[n].append(t[f"{n}/plain"] / max_new * 1e3)
      if eagle is not None:
        round_ms[n].append(t[f"{n}/eagle"] / runs[n].stats.rounds * 1e3)
  for n in targets:
    out["formats"][n]["plain_ms_per_token"] = statistics.median(step_ms[n])
    if eagle is not None:
      out["formats"][n]["eagle_ms_per_round"] = statistics.median(round_ms[n])
  return out
