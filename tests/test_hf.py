"""Hugging Face import: logits and greedy tokens match transformers for llama, qwen2 and mistral.

Needs the `[interop]` extra (torch, transformers); the rest of the suite runs without it.
"""
import dataclasses
import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402

import jspec  # noqa: E402
from jspec import model, testing  # noqa: E402
from jspec.checkpoint import save  # noqa: E402
from jspec.tokenizer import byte_tokenizer  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parent.parent
COMMON = dict(vocab_size=257, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.3,
              bos_token_id=None, eos_token_id=256, pad_token_id=None)
TYPES = {
    "llama": (transformers.LlamaConfig, dict(rope_theta=10000.0, tie_word_embeddings=False)),
    "qwen2": (transformers.Qwen2Config, dict(rope_theta=1000000.0, tie_word_embeddings=True)),
    "mistral": (transformers.MistralConfig, dict(rope_theta=10000.0, sliding_window=None,
                                                 tie_word_embeddings=False)),
}


def make_hf(tmp: pathlib.Path, kind: str, seed: int = 0, shard: bool = False, **overrides):
  cls, extra = TYPES[kind]
  torch.manual_seed(seed)
  cfg = cls(**{**COMMON, **extra, **overrides})
  m = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
  path = tmp / f"{kind}-{seed}"
  m.save_pretrained(path, **({"max_shard_size": "100KB"} if shard else {}))
  byte_tokenizer().save(str(path / "tokenizer.json"))
  return m, path


def hf_greedy(m, prompt_ids, new):
  out = m.generate(torch.tensor([prompt_ids]), max_new_tokens=new, do_sample=False, min_new_tokens=new)
  return out[0, len(prompt_ids):].tolist()


@pytest.mark.parametrize("kind", list(TYPES))
def test_logits_and_greedy_match_transformers(tmp_path, kind):
  m, path = make_hf(tmp_path, kind, shard=kind == "llama")
  if kind == "llama":
    assert (path / "model.safetensors.index.json").is_file()  # the sharded layout is exercised
  ours = jspec.load(path)
  tokens = np.random.default_rng(0).integers(0, 256, size=(2, 37))
  with torch.no_grad():
    want = m(torch.tensor(tokens)).logits.numpy()
  got = np.asarray(model.forward_full(ours.params, tokens, ours.config)[0])
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)

  prompt = [10, 20, 30, 40, 50]
  want_ids = hf_greedy(m, prompt, 24)
  assert jspec.generate(ours, [prompt], max_new_tokens=24).token_ids[0] == want_ids
  draft_m, draft_path = make_hf(tmp_path, "llama", seed=1, num_hidden_layers=1)
  spec = jspec.generate(ours, [prompt], draft=jspec.load(draft_path), max_new_tokens=24, draft_len=3)
  assert spec.token_ids[0] == want_ids


def test_convert_cli_and_bad_hf_dirs(tmp_path):
  m, path = make_hf(tmp_path, "qwen2")
  out = tmp_path / "converted"
  proc = subprocess.run([sys.executable, "-m", "jspec.convert", str(path), str(out)], capture_output=True,
                        text=True, cwd=REPO, timeout=300)
  assert proc.returncode == 0, proc.stderr
  a, b = jspec.load(path), jspec.load(out)
  assert a.config == b.config
  assert (jspec.generate(a, ["abc"], max_new_tokens=8).token_ids
          == jspec.generate(b, ["abc"], max_new_tokens=8).token_ids)

  cfg = json.loads((path / "config.json").read_text())
  (path / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
  with pytest.raises(ValueError, match="unsupported model_type 'gpt2'.*llama, mistral, qwen2"):
    jspec.load(path)
  (path / "config.json").write_text(json.dumps(cfg))

  raw = (path / "model.safetensors").read_bytes()
  size = int.from_bytes(raw[:8], "little")
  header = json.loads(raw[8:8 + size])
  del header["model.norm.weight"]
  new_header = json.dumps(header).encode()
  (path / "model.safetensors").write_bytes(len(new_header).to_bytes(8, "little") + new_header + raw[8 + size:])
  with pytest.raises(ValueError, match="tensor model.norm.weight is missing"):
    jspec.load(path)

  (path / "tokenizer.json").unlink()
  proc = subprocess.run([sys.executable, "-m", "jspec.generate", "--target", str(path), "--prompt", "x"],
                        capture_output=True, text=True, cwd=REPO, timeout=300)
  assert proc.returncode == 2 and "no tokenizer.json" in proc.stderr and proc.stderr.count("\n") == 1


def test_to_hf_export_loads_in_transformers_and_assisted_generation_matches(tmp_path):
  # jspec -> HF Llama (`python -m jspec.convert --to-hf`): transformers computes the same logits, its assisted
  # generation gives jspec's speculative greedy tokens, and jspec reads the export back unchanged.
  target = testing.random_model(dataclasses.replace(testing.TINY, tie_embeddings=False), scale=2.0)
  draft = testing.perturbed(target, 0.3)
  hf = {}
  for name, m in [("target", target), ("draft", draft)]:
    save(m, tmp_path / name)
    proc = subprocess.run([sys.executable, "-m", "jspec.convert", "--to-hf", str(tmp_path / name),
                           str(tmp_path / f"{name}-hf")], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr
    hf[name] = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / f"{name}-hf", dtype=torch.float32).eval()
  back = jspec.load(tmp_path / "target-hf")
  assert back.config == target.config
  for a, b in zip(jax.tree.leaves(back.params), jax.tree.leaves(target.params)):
    np.testing.assert_array_equal(a, b)

  tokens = np.random.default_rng(0).integers(0, 256, size=(2, 29))
  with torch.no_grad():
    want = hf["target"](torch.tensor(tokens)).logits.numpy()
  np.testing.assert_allclose(np.asarray(model.forward_full(target.params, tokens, target.config)[0]), want,
                             atol=1e-4, rtol=1e-4)
  prompt = [10, 20, 30, 40, 50]
  with torch.no_grad():
    assisted = hf["target"].generate(torch.tensor([prompt]), assistant_model=hf["draft"], do_sample=False,
                                     max_new_tokens=24)[0, len(prompt):].tolist()
  ours = jspec.generate(target, [prompt], draft=draft, max_new_tokens=24, draft_len=3).token_ids[0]
  assert ours == assisted == hf_greedy(hf["target"], prompt, len(assisted))
