"""Run by tests/test_sharding.py on 8 simulated CPU devices: engines whose paged KV caches split kv heads over
a mesh's model axis, against one device's engine, for each drafter kind (a draft model's trees stand for its
chains too). Requests arrive while others decode, share a 200-token prefix, are prefilled in chunks of 96
tokens and preempted (7 pages for 4 slots); writes the tokens, prefix hits, preemptions and the loop's
collectives as JSON."""
import dataclasses
import json
import pathlib
import sys

import jax
import numpy as np

import jspec
from jspec import testing
from jspec.core.settings import SpecConfig, TreeConfig
from jspec.decoding import programs
from jspec.decoding.batches import make_batch
from jspec.decoding.decoder import make_decoder
from jspec.engine.requests import Request
from jspec.model import sharding

CONFIG = dataclasses.replace(testing.NO_EOS, n_heads=8, n_kv_heads=8, head_dim=8)  # kv heads split 2 and 8 ways
target = testing.random_model(CONFIG, seed=0, scale=2.0)
draft = testing.perturbed(target, 0.5)
KINDS = {"model-tree": (draft, SpecConfig(3, tree=TreeConfig(3, 8))),
         "ngram": (None, testing.fixed_k(3, drafter="ngram")),
         "suffix": (None, testing.fixed_k(3, drafter="suffix")),
         **{kind: (testing.random_draft(kind, target), testing.fixed_k(3, drafter=kind))
            for kind in ("eagle", "medusa")}}
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
  if mesh is not None and kind == "model-tree":  # the paged segment's collectives against the contiguous loop's
    batch = make_batch(make_decoder(target, d, spec, 4), [p[:8] for p in PROMPTS[:4]], 4)
    contiguous, _ = programs.compiled_run(sharding.place_decoder(mesh, make_decoder(target, d, spec, 4), 4),
                                          sharding.place(batch, mesh))
    result["collectives"] = {"paged": [testing.loop_collectives(e.as_text())
                                       for e in engine.program_cache.ready("segment")],
                             "contiguous": testing.loop_collectives(contiguous.as_text())}
  return result


out = {}
for kind in KINDS:
  out[kind] = {"single": serve(None, kind)}
  for spec in sys.argv[2].split(";"):
    sizes = sharding.mesh_sizes(spec)
    out[kind][spec] = serve(sharding.make_mesh(spec, jax.devices()[:sizes["data"] * sizes["model"]]), kind)
pathlib.Path(sys.argv[1]).write_text(json.dumps(out))
