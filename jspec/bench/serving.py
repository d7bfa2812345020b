"""The serving benchmark, in the manner of vLLM's `benchmark_serving`: requests with Poisson arrivals (and one
at a time, and all at once), mixed prompt and output lengths, streamed over HTTP from `python -m
jspec.serve`; time to first token, time per output token, end-to-end latency (p50, p99) and output tokens/s.
The speculative server and the same server with `--no-draft` run side by side, loaded in turn."""
from __future__ import annotations

import asyncio
import json
import math
import pathlib
import re
import statistics
import sys
import tempfile
import time

import httpx
import numpy as np

from jspec.bench.parts import Models
from jspec.bench.prompts import varied_heldout_prompts
from jspec.serve.launch import start, stop

MODEL = "bench"


def _jobs(count: int, seed: int, output_lens: tuple[int, int]) -> list[tuple[str, int]]:
  """Prompts of mixed lengths (held-out code) and output lengths drawn uniformly in `output_lens`."""
  rng = np.random.default_rng(seed)
  return [(p, int(rng.integers(output_lens[0], output_lens[1] + 1))) for p in varied_heldout_prompts(count, seed)]


async def _one(http: httpx.AsyncClient, prompt: str, max_tokens: int) -> dict:
  body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
          "stream": True, "stream_options": {"include_usage": True}}
  begin = time.perf_counter()
  arrivals, tokens = [], 0  # (seconds since the request, characters so far) of each chunk with text
  async with http.stream("POST", "/v1/completions", json=body) as r:
    r.raise_for_status()
    async for line in r.aiter_lines():
      if not line.startswith("data: ") or line == "data: [DONE]":
        continue
      chunk = json.loads(line[6:])
      if chunk["choices"] and chunk["choices"][0]["text"]:
        arrivals.append((time.perf_counter() - begin, (arrivals[-1][1] if arrivals else 0) +
                         len(chunk["choices"][0]["text"])))
      if chunk.get("usage"):
        tokens = chunk["usage"]["completion_tokens"]
  e2e = time.perf_counter() - begin
  first = arrivals[0][0] if arrivals else None
  return {"ttft": first, "e2e": e2e, "tokens": tokens, "tpot": (e2e - first) / (tokens - 1) if tokens > 1 else None,
          "chunks": len(arrivals), "gaps": [b[0] - a[0] for a, b in zip(arrivals, arrivals[1:])],
          "arrivals": arrivals}


async def _load(url: str, jobs: list[tuple[str, int]], rate: float | None, seed: int) -> dict:
  """Sends `jobs`: one at a time (`rate` None), at Poisson arrivals of `rate` per second, or all at once
  (`rate` inf). Returns the latencies' p50 and p99 and the output tokens per second over the run."""
  rng = np.random.default_rng(seed)
  async with httpx.AsyncClient(base_url=url, timeout=600) as http:
    begin = time.perf_counter()
    if rate is None:
      results = [await _one(http, p, n) for p, n in jobs]
    else:
      async def arrive(delay, job):
        await asyncio.sleep(delay)
        return await _one(http, *job)
      gaps = np.zeros(len(jobs)) if math.isinf(rate) else rng.exponential(1 / rate, len(jobs))
      results = await asyncio.gather(*(arrive(t, job) for t, job in zip(np.cumsum(gaps), jobs)))
    wall = time.perf_counter() - begin
  pct = lambda key, q: float(np.percentile([r[key] for r in results if r[key] is not None], q))
  out = {f"{key}_{name}": pct(key, q) for key in ("ttft", "tpot", "e2e") for name, q in (("p50", 50), ("p99", 99))}
  gaps = [g for r in results for g in r["gaps"]] or [0.0]
  return {**out, "output_tokens_per_second": sum(r["tokens"] for r in results) / wall, "wall_seconds": wall,
          "chunks_per_request": statistics.mean(r["chunks"] for r in results),
          "fewest_chunks": min(r["chunks"] for r in results),
          "gap_p50": float(np.percentile(gaps, 50)), "gap_p99": float(np.percentile(gaps, 99)),
          "first_stream": results[0]["arrivals"]}


def _metric(url: str, name: str) -> float:
  text = httpx.get(f"{url}/metrics").text
  line = next(x for x in text.splitlines() if x.startswith(name))
  return float(line.rsplit(" ", 1)[1])


def _started(*flags: str) -> tuple:
  """A server, once ready and done compiling in the background (so that compiles do not share the CPU with
  what is measured)."""
  proc, url = start(*flags)
  while _metric(url, "jspec:programs_compiling"):
    time.sleep(0.5)
  return proc, url


def _server_flags(models: Models, drafter: str | None) -> list[str]:
  """A server of these models. It measures no cost model of its own once ready (minutes of both models'
  programs running beside what is measured): the speculative one decodes with the checkpoint's figures, or a
  calibration kept earlier (`python -m jspec.calibrate`), as its `jspec:cost_model_info` says."""
  flags = ["--target", str(models.target), "--served-model-name", MODEL, "--no-calibrate"]
  if drafter is None:
    return flags + ["--no-draft"]
  if drafter in models.drafts:
    flags += ["--draft", str(models.drafts[drafter])]
  return flags + ["--drafter", drafter]


def suite_serving(models: Models, drafter: str, rates: list[float], requests: int, repeats: int,
                  batch_size: int, output_lens: tuple[int, int] = (32, 128), out_dir: pathlib.Path | None = None,
                  segment_rounds: int | None = None) -> dict:
  """Both servers under each load, in turn (the order alternating), `repeats` times after one unmeasured
  pass; medians."""
  extra = ["--batch-size", str(batch_size)] + (["--segment-rounds", str(segment_rounds)] if segment_rounds else [])
  startup = _startup(models, drafter, extra)
  servers = {}
  try:
    for name, kind in (("speculative", drafter), ("plain", None)):
      print(f"starting the {name} server", file=sys.stderr)
      servers[name] = _started(*_server_flags(models, kind), *extra)
    loads = [("one at a time", None)] + [(f"{r:g} req/s", r) for r in rates] + [("all at once", math.inf)]
    rows = []
    for label, rate in loads:
      count = max(requests // 3, 4) if rate is None else requests
      jobs = _jobs(count, seed=len(rows), output_lens=output_lens)
      runs = _in_turn(servers, jobs, rate, repeats)
      row = {"load": label, "rate": None if rate is None else rate, "requests": count}
      for name, results in runs.items():
        row[name] = {k: statistics.median(x[k] for x in results) for k in results[0] if k != "first_stream"}
        row[name]["first_stream"] = results[0]["first_stream"]
      row["throughput_ratio"] = row["speculative"]["output_tokens_per_second"] / \
          row["plain"]["output_tokens_per_second"]
      rows.append(row)
      print(f"{label}: {row['throughput_ratio']:.2f}x plain output tokens/s", file=sys.stderr)
    url = servers["speculative"][1]
    prefill = _metric(url, "jspec:request_prefill_time_seconds_sum") / \
        _metric(url, "jspec:request_prefill_time_seconds_count")
    segment = _metric(url, "jspec:segment_time_seconds_sum") / _metric(url, "jspec:segment_time_seconds_count")
    cost_model = _cost_model_source(url)
  finally:
    for proc, _ in servers.values():
      stop(proc)
  one = rows[0]["speculative"]
  result = {"drafter": drafter, "batch_size": batch_size, "output_lens": list(output_lens), "rows": rows,
            "cost_model": cost_model,
            "mean_prefill_seconds": prefill, "mean_segment_seconds": segment, "startup": startup,
            "goals": {"one_at_a_time_ratio": rows[0]["throughput_ratio"], "one_at_a_time_goal": 1.5,
                      "saturation_ratio": rows[-1]["throughput_ratio"], "saturation_goal": 0.95,
                      "ttft_p50_one_at_a_time": one["ttft_p50"], "ttft_bound": prefill + segment}}
  if out_dir is not None:
    (out_dir / "serving.md").write_text(markdown(result))
    plot(result, out_dir / "serving.png")
  return result


def _cost_model_source(url: str) -> str | None:
  """Where the server's adaptive policy's cost model comes from (`jspec:cost_model_info`), if it has one."""
  found = re.search(r'^jspec:cost_model_info{.*source="(\w+)".*} 1\.0$', httpx.get(f"{url}/metrics").text, re.M)
  return found and found.group(1)


def _in_turn(servers: dict, jobs: list[tuple[str, int]], rate: float | None, repeats: int) -> dict[str, list]:
  """Each server's results of `repeats` loads of `jobs`, the servers in turn (the order alternating), after
  one unmeasured load each (it compiles the prefills from cached prefixes that repeated prompts hit)."""
  runs = {name: [] for name in servers}
  for name in servers:
    asyncio.run(_load(servers[name][1], jobs, rate, seed=0))
  for r in range(repeats):
    for name in (list(servers) if r % 2 == 0 else list(servers)[::-1]):
      runs[name].append(asyncio.run(_load(servers[name][1], jobs, rate, seed=r)))
  return runs


def _startup(models: Models, drafter: str, extra: list[str]) -> dict:
  """Seconds from launch to a ready `/health` of the speculative server: a first start with an empty compile
  cache (then stopped: the programs it compiles in the background are not kept), and a second with what it
  kept; and until `/health` first answered at all."""
  out = {}
  with tempfile.TemporaryDirectory() as cache:
    for name in ("first", "second"):
      begin, answered = time.perf_counter(), []
      proc, _ = start(*_server_flags(models, drafter), *extra, "--compile-cache", cache, starting=answered)
      out[f"{name}_ready_seconds"] = time.perf_counter() - begin
      stop(proc)
      print(f"{name} start: ready in {out[f'{name}_ready_seconds']:.1f} s", file=sys.stderr)
  return out


def markdown(result: dict) -> str:
  lines = ["| load | requests | output tok/s spec | plain | ratio | TTFT p50 / p99 spec (s) | plain | "
           "chunks per request spec | plain | gap p50 / p99 spec (ms) | plain | E2E p50 / p99 spec (s) | plain |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in result["rows"]:
    s, p = r["speculative"], r["plain"]
    lines.append(f"| {r['load']} | {r['requests']} | {s['output_tokens_per_second']:.0f} | "
                 f"{p['output_tokens_per_second']:.0f} | {r['throughput_ratio']:.2f}x | "
                 f"{s['ttft_p50']:.3f} / {s['ttft_p99']:.3f} | {p['ttft_p50']:.3f} / {p['ttft_p99']:.3f} | "
                 f"{s['chunks_per_request']:.1f} | {p['chunks_per_request']:.1f} | "
                 f"{1e3 * s['gap_p50']:.0f} / {1e3 * s['gap_p99']:.0f} | {1e3 * p['gap_p50']:.0f} / "
                 f"{1e3 * p['gap_p99']:.0f} | {s['e2e_p50']:.2f} / {s['e2e_p99']:.2f} | "
                 f"{p['e2e_p50']:.2f} / {p['e2e_p99']:.2f} |")
  up = result["startup"]
  lines += ["", f"The speculative server's cost model: {result.get('cost_model') or 'none'} figures.",
            "", f"Start to ready (speculative server, empty compile cache): first {up['first_ready_seconds']:.1f} s, "
                f"second {up['second_ready_seconds']:.1f} s."]
  return "\n".join(lines) + "\n"


def plot(result: dict, path: pathlib.Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  rows = result["rows"]
  labels = [r["load"] for r in rows]
  fig, (a, b, c) = plt.subplots(1, 3, figsize=(16, 4))
  for name in ("speculative", "plain"):
    a.plot(labels, [r[name]["output_tokens_per_second"] for r in rows], marker="o", label=name)
    b.plot(labels, [r[name]["ttft_p50"] for r in rows], marker="o", label=f"{name} TTFT p50")
    b.plot(labels, [r[name]["e2e_p50"] for r in rows], marker="s", linestyle="--", label=f"{name} E2E p50")
  for name in ("speculative", "plain"):  # one request's stream, alone
    times, chars = zip(*rows[0][name]["first_stream"])
    c.step([0, *times], [0, *chars], where="post", marker=".", label=name)
  c.set_xlabel("seconds since the request")
  c.set_ylabel("characters received")
  c.set_title("one streamed request, alone")
  c.legend()
  a.set_ylabel("output tokens/s")
  b.set_ylabel("seconds")
  b.set_yscale("log")
  for ax in (a, b):
    ax.set_xlabel("load")
    ax.tick_params(axis="x", rotation=30)
    ax.legend()
  fig.suptitle(f"jspec.serve, {result['drafter']} drafter against --no-draft, {result['batch_size']} slots")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def suite_streaming(models: Models, drafter: str, requests: int, repeats: int, max_tokens: int = 48,
                    batch_size: int = 8) -> dict:
  """One streamed completion at a time (greedy, `max_tokens` each, EOS ignored, held-out code prompts): the
  server with its default short segments for a young stream against one whose streams run 16-round segments
  (`--stream-rounds 16`, as every segment did before), loaded in turn, medians: chunks per request, time to
  first token against the short server's own mean prefill + 4 rounds, and output tokens/s."""
  flags = [*_server_flags(models, drafter), "--batch-size", str(batch_size)]
  servers = {}
  try:
    for name, rounds in (("short", None), ("long", 16)):
      print(f"starting the server with {name} stream segments", file=sys.stderr)
      servers[name] = _started(*flags, *(["--stream-rounds", str(rounds)] if rounds else []))
    jobs = [(p, max_tokens) for p in varied_heldout_prompts(requests, 0)]
    runs = _in_turn(servers, jobs, None, repeats)
    url = servers["short"][1]
    per = lambda name: _metric(url, f"{name}_sum") / _metric(url, f"{name}_count")
    prefill = per("jspec:request_prefill_time_seconds")
    round_seconds = _metric(url, "jspec:segment_time_seconds_sum") / _metric(url, "jspec:spec_decode_num_drafts_total")
  finally:
    for proc, _ in servers.values():
      stop(proc)
  out = {"drafter": drafter, "max_tokens": max_tokens, "requests": requests, "repeats": repeats,
         "mean_prefill_seconds": prefill, "seconds_per_round": round_seconds, "ttft_bound": prefill + 4 * round_seconds}
  for name, results in runs.items():
    out[name] = {k: statistics.median(x[k] for x in results) for k in
                 ("chunks_per_request", "ttft_p50", "gap_p50", "output_tokens_per_second")}
    out[name]["fewest_chunks"] = min(x["fewest_chunks"] for x in results)
  out["throughput_ratio"] = out["short"]["output_tokens_per_second"] / out["long"]["output_tokens_per_second"]
  print(json.dumps(out), file=sys.stderr)
  return out
