"""Programs compiled for accelerators that are not here (`python -m jspec.plan --compile-for`): TPU
topologies where libtpu is installed, NVIDIA GPUs where the CUDA plugin is (`.[gpu-compile]`); each skips
without its compiler, and the refusals run everywhere."""
import importlib.util
import json

import pytest

from jspec import plan
from jspec.decoding import programs
from jspec.formats import loading
from jspec.model import sharding
from jspec.planning import accelerators, gpus, memory, shaped

# TPU-shaped: widths in whole 128-lane tiles, so XLA's layouts pad nothing the plan does not count; a head dim
# of 128, which the GPU kernel takes (a power of two).
SMALL = {"model_type": "llama", "vocab_size": 2048, "hidden_size": 512, "intermediate_size": 1024,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 1024}


def _libtpu() -> bool:
  return importlib.util.find_spec("libtpu") is not None


def _small(tmp_path) -> str:
  (tmp_path / "target.json").write_text(json.dumps(SMALL))
  return str(tmp_path / "target.json")


def _agrees_with_the_plan(out: dict) -> None:
  """XLA's arguments per device are the plan's weights per device; its temporaries hold the plan's KV caches;
  the plan's total is within 15% of XLA's less the generated code (which the plan does not count); a round
  costs more than a plain step (estimates)."""
  compiled = out["compiled"]
  weights = out["weights_bytes"] + out["draft_weights_bytes"]
  assert weights <= compiled["argument_bytes"] <= weights * 1.01 + 2 ** 16  # + the requests
  caches = out["kv_cache_bytes"] + out["draft_kv_cache_bytes"]
  assert caches <= compiled["temp_bytes"]
  xla = compiled["total_bytes"] - compiled["code_bytes"]
  assert abs(out["total_bytes"] - xla) <= 0.15 * xla, (out["total_bytes"], xla)
  assert compiled["fits"] and compiled["estimated_round_cost"] > 1.0


@pytest.mark.skipif(not _libtpu(), reason="no libtpu: pip install -e '.[tpu]'")
def test_compile_for_a_tpu_topology_agrees_with_the_plan(tmp_path, capsys):
  """The decode program compiled ahead of time for four v5e chips (Mosaic and XLA's TPU passes run here), as
  a server's plan on a mesh that splits the batch: the decode program, and the server's segment and insert
  programs, whose arguments hold the state it keeps between calls (both caches) beside the weights."""
  args = ["--target", _small(tmp_path), "--drafter", "ngram", "--batch-size", "8", "--context", "1024",
          "--compile-for", "tpu:v5e:2x2", "--json", "--serving", "--mesh", "data=4"]
  assert plan.main(args) == 0
  out = json.loads(capsys.readouterr().out)
  compiled = out["compiled"]
  assert compiled["attention"] == "Pallas TPU (Mosaic) kernel" and compiled["cost_source"] == "compiled"
  assert out["devices"] == compiled["devices"] == 4 and out["device_memory_bytes"] == 16 * 10 ** 9  # a v5e chip
  _agrees_with_the_plan(out)
  server, weights = compiled["server"], out["weights_bytes"] + out["draft_weights_bytes"]
  caches = out["kv_cache_bytes"] + out["draft_kv_cache_bytes"]
  assert server["segment"]["argument_bytes"] >= weights + caches and server["insert"]["argument_bytes"] >= caches


@pytest.mark.skipif(not _libtpu(), reason="no libtpu: pip install -e '.[tpu]'")
def test_a_mixture_of_experts_compiles_for_a_tpu_topology_as_planned(tmp_path, capsys):
  """A small Qwen3-MoE shape on four v5e chips: the experts as XLA's grouped matmul, their columns split four
  ways (two 64-column block pairs each); rounds of more K. (XLA's temporaries here exceed the plan's caches and
  workspace by 13 MB, a fixed cost beside 29 MB; at Qwen3-30B-A3B's shape the plan is 6.4% under XLA's total:
  docs/moe.md.)"""
  (tmp_path / "moe.json").write_text(json.dumps({**SMALL, "model_type": "qwen3_moe", "num_experts": 8,
                                                 "num_experts_per_tok": 2, "moe_intermediate_size": 512,
                                                 "head_dim": 128, "norm_topk_prob": True}))
  args = ["--target", str(tmp_path / "moe.json"), "--drafter", "ngram", "--batch-size", "8", "--context", "1024",
          "--compile-for", "tpu:v5e:2x2", "--round-lens", "2", "--json"]
  assert plan.main(args) == 0
  out = json.loads(capsys.readouterr().out)
  compiled, weights = out["compiled"], out["weights_bytes"]
  assert out["experts"]["bytes_per_device"] == out["experts"]["params"] * 2 // 4
  assert weights <= compiled["argument_bytes"] <= weights * 1.01 + 2 ** 16
  assert out["kv_cache_bytes"] <= compiled["temp_bytes"] and compiled["fits"]
  assert set(compiled["round_costs"]) == {"2", "4"} and compiled["round_costs"]["4"] > compiled["round_costs"]["2"]


@pytest.mark.skipif(not gpus.compiler_installed(), reason="no CUDA plugin: pip install -e '.[gpu-compile]'")
def test_compile_for_an_h100_builds_the_triton_kernel_and_agrees_with_the_plan(tmp_path, capsys):
  """The decode program compiled for one H100 (XLA's CUDA passes, Triton and ptxas run here): the attention
  is jspec's Triton kernel, in the executable's HLO as Triton calls; the memory agrees with the plan as on a
  TPU; the estimates come from the optimized module's cost (the CUDA compiler reports none). A server's
  programs compile over its pool of pages: the segment's arguments hold the pools beside the weights. With
  fp8 weights the program's arguments shrink by what the plan saves, and a plain step reads fewer bytes."""
  target = _small(tmp_path)
  args = ["--target", target, "--drafter", "ngram", "--batch-size", "4", "--context", "1024", "--compile-for",
          "gpu:h100:1", "--json"]
  assert plan.main(args) == 0
  out = json.loads(capsys.readouterr().out)
  compiled = out["compiled"]
  assert out["workspace_source"] == "compiled"  # the one-layer program's, compiled for the H100
  assert compiled["attention"] == "Pallas GPU (Triton) kernel" and compiled["cost_source"] == "optimized hlo"
  assert out["device_memory_bytes"] == compiled["hbm_bytes"] == 80 * 10 ** 9 and compiled["topology"] == "gpu:h100:1"
  _agrees_with_the_plan(out)
  assert plan.main([*args, "--quantize", "fp8"]) == 0
  fp8 = json.loads(capsys.readouterr().out)
  # With fp8 weights XLA:GPU's temporaries grow by 7.9 MB here and the one-layer program's (the workspace) by
  # 4.2 MB, so the plan is 19% low for this small model (4% for the 70B: docs/quantization.md)
  assert abs(fp8["total_bytes"] - fp8["compiled"]["total_bytes"]) <= 0.25 * fp8["compiled"]["total_bytes"]
  saved = out["weights_bytes"] - fp8["weights_bytes"]
  assert saved > 0 and compiled["argument_bytes"] - fp8["compiled"]["argument_bytes"] == pytest.approx(saved, rel=0.01)
  assert fp8["compiled"]["estimated_plain_step_s"] < compiled["estimated_plain_step_s"]
  assert plan.main([*args, "--serving"]) == 0
  out = json.loads(capsys.readouterr().out)
  weights, caches = out["weights_bytes"] + out["draft_weights_bytes"], out["kv_cache_bytes"]
  pool = caches * (out["kv_pages"] + 1) / (out["kv_pages"])  # every slot's whole context, and a scratch page
  assert out["compiled"]["server"]["segment"]["argument_bytes"] >= weights + pool
  devices = accelerators.Target.parse("gpu:h100:1").devices()
  assert devices[0].device_kind == gpus.GPUS["h100"].name
  decoder = sharding.place_decoder(sharding.make_mesh("model=1", devices),
                                   shaped.shaped_decoder(loading.load_shapes(target, "bfloat16"), None, None, 4), 4)
  batch = sharding.place(memory.abstract_batch(decoder, 4, 512, 1024), decoder.layout.mesh)
  hlo = programs.lower(decoder, batch).compile().as_text()
  assert hlo.count("__gpu$xla.gpu.triton") >= SMALL["num_hidden_layers"]  # a prefill's and a step's, per layer


@pytest.mark.skipif(not gpus.compiler_installed(), reason="no CUDA plugin: pip install -e '.[gpu-compile]'")
@pytest.mark.parametrize("chip", sorted(gpus.GPUS))
def test_every_gpu_target_config_gives_that_gpus_devices(chip):
  devices = accelerators.Target.parse(f"gpu:{chip}:2").devices()
  assert [d.device_kind for d in devices] == [gpus.GPUS[chip].name] * 2


def test_compile_for_names_its_forms_and_each_chips_figures():
  assert accelerators.Target.parse("gpu:h200:8") == accelerators.Target("h200", "8", "gpu")
  assert accelerators.Target.parse("gpu:h200:8").chips == 8 and str(accelerators.Target.parse("tpu:v4:2x2x1")) \
      == "tpu:v4:2x2x1"
  for name, gpu in gpus.GPUS.items():
    text = gpus.target_config(name)
    assert f"core_count: {gpu.sms}\n" in text and f'device_description_str: "{gpu.name}"' in text
    assert accelerators.CHIPS["gpu"][name].hbm_bytes == gpu.memory_bytes
  for bad in ("gpu:h100", "gpu:h100:0", "gpu:v100:2", "tpu:h100:2", "gpu:h100:2x2"):
    with pytest.raises(ValueError, match="expected tpu:CHIP:TOPOLOGY .*; gpu:CHIP:COUNT with CHIP one of h100"):
      accelerators.Target.parse(bad)


def test_compile_for_refuses_what_it_cannot_compile_in_one_line(tmp_path, capsys):
  base = ["--target", _small(tmp_path), "--no-draft"]
  assert plan.main([*base, "--compile-for", "gpu:h100"]) == 2
  assert "expected tpu:CHIP:TOPOLOGY" in capsys.readouterr().err
  if not _libtpu():
    assert plan.main([*base, "--compile-for", "tpu:v5e:2x2"]) == 2
    assert 'pip install -e ".[tpu]"' in capsys.readouterr().err
  else:
    assert plan.main([*base, "--compile-for", "tpu:v5e:2x2", "--mesh", "model=2"]) == 2
    assert "needs 2 devices; tpu:v5e:2x2 has 4" in capsys.readouterr().err
  if not gpus.compiler_installed():
    assert plan.main([*base, "--compile-for", "gpu:h100:2"]) == 2
    assert 'pip install -e ".[gpu-compile]"' in capsys.readouterr().err
  else:
    assert plan.main([*base, "--compile-for", "gpu:h100:2", "--mesh", "model=4"]) == 2
    assert "needs 4 devices; gpu:h100:2 has 2" in capsys.readouterr().err
