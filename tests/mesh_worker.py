"""Run by tests/test_sharding.py in a subprocess with simulated CPU devices (and, for the two-process test,
under jax.distributed). Decodes on each mesh and on one device, and writes what it saw as JSON."""
import argparse
import dataclasses
import json
import pathlib
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import jax  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("out")
ap.add_argument("--meshes", default="data=8;model=8;data=2,model=4")
ap.add_argument("--coordinator")
ap.add_argument("--num-processes", type=int)
ap.add_argument("--process-id", type=int)
args = ap.parse_args()
if args.coordinator:
  jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)

import numpy as np  # noqa: E402

import jspec  # noqa: E402
from jspec import testing  # noqa: E402
from jspec.decoding import programs  # noqa: E402
from jspec.decoding.batches import make_batch  # noqa: E402
from jspec.decoding.decoder import make_decoder  # noqa: E402
from jspec.drafters import DFlashDrafter  # noqa: E402
from jspec.formats import loading  # noqa: E402
from jspec.model import hf, model, sharding  # noqa: E402
from jspec.model.config import MoeConfig  # noqa: E402

# 8 query and 8 kv heads, so tensor parallelism can use all 8 devices; a vocabulary that 8 divides.
CONFIG = dataclasses.replace(testing.TINY, vocab_size=264, n_heads=8, n_kv_heads=8, head_dim=8, eos_id=None)
DRAFT = dataclasses.replace(CONFIG, n_layers=1, mlp_dim=64)
# A mixture of experts: a dense first layer, then 8 experts whose MLP columns split over "model"
MOE = dataclasses.replace(CONFIG, moe=MoeConfig(experts=8, top_k=2, expert_dim=512, shared_dim=64,
                                                dense_layers=(0,)))
target = testing.random_model(CONFIG, seed=0, scale=2.0)
moe_target = testing.random_model(MOE, seed=0, scale=2.0)
draft = testing.random_model(DRAFT, seed=1, scale=2.0)
DFLASH = testing.random_heads(DFlashDrafter.for_training(CONFIG, {"draft_layers": 2, "block_size": 5}), seed=2)
prompts = [[1, 2, 3, 4], [9, 8, 7], [5] * 6, [100, 200, 30, 40, 50], [7], [3, 3], [250, 1], [60, 61, 62]]
FIXED = testing.fixed_k(3)  # every round verifies on the mesh
# The same target with an EOS, for constraints (which end the text there); free and constrained rows mixed.
ENDING = dataclasses.replace(target, config=dataclasses.replace(CONFIG, eos_id=256))
CONSTRAINTS = [jspec.Regex("[a-z]{2,9}"), None, jspec.Choice(["yes", "no"]), jspec.Regex("[0-9]+")] * 2


def runs(mesh):
  kw = dict(max_new_tokens=12, mesh=mesh)
  return {"ar": jspec.generate(target, prompts, **kw).token_ids,
          "spec": jspec.generate(target, prompts, draft=draft, spec=FIXED, **kw).token_ids,
          # on the mesh with both axes, every cache read by the TPU kernel (interpreted), under shard_map over
          # each device's rows
          "kernel": jspec.generate(target, prompts, draft=draft, spec=FIXED, attention="tpu", **kw).token_ids
          if mesh is not None and dict(mesh.shape) == {"data": 2, "model": 4} else None,
          "spec_replicated_draft": jspec.generate(target, prompts, draft=draft, spec=FIXED, shard_draft=False,
                                                  **kw).token_ids,
          "sampled": jspec.generate(target, prompts, draft=draft, spec=FIXED, temperature=1.0, seed=3,
                                    **kw).token_ids,
          "constrained": jspec.generate(ENDING, prompts, draft=draft, spec=FIXED, constraint=CONSTRAINTS,
                                        **kw).token_ids,
          # on the mesh with both axes: the experts' columns split over model, the rows over data
          "moe": jspec.generate(moe_target, prompts, draft=draft, spec=FIXED, **kw).token_ids
          if mesh is None or dict(mesh.shape) == {"data": 2, "model": 4} else None,
          # a DFlash block drafter: its context cache and projection on the mesh with both axes
          "dflash": jspec.generate(target, prompts, draft=DFLASH, spec=testing.fixed_k(3, drafter="dflash"),
                                   **kw).token_ids if mesh is None or dict(mesh.shape) == {"data": 2, "model": 4}
          else None,
          "continuous": continuous(mesh)}


def continuous(mesh):
  """Twelve prompts through eight slots (continuous batching: finished rows take new prompts in place),
  heads-major on a mesh that splits kv heads."""
  more = prompts + [p[::-1] + [11] for p in prompts[:4]]
  out = [[] for _ in more]
  for delta in jspec.stream(target, more, draft=draft, spec=FIXED, max_new_tokens=12, batch_size=8, mesh=mesh):
    out[delta.index].extend(delta.token_ids)
  return out


def collectives(mesh, mode):
  """all-reduce / all-gather counts in the while bodies of the loop `runs` compiled for the mesh: "ar", or
  speculative with a "sharded" or "replicated" draft (the same executables: nothing compiles again)."""
  decoder = make_decoder(target, *((None, None) if mode == "ar" else (draft, FIXED)), batch=8)
  batch = make_batch(decoder, prompts, 12)
  decoder = sharding.place_decoder(mesh, decoder, 8, shard_draft=mode != "replicated")
  batch = sharding.place(batch, mesh)
  compiled, seconds = programs.compiled_run(decoder, batch)
  assert seconds == 0.0, f"{mode}: not the executable generate compiled"
  text = compiled.as_text()
  explicit = (all(s.is_fully_replicated for s in jax.tree.leaves(compiled.output_shardings))
              and jax.tree.leaves(compiled.input_shardings[0])
              == [x.sharding for x in jax.tree.leaves((decoder, batch))])
  return {**testing.loop_collectives(text), "drafter": testing.loop_collectives(text, "drafter"),
          "explicit_shardings": explicit}


HF_DIR = pathlib.Path(tempfile.mkdtemp()) / "hf"
hf.save_hf(target, HF_DIR)


def hf_directory_on(mesh, quantize: str | None = "int8") -> dict:
  """The target's Hugging Face directory read onto the mesh tensor by tensor, quantized to int8 as it is read
  (values and scales placed by the rules) and speculating with an fp8 draft, or as it is."""
  loaded = jspec.load(HF_DIR, mesh=mesh, quantize=quantize)
  tokens = jspec.generate(loaded, prompts, draft=loading.quantized(draft, quantize and "fp8"), spec=FIXED,
                          max_new_tokens=12, mesh=mesh).token_ids
  if mesh is None:
    return {"spec": tokens}
  specs = sharding.param_specs(loaded.params, CONFIG, mesh)
  want = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
  wq, w_down = specs["layers"][0]["wq"], specs["layers"][0]["w_down"]
  return {"placed_by_the_rules": all(a.sharding.spec == sp for a, sp in zip(jax.tree.leaves(loaded.params), want)),
          "spec": tokens, "quantized_specs": [str(wq.qvalue), str(wq.scale), str(w_down.qvalue), str(w_down.scale)]
          if quantize else None}


# Under jax.distributed the test compares plain and speculative tokens with the single-device run of the
# 8-device worker, and only those.
out = {"single": None if args.coordinator else {**runs(None), "hf_directory": hf_directory_on(None)}, "meshes": {}}
for spec in args.meshes.split(";"):
  mesh = sharding.make_mesh(spec)
  if args.coordinator:
    out["meshes"][spec] = {kind: jspec.generate(target, prompts, max_new_tokens=12, mesh=mesh, **kw).token_ids
                           for kind, kw in (("ar", {}), ("spec", {"draft": draft, "spec": FIXED}))}
    continue
  specs = sharding.param_specs(target.params, CONFIG, mesh)
  moe_specs = sharding.param_specs(moe_target.params, MOE, mesh)["layers"][1]
  out["meshes"][spec] = {
      **runs(mesh),
      "param_specs": {k: str(specs["layers"][0][k]) for k in ("wq", "wk", "wo", "w_gate", "w_down")} |
                     {"embed": str(specs["embed"])} |
                     {k: str(moe_specs[k]) for k in ("router", "we_gate_up", "we_down", "w_gate")},
      "cache_spec": str(sharding.cache_layout(len(prompts), CONFIG, mesh).spec),
      "cache_heads_major": sharding.cache_layout(len(prompts), CONFIG, mesh).heads_major,
      "sharded_init_equals_host_init": all(
          bool(np.allclose(a, b, rtol=1e-6, atol=1e-7)) and a.sharding.spec == sp  # jit may round by 1 ulp
          for a, b, sp in zip(jax.tree.leaves(sharding.init_params(CONFIG, jax.random.PRNGKey(0), mesh)),
                              jax.tree.leaves(model.init_params(CONFIG, jax.random.PRNGKey(0))),
                              jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)))),
      "collectives": {mode: collectives(mesh, mode) for mode in ("ar", "sharded", "replicated")},
      "hf_directory": hf_directory_on(mesh, "int8" if mesh.shape["model"] > 1 else None)}  # weights split or not
if jax.process_index() == 0:
  pathlib.Path(args.out).write_text(json.dumps(out))
