"""A prepared accelerator check: one command, one JSON file, under 8 minutes on one H100/H200-class GPU.

  python -m jspec.bench --suite gpu --out gpu-check      # on a machine with one GPU, no network
  python -m jspec.bench --suite gpu --smoke --out check  # tiny shapes, any backend (the tests run it)
  python -m jspec.bench --suite gpu --compile-for gpu:h100:1  # its programs compiled here for an H100, none run

Sections, each timed and recorded even when a later one fails or the budget runs out:
- lossless: the losslessness checks that matter, on this device: greedy speculative decoding equals plain
  decoding and the target's full-forward argmax; the exact law of the first two sampled tokens on an 8-token
  vocabulary; the cached forward in chunks equals the full forward;
- kernel: this platform's Pallas attention kernel (the GPU's, interpreted, on a CPU) against the reference
  loop over chains, trees, windows, softcaps and a prefill, fp32 and bf16;
- target: plain decoding of a Llama-3-8B-shaped random bf16 target, ms per token, against the
  weight-streaming bound (its weights' bytes over this device's measured copy bandwidth), with the kernel
  (the default on a GPU) and with the XLA loop;
- verify: a forward of N = 1..64 tokens per row over one of 1 token, on that target;
- rounds: a speculative round with a Llama-3.2-1B-shaped random draft, K = 2..8, in target steps;
- shipped: the default shipped pair's speedup with the default settings (greedy, batch 1; with --smoke the
  small pair), interleaved medians; the two runs' tokens must be the same.
"""
from __future__ import annotations

import dataclasses
import sys
import time
import traceback
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jspec
from jspec import testing
from jspec.core import shipped
from jspec.core.settings import SpecConfig
from jspec.core.timing import interleaved
from jspec.decoding import loop, programs
from jspec.decoding.batches import make_batch
from jspec.decoding.decoder import Decoder, make_decoder
from jspec.model import cache as kvcache
from jspec.model import model
from jspec.model.config import ModelConfig, num_params
from jspec.model.kernels import pallas_attention
from jspec.planning import accelerators, shaped
from jspec.planning.calibration import round_and_step, step_loop
from jspec.text.tokenizer import byte_tokenizer

LLAMA3_8B = ModelConfig(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
                        mlp_dim=14336, rope_theta=500000.0, tie_embeddings=False, max_seq_len=8192,
                        dtype="bfloat16")
LLAMA32_1B = dataclasses.replace(LLAMA3_8B, dim=2048, n_layers=16, head_dim=64, mlp_dim=8192, tie_embeddings=True)
SMOKE_TARGET = dataclasses.replace(testing.TINY, eos_id=None)
SMOKE_DRAFT = dataclasses.replace(SMOKE_TARGET, n_layers=1)
TOKENIZER = byte_tokenizer()  # random models need one only to be paired: the same object for both


def lossless(smoke: bool) -> dict:
  target = testing.random_model(SMOKE_TARGET, seed=0, scale=2.0)
  draft = testing.perturbed(target, 0.5)
  prompts = [[1, 2, 3], [7] * 9, list(range(40, 60))]
  plain = jspec.generate(target, prompts, max_new_tokens=32)
  fixed = SpecConfig(draft_len=4, adaptive=None)  # every round verifies: what the checks are about
  spec = jspec.generate(target, prompts, draft=draft, max_new_tokens=32, spec=fixed)
  argmax_ok = True
  for p, ids in zip(prompts, spec.token_ids):
    try:
      testing.assert_target_argmax(target, p, ids)
    except AssertionError:
      argmax_ok = False
  small = dataclasses.replace(SMOKE_TARGET, vocab_size=8)
  small_target = testing.random_model(small, seed=0, scale=1.0)
  draws = 300 if smoke else 4000
  tv, bound, stats = testing.two_token_tv(small_target, [1, 5, 2], (1.0, 0, 1.0), draws,
                                          draft=testing.perturbed(small_target, 1.0, seed=4),
                                          spec=dataclasses.replace(fixed, draft_len=3))
  # The cached forward, fed in chunks of 3 over a ragged batch, against the full forward.
  params = model.init_params(SMOKE_TARGET, jax.random.PRNGKey(0))
  tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 40), 0, SMOKE_TARGET.vocab_size)
  full, _ = model.forward_full(params, tokens, SMOKE_TARGET)
  cache = kvcache.init_cache(SMOKE_TARGET, 2, 128)
  forward = jax.jit(model.forward, static_argnums=4)  # one program for every chunk
  worst = 0.0
  for start in range(0, 39, 3):
    pos = jnp.broadcast_to(jnp.arange(start, start + 3), (2, 3))
    logits, _, cache = forward(params, tokens[:, start:start + 3], pos, cache, SMOKE_TARGET)
    worst = max(worst, float(jnp.abs(logits - full[:, start:start + 3]).max()))
  return {"greedy_speculative_equals_plain": spec.token_ids == plain.token_ids,
          "greedy_equals_full_forward_argmax": argmax_ok,
          "two_token_tv": tv, "two_token_tv_bound": bound, "two_token_law_exact": tv < bound,
          "acceptance_rate": stats.acceptance_rate, "cached_forward_max_error": worst,
          "cached_forward_matches": worst < 1e-4}


def bandwidth_gb_s(smoke: bool) -> float:
  """Device memory bandwidth: a jitted copy of a large buffer (read once, written once)."""
  x = jnp.ones((2 ** (20 if smoke else 30),), jnp.bfloat16)
  copy = jax.jit(lambda x: x * 1)
  t = interleaved({"copy": lambda: jax.block_until_ready(copy(x))}, 1 if smoke else 5)["copy"]
  return 2 * x.nbytes / t / 1e9


def init_on_device(config: ModelConfig, seed: int) -> dict:
  """Random parameters created on the device (no host copy)."""
  return jax.jit(lambda k: model.init_params(config, k))(jax.random.PRNGKey(seed))


def _plain_batch(decoder: Decoder, smoke: bool):
  """The target section's request: 128 prompt tokens, 128 new (16 and 16 with --smoke)."""
  prompt, new = [list(range(1, 129 if not smoke else 17))], 128 if not smoke else 16
  return make_batch(decoder, prompt, new, ignore_eos=True)


def _plain_decode(m: jspec.Model, attention: str, smoke: bool) -> dict[str, Any]:
  """Timed calls of one plain decoding executable: 'decode' (128 tokens) and 'first' (prefill and one)."""
  decoder = make_decoder(m, None, None, 1, attention=attention)
  batch = _plain_batch(decoder, smoke)
  new = int(batch.max_new_tokens_B[0])
  executable, compile_s = programs.compiled_run(decoder, batch)
  first = batch.replace(max_new_tokens_B=np.asarray([1], np.int32))  # prefill and one step: the same program
  return {"decode": lambda: jax.block_until_ready(executable(decoder, batch)),
          "first": lambda: jax.block_until_ready(executable(decoder, first)), "new": new, "compile_s": compile_s}


def target_section(config: ModelConfig, params, smoke: bool) -> dict:
  """Plain decoding with this platform's attention (its Pallas kernel on a GPU or TPU) against the bound;
  where there is a kernel, the XLA loop's time beside it."""
  bw = bandwidth_gb_s(smoke)
  m = jspec.Model(config, params, TOKENIZER)
  kernel = make_decoder(m, None, None, 1).kernel(config.head_dim)
  runs = {name: _plain_decode(m, name, smoke) for name in (("auto", "xla") if kernel else ("auto",))}
  t = interleaved({f"{name} {part}": run[part] for name, run in runs.items() for part in ("decode", "first")},
                  1 if smoke else 3)
  ms = {name: (t[f"{name} decode"] - t[f"{name} first"]) / (run["new"] - 1) * 1e3 for name, run in runs.items()}
  weight_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
  bound = weight_bytes / (bw * 1e9) * 1e3
  out = {"params": num_params(config), "dtype": config.dtype, "bandwidth_gb_s": bw,
         "attention": pallas_attention.attention_name(kernel),
         "ar_ms_per_token": ms["auto"], "weight_streaming_bound_ms": bound, "bound_over_measured": bound / ms["auto"],
         "compile_seconds": runs["auto"]["compile_s"]}
  if kernel is not None:
    out.update(ar_ms_per_token_xla_loop=ms["xla"], kernel_speedup_over_xla_loop=ms["xla"] / ms["auto"])
  return out


KERNEL_TOLERANCE = {"float32": 2e-5, "bfloat16": 3e-2}


def kernel_section(smoke: bool) -> dict:
  """This platform's attention kernel (interpreted where there is none: the GPU's) against the reference
  loop on this device over `testing.ATTENTION_CASES`, in fp32 (full-precision matmuls) and bf16: the largest
  difference from the fp32 reference per case."""
  kernel = (Decoder(None).kernel(testing.ATTENTION_HEAD_DIM) or pallas_attention.Kernel("gpu", interpret=True))
  errors = {}
  with jax.default_matmul_precision("highest"):
    for case in (("chain",) if smoke else testing.ATTENTION_CASES):
      options = testing.ATTENTION_CASES[case]
      ref = testing.attention_case(None, jnp.float32, **options)
      errors[case] = {str(np.dtype(d)): float(jnp.abs(testing.attention_case(kernel, d, **options) - ref).max())
                      for d in (jnp.float32, jnp.bfloat16)}
  return {"kernel": kernel.backend + (" (interpreted)" if kernel.interpret else ""), "max_error": errors,
          "tolerance": KERNEL_TOLERANCE,
          "within_tolerance": all(e <= KERNEL_TOLERANCE[d] for row in errors.values() for d, e in row.items())}


def verify_section(config: ModelConfig, params, smoke: bool) -> dict:
  ns = (1, 2, 4, 8) if smoke else (1, 2, 4, 8, 16, 32, 64)
  fns = {n: step_loop(model.with_head(params), config, 1, 512, 256, n, True, steps=8)[0] for n in ns}
  t = interleaved(fns, 1 if smoke else 3)
  return {"verify_over_step": {n: t[n] / t[1] for n in ns}}


ROUND_PROMPT, ROUND_CAPACITY = 256, 512  # the rounds section's request: a prompt of 256 tokens, 512 slots


def _draft_lens(smoke: bool) -> tuple[int, ...]:
  return (2,) if smoke else (2, 4, 8)


def rounds_section(target_config: ModelConfig, target_params, draft_config: ModelConfig, smoke: bool) -> dict:
  target = jspec.Model(target_config, target_params, TOKENIZER)
  draft = jspec.Model(draft_config, init_on_device(draft_config, 1), TOKENIZER)
  out = {"draft_params": num_params(draft_config), "round_in_target_steps": {}}
  prompt = np.random.default_rng(0).integers(0, target_config.vocab_size, (1, ROUND_PROMPT)).tolist()
  for k in _draft_lens(smoke):
    decoder = make_decoder(target, draft, SpecConfig(k, drafter="model", adaptive=None), 1)
    batch = make_batch(decoder, prompt, 1, ignore_eos=True, capacity_slots=ROUND_CAPACITY)
    state = jax.jit(loop.start)(decoder, batch.replace(max_new_tokens_B=np.full((1,), 10 ** 6, np.int32)))
    t = interleaved(round_and_step(decoder, state, steps=8), 1 if smoke else 3)
    out["round_in_target_steps"][k] = t["round"] / t["step"]
  return out


def shipped_section(smoke: bool) -> dict:
  pair = shipped.SMALL if smoke else shipped.DEFAULT
  target, draft = jspec.load(pair.target), jspec.load(pair.drafts["model"])
  prompt = ["def parse_args(argv):\n"]
  new = 16 if smoke else 128
  kw = dict(max_new_tokens=new, ignore_eos=True)
  tokens = {}

  def run(name, **extra):
    return lambda: tokens.__setitem__(name, jspec.generate(target, prompt, **kw, **extra).token_ids)
  t = interleaved({"plain": run("plain"), "speculative": run("speculative", draft=draft)}, 1 if smoke else 3)
  return {"speedup": t["plain"] / t["speculative"], "greedy_identical": tokens["plain"] == tokens["speculative"],
          "max_new_tokens": new}


def _configs(smoke: bool) -> tuple[ModelConfig, ModelConfig]:
  """The target and draft shapes: Llama-3-8B and Llama-3.2-1B (tiny ones with --smoke), bf16."""
  if smoke:
    return dataclasses.replace(SMOKE_TARGET, dtype="bfloat16"), dataclasses.replace(SMOKE_DRAFT, dtype="bfloat16")
  return LLAMA3_8B, LLAMA32_1B


def compiled_for(where: str, smoke: bool) -> dict:
  """The check's target and rounds programs compiled here for `where` (`gpu:h100:1`: a GPU that is not here)
  with abstract weights, nothing run (`jspec.planning.accelerators`): plain decoding of the target section's
  request with this platform's attention and with the XLA loop, and the rounds section's speculative rounds
  for each K, each with XLA's memory per device and the roofline estimates. A lent GPU then runs programs
  known to compile for it."""
  target = accelerators.Target.parse(where)
  target_config, draft_config = _configs(smoke)
  shapes = lambda c: jspec.Model(c, jax.eval_shape(lambda k: model.init_params(c, k), jax.random.PRNGKey(0)),
                                 TOKENIZER)
  models = shapes(target_config), shapes(draft_config)
  out = {"compiled_for": str(target), "smoke": smoke, "plain": {}, "rounds": {}}
  begin = time.perf_counter()
  for attention in ("auto", "xla"):
    decoder = shaped.shaped_decoder(models[0], None, None, 1, attention)
    batch = _plain_batch(decoder, smoke)
    r = accelerators.compile_for(target, decoder, 1, batch.prompts_BxP.shape[1], batch.capacity)
    out["plain"][attention] = {"attention": r.attention, "total_bytes": r.program.total_bytes,
                               "estimated_plain_step_s": r.plain_step_s}
  for k in _draft_lens(smoke):
    decoder = shaped.shaped_decoder(*models, SpecConfig(k, drafter="model", adaptive=None), 1)
    r = accelerators.compile_for(target, decoder, 1, ROUND_PROMPT, ROUND_CAPACITY)
    out["rounds"][k] = {"total_bytes": r.program.total_bytes, "estimated_round_in_target_steps": r.round_cost}
  out["seconds"] = time.perf_counter() - begin
  return out


def check(smoke: bool, budget: float, save) -> dict:
  """Runs each section in turn, recording its result (or its error) and its seconds, and calling
  `save(result)` after each; sections past `budget` seconds are skipped."""
  start = time.perf_counter()
  result = {"device": str(jax.devices()[0].device_kind), "backend": jax.default_backend(), "jax": jax.__version__,
            "smoke": smoke, "sections": {}}
  target_config, draft_config = _configs(smoke)
  state = {}

  def target_params():
    if "params" not in state:
      state["params"] = init_on_device(target_config, 0)
    return state["params"]

  sections = {
      "lossless": lambda: lossless(smoke),
      "kernel": lambda: kernel_section(smoke),
      "target": lambda: target_section(target_config, target_params(), smoke),
      "verify": lambda: verify_section(target_config, target_params(), smoke),
      "rounds": lambda: rounds_section(target_config, target_params(), draft_config, smoke),
      "shipped": lambda: shipped_section(smoke)}
  for name, run in sections.items():
    if time.perf_counter() - start > budget:
      result["sections"][name] = {"skipped": f"over the {budget:.0f} s budget"}
      continue
    t0 = time.perf_counter()
    try:
      result["sections"][name] = run()
    except Exception as e:  # a failed section is recorded; the others still run
      result["sections"][name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2000:]}
    result["sections"][name]["seconds"] = time.perf_counter() - t0
    save(result)
    print(f"{name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
  result["seconds"] = time.perf_counter() - start
  result["ok"] = all("error" not in s for s in result["sections"].values())
  return result
