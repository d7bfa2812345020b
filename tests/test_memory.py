"""The memory plan: its figures against the parameter and cache arithmetic, the largest batch and context, the
refusal of what cannot fit (API, CLI, engine, server) before anything is allocated, and `python -m jspec.plan`."""
import dataclasses
import json
import math
import pathlib

import jax
import numpy as np
import pytest

import jspec
from jspec import plan, testing
from jspec.core import machine
from jspec.core.settings import SpecConfig
from jspec.decoding import batches, loop
from jspec.decoding.decoder import make_decoder
from jspec.formats import loading
from jspec.model import cache as kvcache
from jspec.model.config import ModelConfig, num_params
from jspec.planning import memory, shaped

# A tiny model whose context is long: hundreds of rows of 200k tokens would need tens of GB.
LONG = ModelConfig(vocab_size=300, dim=32, n_layers=2, n_heads=2, n_kv_heads=2, head_dim=16, mlp_dim=64,
                   max_seq_len=262_144)
HF_FAMILIES = {  # model_type -> what makes its shapes differ
    "llama": dict(tie_word_embeddings=False), "mistral": dict(sliding_window=64, head_dim=16),
    "qwen2": dict(tie_word_embeddings=True), "qwen3": dict(head_dim=24, tie_word_embeddings=False),
    "gemma2": dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=64),
    "gemma3_text": dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=64, sliding_window_pattern=2),
    "phi3": dict(partial_rotary_factor=0.5),
}


def _hf_config(family: str, rng: np.random.Generator, vocab: int) -> dict:
  heads = int(rng.choice([2, 4, 8]))
  return {"model_type": family, "vocab_size": vocab, "hidden_size": int(rng.choice([32, 64, 96])),
          "intermediate_size": int(rng.integers(40, 200)), "num_hidden_layers": int(rng.integers(1, 5)),
          "num_attention_heads": heads, "num_key_value_heads": heads // int(rng.choice([1, 2])),
          "max_position_embeddings": 1024, **HF_FAMILIES[family]}


def _bytes_per(dtype: str) -> int:
  return np.dtype(jax.numpy.dtype(dtype)).itemsize


def _kv_arithmetic(config: ModelConfig, batch: int, capacity: int) -> int:
  """K and V of every layer, plus each row's length and RoPE length."""
  return (2 * config.n_layers * batch * config.n_kv_heads * capacity * config.head_dim * _bytes_per(config.dtype)
          + 2 * batch * 4)


@pytest.mark.parametrize("family", HF_FAMILIES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_plan_is_the_parameter_and_cache_arithmetic(family, dtype, tmp_path):
  """Random configs of each family, from bare config.json files: the weights are the parameter count
  (and the transposed copy of a tied LM head the decoder keeps), the caches the K/V arithmetic."""
  rng = np.random.default_rng(sorted(HF_FAMILIES).index(family))
  for _ in range(2):
    (tmp_path / "t.json").write_text(json.dumps(_hf_config(family, rng, 300)))
    (tmp_path / "d.json").write_text(json.dumps(_hf_config(family, rng, 300)))
    target, draft = loading.load_shapes(tmp_path / "t.json", dtype), loading.load_shapes(tmp_path / "d.json", dtype)
    batch, capacity = int(rng.integers(1, 9)), 128 * int(rng.integers(1, 5))
    decoder = shaped.shaped_decoder(target, draft, SpecConfig(drafter="model"), batch)
    u = memory.usage(decoder, batch, 16, capacity)
    t, d = target.config, draft.config
    head = t.vocab_size * t.dim if t.tie_embeddings else 0
    assert u.weights_bytes == (num_params(t) + head) * _bytes_per(dtype)
    assert u.draft_weights_bytes == num_params(d) * _bytes_per(dtype)
    assert u.kv_cache_bytes == _kv_arithmetic(t, batch, capacity)
    assert u.draft_kv_cache_bytes == _kv_arithmetic(d, batch, capacity)


def test_the_plan_counts_what_decoding_allocates():
  """The state a real decode starts from holds exactly the plan's caches."""
  target, draft = testing.random_pair()
  decoder = make_decoder(target, draft, None, 3)
  batch = batches.make_batch(decoder, [[1, 2], [3], [4, 5, 6]], 40)
  state = loop.init_state(decoder, batch)
  u = memory.usage(decoder, 3, batch.prompts_BxP.shape[1], batch.capacity)
  assert u.kv_cache_bytes == memory.nbytes(state.target_cache)
  assert u.draft_kv_cache_bytes == memory.nbytes(state.drafter_state)
  assert u.weights_bytes == memory.nbytes(decoder.target_params)


def test_a_mesh_divides_what_it_shards():
  """model=2 splits heads, MLP and vocabulary (and the kv-head rows of the cache); data=2 the batch rows."""
  target = loading.load_shapes(jspec.core.shipped.SMALL.target)
  decoder = shaped.shaped_decoder(target, None, None, 4)
  one = memory.usage(decoder, 4, 16, 512)
  model2 = memory.usage(decoder, 4, 16, 512, memory.planned_mesh({"model": 2}))
  data2 = memory.usage(decoder, 4, 16, 512, memory.planned_mesh({"data": 2}))
  norms = sum(math.prod(x.shape) * 4 for x in jax.tree.leaves(decoder.target_params) if len(x.shape) == 1)
  assert model2.weights_bytes == (one.weights_bytes - norms) // 2 + norms  # all but the norms split
  cache_rows = 2 * 4 * 4  # lengths and RoPE lengths stay whole
  assert model2.kv_cache_bytes - cache_rows == (one.kv_cache_bytes - cache_rows) // 2
  assert data2.kv_cache_bytes - cache_rows == (one.kv_cache_bytes - cache_rows) // 2
  assert data2.weights_bytes == one.weights_bytes


def test_the_largest_batch_and_context_are_the_edge_of_what_fits():
  target = loading.load_shapes(jspec.core.shipped.SMALL.target)
  decoder = shaped.shaped_decoder(target, None, None, 1)
  budget = (300 * 10 ** 6, "given")
  need = lambda rows, ctx, prompt: memory.usage(decoder, rows, *memory.shape(decoder, ctx, prompt)).total_bytes
  p = memory.make_plan(decoder, 8, 2048, 1024, memory=budget)
  assert need(p.max_batch, 2048, 1024) <= budget[0] < need(p.max_batch + 1, 2048, 1024)
  small = memory.make_plan(decoder, 64, 2048, 100, memory=budget)
  assert not small.fits and 0 < small.max_context < 2048
  fits = lambda ctx: need(64, ctx, min(100, ctx - 1)) <= budget[0]
  assert fits(small.max_context) and not fits(small.max_context + 1)


@pytest.mark.slow  # compiled as users compile
def test_the_estimated_workspace_bounds_the_compiled_one():
  """What the refusal assumes without compiling is at least what XLA reports for the program, long prompts
  included, for a draft model and a head drafter."""
  target = testing.random_model(dataclasses.replace(testing.NO_EOS, max_seq_len=2048))
  for kind in ("model", "eagle"):
    draft = testing.random_draft(kind, target)
    decoder = make_decoder(target, draft, SpecConfig(drafter=kind, adaptive=None), 2)
    for width, capacity in [(16, 256), (768, 1024)]:
      measured = shaped.compiled_workspace(decoder, 2, width, capacity, testing.AS_USERS_COMPILE)
      assert measured is not None and 0 < measured <= memory.estimated_workspace(decoder, 2, width)


def _refused(call) -> str:
  from jspec.bench.harness import peak_memory_mb, reset_peak_memory
  reset_peak_memory()
  before = peak_memory_mb()
  with pytest.raises(ValueError) as refusal:
    call()
  assert peak_memory_mb() - before < 200  # MB: nothing of the tens of GB was allocated
  return str(refusal.value)


def test_what_cannot_fit_is_refused_before_anything_is_allocated():
  """Hundreds of rows of 200k tokens: one line with the need, what there is, and what would fit."""
  m = testing.random_model(LONG)
  budget = machine.device_memory()[0]
  message = _refused(lambda: jspec.generate(m, [[1, 2, 3]] * 300, max_new_tokens=200_000))
  assert "300 rows of" in message and "is available" in message and "rows fit at this context" in message
  assert "\n" not in message
  rows = int(message.split("at most ")[1].split(" rows")[0])
  assert 0 < rows < 300
  # An engine's slots share a paged cache of the pages that fit (nothing allocated until a request comes);
  # one that cannot hold a single page is refused. Without slots, as many whole contexts as fit.
  per_row = jspec.make_engine(m, slots=1, max_len=200_000).capacity // kvcache.PAGE_SIZE
  assert jspec.make_engine(m, slots=300, max_len=200_000).kv_pages.pages < 300 * per_row
  need = lambda rows: memory.make_plan(make_decoder(m, None, None, 1), rows, 200_000, 199_999,
                                       serving=True, memory=(budget, "")).usage.total_bytes
  fraction = (need(4) + need(5)) / 2 / budget
  assert 4 * per_row <= jspec.make_engine(m, slots=5, max_len=200_000, memory_fraction=fraction).kv_pages.pages \
      < 5 * per_row
  assert jspec.make_engine(m, slots=None, max_len=200_000, memory_fraction=fraction).slots == 4
  message = _refused(lambda: jspec.make_engine(m, slots=300, max_len=200_000, memory_fraction=need(0) / budget))
  assert "KV pages of 128 tokens need" in message and "not even one page fits" in message


def test_the_cli_and_the_server_refuse_with_exit_status_2(tmp_path, capsys):
  from jspec import cli
  from jspec.serve import cli as serve_cli
  jspec.save(testing.random_model(LONG), tmp_path / "long")
  (tmp_path / "prompts.txt").write_text("ab\n" * 300)
  args = ["--target", str(tmp_path / "long"), "--no-draft", "--prompt-file", str(tmp_path / "prompts.txt"),
          "--batch-size", "300", "--max-new-tokens", "200000", "--no-compile-cache", "--quiet"]
  assert cli.main(args) == 2
  err = capsys.readouterr().err
  assert err.startswith("error: 300 rows of") and err.count("\n") == 1
  assert serve_cli.main(["--target", str(tmp_path / "long"), "--no-draft", "--batch-size", "300",
                         "--max-model-len", "200000", "--no-compile-cache", "--max-total-tokens", "100000000",
                         "--port", "0"]) == 2
  assert "error: 781250 KV pages of 128 tokens need" in capsys.readouterr().err
  # Several processes serve one model sharded over all their devices: a mesh is needed (refused before anything loads).
  assert serve_cli.main(["--num-processes", "2", "--process-id", "0", "--coordinator", "127.0.0.1:1"]) == 2
  assert "give --mesh" in capsys.readouterr().err


def test_python_m_jspec_plan_prints_the_plan(tmp_path, capsys):
  rng = np.random.default_rng(0)
  (tmp_path / "target.json").write_text(json.dumps(_hf_config("llama", rng, 300)))
  (tmp_path / "draft.json").write_text(json.dumps(_hf_config("llama", rng, 300)))
  args = ["--target", str(tmp_path / "target.json"), "--draft", str(tmp_path / "draft.json"), "--drafter", "model",
          "--batch-size", "4", "--context", "512", "--mesh", "model=2", "--device-memory", "2MB"]
  assert plan.main([*args, "--json"]) == 0
  out = json.loads(capsys.readouterr().out)
  for name in ("weights_bytes", "draft_weights_bytes", "kv_cache_bytes", "draft_kv_cache_bytes", "workspace_bytes",
               "total_bytes", "device_memory_bytes", "fits", "max_batch", "max_context"):
    assert name in out
  assert out["device_memory_bytes"] == 2 * 10 ** 6 and out["devices"] == 2
  assert out["fits"] == (out["total_bytes"] <= out["device_memory_bytes"])
  assert plan.main([*args, "--json", "--dtype", "float32"]) == 0  # another device is planned in bf16 unless told
  assert json.loads(capsys.readouterr().out)["weights_bytes"] == 2 * out["weights_bytes"]
  assert plan.main([*args, "--json", "--attention", "xla"]) == 0  # attention scores in memory: more workspace
  assert json.loads(capsys.readouterr().out)["workspace_bytes"] > out["workspace_bytes"]
  assert plan.main(args) == 0
  text = capsys.readouterr().out
  assert "target KV cache" in text and "largest batch at 512 tokens" in text
  for bad, message in [(["--device-memory", "lots"], "--device-memory"), (["--batch-size", "0"], "--batch-size"),
                       (["--context", "99999"], "exceeds the model's context")]:
    assert plan.main([*args, *bad]) == 2
    assert message in capsys.readouterr().err
  assert plan.parse_bytes("80GB") == 80 * 10 ** 9 and plan.parse_bytes("24 GiB") == 24 * 2 ** 30
  # The suffix drafter's index (int32): a ring of C tokens, 8 tables of B buckets (a power of two >= C) for the
  # ended texts, and 8 for the running rows' (a power of two >= the batch's slots, at most B: a row of 256 tokens
  # and a draft's headroom, 512).
  suffix = ["--target", str(tmp_path / "target.json"), "--drafter", "suffix", "--suffix-cache-tokens", "1000",
            "--context", "256"]
  assert plan.main([*suffix, "--json"]) == 0
  assert json.loads(capsys.readouterr().out)["draft_kv_cache_bytes"] == 4 * (1000 + 8 * 1024 + 1 + 8 * 512)
  assert plan.main(suffix) == 0 and "suffix index" in capsys.readouterr().out


@pytest.mark.parametrize("draft", ["llama-3.2-1b", "llama-3-70b-eagle"])
def test_the_documented_configs_plan(draft, capsys):
  """docs/memory.md's deployment, as its command runs it, with each documented drafter; 64 slots of whole
  contexts do not fit, and the paged cache's pages hold a row per slot at a mean of 2,048 tokens."""
  configs = pathlib.Path(__file__).parents[1] / "docs" / "plan"
  args = ["--target", str(configs / "llama-3-70b.json"), "--draft", str(configs / f"{draft}.json"), "--mesh",
          "model=2", "--device-memory", "80GB", "--context", "8192", "--serving", "--json"]
  assert plan.main(args) == 0
  assert json.loads(capsys.readouterr().out)["fits"]
  assert plan.main([*args, "--mesh", "model=4", "--batch-size", "64", "--mean-len", "2048"]) == 0
  out = json.loads(capsys.readouterr().out)
  assert not out["fits"] and out["rows_at_mean_len"] == min(64, out["kv_pages"] // 16) == 64


def test_a_mixture_of_experts_plans_its_experts(capsys):
  """Qwen3-30B-A3B's shape on four devices: every expert on each, its MLP columns split four ways; with its
  EAGLE-3 head, or an MTP layer for it (a sparse layer of its shape)."""
  configs = pathlib.Path(__file__).parents[1] / "docs" / "plan"
  args = ["--target", str(configs / "qwen3-30b-a3b.json"), "--mesh", "model=4", "--device-memory", "95GB",
          "--context", "4096", "--batch-size", "8", "--estimate"]
  assert plan.main([*args, "--draft", str(configs / "qwen3-30b-a3b-eagle3.json"), "--drafter", "eagle",
                    "--json"]) == 0
  out = json.loads(capsys.readouterr().out)
  experts = out["experts"]
  assert (experts["per_layer"], experts["per_token"], experts["sparse_layers"]) == (128, 8, 48)
  assert experts["params"] == 48 * 128 * 3 * 2048 * 768 and experts["bytes_per_device"] == experts["params"] * 2 // 4
  assert round(experts["total_params"] / 1e9, 1) == 30.5 and round(experts["active_params"] / 1e9, 2) == 3.35
  assert experts["bytes_per_device"] < out["weights_bytes"] < experts["bytes_per_device"] * 1.1
  assert plan.main([*args, "--drafter", "mtp"]) == 0
  text = capsys.readouterr().out
  assert "experts: 128 per layer in 48 layers, 8 per token" in text and "mtp drafter" in text


def test_the_plan_shapes_caches_as_generate_and_the_engine_do():
  m = testing.random_model()
  decoder = make_decoder(m, None, None, 1)
  assert memory.shape(decoder, 300, 16) == (16, batches.capacity(16, 284, decoder.headroom)) == (16, 384)
  assert memory.shape(decoder, 300, 299, serving=True) == (384, 384)
  assert jspec.make_engine(m, slots=1, max_len=300).capacity == 384
  assert kvcache.BLOCK_SIZE == 128
