"""The paged engine's memory and prefill, measured in one process on the shipped pair (`jspec.Engine`, no
HTTP): how many requests of a mixed workload decode at once in the memory of a few whole-context slots,
the time to first token of requests that share a long system prompt, and how evenly running streams move
while a long prompt is prefilled in chunks."""
from __future__ import annotations

import statistics
import time

import jax
import numpy as np

import jspec
from jspec.bench.parts import Models, shipped_pair
from jspec.decoding import programs
from jspec.decoding.batches import make_batch
from jspec.decoding.decoder import make_decoder
from jspec.engine import pages
from jspec.engine.requests import Request
from jspec.train import data

CHUNK = 512  # the server's --max-prefill-tokens


def _heldout_tokens(target, count: int, seed: int) -> list[int]:
  """`count` token ids of held-out code, from files in a random order."""
  rng = np.random.default_rng(seed)
  texts = data.read_texts("heldout")
  ids: list[int] = []
  for i in rng.permutation(len(texts)):
    ids += target.tokenizer.encode(texts[i]).ids
    if len(ids) >= count:
      return ids[:count]
  raise ValueError("not enough held-out text")


def _drain(engine, on_step=None) -> dict:
  """Steps until idle; {id: [(seconds since the start, Delta)]}."""
  out, begin = {}, time.perf_counter()
  while engine.has_work:
    for d in engine.step():
      out.setdefault(d.index, []).append((time.perf_counter() - begin, d))
    if on_step is not None:
      on_step()
  return out


def capacity(target, draft, kind: str, slot_rows: int, requests: int, max_len: int, seed: int = 0) -> dict:
  """Requests of prompts 64-1,024 and outputs 32-256 tokens, all queued at once on an engine whose pages
  are the memory of `slot_rows` whole-context slots: the most decoding at once (a contiguous cache holds
  `slot_rows`)."""
  rng = np.random.default_rng(seed)
  text = _heldout_tokens(target, 1024 * requests, seed)
  lens = [(int(rng.integers(64, 1025)), int(rng.integers(32, 257))) for _ in range(requests)]
  probe = jspec.make_engine(target, draft=draft, slots=1, max_len=max_len)
  per_row = probe.capacity // jspec.model.cache.PAGE_SIZE
  engine = jspec.make_engine(target, draft=draft, slots=requests, max_len=max_len, pages=slot_rows * per_row)
  for i, (p, n) in enumerate(lens):
    engine.add(Request(text[i * 1024:i * 1024 + p], n, ignore_eos=True), i)
  decoding = []
  begin = time.perf_counter()
  _drain(engine, lambda: decoding.append(sum(r is not None for r in engine._running)))
  mean_prompt, mean_output = statistics.mean(p for p, _ in lens), statistics.mean(n for _, n in lens)
  return {"drafter": kind, "max_len": max_len, "pages": engine.kv_pages.pages, "pages_per_slot": per_row,
          "slot_rows": slot_rows, "requests": requests, "mean_prompt": mean_prompt, "mean_output": mean_output,
          # what a perfectly packed cache could hold: a slot's tokens over a request's mean
          "ceiling_ratio": per_row * pages.PAGE_SIZE / (mean_prompt + mean_output), "most_decoding": max(decoding),
          "mean_decoding": statistics.mean(decoding), "capacity_ratio": max(decoding) / slot_rows,
          "preemptions": engine.num_preemptions, "seconds": time.perf_counter() - begin}


def shared_prefix(target, draft, kind: str, system_tokens: int, requests: int, max_len: int) -> dict:
  """One streamed request at a time, each a `system_tokens` system prompt and a question of its own: the first
  prefills it all, the later ones only what follows the cached pages. Times to first token, from a second
  pass with another system prompt (the first compiles the shapes)."""
  text = _heldout_tokens(target, 2 * system_tokens + 64 * requests, 1)
  engine = jspec.make_engine(target, draft=draft, slots=1, max_len=max_len, max_prefill_tokens=CHUNK)
  for attempt in range(2):
    system = text[attempt * system_tokens:(attempt + 1) * system_tokens]
    ttft, prefill = [], []
    for i in range(requests):
      question = text[2 * system_tokens + 64 * i:2 * system_tokens + 64 * (i + 1)]
      begin, first, spent = time.perf_counter(), None, 0.0
      engine.add(Request(system + question, 16, ignore_eos=True, stream=True), (attempt, i))
      while engine.has_work:
        deltas = engine.step()
        spent += sum(engine.last_prefill_seconds)
        if first is None and any(d.token_ids for d in deltas):
          first = time.perf_counter() - begin
      ttft.append(first)
      prefill.append(spent)
  later = statistics.median(ttft[1:])
  return {"drafter": kind, "system_tokens": system_tokens, "max_prefill_tokens": CHUNK, "ttft_first": ttft[0],
          "ttft_later_median": later, "ttft_ratio": later / ttft[0], "goal": 0.3, "prefill_first": prefill[0],
          "prefill_later_median": statistics.median(prefill[1:]),
          "prefix_hits": engine.kv_pages.prefix_hits, "prefix_queries": engine.kv_pages.prefix_queries}


def long_prompt_stall(target, draft, kind: str, streams: int, prompt_tokens: int, max_prefill: int | None,
                      max_len: int) -> dict:
  """`streams` requests decode; a `prompt_tokens` prompt arrives: the gaps between the streams' deltas
  from its arrival to a few segments after it starts decoding, their longest against their median (goal:
  at most 2x), with chunks of `max_prefill` tokens (None: whole prompts)."""
  text = _heldout_tokens(target, 2 * prompt_tokens + 64 * streams, 2)
  engine = jspec.make_engine(target, draft=draft, slots=streams + 1, max_len=max_len, max_prefill_tokens=max_prefill)
  times: dict = {}
  for attempt in range(2):  # the first compiles the shapes
    for i in range(streams):
      question = text[2 * prompt_tokens + 64 * i:2 * prompt_tokens + 64 * (i + 1)]
      engine.add(Request(question, max_len - 128, ignore_eos=True, stream=True), (attempt, i))
    for _ in range(3):
      engine.step()
    engine.add(Request(text[attempt * prompt_tokens:(attempt + 1) * prompt_tokens], 16, ignore_eos=True),
               (attempt, "long"))
    times = {(attempt, i): [] for i in range(streams)}
    after = None
    for _ in range(200):  # bounded
      for d in engine.step():
        if d.index in times and d.token_ids:
          times[d.index].append(time.perf_counter())
      started = any(r is not None and r.id == (attempt, "long") for r in engine._running)
      after = (after or 0) + 1 if started or after is not None else None
      if after is not None and after > 6:
        break
    for i in [*times, (attempt, "long")]:
      engine.abort(i)
    _drain(engine)
  gaps = [b - a for ts in times.values() for a, b in zip(ts, ts[1:])]
  return {"drafter": kind, "streams": streams, "prompt_tokens": prompt_tokens, "max_prefill_tokens": max_prefill,
          "longest_gap": max(gaps), "median_gap": statistics.median(gaps),
          "gap_ratio": max(gaps) / statistics.median(gaps), "goal": 2.0}


def static_batch(target, draft, kind: str, batch: int, new_tokens: int, repeats: int) -> dict:
  """`jspec.generate`'s program over a static batch with contiguous caches and with the same caches paged
  (each row's pages scattered over a pool): decode seconds, interleaved, medians."""
  text = _heldout_tokens(target, 200 * batch, 3)
  decoder = make_decoder(target, draft, jspec.SpecConfig(4, drafter=kind), batch)
  prompts = [text[200 * i:200 * (i + 1)] for i in range(batch)]
  batch_of_prompts = make_batch(decoder, prompts, new_tokens, ignore_eos=True)
  per_row = batch_of_prompts.capacity // pages.PAGE_SIZE
  table = np.random.default_rng(0).permutation(batch * per_row).reshape(batch, per_row).astype(np.int32)
  paged = batch_of_prompts.replace(page_table_BxR=table, pages=batch * per_row)
  runs = {"contiguous": batch_of_prompts, "paged": paged}
  times = {name: [] for name in runs}
  for r in runs.values():  # compile
    jax.block_until_ready(programs.run(decoder, r))
  for i in range(repeats):
    for name in (list(runs) if i % 2 == 0 else list(runs)[::-1]):
      begin = time.perf_counter()
      jax.block_until_ready(programs.run(decoder, runs[name]))
      times[name].append(time.perf_counter() - begin)
  medians = {name: statistics.median(t) for name, t in times.items()}
  return {"drafter": kind, "batch": batch, "new_tokens": new_tokens, "repeats": repeats,
          "seconds": medians, "paged_over_contiguous": medians["paged"] / medians["contiguous"]}


def suite_paging(models: Models, kind: str) -> dict:
  target, draft = shipped_pair(models, kind)
  context = target.config.max_seq_len
  result = {"static_batch": static_batch(target, draft, kind, batch=4, new_tokens=128, repeats=5),
            "capacity": capacity(target, draft, kind, slot_rows=4, requests=32, max_len=context),
            "shared_prefix": shared_prefix(target, draft, kind, system_tokens=1000, requests=6, max_len=context),
            "long_prompt": [long_prompt_stall(target, draft, kind, 4, min(2000, context - 48), chunk, context)
                            for chunk in (CHUNK, None)]}
  return result


def markdown(result: dict) -> str:
  c, s, b = result["capacity"], result["shared_prefix"], result["static_batch"]
  lines = [f"A static batch of {b['batch']} ({b['new_tokens']} new tokens), `generate`'s program: paged caches took "
           f"{b['paged_over_contiguous']:.2f}x the contiguous caches' time ({b['seconds']['paged']:.2f} s against "
           f"{b['seconds']['contiguous']:.2f} s, medians of {b['repeats']}).",
           f"Capacity: {c['requests']} requests (prompts 64-1,024 tokens, mean {c['mean_prompt']:.0f}; outputs "
           f"32-256, mean {c['mean_output']:.0f}) on pages worth {c['slot_rows']} whole-context slots "
           f"({c['pages']} pages of {pages.PAGE_SIZE}): at most {c['most_decoding']} decoding at once (mean "
           f"{c['mean_decoding']:.1f}), {c['capacity_ratio']:.2f}x the slots (goal >= 4; a perfectly packed cache: "
           f"{c['ceiling_ratio']:.2f}x); {c['preemptions']} preemptions.",
           f"Shared {s['system_tokens']}-token system prompt: time to first token {s['ttft_first'] * 1e3:.0f} ms "
           f"first, {s['ttft_later_median'] * 1e3:.0f} ms later (median): {s['ttft_ratio']:.2f}x (goal <= 0.3); "
           f"of which prefill {s['prefill_first'] * 1e3:.0f} ms and {s['prefill_later_median'] * 1e3:.0f} ms."]
  for row in result["long_prompt"]:
    lines.append(f"A {row['prompt_tokens']}-token prompt while {row['streams']} streams decode, chunks of "
                 f"{row['max_prefill_tokens'] or 'the whole prompt'}: longest gap {row['longest_gap'] * 1e3:.0f} ms, "
                 f"median {row['median_gap'] * 1e3:.0f} ms: {row['gap_ratio']:.2f}x (goal <= 2).")
  return "\n".join(lines)
