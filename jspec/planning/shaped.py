"""Decoders of shapes only, and what XLA says of their memory.

`shaped_decoder` pairs models whose parameters may be abstract (`jspec.formats.loading.load_shapes`), so a plan
needs no weights in memory; `compiled_workspace` compiles the decode program with one layer per model for
such shapes and reads its temporaries from XLA's `memory_analysis()` (a layer's temporaries are reused by
the next, so the figure does not grow with depth): the workspace the memory plan otherwise estimates.
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jspec.decoding import loop, programs
from jspec.decoding.decoder import Decoder, make_decoder
from jspec.planning import memory


def shaped_decoder(target, draft, spec, batch: int, attention: str = "auto") -> Decoder:
  """`make_decoder` over models whose parameters may be shapes only (`jspec.formats.loading.load_shapes`):
  a decoder of abstract arrays, nothing allocated."""
  with_params = lambda m, p: None if m is None else dataclasses.replace(m, params=p)
  build = lambda tp, dp: make_decoder(with_params(target, tp), with_params(draft, dp), spec, batch,
                                      attention=attention)
  return jax.eval_shape(build, target.params, None if draft is None else draft.params)


def one_layer(decoder: Decoder) -> Decoder:
  """The same program with one layer in the target and in a draft model: the same activations. A mixture of
  experts keeps a sparse layer (whose activations are the larger); an EAGLE-3 head reads that layer."""
  def cut(params, config):
    if config is None or config.n_layers == 1 or "layers" not in (params or {}):
      return params, config
    kept = next((i for i, layer in enumerate(params["layers"]) if "router" in layer), 0)
    moe = config.moe and dataclasses.replace(config.moe, dense_layers=() if kept or config.moe.sparse(0) else (0,))
    return ({**params, "layers": params["layers"][kept:kept + 1]},
            dataclasses.replace(config, n_layers=1, sliding_windows=(), moe=moe))
  target_params, target_config = cut(decoder.target_params, decoder.target_config)
  decoder = decoder.replace(target_params=target_params, target_config=target_config)
  drafter = decoder.drafter
  if drafter is not None and getattr(drafter, "config", None) is not None:
    params, config = cut(decoder.drafter_params, drafter.config)
    drafter = dataclasses.replace(drafter, config=config)
    if getattr(drafter, "feature_layers", ()):
      drafter = dataclasses.replace(drafter, feature_layers=(0,) * len(drafter.feature_layers))
    decoder = decoder.replace(drafter_params=params, drafter=drafter)
  return decoder


def compiled_workspace(decoder: Decoder, batch: int, prompt_width: int, capacity: int,
                       compiler_options: dict | None = None) -> int | None:
  """The decode program's temporaries beyond its caches, from XLA's `memory_analysis()` of the program with
  one layer per model (compiled for the abstract shapes, with these XLA options; nothing allocated). None
  where the backend does not say."""
  small = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), one_layer(decoder.replace(layout=None)))
  abstract = memory.abstract_batch(small, batch, prompt_width, capacity)
  analysis = programs.lower(small, abstract).compile(compiler_options=compiler_options).memory_analysis()
  if analysis is None or not getattr(analysis, "temp_size_in_bytes", 0):
    return None
  state = jax.eval_shape(loop.init_state, small, abstract)
  return max(int(analysis.temp_size_in_bytes) - memory.nbytes((state.target_cache, state.drafter_state)), 0)


def compiled_workspace_per_row(decoder: Decoder, batch: int, context: int, prompt_len: int, mesh=None,
                               serving: bool = False) -> float | None:
  """`compiled_workspace` per row of one device, for the batch a plan sizes (`memory.make_plan`'s
  `workspace_per_row`); None where the backend does not say."""
  rows = max(batch // memory.axis_sizes(mesh)["data"], 1)
  width, capacity = memory.shape(decoder, context, prompt_len, serving)
  measured = compiled_workspace(decoder, rows, width, capacity)
  return None if measured is None else measured / rows
