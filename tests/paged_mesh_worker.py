"""Run by tests/test_paged_mesh.py on 8 simulated CPU devices: engines whose paged KV caches split kv heads over
a mesh's model axis and pages over its data axis, against one device's engine. Requests arrive while others
decode, share a 200-token prefix, are prefilled in chunks of 96 tokens and preempted (7 pages for 4 slots);
writes the tokens, prefix hits, preemptions and the loop's collectives as JSON. The drafters: a draft model's
trees (its cache paged beside the target's; they stand for its chains too), an EAGLE head (its cache paged,
keyed with a token of lookahead), and n-gram (the target's cache alone, as for Medusa and suffix drafts,
whose paging is the same)."""
import dataclasses
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

import jspec
from jspec import testing
from jspec.core.settings import SpecConfig, TreeConfig
from jspec.decoding import batches, programs
from jspec.decoding.decoder import make_decoder
from jspec.engine.requests import Request
from jspec.model import sharding
from jspec.planning import accelerators, memory

CONFIG = dataclasses.replace(testing.NO_EOS, n_heads=8, n_kv_heads=8, head_dim=8)  # kv heads split 2 and 8 ways
target = testing.random_model(CONFIG, seed=0, scale=2.0)
draft = testing.perturbed(target, 0.5)
KINDS = {"model-tree": (draft, SpecConfig(3, tree=TreeConfig(3, 8))),
         "eagle": (testing.random_draft("eagle", target), testing.fixed_k(3, drafter="eagle")),
         "ngram": (None, testing.fixed_k(3, drafter="ngram"))}
MESHES = {"model=8": KINDS, "data=2,model=4": ("model-tree", "eagle")}  # the kinds each mesh runs
rng = np.random.default_rng(0)
shared = rng.integers(0, 256, 200).tolist()
PROMPTS = [shared + rng.integers(0, 256, int(n)).tolist() for n in rng.integers(1, 60, 4)] + [[5, 6, 7]]
NEW = [60 + 10 * i for i in range(len(PROMPTS))]


def serve(mesh, kind: str) -> dict:
  d, spec = KINDS[kind]
  engine = jspec.make_engine(target, draft=d, spec=spec, slots=4, max_len=400, segment_rounds=2, pages=7,
                             mesh=mesh, max_prefill_tokens=96)
  engine.add(Request(PROMPTS[0], NEW[0]), 0)
  out, steps = {i: [] for i in range(len(PROMPTS))}, 0
  while engine.has_work:
    steps += 1
    if steps == 3:  # the rest arrive while the first decodes
      for i in range(1, len(PROMPTS)):
        engine.add(Request(PROMPTS[i], NEW[i]), i)
    for delta in engine.step():
      out[delta.index] += delta.token_ids
  result = {"tokens": out, "prefix_hits": engine.kv_pages.prefix_hits, "preemptions": engine.num_preemptions}
  if mesh is not None and kind == "model-tree":  # the paged segment's collectives against a contiguous one's
    result["collectives"] = {"paged": [testing.loop_collectives(e.as_text())
                                       for e in engine.program_cache.ready("segment")],
                             "contiguous": testing.loop_collectives(contiguous_segment(mesh, d, spec, engine.capacity))}
  return result


def contiguous_segment(mesh, d, spec, capacity: int) -> str:
  """The HLO of the segment program over 4 slots of contiguous caches, as an engine without pages ran it."""
  decoder = sharding.place_decoder(mesh, make_decoder(target, d, spec, 4), 4)
  idle = sharding.place(memory.abstract_batch(decoder, 4, batches.prompt_bucket(1), capacity), mesh)
  state = accelerators.started_state(decoder, idle, capacity)
  scalar = lambda dtype, shape=(): jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, PartitionSpec()))
  return programs.segment.lower(decoder, state, scalar(jnp.int32), scalar(jnp.bool_), scalar(jnp.bool_, (4,)),
                                width=4).compile().as_text()


out = {kind: {"single": serve(None, kind)} for kind in KINDS}
for spec, kinds in MESHES.items():
  for kind in kinds:
    out[kind][spec] = serve(sharding.make_mesh(spec), kind)
pathlib.Path(sys.argv[1]).write_text(json.dumps(out))
