"""Drafts with another tokenizer: τ and speedup against a same-tokenizer draft, what reading the text as
spelled target tokens costs against re-tokenizing it, and what re-tokenizing on the host costs per round."""
from __future__ import annotations

import json
import statistics
import sys
import time

import jax
import numpy as np

import jspec
from jspec import testing
from jspec.bench.parts import Models, shipped_pair
from jspec.bench.prompts import PROMPT_SETS
from jspec.core.settings import SpecConfig
from jspec.core.timing import interleaved
from jspec.decoding.decoder import make_decoder
from jspec.drafters.draft_model import CrossVocabDrafter
from jspec.model import model
from jspec.text.tokenizer import detokenize, encode


def suite_cross_vocab(pair: Models, others: list[str], draft_lens: list[int], sets: list[str], max_new: int,
                      repeats: int, count: int) -> dict:
  """The pair's draft model and each draft in `others` (any tokenizer) at each fixed K of `draft_lens` (so that
  no cost model decides), greedy, batch 1, interleaved against plain decoding per prompt (EOS ignored);
  for drafts with another tokenizer, first-draft acceptance with the spelled text against the re-tokenized
  text, and the host's re-tokenizing time per round against the loop's whole round."""
  target, same = shipped_pair(pair, "model")
  drafts = {"same": same, **{d: jspec.load(d) for d in others}}
  variants = {f"{name}_k{k}": dict(draft=d, spec=SpecConfig(k, drafter="model", adaptive=None))
              for name, d in drafts.items() for k in draft_lens}
  out = {"max_new_tokens": max_new, "drafts": {n: _describe(target, d) for n, d in drafts.items()}, "sets": {}}
  for name in sets:
    rows, outputs = [], []
    prompts = PROMPT_SETS[name](count)
    for prompt in prompts:
      last = {}
      run = lambda v, **kw: last.__setitem__(v, jspec.generate(target, [prompt], max_new_tokens=max_new,
                                                               ignore_eos=True, **kw))
      fns = {"ar": lambda: run("ar"), **{v: lambda v=v, kw=kw: run(v, **kw) for v, kw in variants.items()}}
      t = interleaved(fns, repeats)
      outputs.append(last["ar"].token_ids[0])
      rows.append({v: {"speedup": t["ar"] / t[v], "tau": last[v].stats.mean_accepted_length,
                       "round_ms": 1e3 * t[v] / max(last[v].stats.rounds, 1),
                       "greedy_identical": last[v].token_ids == last["ar"].token_ids} for v in variants})
      print(json.dumps({"set": name, **{v: round(r["speedup"], 3) for v, r in rows[-1].items()}}), file=sys.stderr)
    summary = {v: {"median_speedup": statistics.median(r[v]["speedup"] for r in rows),
                   "min_speedup": min(r[v]["speedup"] for r in rows),
                   "median_tau": statistics.median(r[v]["tau"] for r in rows),
                   "median_round_ms": statistics.median(r[v]["round_ms"] for r in rows),
                   "greedy_identical": all(r[v]["greedy_identical"] for r in rows)} for v in variants}
    ids = [encode(target.tokenizer, p) for p in prompts]
    cross = {n: d for n, d in drafts.items() if _is_cross(target, d)}
    summary["first_draft_acceptance"] = {n: first_draft_acceptance(target, d, ids, outputs) for n, d in cross.items()}
    summary["host_retokenize_ms"] = {n: host_retokenize_ms(target, d, ids, outputs, max(draft_lens))
                                     for n, d in cross.items()}
    out["sets"][name] = {**summary, "rows": rows}
  return out


def _is_cross(target, draft) -> bool:
  return isinstance(make_decoder(target, draft, testing.fixed_k(1), 1).drafter, CrossVocabDrafter)


def _describe(target, draft) -> dict:
  decoder = make_decoder(target, draft, testing.fixed_k(1), 1)
  described = {"params": int(sum(x.size for x in jax.tree.leaves(draft.params))),
               "vocab_size": draft.config.vocab_size}
  if isinstance(decoder.drafter, CrossVocabDrafter):
    tables = decoder.drafter.tables
    described |= {"shared_fraction": tables.shared_fraction, "spelling_len": tables.spelling_len,
                  "mean_spelling": float(np.mean(tables.spelling_lens_Vt))}
  return described


def _intersection_argmax(tables, logits_SxV: np.ndarray) -> np.ndarray:
  """The target id of the draft's most likely token in the intersection, per position."""
  return tables.target_ids_I[np.argmax(logits_SxV[:, tables.draft_ids_I], axis=-1)]


def first_draft_acceptance(target, draft, prompts: list[list[int]], outputs: list[list[int]]) -> dict:
  """Teacher-forced on the target's greedy text: how often the draft's greedy first proposal (on the
  intersection) is the target's next token, when it reads the text as the loop spells it (each target
  token's spelling in turn) and when it reads the text re-tokenized whole by its own tokenizer (as
  transformers' universal assisted generation does each round)."""
  tables = make_decoder(target, draft, testing.fixed_k(1), 1).drafter.tables
  forward = jax.jit(lambda p, t: model.forward_full(p, t, draft.config)[0][0])
  padded = lambda ids: np.pad(np.asarray(ids, np.int32), (0, -len(ids) % 128))[None]
  hits = {"spelled": 0, "retokenized": 0}
  total = 0
  for prompt, new in zip(prompts, outputs):
    text = prompt + new
    spelled, ends = [], []
    for t in text:
      spelled.extend(tables.spelling_VtxL[t, :tables.spelling_lens_Vt[t]].tolist())
      ends.append(len(spelled))
    logits = np.asarray(forward(draft.params, padded(spelled)))
    guesses = _intersection_argmax(tables, logits[[ends[i - 1] - 1 for i in range(len(prompt), len(text))]])
    hits["spelled"] += int(np.sum(guesses == np.asarray(new)))
    for i in range(len(prompt), len(text)):
      ids = encode(draft.tokenizer, detokenize(target.tokenizer, text[:i]))
      logits = np.asarray(forward(draft.params, padded(ids)))
      hits["retokenized"] += int(_intersection_argmax(tables, logits[len(ids) - 1:len(ids)])[0] == text[i])
    total += len(new)
  return {k: v / total for k, v in hits.items()}


def host_retokenize_ms(target, draft, prompts: list[list[int]], outputs: list[list[int]], draft_len: int) -> float:
  """The median host time of one round's re-tokenizing as transformers' universal assisted generation does
  it: the target's text decoded and encoded for the draft, and K draft tokens decoded and encoded for the
  target; over every prefix of the target's greedy texts (the device sync it also needs is not counted)."""
  times = []
  for prompt, new in zip(prompts, outputs):
    text = prompt + new
    for i in range(len(prompt), len(text), 4):
      start = time.perf_counter()
      draft_ids = encode(draft.tokenizer, detokenize(target.tokenizer, text[:i]))
      proposal = draft_ids[-draft_len:]  # stands in for K drafted tokens
      encode(target.tokenizer, detokenize(draft.tokenizer, proposal))
      times.append(time.perf_counter() - start)
  return 1e3 * statistics.median(times)
