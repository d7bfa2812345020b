"""`python -m jspec.plan`: what a deployment needs in memory on each device, whether it fits, and the largest
batch and context that do, from model directories or bare config files (no weights read).

Parsing imports no JAX, so `--help` answers at once. User errors: one line on stderr, exit 2.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys

from jspec import flags
from jspec.core.settings import MAX_DRAFT_LEN, SpecConfig
from jspec.model.cache import PAGE_SIZE

EXAMPLES = """examples:
  python -m jspec.plan --batch-size 8 --context 2048
  python -m jspec.plan --target llama-70b/config.json --draft llama-1b/config.json --drafter model \\
      --dtype bfloat16 --mesh model=2 --device-memory 80GB --batch-size 64 --context 8192
"""
UNITS = {"": 1, "B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "TB": 10 ** 12, "KIB": 2 ** 10,
         "MIB": 2 ** 20, "GIB": 2 ** 30, "TIB": 2 ** 40}


def parse_bytes(text: str) -> int:
  """"80GB", "80 GiB", "1.5e9": bytes."""
  match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", text)
  unit = match and match.group(2).upper()
  try:
    value = float(match.group(1)) * UNITS[unit] if match else -1
  except (KeyError, ValueError):
    value = -1
  if value <= 0:
    raise ValueError(f"--device-memory: expected a size such as 80GB or 24GiB, got {text!r}")
  return int(value)


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m jspec.plan", formatter_class=flags.Formatter, epilog=EXAMPLES,
                              description="The memory a speculative deployment needs per device: target and "
                                          "draft weights, both KV caches and the workspace.")
  flags.add_model_args(p, config_files=True)
  g = p.add_argument_group("deployment")
  g.add_argument("--draft-len", type=int, default=4, metavar="K", help="the longest draft a round verifies")
  g.add_argument("--suffix-cache-tokens", type=int, default=SpecConfig().suffix_cache_tokens, metavar="N",
                 help="with --drafter suffix: the tokens its index holds")
  g.add_argument("--batch-size", type=int, default=1, metavar="B", help="rows decoded together")
  g.add_argument("--context", type=int, default=None, metavar="N",
                 help="tokens a row holds, prompt and output (default: the model's context)")
  g.add_argument("--prompt-len", type=int, default=None, metavar="P",
                 help="prompt tokens per row, prefilled together (default: half the context)")
  g.add_argument("--serving", action="store_true",
                 help="plan a server (python -m jspec.serve --max-model-len CONTEXT --batch-size B): any prompt up "
                      "to the context, prefilled one request at a time, and the pages of its paged KV cache")
  g.add_argument("--mean-len", type=int, default=None, metavar="N",
                 help="with --serving: the mean tokens a request holds, for the rows the pages hold at once "
                      "(default: half the context)")
  g.add_argument("--mesh", default=None, metavar="SPEC", help="data=D,model=M: the devices it is sharded over")
  g.add_argument("--replicate-draft", action="store_true", help="with --mesh: the drafter unsharded")
  g.add_argument("--device-memory", default=None, metavar="SIZE",
                 help="memory per device, e.g. 80GB (default: the devices here; on the CPU the memory "
                      "available to this process)")
  g.add_argument("--memory-fraction", type=float, default=1.0, metavar="F",
                 help="share of each device's memory the deployment may use")
  g.add_argument("--compile-for", default=None, metavar="tpu:CHIP:TOPOLOGY|gpu:CHIP:COUNT",
                 help="also compile the decode program for this TPU topology (e.g. tpu:v5e:2x4; chips: v4, v5e, "
                      "v5p, v6e; needs libtpu: pip install -e \".[tpu]\") or these NVIDIA GPUs on one host (e.g. "
                      "gpu:h100:2; chips: h100, h200, a100, b200, l4; needs the CUDA compiler: pip install -e "
                      "\".[gpu-compile]\") with abstract weights, and report XLA's memory per device and a roofline "
                      "estimate of a step and a round")
  g.add_argument("--round-lens", default="", metavar="K,K,...",
                 help="with --compile-for: also estimate a round of each of these K (each compiled on its own), and "
                      "the K the adaptive policy would choose from them at τ = 3")
  flags.add_attention_arg(g)
  g.add_argument("--estimate", action="store_true",
                 help="estimate the workspace instead of compiling the decode program with one layer per model to "
                      "measure it (for the --compile-for hardware, else this machine's; it is estimated for other "
                      "devices: with --device-memory or --mesh, and for a server's --compile-for plan)")
  p.add_argument("--json", action="store_true", help="print the plan as JSON")
  return p


def planned_dtype(args: argparse.Namespace) -> str | None:
  """`--dtype`; else, for a device that is not here (`--device-memory`, `--compile-for`), what accelerators
  run: the Hugging Face checkpoint's `torch_dtype` where jspec runs it in that dtype, else bfloat16; else None
  (this machine's default)."""
  if args.dtype is not None or (args.device_memory is None and args.compile_for is None):
    return args.dtype
  from jspec.core import shipped
  from jspec.formats import checkpoint
  path = shipped.resolve(args.target)
  fields = checkpoint.read_json(path / "config.json" if path.is_dir() else path)
  stated = fields.get("torch_dtype") or (fields.get("dtype") if "model_type" in fields else None)
  return "float32" if stated == "float32" else "bfloat16"


def planned_platform(args: argparse.Namespace) -> str | None:
  """What the plan's attention runs on: the `--compile-for` platform's kernel, an accelerator's for
  `--device-memory` (the GPU's, which a head dim that is not a power of two cannot take), else this
  machine's."""
  if args.compile_for is not None:
    from jspec.planning import accelerators
    return accelerators.Target.parse(args.compile_for).platform
  return "gpu" if args.device_memory is not None else None


def plan(args: argparse.Namespace):
  from jspec.core import machine
  from jspec.decoding.decoder import drafter_kind
  from jspec.formats import loading
  from jspec.model import sharding
  from jspec.planning import memory, shaped

  for name in ("batch_size", "context", "prompt_len", "draft_len"):
    if getattr(args, name) is not None and getattr(args, name) < 1:
      raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
  compile_for = None
  if args.compile_for is not None:
    from jspec.planning import accelerators
    compile_for = accelerators.Target.parse(args.compile_for)
    devices = len(compile_for.devices())  # no compiler for it: one line, before anything loads
    args.mesh = args.mesh or f"model={devices}"
    sizes = sharding.mesh_sizes(args.mesh)
    if sizes["data"] * sizes["model"] != devices:
      raise ValueError(f"--mesh {args.mesh} needs {sizes['data'] * sizes['model']} devices; {args.compile_for} has "
                       f"{devices}")
    hbm = compile_for.per_device(devices).hbm_bytes
  dtype = planned_dtype(args)
  target = loading.load_shapes(args.target, dtype, args.quantize)
  if not isinstance(target, loading.Model):
    raise ValueError(f"--target {args.target}: heads, not a model")
  draft, drafter = flags.load_draft(args, lambda path, **kw: loading.load_shapes(path, dtype, args.draft_quantize,
                                                                                **kw))
  drafter = drafter or (draft and drafter_kind(draft))
  spec = None if drafter is None and draft is None else \
      SpecConfig(args.draft_len, drafter=drafter, suffix_cache_tokens=args.suffix_cache_tokens)
  sizes = sharding.mesh_sizes(args.mesh or "")
  mesh = memory.planned_mesh(sizes) if args.mesh else None
  decoder = shaped.shaped_decoder(target, draft, spec, args.batch_size, args.attention)
  context = args.context or decoder.context_len
  if context > decoder.context_len:
    raise ValueError(f"--context {context} exceeds the model's context of {decoder.context_len} tokens")
  prompt_len = min(args.prompt_len or max(context // 2, 1), context - 1) or 1
  # The workspace is measured on the devices here, and estimated for other hardware.
  here = None if args.device_memory is not None or args.mesh else True
  if compile_for is not None and args.device_memory is None:
    available = (int(hbm * args.memory_fraction), f"{compile_for.chip_name} HBM per device")
  elif args.device_memory is not None:
    available = (int(parse_bytes(args.device_memory) * args.memory_fraction), f"{args.device_memory} given")
  else:
    if mesh is not None and sizes["data"] * sizes["model"] > 1:
      raise ValueError("--mesh without --device-memory: say each device's memory")
    available = machine.budget(None, args.memory_fraction)
  measured = None if args.estimate or here is None else shaped.compiled_workspace_per_row(
      decoder, args.batch_size, context, prompt_len, mesh, args.serving)
  if compile_for is not None and not (args.estimate or args.serving):  # the one-layer program for that hardware
    from jspec.planning import accelerators
    measured = accelerators.workspace_per_row(compile_for, decoder, args.batch_size,
                                              *memory.shape(decoder, context, prompt_len), args.mesh,
                                              not args.replicate_draft)
  result = memory.make_plan(decoder, args.batch_size, context, prompt_len, mesh=mesh,
                            shard_draft=not args.replicate_draft, memory=available, workspace_per_row=measured,
                            serving=args.serving, platform=planned_platform(args))
  report = None
  if compile_for is not None:
    from jspec.planning import accelerators
    width, capacity = memory.shape(decoder, context, prompt_len, args.serving)
    fixed = None if spec is None else shaped.shaped_decoder(  # a round of K, not every offered K's branch
        target, draft, dataclasses.replace(spec, adaptive=None), args.batch_size, args.attention)
    # the engine's pool: its usable pages and each data shard's scratch page
    pages = result.pages + memory.page_shards(mesh, args.batch_size) if result.pages else None
    more = {k: shaped.shaped_decoder(target, draft, dataclasses.replace(spec, draft_len=k, adaptive=None),
                                     args.batch_size, args.attention) for k in round_lens(args) if spec is not None}
    report = accelerators.compile_for(compile_for, decoder, args.batch_size, width, capacity, args.mesh,
                                      not args.replicate_draft, fixed, args.serving, pages, more)
  return result, drafter, report


def round_lens(args: argparse.Namespace) -> list[int]:
  try:
    lens = sorted({int(k) for k in args.round_lens.split(",") if k.strip()} - {args.draft_len})
  except ValueError:
    lens = [0]
  if any(not 1 <= k <= MAX_DRAFT_LEN for k in lens):
    raise ValueError(f"--round-lens {args.round_lens!r}: draft lengths from 1 to {MAX_DRAFT_LEN}, comma-separated")
  if lens and args.compile_for is None:
    raise ValueError("--round-lens estimates rounds on the --compile-for hardware: name it")
  return lens


def adaptive_choice(round_costs: dict[int, float], tau: float, at: int) -> tuple[float, int]:
  """(α, K): the per-position acceptance α at which a round of `at` drafts commits τ tokens on average
  (1 + α + ... + α^at = τ), and the K among `round_costs` (plain steps, by K) that the adaptive policy's rule,
  the most tokens per plain step, picks at that α."""
  lo, hi = 0.0, 1.0
  for _ in range(60):
    mid = (lo + hi) / 2
    lo, hi = (mid, hi) if sum(mid ** i for i in range(at + 1)) < tau else (lo, mid)
  gain = {k: sum(lo ** i for i in range(k + 1)) / cost for k, cost in round_costs.items()}
  return lo, max(gain, key=gain.get)


def describe(p, args: argparse.Namespace, drafter: str | None) -> str:
  from jspec.planning.memory import gb
  u = p.usage
  drafter_cache = "suffix index" if drafter == "suffix" else "draft KV cache"
  figures = [("target weights", u.weights_bytes), ("draft weights", u.draft_weights_bytes),
          ("target KV cache", u.kv_cache_bytes), (drafter_cache, u.draft_kv_cache_bytes),
          (f"workspace ({'measured' if p.workspace_source == 'compiled' else 'estimated'})", u.workspace_bytes)]
  rows = lambda n: f"{n} row{'s' * (n != 1)}"
  head = (f"{args.target} with {drafter + ' drafter' if drafter else 'no drafter'}: {rows(p.batch)} x "
          f"{p.context:,} tokens (prompts {p.prompt_len:,}), {p.devices} device{'s' * (p.devices > 1)}")
  lines = [head, *(f"  {name:<24}{gb(n):>12}" for name, n in figures),
           f"  {'total per device':<24}{gb(u.total_bytes):>12} of {gb(p.device_memory_bytes)} "
           f"({p.memory_source}): {'fits' if p.fits else 'does NOT fit'}",
           f"  largest batch at {p.context:,} tokens: {p.max_batch}",
           f"  largest context at {rows(p.batch)}: {p.max_context:,} tokens"]
  if p.experts is not None:
    e = p.experts
    lines.append(f"  experts: {e.per_layer} per layer in {e.sparse_layers} layers, {e.per_token} per token; "
                 f"{e.params / 1e9:.3g}B of the target's {e.total_params / 1e9:.3g}B parameters "
                 f"({e.active_params / 1e9:.3g}B active per token); {gb(e.bytes_per_device)} per device "
                 f"(every expert on each device)")
  if p.pages is not None:
    mean = mean_len(args, p)
    held = f" ({p.pages_per_device:,} on each device)" if p.page_shards > 1 else ""
    lines.append(f"  paged KV cache: {p.pages:,} pages of {PAGE_SIZE} tokens{held}, {rows(p.rows_at(mean))} of "
                 f"{mean:,} tokens at once (of {p.batch} slots)")
  return "\n".join(lines)


def mean_len(args: argparse.Namespace, p) -> int:
  return args.mean_len or max(p.context // 2, 1)


COST_SOURCES = {"compiled": "", "optimized hlo": " in the optimized module, per device"}


def describe_compiled(r, tau: float = 3.0) -> str:
  """What XLA compiled for the topology, beside the plan; the times are labelled estimates."""
  from jspec.planning.memory import gb
  c, chip = r.program, r.per_device
  return "\n".join([
      f"compiled for {r.target} by XLA ({r.devices} device{'s' * (r.devices > 1)}), per device:",
      f"  {'arguments':<24}{gb(c.argument_bytes):>12}", f"  {'temporaries':<24}{gb(c.temp_bytes):>12}",
      f"  {'output':<24}{gb(c.output_bytes):>12}", f"  {'generated code':<24}{gb(c.code_bytes):>12}",
      f"  {'total':<24}{gb(c.total_bytes):>12} of {gb(chip.hbm_bytes)} HBM: {'fits' if r.fits else 'does NOT fit'}",
      f"  estimate (XLA's FLOPs and bytes{COST_SOURCES[r.cost_source]} over {chip.bf16_flops_per_s / 1e12:.0f} "
      f"TFLOP/s, "
      f"{chip.hbm_bytes_per_s / 1e9:.0f} GB/s): plain step {r.plain_step_s * 1e3:.3f} ms, round of K = "
      f"{r.draft_len} {r.round_s * 1e3:.3f} ms = {r.round_cost:.2f} plain steps; at τ = {tau:g}: "
      f"{r.speedup(tau):.2f}x (estimate)", *_describe_rounds(r, tau), f"  attention: {r.attention}",
      *_describe_server(r)])


def _describe_rounds(r, tau: float) -> list[str]:
  if not r.rounds:
    return []
  costs = r.round_costs()
  alpha, best = adaptive_choice(costs, tau, r.draft_len)
  return ["  rounds in plain steps (estimate): " + ", ".join(f"K = {k} {c:.2f}" for k, c in costs.items()),
          f"  the adaptive policy's K at τ = {tau:g} for K = {r.draft_len} (α = {alpha:.2f} per position): {best}"]


def _describe_server(r) -> list[str]:
  if r.server is None:
    return []
  from jspec.planning.memory import gb
  return [f"  server's {name} program: arguments {gb(c.argument_bytes)}, temporaries {gb(c.temp_bytes)}, total "
          f"{gb(c.total_bytes)}: {'fits' if c.total_bytes <= r.per_device.hbm_bytes else 'does NOT fit'}"
          for name, c in r.server.items()]


def compiled_json(r, tau: float = 3.0) -> dict:
  return {"topology": str(r.target), "devices": r.devices, "cost_source": r.cost_source,
          **{k: getattr(r.program, k) for k in ("argument_bytes", "temp_bytes", "output_bytes", "code_bytes",
                                                "total_bytes", "flops", "bytes_accessed")},
          "hbm_bytes": r.per_device.hbm_bytes, "fits": r.fits, "estimated_plain_step_s": r.plain_step_s,
          "estimated_round_s": r.round_s, "estimated_round_cost": r.round_cost,
          f"estimated_speedup_at_tau_{tau:g}": r.speedup(tau), "chip_source": r.target.chip.source,
          "attention": r.attention, "round_costs": {str(k): c for k, c in r.round_costs().items()},
          **({f"adaptive_k_at_tau_{tau:g}": adaptive_choice(r.round_costs(), tau, r.draft_len)[1]} if r.rounds else {}),
          "server": r.server and {name: {k: getattr(c, k) for k in ("argument_bytes", "temp_bytes", "total_bytes")}
                                  for name, c in r.server.items()}}


@flags.command
def main(argv: list[str] | None = None) -> int:
  args = parser().parse_args(argv)
  flags.show_status(not args.json)
  result, drafter, report = plan(args)
  if args.json:
    rows = {} if result.pages is None else {"mean_len": mean_len(args, result),
                                             "rows_at_mean_len": result.rows_at(mean_len(args, result))}
    print(json.dumps({**result.to_json(), **rows, **({"compiled": compiled_json(report)} if report else {})}))
  else:
    print(describe(result, args, drafter) + ("\n" + describe_compiled(report) if report else ""))
  return 0


if __name__ == "__main__":
  sys.exit(main())
