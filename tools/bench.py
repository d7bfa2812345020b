"""Benchmarks. Ratios are measured in one process, interleaved (A, B, A, B, ...), and reported as medians.

  python tools/bench.py                 # the sweep: drafter x K x temperature x batch vs AR, held-out code
  python tools/bench.py --prompt-sets edit,prose --temperatures 0 --batches 1   # other prompt sets
  python tools/bench.py --with-hf       # also Hugging Face assisted generation on the same pair
  python tools/bench.py --suite step    # decode-step costs: attention vs none, verify vs step, c
  python tools/bench.py --suite loop    # loop overhead and the verify cost curve on a ~30M model
  python tools/bench.py --suite adaptive --drafters model   # adaptive K and fallback vs fixed K and AR
  python tools/bench.py --suite round   # where a speculative round's time goes (K = 4, batch 1)
  python tools/bench.py --suite prefill # prefill time by prompt bucket width
  python tools/bench.py --suite cost --write   # the shipped drafters' cost models (batch 1, 4, 8), stored
  python tools/bench.py --suite stream --drafters model --max-new-tokens 128   # streaming's cost (segments)
  python tools/bench.py --suite batching --drafters model --prompts 256 --max-new-tokens 128 --repeats 2
  python tools/bench.py --suite defaults --max-new-tokens 128   # every default vs AR, per prompt, batch 1 and 4
  python tools/bench.py --quick         # a smoke run of the sweep on tiny random models (CI)
Writes bench.json (everything), and for the sweep bench.md (tables) and PNG plots, to --out DIR.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import pathlib
import resource
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

import jspec  # noqa: E402
from jspec import adaptive, checkpoint, data, decode, engine, model, pairing, shipped, testing  # noqa: E402
from jspec import cache as kvcache  # noqa: E402
from jspec.config import ModelConfig, num_params  # noqa: E402
from jspec.drafters import Proposal  # noqa: E402
from jspec.settings import AdaptiveConfig, CostModel, SpecConfig, TreeConfig  # noqa: E402

# ~31M parameters: a target large enough that a step is dominated by reading its weights.
MID = ModelConfig(vocab_size=8192, dim=512, n_layers=8, n_heads=8, n_kv_heads=8, head_dim=64, mlp_dim=1536,
                  max_seq_len=8192)
# The model of the decode-step measurements (docs/cpu-performance.md): 6 layers, width 384, heads of 64.
STEP_MODEL = ModelConfig(vocab_size=4096, dim=384, n_layers=6, n_heads=6, n_kv_heads=6, head_dim=64,
                         mlp_dim=1024, max_seq_len=8192)


def interleaved(fns: dict, repeats: int, warmup: bool = True, warm_each: bool = False) -> dict[str, float]:
  """Median seconds of each fn, calling them in turn `repeats` times (after one warm-up each).

  `warm_each` times each call right after an untimed call of the same fn: for fns that share no weights,
  so that none is timed with the CPU caches full of the previous fn's data.
  """
  for f in fns.values() if warmup else ():
    f()
  times = {k: [] for k in fns}
  for _ in range(repeats):
    for k, f in fns.items():
      if warm_each:
        f()
      t0 = time.perf_counter()
      f()
      times[k].append(time.perf_counter() - t0)
  return {k: statistics.median(v) for k, v in times.items()}


def edit_prompts(count: int, max_lines: int = 12) -> list[str]:
  """Context-editing prompts: a held-out function, a request to rewrite it, and its first line again.

  The continuation mostly repeats text from the prompt, which is where n-gram lookup should shine.
  """
  prompts = []
  for path in data.corpus_files("heldout"):
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)
    for i, line in enumerate(lines):
      if line.startswith("def ") and i > 5:
        body = "".join(lines[i:i + max_lines])
        prompts.append(f"{body}\n# The same function, rewritten with better names:\n{line}")
        break
    if len(prompts) == count:
      break
  return prompts


PROSE = [
    "The old lighthouse keeper had not spoken to anyone for three weeks when the boat finally arrived. He",
    "Most people think of autumn as a season of endings, but for a gardener it is the beginning of",
    "When the committee met again on Thursday, the mood in the room had changed. Nobody wanted to",
    "My grandmother kept every letter she ever received, tied in bundles with faded ribbon, and",
    "The history of the bicycle is a story of small improvements that, taken together, transformed",
    "It rained all night, and by morning the river had risen almost to the top of the stone wall that",
    "Learning a second language as an adult is humbling. At first every sentence feels like",
    "The bakery on the corner opens at six, and by half past there is usually a line of sleepy",
]


def prose_prompts(count: int) -> list[str]:
  """English prose, which the code models have hardly seen: drafts are accepted rarely."""
  return PROSE[:count]


def heldout_prompts(count: int, max_chars: int = 600) -> list[str]:
  """The start of a function in held-out stdlib files: everything up to and including a `def` line."""
  prompts = []
  for path in data.corpus_files("heldout"):
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = text.splitlines(keepends=True)
    for i, line in enumerate(lines):
      if line.lstrip().startswith("def ") and i > 5:
        prompts.append("".join(lines[:i + 1])[-max_chars:])
        break
    if len(prompts) == count:
      break
  return prompts


def step_loop(params, config: ModelConfig, batch: int, capacity: int, used: int, seq: int, attention: bool,
              steps: int = 32):
  """A jitted while-loop of `steps` forwards of `seq` tokens per row over a cache holding `used` tokens.

  The cache is donated and handed back, as in the decode loop, so no call pays for copying it.
  """
  tokens = jnp.ones((batch, seq), jnp.int32)
  positions = used + jnp.broadcast_to(jnp.arange(seq), (batch, seq))

  def one(cache):
    if attention:
      logits, _, cache = model.forward(params, tokens, positions, cache, config)
      return logits, cache.rewind(cache.lengths - seq)
    hidden = model.trunk(params, tokens, positions, config, lambda i, q, k, v: q)
    return model.logits_from_hidden(params, hidden, config), cache

  @functools.partial(jax.jit, donate_argnums=0)
  def run(cache):
    def body(i, c):
      acc, cache = c
      logits, cache = one(cache)
      return acc + logits[0, 0, 0], cache
    return lax.fori_loop(0, steps, body, (jnp.zeros(()), cache))

  state = [kvcache.init_cache(config, batch, capacity).rewind(jnp.full((batch,), used, jnp.int32))]

  def call():
    acc, state[0] = run(state[0])
    jax.block_until_ready(acc)
  return call, steps


def naive_step_loop(params, config: ModelConfig, batch: int, capacity: int, used: int, steps: int = 32):
  """The layout jspec/cache.py avoids: one stacked `[N, B, T, J, Dh]` cache, a vmapped per-row update, and
  attention over the whole capacity. XLA on the CPU copies the written buffer every step."""
  tokens = jnp.ones((batch, 1), jnp.int32)
  positions = jnp.full((batch, 1), used, jnp.int32)
  lengths = jnp.full((batch,), used, jnp.int32)
  write_row = jax.vmap(lambda buf, new, n: lax.dynamic_update_slice(buf, new, (n, 0, 0)))

  def one(k_NxBxTxJxDh, v_NxBxTxJxDh):
    caches = [k_NxBxTxJxDh, v_NxBxTxJxDh]

    def attend(i, q, k, v):
      caches[0] = caches[0].at[i].set(write_row(caches[0][i], k, lengths))
      caches[1] = caches[1].at[i].set(write_row(caches[1][i], v, lengths))
      keys = jnp.repeat(caches[0][i], config.n_heads // config.n_kv_heads, axis=2)
      values = jnp.repeat(caches[1][i], config.n_heads // config.n_kv_heads, axis=2)
      s = jnp.einsum("bqhd,bthd->bhqt", q, keys) * config.head_dim ** -0.5
      s = jnp.where(jnp.arange(capacity) <= used, s, -jnp.inf)
      return jnp.einsum("bhqt,bthd->bqhd", jax.nn.softmax(s, axis=-1), values)

    hidden = model.trunk(params, tokens, positions, config, attend)
    return model.logits_from_hidden(params, hidden, config), caches

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def run(k, v):
    def body(i, c):
      acc, k, v = c
      logits, (k, v) = one(k, v)
      return acc + logits[0, 0, 0], k, v
    return lax.fori_loop(0, steps, body, (jnp.zeros(()), k, v))

  shape = (config.n_layers, batch, capacity, config.n_kv_heads, config.head_dim)
  state = [jnp.zeros(shape), jnp.zeros(shape)]

  def call():
    acc, state[0], state[1] = run(*state)
    jax.block_until_ready(acc)
  return call, steps


def suite_step(repeats: int) -> dict:
  config = STEP_MODEL
  params = model.init_params(config, jax.random.PRNGKey(0))
  draft_config = dataclasses.replace(config, dim=128, n_layers=1, n_heads=2, n_kv_heads=2, mlp_dim=384)
  draft_params = model.init_params(draft_config, jax.random.PRNGKey(1))
  out = {"model_params": num_params(config), "rows": []}
  for capacity in (1024, 4096):
    for batch in (1, 8):
      used = 256
      fns, steps = {}, 0
      for name, seq, attn in [("step", 1, True), ("no_attention", 1, False), ("verify5", 5, True),
                              ("verify5_no_attention", 5, False)]:
        fns[name], steps = step_loop(params, config, batch, capacity, used, seq, attn)
      fns["draft_step"], _ = step_loop(draft_params, draft_config, batch, capacity, used, 1, True)
      fns["before_step"], _ = naive_step_loop(params, config, batch, capacity, used)
      t = {k: v / steps for k, v in interleaved(fns, repeats).items()}
      out["rows"].append({
          "capacity": capacity, "batch": batch, "used": used, "step_ms": t["step"] * 1e3,
          "no_attention_ms": t["no_attention"] * 1e3, "step_over_no_attention": t["step"] / t["no_attention"],
          "before_step_ms": t["before_step"] * 1e3,
          "before_over_no_attention": t["before_step"] / t["no_attention"],
          "verify5_over_step": t["verify5"] / t["step"],
          # Above 1.3 here, the matmuls of 5 tokens per row are compute-bound: attention cannot fix that.
          "verify5_over_step_no_attention": t["verify5_no_attention"] / t["no_attention"],
          "c_draft_over_target": t["draft_step"] / t["step"],
          "param_ratio": num_params(draft_config) / num_params(config)})
      print(json.dumps(out["rows"][-1]), file=sys.stderr)
  return out


def suite_loop(repeats: int) -> dict:
  """Loop overhead (AR loop vs one jitted forward) and the verify cost curve, on a ~31M model."""
  target = testing.random_model(MID)
  prompts = [list(range(1, 33))]
  new = 64
  single, _ = step_loop(target.params, MID, 1, 256, 32, 1, True, steps=1)
  t = interleaved({"single": single,
                   "ar": lambda: jspec.generate(target, prompts, max_new_tokens=new)}, repeats)
  ar = jspec.generate(target, prompts, max_new_tokens=new)
  out = {"model_params": num_params(MID), "single_forward_ms": t["single"] * 1e3,
         "ar_tokens_per_second": ar.stats.tokens_per_second,
         "loop_overhead_ratio": ar.stats.tokens_per_second * t["single"]}
  fns = {f"verify{k + 1}": step_loop(target.params, MID, 1, 256, 32, k + 1, True)[0] for k in range(0, 9)}
  tv = interleaved(fns, repeats)
  out["verify_cost_over_step"] = {k: tv[f"verify{k + 1}"] / tv["verify1"] for k in range(1, 9)}
  copy = jspec.generate(target, prompts, draft=target, max_new_tokens=5 * 8, draft_len=4)
  out["draft_equals_target_tokens_per_forward"] = copy.stats.mean_accepted_length
  return out


def suite_prefill(pair: shipped.Pair, repeats: int, widths: tuple[int, ...] = (96, 128, 192, 256, 384, 512)) -> dict:
  """The shipped target's prefill of one prompt as wide as each prompt bucket: prefill runs over the whole
  padded width, so its cost follows the bucket, not the prompt."""
  target = jspec.load(pair.target)
  tparams = model.with_head(target.params)
  prefill = jax.jit(lambda c, t, n: model.prefill(tparams, target.config, c, t, n)[0].sum())
  fns = {}
  for width in widths:
    args = (kvcache.init_cache(target.config, 1, kvcache.round_capacity(width + 1)),
            jnp.ones((1, width), jnp.int32), jnp.full((1,), width, jnp.int32))
    fns[width] = lambda args=args: jax.block_until_ready(prefill(*args))
  t = interleaved(fns, repeats)
  return {"prefill_ms": {w: t[w] * 1e3 for w in widths},
          "prefill_us_per_token": {w: t[w] * 1e6 / w for w in widths}}


def shipped_pair(pair: shipped.Pair, kind: str):
  """A shipped target and the shipped weights of a drafter for it (None for n-gram)."""
  return jspec.load(pair.target), jspec.load(pair.drafts[kind]) if kind in pair.drafts else None


def started(target, draft, kind: str, draft_len: int, batch: int, used: int, max_new: int = 10 ** 6):
  """A decoder (target head untied, as the loop reads it) and its state after prefilling `batch` random
  prompts of `used` tokens, greedy, in a cache of 512 slots."""
  decoder = pairing.make_decoder(target, draft, SpecConfig(draft_len, drafter=kind, adaptive=None), batch)
  decoder = decoder.replace(target_params=model.with_head(decoder.target_params))
  prompt = jnp.asarray(np.random.default_rng(0).integers(0, target.config.vocab_size, (batch, used)), jnp.int32)
  requests = decode.Requests(prompt, jnp.full((batch,), used, jnp.int32), jnp.full((batch,), max_new, jnp.int32),
                             engine.as_sampling(0.0, 0, 1.0, batch), jnp.zeros((batch,), jnp.uint32),
                             decode.stop_ids(target.config, batch, ignore_eos=True))
  return decoder, decode.start(decoder, requests, 512)


def suite_round(pair: shipped.Pair, repeats: int, kind: str = "model", draft_len: int = 4, used: int = 200,
                batch: int = 1) -> dict:
  """Where a speculative round's time goes, shipped pair, greedy: the whole round, its parts (the proposal
  of K tokens, the target forward of K+1), and a plain AR step, each 32 times in a jitted loop from the same
  decode state; the rest of the round is its overhead."""
  target, draft = shipped_pair(pair, kind)
  decoder, state = started(target, draft, kind, draft_len, batch, used)
  tparams, config = decoder.target_params, target.config
  keys = jnp.zeros((draft_len, batch, 2), jnp.uint32)
  chunk = jnp.ones((batch, draft_len + 1), jnp.int32)
  fixed = Proposal(chunk[:, 1:], jnp.zeros((batch, draft_len, config.vocab_size), jnp.float32),
                   jnp.ones((batch,), bool))

  def propose(s, i):
    dstate, proposal = decoder.drafter.propose(decoder.drafter_params, tparams, s.drafter_state, s.tokens,
                                               s.seq_lens - i % 2, keys, s.sampling)
    return s.replace(drafter_state=dstate), proposal.logits_BxKxV.sum()

  def verify_forward(s, i):
    logits, _, cache = model.forward(tparams, chunk, s.seq_lens[:, None] - 1 + jnp.arange(draft_len + 1),
                                     s.target_cache, config)
    return s.replace(target_cache=cache.rewind(s.seq_lens - 1)), logits.sum()

  def propose_and_ar_step(s, i):
    """A proposal and an AR step that do not depend on each other: what they cost together beyond their
    sum is what the draft's weights and cache cost the target in evicted CPU caches."""
    s, value = propose(s, i)
    s = decode.autoregressive_step(decoder, s)
    return s, value + s.seq_lens.sum()

  # Each part returns (state, a value that depends on all its work), so XLA cannot drop any of it; the
  # parts rewind to where they started, so every iteration does the same work.
  with_lengths = lambda s: (s, s.seq_lens.sum())
  parts = {
      "round": lambda s, i: with_lengths(decode.speculative_step(decoder, s)),
      "ar_step": lambda s, i: with_lengths(decode.autoregressive_step(decoder, s)),
      "verify_step": lambda s, i: with_lengths(decode.verify_step(decoder, s, fixed, keys[0])),
      "propose": propose, "verify_forward": verify_forward, "propose_and_ar_step": propose_and_ar_step}

  def timed(fn):
    def body(i, carry):
      s, acc = carry
      s, value = fn(s, i)
      return s, acc + value
    run = jax.jit(lambda s: lax.fori_loop(0, 32, body, (s, jnp.zeros((), jnp.float32)))[1])
    return lambda: jax.block_until_ready(run(state))
  t = {k: v / 32 * 1e3 for k, v in interleaved({k: timed(f) for k, f in parts.items()}, repeats).items()}
  rest = t["round"] - t["propose"] - t["verify_forward"]
  return {"drafter": kind, "draft_len": draft_len, "batch": batch, "used": used, "ms": t,
          "round_in_ar_steps": t["round"] / t["ar_step"], "overhead_ms": rest,
          "overhead_in_ar_steps": rest / t["ar_step"],
          # of which: acceptance, commit, statistics and the drafter's bookkeeping after the forward
          "verify_logic_ms": t["verify_step"] - t["verify_forward"],
          "interference_ms": t["propose_and_ar_step"] - t["propose"] - t["ar_step"]}


def drafter_cost_ratio(target, draft, kind: str, repeats: int, used: int = 200, batch: int = 1) -> float:
  """c for any drafter: one proposal (K = 1) over one target step, `batch` rows of `used` tokens.

  Both run 32 times in a jitted loop whose inputs move with the loop index, so nothing is hoisted.
  """
  decoder, state = started(target, draft, kind, 1, batch, used)
  tparams, lens = decoder.target_params, state.seq_lens
  keys = jnp.zeros((1, batch, 2), jnp.uint32)

  # Caches are carried through the loop and donated, as in the decode loop, so no step pays a copy.
  @functools.partial(jax.jit, donate_argnums=0)
  def propose_loop(dstate):
    def body(i, carry):
      acc, dstate = carry
      dstate, proposal = decoder.drafter.propose(decoder.drafter_params, tparams, dstate, state.tokens,
                                                 lens - i % 2, keys, state.sampling)
      return acc + proposal.logits_BxKxV[0, 0, 0], dstate
    return lax.fori_loop(0, 32, body, (jnp.zeros(()), dstate))

  @functools.partial(jax.jit, donate_argnums=0)
  def target_loop(cache):
    def body(i, carry):
      acc, cache = carry
      pos = lens[:, None] - 1 - i % 2
      logits, _, cache = model.forward(tparams, state.tokens[:, :1], pos, cache.rewind(pos[:, 0]), target.config)
      return acc + logits[0, 0, 0], cache
    return lax.fori_loop(0, 32, body, (jnp.zeros(()), cache))

  carried = jax.tree.map(jnp.copy, {"draft": state.drafter_state, "target": state.target_cache})  # to donate

  def run(name, fn):
    acc, carried[name] = fn(carried[name])
    jax.block_until_ready(acc)

  t = interleaved({"draft": lambda: run("draft", propose_loop), "target": lambda: run("target", target_loop)},
                  repeats)
  return t["draft"] / t["target"]


def suite_cost(pair: shipped.Pair, repeats: int, kinds: list[str], write: bool, batches: list[int],
               draft_len: int = 4) -> dict:
  """Each shipped drafter's cost model on the shipped target at each batch size: c
  (`drafter_cost_ratio`), v from the verify of K+1 tokens a row against one, and o, what a round
  (`suite_round`) costs beyond 1 + K (c + v). `write` stores them in the checkpoints (`cost_model.json`),
  where the API and CLI read them: batch 1's as the cost model, the others as its `batches`."""
  target = jspec.load(pair.target)
  batches = sorted({1, *batches})  # batch 1's is the cost model itself
  v = {b: (verify_ratio(target, b, draft_len, repeats) - 1) / draft_len for b in batches}
  out = {}
  for kind in kinds:
    _, draft = shipped_pair(pair, kind)
    measured = {}
    for b in batches:
      c = drafter_cost_ratio(target, draft, kind, repeats, batch=b)
      round_cost = suite_round(pair, repeats, kind, draft_len, batch=b)["round_in_ar_steps"]
      measured[b] = CostModel(round(c, 4), round(v[b], 4), round(max(round_cost - 1 - draft_len * (c + v[b]), 0.0), 4))
      out.setdefault(kind, {})[b] = {"cost_ratio": measured[b].cost_ratio, "verify_cost": measured[b].verify_cost,
                                     "round_overhead": measured[b].round_overhead, "round_in_ar_steps": round_cost}
      print(json.dumps({kind: {b: out[kind][b]}}), file=sys.stderr)
    cost = dataclasses.replace(measured[1], target_params=num_params(target.config),
                               batches=tuple((b, m) for b, m in measured.items() if b != 1))
    if write:
      where = pair.drafts.get(kind, pair.target)  # n-gram's cost model lives with the target
      models = checkpoint.read_cost_models(where)
      if kind in models:  # a measured tree shape stays
        cost = dataclasses.replace(cost, tree_top_k=models[kind].tree_top_k, tree_nodes=models[kind].tree_nodes)
      checkpoint.write_cost_models(where, {**models, kind: cost})
  return {"draft_len": draft_len, "target_params": num_params(target.config), "written": write,
          "cost_models": out}


def peak_memory_mb() -> float | None:
  """Peak memory since the last `reset_peak_memory`: device memory on accelerators, RSS on the CPU."""
  stats = jax.devices()[0].memory_stats() or {}
  if "peak_bytes_in_use" in stats:
    return stats["peak_bytes_in_use"] / 2 ** 20
  try:
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
      if line.startswith("VmHWM:"):
        return int(line.split()[1]) / 1024
  except OSError:
    pass
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def reset_peak_memory() -> None:
  """Linux resets the RSS high-water mark on writing 5 to clear_refs; elsewhere the peak is process-wide."""
  try:
    pathlib.Path("/proc/self/clear_refs").write_text("5")
  except OSError:
    pass


class Progress:
  """A one-line progress bar on stderr: cells done, the current cell, and the time left at this pace."""

  def __init__(self, total: int):
    self.total, self.done, self.start = total, 0, time.perf_counter()

  def step(self, label: str) -> None:
    elapsed = time.perf_counter() - self.start
    eta = elapsed / self.done * (self.total - self.done) if self.done else 0.0
    bar = "#" * (20 * self.done // self.total)
    print(f"\r[{bar:<20}] {self.done}/{self.total} {label:<34} {elapsed / 60:5.1f} min, ~{eta / 60:.1f} left",
          end="", file=sys.stderr, flush=True)
    self.done += 1

  def close(self) -> None:
    print(file=sys.stderr)


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


def verify_ratio(target, batch: int, k: int, repeats: int, used: int = 200) -> float:
  """A forward of K+1 tokens per row over one of 1 token, batch rows, `used` tokens in the cache: 1 + K v
  in the cost model's terms."""
  tparams = model.with_head(target.params)
  one, _ = step_loop(tparams, target.config, batch, 512, used, 1, True)
  wide, _ = step_loop(tparams, target.config, batch, 512, used, k + 1, True)
  t = interleaved({"one": one, "wide": wide}, repeats)
  return t["wide"] / t["one"]


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
    row["predicted_speedup"] = None if row["alpha"] is None else float(
        adaptive.expected_speedup(jnp.full((k,), row["alpha"]), c, v)[-1])  # Leviathan's bound
    row["engine_efficiency"] = None if row["alpha"] is None else row["decode_speedup"] / row["predicted_speedup"]
    row["round_cost_predicted"] = 1 + k * (c + v)
    out["cells"].append(row)
    save(out)
    engine.release_executables()
  progress.close()
  return out


def suite_adaptive(target, draft, kind: str, max_new: int, repeats: int, prompts_per_set: int) -> dict:
  """Adaptive K (K_max 6) against every fixed K on code, and fallback on prose, each against AR, batch 1,
  greedy, interleaved per prompt, with the drafter's measured cost model (from its checkpoint)."""
  variants = {f"fixed{k}": dict(draft_len=k, spec=SpecConfig(drafter=kind, adaptive=None)) for k in (2, 3, 4, 5, 6)}
  variants["adaptive"] = dict(draft_len=6, spec=SpecConfig(drafter=kind, adaptive=AdaptiveConfig()))
  variants["adaptive_no_fallback"] = dict(draft_len=6, spec=SpecConfig(
      drafter=kind, adaptive=AdaptiveConfig(fallback_threshold=0.0)))
  cost = pairing.make_decoder(target, draft, variants["adaptive"]["spec"], 1).spec.adaptive.cost
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


def suite_defaults(pair: shipped.Pair, max_new: int, repeats: int, count: int,
                   draft_lens: tuple[int, ...] = (), other_drafters: tuple[str, ...] = ()) -> dict:
  """What a user gets: `jspec.generate` with every default (the default drafter and its shipped weights,
  adaptive speculation with the checkpoint's cost model), greedy, against plain decoding, interleaved per
  batch of prompts: each held-out code and English prose prompt alone, and held-out code in batches of 4.
  Every row decodes `max_new` tokens (EOS ignored), so both sides do the same work. Each of `draft_lens`
  is also timed as the longest draft in the same interleaving (what another default `draft_len` would give),
  and each of `other_drafters` with its shipped weights and otherwise default settings (another default
  drafter)."""
  target, draft = shipped_pair(pair, shipped.DEFAULT_DRAFTER)
  kw = dict(max_new_tokens=max_new, ignore_eos=True)
  variants = {"spec": dict(draft=draft), **{f"spec_k{k}": dict(draft=draft, draft_len=k) for k in draft_lens},
              **{f"spec_{kind}": dict(draft=shipped_pair(pair, kind)[1], spec=SpecConfig(drafter=kind))
                 for kind in other_drafters}}
  others = [f"k{k}" for k in draft_lens] + list(other_drafters)
  out = {"drafter": shipped.DEFAULT_DRAFTER, "max_new_tokens": max_new, "runs": {}}
  for name, batch in (("code", 1), ("prose", 1), ("code", 4)):
    prompts = PROMPT_SETS[name](count)
    rows, last = [], {}
    for group in (prompts[i:i + batch] for i in range(0, len(prompts), batch)):
      run = lambda name, g=group, **extra: last.__setitem__(name, jspec.generate(target, g, **kw, **extra))
      fns = {"ar": lambda: run("ar"), **{v: lambda v=v: run(v, **variants[v]) for v in variants}}
      t = interleaved(fns, repeats)
      ar, spec = last["ar"], last["spec"]
      rows.append({"prompts": len(group), "speedup": t["ar"] / t["spec"], "tau": spec.stats.mean_accepted_length,
                   "acceptance_rate": spec.stats.acceptance_rate, "plain_forwards": spec.stats.plain_forwards,
                   "draft_len_counts": spec.stats.draft_len_counts,
                   "greedy_identical": all(last[v].token_ids == ar.token_ids for v in variants),
                   **{f"speedup_{x}": t["ar"] / t[f"spec_{x}"] for x in others},
                   **{f"tau_{kind}": last[f"spec_{kind}"].stats.mean_accepted_length for kind in other_drafters}})
      print(json.dumps({"set": name, "batch": batch, **rows[-1]}), file=sys.stderr)
    summary = lambda key: {f"median_{key}": statistics.median(r[key] for r in rows),
                           f"min_{key}": min(r[key] for r in rows), f"max_{key}": max(r[key] for r in rows)}
    out["runs"][f"{name}_batch{batch}"] = {"set": name, "batch": batch, "rows": rows, **summary("speedup"),
                                           **{k: v for x in others for k, v in summary(f"speedup_{x}").items()}}
  return out


def suite_stream(pair: shipped.Pair, kind: str, max_new: int, repeats: int, prompts_per_set: int) -> dict:
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


def varied_heldout_prompts(count: int, seed: int = 0) -> list[str]:
  """Held-out code cut at random lines, with 100 to 1,500 characters of context: prompts of mixed lengths,
  some close enough to the end of their file that the target ends them (EOS) early."""
  rng = np.random.default_rng(seed)
  texts = [t for t in data.read_texts("heldout") if t.count("\n") > 10]
  prompts = []
  while len(prompts) < count:
    lines = texts[rng.integers(len(texts))].splitlines(keepends=True)
    cut = int(rng.integers(5, len(lines)))
    prompts.append("".join(lines[:cut])[-int(rng.integers(100, 1500)):])
  return prompts


def suite_batching(pair: shipped.Pair, kind: str, max_new: int, repeats: int, count: int, slots: int = 8) -> dict:
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


def suite_tree(pair: shipped.Pair, kinds: list[str], chain_lens: list[int], batches: list[int], max_new: int,
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
      engine.release_executables()
    trees = [c for c in out["cells"] if c["drafter"] == kind and c["tree"] and c["batch"] == min(batches)]
    out.setdefault("fastest_tree", {})[kind] = max(trees, key=lambda c: c["speedup"])["tree"]
    if write:
      where = pair.drafts[kind]
      models = checkpoint.read_cost_models(where)
      measured = models.get(kind, CostModel(CostModel.neutral(kind).cost_ratio,
                                            target_params=num_params(target.config)))
      models[kind] = dataclasses.replace(measured, tree_top_k=out["fastest_tree"][kind]["top_k"],
                                         tree_nodes=out["fastest_tree"][kind]["nodes"])
      checkpoint.write_cost_models(where, models)
  return out


PROMPT_SETS = {"code": heldout_prompts, "edit": edit_prompts, "prose": prose_prompts}


def floats(text: str) -> list[float]:
  return [float(x) for x in text.split(",")]


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--suite", choices=["sweep", "step", "loop", "adaptive", "round", "prefill", "cost", "stream",
                                     "batching", "tree", "defaults"],
                  default="sweep")
  ap.add_argument("--write", action="store_true",
                  help="--suite cost: store the cost models in the checkpoints; --suite tree: the fastest tree shapes")
  ap.add_argument("--quick", action="store_true", help="a smoke run of the sweep on tiny random models (CI)")
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--prompts", type=int, default=8, help="prompts per set")
  ap.add_argument("--max-new-tokens", type=int, default=64)
  ap.add_argument("--draft-lens", default="1,2,3,4,5,6,7,8")
  ap.add_argument("--temperatures", default="0,0.7,1.0")
  ap.add_argument("--batches", default="1,4,8")
  ap.add_argument("--drafters", default="model,medusa,eagle,ngram")
  ap.add_argument("--also-draft-lens", default="",
                  help="--suite defaults: also time these longest drafts (other defaults for --draft-len)")
  ap.add_argument("--also-drafters", default="",
                  help="--suite defaults: also time these drafters with their shipped weights (other defaults)")
  ap.add_argument("--tree-depth", type=int, default=4, help="--suite tree: the trees' depth")
  ap.add_argument("--tree-shapes", default="2x8,4x16,4x32", help="--suite tree: top-k x nodes of each tree")
  ap.add_argument("--prompt-sets", default="code",
                  help="comma-separated: code (held-out completions), edit (context editing), prose (English)")
  ap.add_argument("--with-hf", action="store_true",
                  help="also run Hugging Face transformers' assisted generation on the shipped pair (needs [interop])")
  ap.add_argument("--pair", choices=list(shipped.PAIRS), default=shipped.DEFAULT.name,
                  help="the shipped target and drafters to measure")
  ap.add_argument("--out", default="bench-out", help="directory for bench.json, bench.md and the plots")
  args = ap.parse_args()
  out_dir = pathlib.Path(args.out)
  out_dir.mkdir(parents=True, exist_ok=True)
  ints = lambda text: [int(x) for x in text.split(",")]
  pair = shipped.PAIRS[args.pair]
  if args.quick:
    target = testing.random_model(testing.TINY, scale=2.0)
    drafts = {"model": testing.perturbed(target, 0.3), "ngram": None}
    result = {"sets": {"quick": suite_sweep(target, drafts, ["def f(x):", "import os\n"], [2], [0.0, 1.0],
                                            [1, 2], 16, 1)}}
  elif args.suite == "step":
    result = suite_step(args.repeats)
  elif args.suite == "loop":
    result = suite_loop(args.repeats)
  elif args.suite == "prefill":
    result = suite_prefill(pair, args.repeats)
  elif args.suite == "round":
    result = {"rounds": [suite_round(pair, args.repeats, kind) for kind in args.drafters.split(",")]}
  elif args.suite == "cost":
    result = suite_cost(pair, args.repeats, args.drafters.split(","), args.write, ints(args.batches))
  elif args.suite == "adaptive":
    kind = args.drafters.split(",")[0]
    result = suite_adaptive(*shipped_pair(pair, kind), kind, args.max_new_tokens, args.repeats, args.prompts)
  elif args.suite == "stream":
    result = suite_stream(pair, args.drafters.split(",")[0], args.max_new_tokens, args.repeats, args.prompts)
  elif args.suite == "tree":
    result = suite_tree(pair, args.drafters.split(","), ints(args.draft_lens), ints(args.batches),
                        args.max_new_tokens, args.repeats, args.prompts, args.write, args.tree_depth,
                        tuple(tuple(ints(shape.replace("x", ","))) for shape in args.tree_shapes.split(",")))
  elif args.suite == "defaults":
    result = suite_defaults(pair, args.max_new_tokens, args.repeats, args.prompts,
                            tuple(ints(args.also_draft_lens)) if args.also_draft_lens else (),
                            tuple(args.also_drafters.split(",")) if args.also_drafters else ())
  elif args.suite == "batching":
    result = suite_batching(pair, args.drafters.split(",")[0], args.max_new_tokens, args.repeats, args.prompts)
  else:
    target = jspec.load(pair.target)
    drafts = {kind: shipped_pair(pair, kind)[1] for kind in args.drafters.split(",")}
    result = {"sets": {}}
    for name in args.prompt_sets.split(","):
      print(f"prompt set {name}", file=sys.stderr)

      def save(sweep, name=name):
        result["sets"][name] = sweep
        (out_dir / "bench.json").write_text(json.dumps({"partial": True, **result}, indent=2))
      result["sets"][name] = suite_sweep(target, drafts, PROMPT_SETS[name](args.prompts), ints(args.draft_lens),
                                         floats(args.temperatures), ints(args.batches), args.max_new_tokens,
                                         args.repeats, save)
    if args.with_hf:
      import bench_hf
      result["hf"] = bench_hf.compare(pair.target, pair.drafts["model"],
                                      PROMPT_SETS["code"](args.prompts), args.max_new_tokens, args.repeats,
                                      out_dir / "hf")
  result = {"suite": "quick" if args.quick else args.suite, "command": " ".join(sys.argv), "jax": jax.__version__,
            "device": str(jax.devices()[0].device_kind), "machine": machine(), **result}
  (out_dir / "bench.json").write_text(json.dumps(result, indent=2))
  if result["suite"] in ("sweep", "quick"):
    import bench_report
    (out_dir / "bench.md").write_text(bench_report.markdown(result))
    bench_report.plots(result, out_dir)
  print(json.dumps({k: v for k, v in result.items() if k not in ("sets",)}, indent=2))
  plots = ", bench.md and plots" if result["suite"] in ("sweep", "quick") else ""
  print(f"wrote {out_dir}/bench.json{plots}", file=sys.stderr)
  return 0


def machine() -> dict:
  """What the numbers were measured on."""
  import os
  import platform
  cpu = platform.processor() or platform.machine()
  try:
    cpu = next(x.split(":", 1)[1].strip() for x in open("/proc/cpuinfo") if x.startswith("model name"))
  except (OSError, StopIteration):
    pass
  return {"platform": platform.platform(), "processor": cpu, "cpus": os.cpu_count(),
          "python": platform.python_version(), "backend": jax.default_backend(), "devices": len(jax.devices())}

if __name__ == "__main__":
  raise SystemExit(main())
