"""Quantized weights (int8, fp8, fp8-block): error bounds, the quantized linear, published FP8 checkpoints, exact
speculation over a quantized target, checkpoints and refusals."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import jspec
from jspec import testing
from jspec.core.settings import SpecConfig
from jspec.formats import checkpoint, loading
from jspec.model import hf, model, quantization

E4M3_MAX = 448.0
BLOCKY = dataclasses.replace(testing.TINY, dim=128, n_heads=4, n_kv_heads=4, head_dim=32, mlp_dim=256, eos_id=None)


@pytest.mark.parametrize("fmt", ["int8", "fp8", "fp8-block"])
def test_quantize_and_dequantize_stay_within_the_formats_error(fmt):
  w = np.asarray(jax.random.normal(jax.random.PRNGKey(0), (256, 384)) * jnp.linspace(0.1, 3, 384))
  q = quantization.quantize(jnp.asarray(w), fmt)
  assert q.qvalue.dtype == quantization.QTYPES[fmt] and q.scale.dtype == jnp.float32
  err = np.abs(np.asarray(quantization.dequantize_params({"w": q}, jnp.float32)["w"]) - w)
  scale = np.repeat(np.repeat(np.asarray(q.scale), 256 // q.scale.shape[0], 0), 384 // q.scale.shape[1], 1)
  if fmt == "int8":  # round to nearest of 255 levels: half a step
    assert np.all(err <= scale / 2 * (1 + 1e-4))
  else:  # e4m3: 3 mantissa bits, half an ulp relative; subnormals below 2^-6 step by 2^-9
    assert np.all(err <= np.maximum(np.abs(w) * 2.0 ** -4, scale * 2.0 ** -10) * (1 + 1e-4))
  assert np.abs(np.asarray(q.qvalue, np.float32)).max() <= (128 if fmt == "int8" else E4M3_MAX)


@pytest.mark.parametrize("fmt", ["int8", "fp8", "fp8-block"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_quantized_linear_equals_its_dequantized_float_version(fmt, dtype):
  w = jax.random.normal(jax.random.PRNGKey(1), (256, 128)) / 16
  x = jax.random.normal(jax.random.PRNGKey(2), (3, 5, 256)).astype(dtype)
  q = quantization.quantize(w, fmt)
  got = quantization.linear(x, q)
  want = x.astype(jnp.float32) @ quantization.dequantize_params(q, jnp.float32)
  assert got.dtype == x.dtype
  np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=1e-5 if dtype == "float32" else 3e-2)


def _published(path, fmt: str, float_dir) -> dict:
  """A float Hugging Face directory rewritten as a published quantized checkpoint (the layouts the formats
  define: weights [out, in] in F8_E4M3 or I8; compressed-tensors' `weight_scale` per channel [out, 1] or per
  tensor [1] and a static `input_scale`; block-wise fp8's `weight_scale_inv` [out/128, in/128]), quantized
  here with numpy alone. Returns the dequantized weights by tensor name: the float model they stand for."""
  tensors = load_file(float_dir / "model.safetensors")
  out, dequantized = {}, {}
  for name, w in tensors.items():
    if not name.endswith("_proj.weight"):
      out[name] = w
      continue
    module = name[:-len(".weight")]
    if fmt == "fp8-block":
      blocks = w.reshape(w.shape[0] // 128, 128, w.shape[1] // 128, 128)
      scale = np.abs(blocks).max(axis=(1, 3)) / E4M3_MAX
      q = (blocks / scale[:, None, :, None]).reshape(w.shape).astype(ml_dtypes.float8_e4m3fn)
      deq = (q.astype(np.float32).reshape(blocks.shape) * scale[:, None, :, None]).reshape(w.shape)
      out[f"{module}.weight_scale_inv"] = scale.astype(np.float32)
    else:
      per_tensor = fmt == "ct-fp8-tensor"
      top, dtype = (127.0, np.int8) if fmt == "ct-int8" else (E4M3_MAX, ml_dtypes.float8_e4m3fn)
      scale = (np.abs(w).max() if per_tensor else np.abs(w).max(axis=1, keepdims=True)) / top
      scaled = w / scale
      q = np.round(scaled).astype(dtype) if dtype == np.int8 else scaled.astype(dtype)
      deq = q.astype(np.float32) * scale
      out[f"{module}.weight_scale"] = np.asarray(scale, np.float32).reshape(1 if per_tensor else (-1, 1))
      out[f"{module}.input_scale"] = np.ones(1, np.float32)
    out[name], dequantized[name] = q, deq
  path.mkdir()
  save_file(out, str(path / "model.safetensors"))
  (path / "tokenizer.json").write_text((float_dir / "tokenizer.json").read_text())
  config = json.loads((float_dir / "config.json").read_text())
  if fmt == "fp8-block":
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128]}
  else:
    kind = "int" if fmt == "ct-int8" else "float"
    weights = {"num_bits": 8, "type": kind, "symmetric": True, "dynamic": False,
               "strategy": "tensor" if fmt == "ct-fp8-tensor" else "channel"}
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": f"{kind}-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                      "input_activations": {**weights, "strategy": "tensor"}}}}
  (path / "config.json").write_text(json.dumps(config))
  return dequantized


@pytest.mark.parametrize("fmt,stored", [("ct-fp8-channel", "fp8"), ("ct-fp8-tensor", "fp8"), ("ct-int8", "int8"),
                                        ("fp8-block", "fp8-block")])
def test_published_quantized_checkpoints_load_as_their_dequantized_models(tmp_path, fmt, stored):
  float_model = testing.random_model(BLOCKY, seed=3)
  hf.save_hf(float_model, tmp_path / "float")
  dequantized = _published(tmp_path / "q", fmt, tmp_path / "float")
  loaded = jspec.load(tmp_path / "q", dtype="float32")
  assert loaded.config.quantization == stored
  assert quantization.is_qarray(loaded.params["layers"][0]["wq"])
  reference = hf.load_hf(tmp_path / "float", "float32")
  for i, layer in enumerate(reference.params["layers"]):  # the float model the stored values and scales stand for
    for ours, theirs in {**hf.ATTENTION_NAMES, **hf.MLP_NAMES}.items():
      layer[ours] = jnp.asarray(dequantized[f"model.layers.{i}.{theirs}.weight"].T)
  tokens = jnp.asarray([[5, 17, 200, 3, 99, 41]])
  got, _ = model.forward_full(loaded.params, tokens, loaded.config)
  want, _ = model.forward_full(reference.params, tokens, reference.config)
  np.testing.assert_allclose(got, want, atol=2e-4, rtol=2e-4)


def test_unsupported_quantization_is_refused_in_one_line(tmp_path, capsys):
  from jspec import cli
  hf.save_hf(testing.random_model(testing.TINY), tmp_path)
  config = json.loads((tmp_path / "config.json").read_text())
  config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128}
  (tmp_path / "config.json").write_text(json.dumps(config))
  assert cli.main(["--target", str(tmp_path), "--no-draft", "--prompt", "x"]) == 2
  err = capsys.readouterr().err
  assert "Traceback" not in err and "unsupported quantization 'gptq' (bits 4, group_size 128)" in \
      err.strip().splitlines()[-1]
  with pytest.raises(ValueError, match="stored in int8; it loads as it is, not as fp8"):
    loading.quantized(loading.quantized(testing.random_model(), "int8"), "fp8")
  with pytest.raises(ValueError, match="medusa heads have no attention or MLP layers"):
    loading.quantized(testing.random_draft("medusa", testing.random_model()), "int8")


def test_quantized_checkpoints_save_and_restore_quantized(tmp_path):
  from jspec import convert
  hf.save_hf(testing.random_model(BLOCKY), tmp_path / "hf")
  assert convert.main([str(tmp_path / "hf"), str(tmp_path / "converted"), "--quantize", "fp8"]) == 0
  converted = jspec.load(tmp_path / "converted")
  assert converted.config.quantization == "fp8" and quantization.is_quantized(converted.params)
  assert convert.main([str(tmp_path / "converted"), str(tmp_path / "back"), "--to-hf"]) == 2  # float32 only
  target = loading.quantized(testing.random_model(BLOCKY), "fp8-block")
  heads = loading.quantized(testing.random_eagle3(testing.random_model()), "int8")
  checkpoint.save(target, tmp_path / "model", storage_dtype="bfloat16")  # the stored values and scales stay
  checkpoint.save_heads(heads, tmp_path / "heads")
  for saved, path in ((target, "model"), (heads, "heads")):
    restored = jspec.load(tmp_path / path, dtype="float32")
    assert jax.tree.structure(restored.params) == jax.tree.structure(saved.params)
    is_q = quantization.is_qarray
    for a, b in zip(jax.tree.leaves(restored.params, is_leaf=is_q), jax.tree.leaves(saved.params, is_leaf=is_q)):
      if is_q(b):  # exactly
        assert a.qvalue.dtype == b.qvalue.dtype and a.scale.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(a.qvalue, np.float32), np.asarray(b.qvalue, np.float32))
        np.testing.assert_array_equal(a.scale, b.scale)
      else:  # the rest as bfloat16 stored it
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-2, atol=1e-3)


@pytest.fixture(scope="module")
def int8_target():
  return loading.quantized(testing.random_model(testing.SMALL_VOCAB, seed=0, scale=2.0), "int8")


def test_greedy_speculation_over_a_quantized_target_is_its_plain_decoding(int8_target):
  """Every drafter, a draft tree, and drafts quantized otherwise: the int8 target's own greedy tokens."""
  target, float_target = int8_target, testing.random_model(testing.SMALL_VOCAB, seed=0, scale=2.0)
  rng = np.random.default_rng(0)
  ps = [rng.integers(0, 16, size=int(n)).tolist() for n in (3, 9, 5, 1)]
  plain = jspec.generate(target, ps, max_new_tokens=16)
  logits = lambda m: testing.full_logits(m, [ps[1] + plain.token_ids[1]])
  assert np.abs(logits(target) - logits(float_target)).max() > 1e-3  # another model than the float one
  for p, ids in zip(ps, plain.token_ids):
    testing.assert_target_argmax(target, p, ids)
  drafts = {"model": loading.quantized(testing.random_draft("model", float_target), "fp8"),
            "medusa": testing.random_draft("medusa", target),
            "eagle": loading.quantized(testing.random_draft("eagle", float_target), "fp8"),
            "ngram": None, "suffix": None}
  for kind, draft in drafts.items():
    r = jspec.generate(target, ps, draft=draft, spec=testing.fixed_k(3, drafter=kind), max_new_tokens=16)
    assert r.token_ids == plain.token_ids and r.stats.accepted_tokens > 0, kind
  tree = SpecConfig(3, drafter="eagle", tree=jspec.TreeConfig(2, 6), adaptive=None)
  eagle3 = loading.quantized(testing.random_eagle3(float_target), "int8")
  r = jspec.generate(target, ps, draft=eagle3, spec=tree, max_new_tokens=16)
  assert r.token_ids == plain.token_ids and r.stats.accepted_tokens > 0


def test_two_tokens_over_a_quantized_target_and_draft_follow_the_quantized_targets_law(int8_target):
  draft = loading.quantized(testing.perturbed(testing.random_model(testing.SMALL_VOCAB, seed=0, scale=2.0), 0.5),
                            "fp8")
  tv, bound, stats = testing.two_token_tv(int8_target, [3, 1, 4], (1.0, 0, 1.0), 4000, draft=draft,
                                          spec=testing.fixed_k(2, drafter="model"))
  assert tv < bound and 0 < stats.acceptance_rate < 1
