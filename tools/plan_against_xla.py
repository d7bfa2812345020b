"""The memory plan against XLA's compiler across batch sizes and contexts: for each shape, the plan's total per
device (`jspec.planning.memory.make_plan`) with the estimated workspace (the formula) and with the workspace
of the one-layer program compiled for that hardware (what `plan --compile-for` uses), and the decode
program's total per device as XLA compiles it (`jspec.planning.accelerators`), one line each.

  python tools/plan_against_xla.py --target docs/plan/llama-3.1-8b.json --draft docs/plan/llama-3.2-1b.json \
      --compile-for tpu:v5p:2x2x1 --batches 1,8,32 --contexts 2048,8192,32768
"""
from __future__ import annotations

import argparse
import time

from jspec.core.settings import SpecConfig
from jspec.decoding import programs
from jspec.formats import loading
from jspec.model import sharding
from jspec.planning import accelerators, memory, shaped


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--target", required=True)
  p.add_argument("--draft", required=True)
  p.add_argument("--compile-for", required=True)
  p.add_argument("--batches", default="1,8,32")
  p.add_argument("--contexts", default="2048,8192,32768")
  args = p.parse_args()
  target = accelerators.Target.parse(args.compile_for)
  devices = target.devices()
  mesh = sharding.make_mesh(f"model={len(devices)}", devices)
  hbm = target.per_device(len(devices)).hbm_bytes
  models = [loading.load_shapes(path, "bfloat16") for path in (args.target, args.draft)]
  print("| batch | context | XLA per device (GB) | plan, estimated workspace (GB) | / XLA | plan, one-layer "
        "workspace (GB) | / XLA | compile s |")
  print("|---|---|---|---|---|---|---|---|")
  for batch in map(int, args.batches.split(",")):
    for context in map(int, args.contexts.split(",")):
      decoder = shaped.shaped_decoder(*models, SpecConfig(4, drafter="model"), batch)
      prompt_len = context // 2
      width, capacity = memory.shape(decoder, context, prompt_len)
      plan = lambda per_row: memory.make_plan(
          decoder, batch, context, prompt_len, mesh=memory.planned_mesh(dict(mesh.shape)),
          memory=(hbm, args.compile_for), platform=target.platform, workspace_per_row=per_row).usage.total_bytes
      estimated, derived = plan(None), plan(accelerators.workspace_per_row(target, decoder, batch, width, capacity))
      placed = sharding.place_decoder(mesh, decoder, batch)
      abstract = sharding.place(memory.abstract_batch(placed, batch, width, capacity), mesh)
      begin = time.perf_counter()
      xla = accelerators.compiled(programs.lower(placed, abstract))
      seconds = time.perf_counter() - begin
      total = xla.total_bytes
      print(f"| {batch} | {context:,} | {total / 1e9:.2f} | {estimated / 1e9:.2f} | {estimated / total:.3f} | "
            f"{derived / 1e9:.2f} | {derived / total:.3f} | {seconds:.0f} |", flush=True)


if __name__ == "__main__":
  main()
