"""Hugging Face import, one family at a time: logits, greedy and speculative tokens against transformers.

Each family is a tiny random model built by `transformers` with what makes it differ switched on (RoPE
scaling active past `original_max_position_embeddings`, sliding windows shorter than the prompt, GQA,
soft-caps, q/k norms, fused projections). Needs the `[interop]` extra (torch, transformers); the rest of the
suite runs without it.
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
from jspec import convert, testing  # noqa: E402
from jspec.core.settings import SpecConfig  # noqa: E402
from jspec.decoding.decoder import make_decoder  # noqa: E402
from jspec.drafters.base import DraftWeights  # noqa: E402
from jspec.formats.checkpoint import save  # noqa: E402
from jspec.model import hf, hf_config, model  # noqa: E402
from jspec.text.tokenizer import byte_tokenizer, encode  # noqa: E402

pytestmark = pytest.mark.slow  # every family against transformers

FIXED = testing.fixed_k(3)  # every round drafts 3: the tests exercise verification

REPO = pathlib.Path(__file__).resolve().parent.parent
COMMON = dict(vocab_size=264, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.3,
              bos_token_id=None, eos_token_id=None, pad_token_id=None)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
# family -> (config class, its settings); prompts of 20 tokens decode 24 more: past position 32 (where the
# RoPE scalings start to matter) and far past the windows of 8.
FAMILIES = {
    "llama": (transformers.LlamaConfig, dict(rope_scaling=LLAMA3, tie_word_embeddings=False)),
    "llama-linear": (transformers.LlamaConfig, dict(rope_scaling={"rope_type": "linear", "factor": 2.0},
                                                    tie_word_embeddings=True)),
    "llama-dynamic": (transformers.LlamaConfig, dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0},
                                                     max_position_embeddings=32)),
    "qwen2": (transformers.Qwen2Config, dict(rope_scaling=YARN, use_sliding_window=True, sliding_window=8,
                                             max_window_layers=1, tie_word_embeddings=True)),
    "qwen3": (transformers.Qwen3Config, dict(head_dim=32, rope_scaling=YARN, tie_word_embeddings=False)),
    "mistral": (transformers.MistralConfig, dict(sliding_window=8, head_dim=16)),
    "gemma2": (transformers.Gemma2Config, dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
                                               attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
    "gemma3": (transformers.Gemma3TextConfig, dict(
        head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
    "phi3": (transformers.Phi3Config, dict(partial_rotary_factor=0.5, sliding_window=8)),
    # mixtures of experts: softmax routing renormalized or not, a dense layer among sparse ones; sigmoid routing
    # among groups with the correction bias, shared experts, a q/k/v bias, q/k norms and half-rotary heads
    "qwen3_moe": (transformers.Qwen3MoeConfig, dict(head_dim=32, num_experts=8, num_experts_per_tok=2,
                                                    moe_intermediate_size=32, norm_topk_prob=False,
                                                    mlp_only_layers=[1])),
    "mixtral": (transformers.MixtralConfig, dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=8)),
    "glm4_moe": (transformers.Glm4MoeConfig, dict(
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
        n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=2.5, attention_bias=True,
        use_qk_norm=True)),
}
PROMPT = [int(x) for x in np.random.default_rng(1).integers(0, 256, 20)]
NEW = 24


def make_hf(tmp: pathlib.Path, family: str, seed: int = 0, shard: bool = False, **overrides):
  """A random transformers model of the family (norm weights randomized too), saved with the byte tokenizer."""
  cls, extra = FAMILIES[family]
  torch.manual_seed(seed)
  m = transformers.AutoModelForCausalLM.from_config(cls(**{**COMMON, **extra, **overrides}),
                                                    attn_implementation="eager").float().eval()
  with torch.no_grad():
    for name, p in m.named_parameters():
      if "norm" in name:
        p.add_(0.2 * torch.randn_like(p))
    for name, b in m.named_buffers():
      if "e_score_correction_bias" in name:
        b.copy_(0.1 * torch.randn_like(b))
  path = tmp / f"{family}-{seed}"
  m.save_pretrained(path, **({"max_shard_size": "100KB"} if shard else {}))
  byte_tokenizer().save(str(path / "tokenizer.json"))
  return m, path


def truncated(m, tmp: pathlib.Path, layers: int = 2) -> pathlib.Path:
  """A smaller draft of the same family: the target's first layers, which agree with it often."""
  fields = {**m.config.to_dict(), "num_hidden_layers": layers}
  if fields.get("layer_types"):
    fields["layer_types"] = fields["layer_types"][:layers]
  config = m.config.__class__(**fields)
  draft = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
  draft.load_state_dict(m.state_dict(), strict=False)
  path = tmp / "draft"
  draft.save_pretrained(path)
  byte_tokenizer().save(str(path / "tokenizer.json"))
  return path


def hf_greedy(m, prompt_ids, new, **kw):
  with torch.no_grad():
    out = m.generate(torch.tensor([prompt_ids]), max_new_tokens=new, do_sample=False, **kw)
  return out[0, len(prompt_ids):].tolist()


def hf_logits(m, tokens):
  with torch.no_grad():
    return m(torch.tensor(tokens)).logits.numpy()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_matches_transformers(tmp_path, family):
  m, path = make_hf(tmp_path, family, shard=family == "llama")
  if family == "llama":
    assert (path / "model.safetensors.index.json").is_file()  # the sharded layout is exercised
  ours = jspec.load(path)
  tokens = np.random.default_rng(0).integers(0, 256, size=(2, 48))
  got = np.asarray(model.forward_full(ours.params, tokens, ours.config)[0])
  np.testing.assert_allclose(got, hf_logits(m, tokens), atol=1e-4, rtol=1e-4)

  plain = jspec.generate(ours, [PROMPT], max_new_tokens=NEW).token_ids[0]
  spec = jspec.generate(ours, [PROMPT], draft=jspec.load(truncated(m, tmp_path)), max_new_tokens=NEW,
                        spec=FIXED)
  assert spec.token_ids[0] == plain
  assert spec.stats.accepted_tokens > 0  # whole rounds are accepted, windows included
  if family == "llama-dynamic":
    # Dynamic NTK under jit is pinned to the request's final length: each token is the argmax of a full
    # forward over the finished sequence, which is what transformers computes for that sequence (checked
    # above). transformers' own generate re-derives the frequencies as the sequence grows, and keeps keys
    # rotated the old way in its cache, so token-by-token it is not comparable past position 32.
    testing.assert_target_argmax(ours, PROMPT, plain)
  else:
    assert plain == hf_greedy(m, PROMPT, NEW)

  # python -m jspec.convert, then the jspec checkpoint reads back the same model (for the families whose configs
  # hold every kind of field: RoPE scalings, sliding windows and local bases, experts)
  if family in ("llama", "qwen3", "gemma3", "glm4_moe"):
    assert convert.main([str(path), str(tmp_path / "converted")]) == 0
    back = jspec.load(tmp_path / "converted")
    assert back.config == ours.config
    jax.tree.map(np.testing.assert_array_equal, back.params, ours.params)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
def test_transformers_4_config_keys_read_the_same(tmp_path, family):
  """The same model described with transformers 4's keys: `rope_theta`, `rope_scaling` with `type`, and
  Gemma 3's `rope_local_base_freq` and `sliding_window_pattern`."""
  cfg = hf_config.config_from_hf(json.loads((make_hf(tmp_path, family)[1] / "config.json").read_text()))
  old = json.loads((tmp_path / f"{family}-0" / "config.json").read_text())
  rope = old.pop("rope_parameters")
  if family == "gemma3":
    old.pop("layer_types")
    rope, local = rope["full_attention"], rope["sliding_attention"]
    old.update(rope_local_base_freq=local["rope_theta"], sliding_window_pattern=2)
  old["rope_theta"] = rope.pop("rope_theta")
  old["rope_scaling"] = {"type": rope.pop("rope_type"), **rope}
  assert hf_config.config_from_hf(old) == cfg


def test_gemma3_multimodal_directory_reads_its_language_model(tmp_path):
  """A Gemma3ForConditionalGeneration directory: the text model's weights under `language_model.*` and its
  config under `text_config`."""
  m, path = make_hf(tmp_path, "gemma3")
  wrapped = tmp_path / "gemma3-mm"
  wrapped.mkdir()
  text = json.loads((path / "config.json").read_text())
  (wrapped / "config.json").write_text(json.dumps({"model_type": "gemma3", "text_config": text,
                                                   "vision_config": {"model_type": "siglip_vision_model"}}))
  from safetensors.numpy import load_file, save_file
  tensors = load_file(str(path / "model.safetensors"))
  tensors = {("language_model." + k): v for k, v in tensors.items()}
  tensors["vision_tower.vision_model.embeddings.patch_embedding.weight"] = np.zeros((4, 3, 2, 2), np.float32)
  save_file(tensors, str(wrapped / "model.safetensors"))
  byte_tokenizer().save(str(wrapped / "tokenizer.json"))
  ours = jspec.load(wrapped)
  tokens = np.random.default_rng(0).integers(0, 256, size=(1, 40))
  np.testing.assert_allclose(np.asarray(model.forward_full(ours.params, tokens, ours.config)[0]),
                             hf_logits(m, tokens), atol=1e-4, rtol=1e-4)


def test_every_eos_id_stops_a_row(tmp_path):
  m, path = make_hf(tmp_path, "llama")
  free = hf_greedy(m, PROMPT, NEW)
  stop_a, stop_b = free[5], free[9]  # tokens greedy decoding will meet
  stop_b = stop_b if stop_b != stop_a else free[10]
  cfg = json.loads((path / "config.json").read_text())
  for eos, generation in [([999, stop_a], None), (999, {"eos_token_id": [stop_a]}), ([stop_b, stop_a], None)]:
    (path / "config.json").write_text(json.dumps({**cfg, "eos_token_id": eos}))
    (path / "generation_config.json").unlink(missing_ok=True)
    if generation:
      (path / "generation_config.json").write_text(json.dumps(generation))
    ours = jspec.load(path)
    out = jspec.generate(ours, [PROMPT], max_new_tokens=NEW).token_ids[0]
    first = min(free.index(t) for t in (stop_a, stop_b) if t in ours.config.stop_ids)
    assert out == free[:first + 1]
    hf_eos = [t for t in ours.config.stop_ids if t < 264]
    assert out == hf_greedy(m, PROMPT, NEW, eos_token_id=hf_eos)  # transformers stops at the same token
    spec = jspec.generate(ours, [PROMPT], draft=testing.perturbed(ours, 0.3), max_new_tokens=NEW, spec=FIXED)
    assert spec.token_ids[0] == out


CHAT = ("{{ bos_token }}{% for message in messages %}{{ '<|' + message['role'] + '|>' + message['content'] | trim }}"
        "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")


def test_chat_template_renders_as_transformers_does(tmp_path):
  _, path = make_hf(tmp_path, "llama")
  (path / "tokenizer_config.json").write_text(json.dumps({
      "chat_template": CHAT, "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
      "tokenizer_class": "PreTrainedTokenizerFast"}))
  hf_tok = transformers.PreTrainedTokenizerFast.from_pretrained(path)
  messages = [{"role": "user", "content": "  def f(x):\n  é "}]
  want = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
  ours = jspec.load(path)
  assert ours.chat_template.render(messages[0]["content"]) == want
  ids = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
  assert encode(ours.tokenizer, want) == list(ids)
  chat = jspec.generate(ours, [messages[0]["content"]], chat=True, max_new_tokens=4)
  assert chat.token_ids == jspec.generate(ours, [list(ids)], max_new_tokens=4).token_ids
  # The template is kept through a conversion to a jspec checkpoint.
  assert convert.main([str(path), str(tmp_path / "converted")]) == 0
  assert jspec.load(tmp_path / "converted").chat_template == ours.chat_template

  # Untrusted templates run sandboxed, and every failure is one line.
  for template, message in [("{{ raise_exception('no system role') }}", "no system role"),
                            ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "failed to render"),
                            ("{% for %}", "failed to render")]:
    broken = dataclasses.replace(ours, chat_template=dataclasses.replace(ours.chat_template, template=template))
    with pytest.raises(ValueError, match=message):
      jspec.generate(broken, ["hi"], chat=True, max_new_tokens=2)
  with pytest.raises(ValueError, match="no chat template"):
    jspec.generate(dataclasses.replace(ours, chat_template=None), ["hi"], chat=True)


def test_a_draft_with_a_padded_vocabulary(tmp_path):
  """Qwen2.5's drafts pad the embedding to other sizes than their targets, with the same tokenizer."""
  _, path = make_hf(tmp_path, "qwen2")
  target = jspec.load(path)
  plain = jspec.generate(target, [PROMPT], max_new_tokens=NEW).token_ids
  for rows in (257, 300):  # fewer and more rows than the target's 264; the tokenizer has 257 tokens
    _, draft_path = make_hf(tmp_path, "qwen2", seed=rows, num_hidden_layers=1, vocab_size=rows)
    draft = jspec.load(draft_path)
    assert jspec.generate(target, [PROMPT], draft=draft, max_new_tokens=NEW, spec=FIXED).token_ids == plain
    if rows < 264:  # adaptive K: the draft's wide catch-up writes logits at the target's width
      assert jspec.generate(target, [PROMPT], draft=draft, max_new_tokens=NEW, draft_len=2).token_ids == plain
    else:
      sampled = jspec.generate(target, [PROMPT] * 8, draft=draft, max_new_tokens=NEW, spec=FIXED, temperature=1)
      assert all(max(ids) < 264 for ids in sampled.token_ids)
    # Proposals are over the target's vocabulary and never past the smaller one.
    decoder = make_decoder(target, draft, None, 1)
    logits = decoder.drafter._logits(draft.params, np.ones((1, 1, 64), np.float32))
    assert logits.shape[-1] == 264 and np.all(np.isneginf(np.asarray(logits)[..., min(rows, 264):]))


def test_a_draft_of_another_family_with_another_tokenizer(tmp_path):
  """A Llama target with a SentencePiece-style tokenizer, drafted for by a Qwen2 model with a byte-level one:
  greedy tokens are transformers' plain greedy tokens."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  m, path = make_hf(tmp_path, "llama")
  spm = Tokenizer(models.BPE(byte_fallback=True))
  spm.pre_tokenizer, spm.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
  text = pathlib.Path(jspec.__file__).read_text()
  spm.train_from_iterator([text], trainers.BpeTrainer(vocab_size=200, special_tokens=["<s>", "</s>"],
                                                      show_progress=False))
  spm.save(str(path / "tokenizer.json"))
  _, draft_path = make_hf(tmp_path, "qwen2", seed=3, num_hidden_layers=1)
  target, draft = jspec.load(path), jspec.load(draft_path)
  assert type(make_decoder(target, draft, FIXED, 1).drafter).__name__ == "CrossVocabDrafter"
  prompts = [encode(target.tokenizer, "def load(path"), encode(target.tokenizer, "import jspec\n\nx = 1\n")]
  got = jspec.generate(target, prompts, draft=draft, max_new_tokens=NEW, spec=FIXED)
  assert got.token_ids == [hf_greedy(m, p, NEW) for p in prompts]
  assert got.stats.drafted_tokens > 0


def test_unsupported_checkpoints_are_one_line_errors(tmp_path):
  m, path = make_hf(tmp_path, "qwen2")
  cfg = json.loads((path / "config.json").read_text())
  for change, message in [
      ({"model_type": "gpt2"}, "unsupported model_type 'gpt2': jspec reads gemma2, gemma3, glm4_moe, llama"),
      ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "rope_scaling.rope_type 'longrope'"),
      ({"rope_scaling": {"rope_type": "su", "factor": 2.0}}, "unsupported RoPE scaling type 'su'"),
      ({"hidden_act": "relu"}, "unsupported hidden_act 'relu'"),
      ({"mlp_bias": True}, "unsupported: attention_bias or mlp_bias")]:
    (path / "config.json").write_text(json.dumps({**cfg, **change, "rope_parameters": None}))
    with pytest.raises(ValueError, match=message):
      jspec.load(path)
  (path / "config.json").write_text(json.dumps(cfg))

  from safetensors.numpy import load_file, save_file
  tensors = load_file(str(path / "model.safetensors"))
  save_file({k: v for k, v in tensors.items() if k != "model.norm.weight"}, str(path / "model.safetensors"))
  with pytest.raises(ValueError, match="tensor model.norm.weight is missing"):
    jspec.load(path)
  raw = (path / "model.safetensors").read_bytes()
  (path / "model.safetensors").write_bytes(raw[:len(raw) // 2])  # truncated
  with pytest.raises(ValueError, match="not a readable safetensors file"):
    jspec.load(path)

  (path / "tokenizer.json").unlink()
  proc = subprocess.run([sys.executable, "-m", "jspec.generate", "--target", str(path), "--prompt", "x", "--quiet"],
                        capture_output=True, text=True, cwd=REPO, timeout=300)
  assert proc.returncode == 2 and "no tokenizer.json" in proc.stderr and proc.stderr.count("\n") == 1


def test_bf16_weights_load_as_bf16(tmp_path):
  m, path = make_hf(tmp_path, "llama")
  m.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
  byte_tokenizer().save(str(tmp_path / "bf16" / "tokenizer.json"))
  half = jspec.load(tmp_path / "bf16", dtype="bfloat16")
  assert {x.dtype for x in jax.tree.leaves(half.params)} == {jax.numpy.dtype("bfloat16")}
  assert len(jspec.generate(half, [PROMPT], max_new_tokens=4).token_ids[0]) == 4
  with pytest.raises(ValueError, match="unsupported dtype 'float16'"):
    jspec.load(path, dtype="float16")


def test_to_hf_export_loads_in_transformers_and_assisted_generation_matches(tmp_path):
  # jspec -> HF Llama (`python -m jspec.convert --to-hf`): transformers computes the same logits, its assisted
  # generation gives jspec's speculative greedy tokens, and jspec reads the export back unchanged.
  target = testing.random_model(dataclasses.replace(testing.TINY, tie_embeddings=False), scale=2.0)
  draft = testing.perturbed(target, 0.3)
  exported = {}
  for name, m in [("target", target), ("draft", draft)]:
    save(m, tmp_path / name)
    proc = subprocess.run([sys.executable, "-m", "jspec.convert", "--to-hf", str(tmp_path / name),
                           str(tmp_path / f"{name}-hf")], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr
    exported[name] = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / f"{name}-hf",
                                                                       dtype=torch.float32).eval()
  back = jspec.load(tmp_path / "target-hf")
  assert back.config == target.config
  for a, b in zip(jax.tree.leaves(back.params), jax.tree.leaves(target.params)):
    np.testing.assert_array_equal(a, b)

  tokens = np.random.default_rng(0).integers(0, 256, size=(2, 29))
  np.testing.assert_allclose(np.asarray(model.forward_full(target.params, tokens, target.config)[0]),
                             hf_logits(exported["target"], tokens), atol=1e-4, rtol=1e-4)
  prompt = [10, 20, 30, 40, 50]
  with torch.no_grad():
    assisted = exported["target"].generate(torch.tensor([prompt]), assistant_model=exported["draft"], do_sample=False,
                                     max_new_tokens=24)[0, len(prompt):].tolist()
  ours = jspec.generate(target, [prompt], draft=draft, max_new_tokens=24, spec=FIXED).token_ids[0]
  assert ours == assisted == hf_greedy(exported["target"], prompt, len(assisted), min_new_tokens=len(assisted))
  # A parallel draft model's mask token travels as PARD writes it (`pard_token`) and is read back.
  parallel = dataclasses.replace(draft, config=dataclasses.replace(draft.config, mask_id=7))
  hf.save_hf(parallel, tmp_path / "parallel-hf")
  assert json.loads((tmp_path / "parallel-hf" / "config.json").read_text())["pard_token"] == 7
  assert jspec.load(tmp_path / "parallel-hf").config.mask_id == 7
  gemma = testing.random_model(dataclasses.replace(testing.TINY, norm_plus_one=True))
  with pytest.raises(ValueError, match="Llama directory, which has no"):
    hf.save_hf(gemma, tmp_path / "gemma-hf")


def rms(x, w, eps=1e-6):
  return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def test_mtp_layer_matches_the_forward_serving_systems_run_and_drafts_exactly(tmp_path):
  """GLM-4.5's layout: a random MTP layer (a sparse decoder layer after the last, `enorm`, `hnorm`, `eh_proj`,
  `shared_head`) added to a glm4_moe checkpoint. Its draft logits against vLLM's MTP forward, written here in
  torch over transformers' decoder layer; greedy speculation with it gives the target's greedy tokens."""
  m, path = make_hf(tmp_path, "glm4_moe")
  cfg, n, d = m.config, m.config.num_hidden_layers, m.config.hidden_size
  assert cfg.num_nextn_predict_layers == 1
  torch.manual_seed(1)
  layer = type(m.model.layers[-1])(cfg, n).float().eval()
  with torch.no_grad():
    for name, p in layer.named_parameters():
      p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p) / p.shape[-1] ** 0.5)
    layer.mlp.gate.e_score_correction_bias.copy_(0.1 * torch.randn(cfg.n_routed_experts))
  extra = {"enorm.weight": 1 + 0.2 * torch.randn(d), "hnorm.weight": 1 + 0.2 * torch.randn(d),
           "eh_proj.weight": torch.randn(d, 2 * d) / (2 * d) ** 0.5,
           "shared_head.norm.weight": 1 + 0.2 * torch.randn(d), "shared_head.head.weight": m.lm_head.weight.detach(),
           "embed_tokens.weight": m.model.embed_tokens.weight.detach()}
  stored = {f"model.layers.{n}.{k}": v for k, v in extra.items()}
  f = layer.mlp.experts.gate_up_proj.shape[1] // 2
  for name, v in layer.state_dict().items():
    if name == "mlp.experts.gate_up_proj":  # transformers fuses the experts; checkpoints keep one module each
      for e in range(v.shape[0]):
        stored[f"model.layers.{n}.mlp.experts.{e}.gate_proj.weight"] = v[e, :f]
        stored[f"model.layers.{n}.mlp.experts.{e}.up_proj.weight"] = v[e, f:]
    elif name == "mlp.experts.down_proj":
      for e in range(v.shape[0]):
        stored[f"model.layers.{n}.mlp.experts.{e}.down_proj.weight"] = v[e]
    else:
      stored[f"model.layers.{n}.{name}"] = v
  from safetensors.numpy import load_file, save_file
  tensors = load_file(str(path / "model.safetensors"))
  save_file({**tensors, **{k: np.ascontiguousarray(v.numpy()) for k, v in stored.items()}},
            str(path / "model.safetensors"))

  tokens = np.random.default_rng(0).integers(0, 256, size=(1, 24))
  with torch.no_grad():  # position p: the hidden state of token p and the embedding of token p + 1 (zero at 0)
    hidden = m.model(torch.tensor(tokens)).last_hidden_state[:, :-1]
    embedded = m.model.embed_tokens(torch.tensor(tokens[:, 1:]))
    embedded[:, 0] = 0
    x = torch.cat([rms(embedded, extra["enorm.weight"]), rms(hidden, extra["hnorm.weight"])], -1)
    x = x @ extra["eh_proj.weight"].T
    positions = torch.arange(x.shape[1])[None]
    mask = torch.full((x.shape[1], x.shape[1]), float("-inf")).triu(1)[None, None]
    out = layer(x, attention_mask=mask, position_ids=positions,
                position_embeddings=m.model.rotary_emb(x, positions))
    want = (rms(out, extra["shared_head.norm.weight"]) @ m.lm_head.weight.T).numpy()

  target, heads = jspec.load(path), jspec.load(path, mtp=True)
  assert heads.drafter.kind == "mtp" and not (heads.drafter.own_embed or heads.drafter.own_head)  # copies
  features = model.forward_full(target.params, tokens, target.config)[1][:, :-1]
  out = heads.drafter.unrolled(heads.params, target.params, features, tokens[:, 1:], np.arange(23)[None],
                               model.full_attention(heads.drafter.config))
  np.testing.assert_allclose(heads.drafter.logits(heads.params, target.params, out), want, atol=1e-5, rtol=1e-5)

  plain = jspec.generate(target, [PROMPT], max_new_tokens=NEW).token_ids
  spec = jspec.generate(target, [PROMPT], draft=heads, spec=testing.fixed_k(3, drafter="mtp"), max_new_tokens=NEW)
  assert spec.token_ids == plain and spec.stats.drafter == "mtp"

  (path / "config.json").write_text(json.dumps({**json.loads((path / "config.json").read_text()),
                                                "num_nextn_predict_layers": 0}))
  with pytest.raises(ValueError, match="no MTP layers .* train some: python -m jspec.train drafter --kind mtp"):
    jspec.load(path, mtp=True)


def rope(x, positions, theta):
  """Neox-style rotary embedding of [B, S, heads, Dh] at positions [S]."""
  half = x.shape[-1] // 2
  angles = positions[:, None].double() * theta ** (-torch.arange(half).double() / half)
  cos, sin = (torch.cat([f(angles)] * 2, -1).float()[None, :, None] for f in (torch.cos, torch.sin))
  return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def test_dflash_drafter_matches_the_published_forward_and_drafts_exactly(tmp_path):
  """z-lab's layout: a random DFlash drafter (two Qwen3 layers reading target layers 0 and 1, blocks of 4) for a
  random qwen3 target. Its draft logits against z-lab's forward written here in torch (the target's hidden states
  of those layers projected and normed as context; the block's queries over the context's and the block's keys,
  no causal mask); greedy speculation with it gives the target's tokens; `convert --to dflash` writes it back."""
  m, path = make_hf(tmp_path, "qwen3")
  d, heads_, kv, dh, layers, block, mask, theta = 64, 4, 2, 16, 2, 4, 263, 10000.0
  torch.manual_seed(2)
  w = {"fc.weight": torch.randn(d, 2 * d) / (2 * d) ** 0.5, "hidden_norm.weight": 1 + 0.2 * torch.randn(d),
       "norm.weight": 1 + 0.2 * torch.randn(d)}
  shapes = {"self_attn.q_proj": (heads_ * dh, d), "self_attn.k_proj": (kv * dh, d), "self_attn.v_proj": (kv * dh, d),
            "self_attn.o_proj": (d, heads_ * dh), "mlp.gate_proj": (96, d), "mlp.up_proj": (96, d),
            "mlp.down_proj": (d, 96)}
  for i in range(layers):
    w.update({f"layers.{i}.{name}.weight": torch.randn(*s) / s[1] ** 0.5 for name, s in shapes.items()})
    w.update({f"layers.{i}.{name}.weight": 1 + 0.2 * torch.randn(n) for name, n in (
        ("input_layernorm", d), ("post_attention_layernorm", d), ("self_attn.q_norm", dh), ("self_attn.k_norm", dh))})
  draft_dir = tmp_path / "dflash"
  draft_dir.mkdir()
  from safetensors.torch import save_file
  save_file(w, str(draft_dir / "model.safetensors"))
  (draft_dir / "config.json").write_text(json.dumps({
      "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": d, "intermediate_size": 96,
      "num_hidden_layers": layers, "num_attention_heads": heads_, "num_key_value_heads": kv, "head_dim": dh,
      "rms_norm_eps": 1e-6, "rope_theta": theta, "vocab_size": 264, "max_position_embeddings": 512,
      "block_size": block, "num_target_layers": 3,
      "dflash_config": {"target_layer_ids": [0, 1], "mask_token_id": mask}}))

  tokens = torch.tensor([PROMPT])
  n = tokens.shape[1]
  with torch.no_grad():  # z-lab's forward: context = the positions before the pending token n - 1
    out = m(tokens, output_hidden_states=True)
    ctx = rms(torch.cat([out.hidden_states[i + 1] for i in (0, 1)], -1)[:, :n - 1] @ w["fc.weight"].T,
              w["hidden_norm.weight"])
    h = m.model.embed_tokens(torch.tensor([[PROMPT[-1]] + [mask] * (block - 1)]))
    q_pos, k_pos = torch.arange(n - 1, n - 1 + block), torch.arange(n - 1 + block)
    for i in range(layers):
      p = lambda name: w[f"layers.{i}.{name}.weight"]
      x = rms(h, p("input_layernorm"))
      q = rope(rms((x @ p("self_attn.q_proj").T).view(1, block, heads_, dh), p("self_attn.q_norm")), q_pos, theta)
      both = torch.cat([ctx, x], 1)
      k = rope(rms((both @ p("self_attn.k_proj").T).view(1, -1, kv, dh), p("self_attn.k_norm")), k_pos, theta)
      v = (both @ p("self_attn.v_proj").T).view(1, -1, kv, dh)
      k, v = k.repeat_interleave(heads_ // kv, 2), v.repeat_interleave(heads_ // kv, 2)
      attn = torch.softmax(torch.einsum("bqhd,bkhd->bhqk", q, k) * dh ** -0.5, -1)
      h = h + torch.einsum("bhqk,bkhd->bqhd", attn, v).reshape(1, block, -1) @ p("self_attn.o_proj").T
      y = rms(h, p("post_attention_layernorm"))
      h = h + (torch.nn.functional.silu(y @ p("mlp.gate_proj").T) * (y @ p("mlp.up_proj").T)) @ p("mlp.down_proj").T
    want = (rms(h, w["norm.weight"]) @ m.lm_head.weight.T)[:, 1:].numpy()
    try:  # z-lab's own modeling code, where its package (`dflash` on PyPI) is installed
      from dflash.model import DFlashDraftModel
    except ImportError:
      DFlashDraftModel = None
    if DFlashDraftModel is not None:
      published = DFlashDraftModel.from_pretrained(draft_dir).float().eval()
      features = torch.cat([out.hidden_states[i + 1] for i in published.target_layer_ids], -1)[:, :n - 1]
      block_ids = torch.tensor([[PROMPT[-1]] + [mask] * (block - 1)])
      hidden = published(position_ids=k_pos[None], noise_embedding=m.model.embed_tokens(block_ids),
                         target_hidden=features)
      np.testing.assert_allclose((hidden @ m.lm_head.weight.T)[:, 1:].numpy(), want, atol=1e-5, rtol=1e-5)

  target, heads = jspec.load(path), jspec.load(draft_dir)
  assert heads.drafter.kind == "dflash" and heads.drafter.feature_layers == (0, 1) and heads.drafter.block_size == block
  drafter = heads.drafter.for_pair(target, heads, SpecConfig(3, drafter="dflash"))
  weights = DraftWeights(heads.params, model.with_head(target.params))
  features = model.forward_full(target.params, np.asarray(tokens), target.config, drafter.feature_layers)[1]
  state = drafter.prefill(weights, drafter.init(1, 128, 3), np.asarray(tokens), np.array([n]), features,
                          np.zeros(1, np.int32))
  got = drafter.block_logits(weights, state.cache, np.asarray(tokens), np.array([n]))
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)

  plain = jspec.generate(target, [PROMPT], max_new_tokens=NEW).token_ids
  r = jspec.generate(target, [PROMPT], draft=heads, spec=testing.fixed_k(3, drafter="dflash"), max_new_tokens=NEW)
  assert r.token_ids == plain and r.stats.drafter == "dflash"

  assert convert.main(["--to", "dflash", str(draft_dir), str(tmp_path / "out"), "--target", str(path)]) == 0
  assert json.loads((tmp_path / "out" / "config.json").read_text())["dflash_config"] == {
      "target_layer_ids": [0, 1], "mask_token_id": mask}
  back = jspec.load(tmp_path / "out")
  assert back.drafter == heads.drafter
  for a, b in zip(jax.tree.leaves(back.params), jax.tree.leaves(heads.params)):
    np.testing.assert_array_equal(a, b)
