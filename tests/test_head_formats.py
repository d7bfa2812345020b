"""Published draft heads (EAGLE-1/2, EAGLE-3, speculators, Medusa): read, run and written back exactly.

Each format's forward is the reference. `speculators` (vLLM's EAGLE-3 reference) cannot install beside the
test dependencies (it pins transformers <= 5.19 and pulls torchaudio and torchvision, hence a CUDA build of
torch), nor can `eagle-llm` (gradio 3, openai 0.28) or `medusa-llm` (fschat): so the references below are
written in torch from the formats' source, on transformers' own decoder layers, each step naming the line it
follows; `test_speculators_package_agrees` checks against the package itself where it is installed.
Random small weights are written in each format; on the same target features (a random tiny target built by
transformers) the draft logits agree with jspec's within 1e-4 in fp32, for the first drafted token and for
the next one drafted on the head's own output feature.
"""
import json
import pathlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

import jspec  # noqa: E402
from jspec import convert, testing  # noqa: E402
from jspec.core import shipped  # noqa: E402
from jspec.core.settings import SpecConfig  # noqa: E402
from jspec.drafters import DraftWeights  # noqa: E402
from jspec.formats.loading import load_shapes  # noqa: E402
from jspec.model import cache as kvcache  # noqa: E402
from jspec.model import model  # noqa: E402
from jspec.text.tokenizer import byte_tokenizer  # noqa: E402

F = torch.nn.functional
WIDTH, LAYERS, VOCAB, DRAFT_VOCAB = 64, 8, 264, 200
TARGET = dict(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=128, num_hidden_layers=LAYERS,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
              initializer_range=0.3, bos_token_id=None, eos_token_id=None, pad_token_id=None,
              tie_word_embeddings=False, head_dim=16)
CONFIGS = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}
TOKENS = torch.tensor([np.random.default_rng(0).integers(0, 256, 14).tolist()])
AUX_IDS = [2, LAYERS // 2, LAYERS - 3]  # the EAGLE repository's EAGLE-3 layers (cnets / modeling_llama_kv)


def family_config(family: str, **fields):
  made = CONFIGS[family](**{**TARGET, **fields})
  made._attn_implementation = "eager"
  return made


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
  """A random tiny target of each family, in transformers and as jspec reads its directory."""
  out = {}
  for family in CONFIGS:
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(family_config(family), attn_implementation="eager")
    m = m.float().eval()
    path = tmp_path_factory.mktemp(family)
    m.save_pretrained(path)
    byte_tokenizer().save(str(path / "tokenizer.json"))
    out[family] = (m, jspec.load(path, dtype="float32"), path)
  return out


def random_tensors(shapes: dict, seed: int) -> dict:
  g = torch.Generator().manual_seed(seed)
  return {name: (torch.randn(shape, generator=g) * (shape[-1] ** -0.5 if len(shape) > 1 else 0.1)
                 + (1.0 if name.endswith("norm.weight") else 0.0)) for name, shape in shapes.items()}


def layer_shapes(prefix: str, config, wide: bool = False, input_norm: bool = True, bias: bool = False,
                 qk_norm: bool = False) -> dict:
  h, q, kv, f = config.hidden_size, 4 * 16, 2 * 16, config.intermediate_size
  a = 2 * h if wide else h
  shapes = {f"{prefix}self_attn.q_proj.weight": (q, a), f"{prefix}self_attn.k_proj.weight": (kv, a),
            f"{prefix}self_attn.v_proj.weight": (kv, a), f"{prefix}self_attn.o_proj.weight": (h, q),
            f"{prefix}mlp.gate_proj.weight": (f, h), f"{prefix}mlp.up_proj.weight": (f, h),
            f"{prefix}mlp.down_proj.weight": (h, f), f"{prefix}post_attention_layernorm.weight": (h,)}
  if input_norm:
    shapes[f"{prefix}input_layernorm.weight"] = (h,)
  if bias:
    shapes.update({f"{prefix}self_attn.{p}_proj.bias": (n,) for p, n in (("q", q), ("k", kv), ("v", kv))})
  if qk_norm:
    shapes.update({f"{prefix}self_attn.q_norm.weight": (16,), f"{prefix}self_attn.k_norm.weight": (16,)})
  return shapes


def write(path: pathlib.Path, config: dict, tensors: dict, torch_file: bool = False) -> pathlib.Path:
  path.mkdir(parents=True, exist_ok=True)
  (path / "config.json").write_text(json.dumps(config))
  if torch_file:
    torch.save(tensors, path / "pytorch_model.bin")
  else:
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
  return path


def decoder_layer(family: str, tensors: dict, prefix: str, config, input_norm: bool = True):
  """transformers' decoder layer of the family with the head's weights; without `input_norm` its
  `input_layernorm` is the identity (EAGLE `cnets1.py` LlamaDecoderLayer: `if self.index != 0`)."""
  cls = {"llama": transformers.models.llama.modeling_llama.LlamaDecoderLayer,
         "qwen2": transformers.models.qwen2.modeling_qwen2.Qwen2DecoderLayer,
         "qwen3": transformers.models.qwen3.modeling_qwen3.Qwen3DecoderLayer}[family]
  layer = cls(config, layer_idx=0)
  if not input_norm:
    layer.input_layernorm = torch.nn.Identity()
  return layer, {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}


class Eagle3FirstLayer(torch.nn.Module):
  """speculators 0.9.0 `models/eagle3/model_definitions.py` Eagle3FirstLayerMixin (= the EAGLE
  repository's `cnets.py` LlamaDecoderLayeremb with norm_before_residual False)."""

  def __init__(self, family: str, config, norm_before_residual: bool):
    super().__init__()
    base, _ = decoder_layer(family, {}, "", config)
    h = config.hidden_size
    # _patch_eagle3_projections: q/k/v take 2 * hidden_size, and a hidden_norm
    base.self_attn.q_proj = torch.nn.Linear(2 * h, config.num_attention_heads * config.head_dim,
                                            bias=config.attention_bias)
    base.self_attn.k_proj = torch.nn.Linear(2 * h, config.num_key_value_heads * config.head_dim,
                                            bias=config.attention_bias)
    base.self_attn.v_proj = torch.nn.Linear(2 * h, config.num_key_value_heads * config.head_dim,
                                            bias=config.attention_bias)
    self.base, self.norm_before_residual = base, norm_before_residual
    self.hidden_norm = transformers.models.llama.modeling_llama.LlamaRMSNorm(h, eps=config.rms_norm_eps)

  def forward(self, hidden_states, attention_mask, position_embeddings):
    mid = hidden_states.shape[2] // 2
    embeds, hidden = hidden_states.split(mid, dim=-1)  # cat([embeds, hidden])
    residual = hidden
    embeds = self.base.input_layernorm(embeds)
    hidden = self.hidden_norm(hidden)
    if self.norm_before_residual:
      residual = hidden
    hidden_states = torch.cat([embeds, hidden], dim=-1)
    hidden_states, _ = self.base.self_attn(hidden_states=hidden_states, attention_mask=attention_mask,
                                           position_embeddings=position_embeddings)
    hidden_states = residual + hidden_states
    residual = hidden_states
    hidden_states = self.base.mlp(self.base.post_attention_layernorm(hidden_states))
    return residual + hidden_states


def run_layers(layers, x, config):
  """The head's layers over a whole sequence, causally, positions 0..S-1 (RoPE is relative: speculators'
  positions from 1 give the same logits)."""
  seq = x.shape[1]
  mask = torch.full((1, 1, seq, seq), float("-inf")).triu(1)
  rope = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config)
  pos = rope(x, torch.arange(seq)[None])
  for layer in layers:
    out = layer(x, attention_mask=mask, position_embeddings=pos)
    x = out[0] if isinstance(out, tuple) else out
  return x


def target_features(m, tokens):
  """The target's final-normed hidden state and its hidden states by index (index i: the input of layer i)."""
  with torch.no_grad():
    out = m.model(tokens, output_hidden_states=True)
  return out.last_hidden_state, out.hidden_states


def jspec_logits(heads, target, feature_BxSxF, tokens_BxS, fused: bool = True):
  """jspec's draft logits after the real features (teacher-forced) and, one step more, after its own output
  feature at the last position with the next token: [S+1, V]."""
  drafter = heads.drafter.for_pair(target, heads, SpecConfig(2, drafter=heads.drafter.kind, adaptive=None))
  params, tp = heads.params, model.with_head(target.params)
  if drafter.kind == "medusa":
    x = drafter.head_features(params, jnp.asarray(feature_BxSxF), drafter.num_heads)
    return np.asarray(drafter.head_logits(DraftWeights(params, tp), x))[0]
  seq = tokens_BxS.shape[1] - 1
  cache = kvcache.init_cache(drafter.config, 1, 128)
  feature = drafter._fused(params, jnp.asarray(feature_BxSxF)[:, :seq])
  out, cache = drafter.step(params, tp, cache, feature, jnp.asarray(tokens_BxS[:, :seq]), jnp.arange(seq)[None])
  again, _ = drafter.step(params, tp, cache, out[:, -1:], jnp.asarray(tokens_BxS[:, seq:]), jnp.asarray([[seq]]))
  return np.asarray(drafter.logits(params, tp, jnp.concatenate([out, again], 1)))[0]


def assert_logits_match(ours, theirs):
  ours, theirs = np.asarray(ours), np.asarray(theirs)
  np.testing.assert_array_equal(np.isfinite(ours), np.isfinite(theirs))
  finite = np.isfinite(theirs)
  np.testing.assert_allclose(ours[finite], theirs[finite], atol=1e-4, rtol=1e-4)


# -- EAGLE-1/2 (EAGLE repository, `eagle/model/cnets1.py`) -------------------------------------------------------

def eagle1_head(family: str, seed: int = 1) -> tuple[dict, dict]:
  config = family_config(family, num_hidden_layers=1)
  shapes = {"fc.weight": (WIDTH, 2 * WIDTH), "fc.bias": (WIDTH,),
            **layer_shapes("layers.0.", config, input_norm=False, bias=family == "qwen2")}
  fields = {**config.to_dict(), "num_hidden_layers": 1, "bias": True}
  return fields, random_tensors(shapes, seed)


def eagle1_reference(family, fields, tensors, m, tokens):
  """cnets1.py Model.forward then `head(out_hidden)` (ea_model: the target's LM head, no norm)."""
  config = family_config(family, num_hidden_layers=1)
  layer, weights = decoder_layer(family, tensors, "layers.0.", config, input_norm=False)
  layer.load_state_dict(weights)
  seq = tokens.shape[1] - 2  # teacher-forced on features 0..seq-1, then one step on its own
  hidden, _ = target_features(m, tokens[:, :seq])
  with torch.no_grad():
    embeds = m.model.embed_tokens(tokens[:, 1:seq + 1])
    x = F.linear(torch.cat((embeds, hidden), dim=-1), tensors["fc.weight"], tensors["fc.bias"])
    out = run_layers([layer], x, config)
    # the next step (topK_generate): its own output at the last position with the next token, through fc
    x2 = F.linear(torch.cat((m.model.embed_tokens(tokens[:, seq + 1:seq + 2]), out[:, -1:]), -1),
                  tensors["fc.weight"], tensors["fc.bias"])
    out2 = run_layers([layer], torch.cat([x, x2], 1), config)[:, -1:]
    return m.lm_head(torch.cat([out, out2], 1))[0].numpy(), hidden


@pytest.mark.parametrize("family,torch_file", [("llama", False), ("qwen2", True)])
def test_eagle1_heads_draft_as_the_eagle_repository(targets, tmp_path, family, torch_file):
  m, target, _ = targets[family]
  fields, tensors = eagle1_head(family)
  heads = jspec.load(write(tmp_path / "eagle1", fields, tensors, torch_file))
  assert heads.source == "an EAGLE-1/2 head (EAGLE repository)" and heads.drafter.version == 1
  want, hidden = eagle1_reference(family, fields, tensors, m, TOKENS)
  assert_logits_match(jspec_logits(heads, target, hidden.numpy(), TOKENS[:, 1:].numpy()), want)


# -- EAGLE-3 (EAGLE repository `cnets.py`, speculators) -----------------------------------------------------------

def eagle3_tensors(family: str, prefix, layers: int = 1, seed: int = 2) -> dict:
  config = family_config(family)
  qk = family == "qwen3"
  shapes = {"fc.weight": (WIDTH, 3 * WIDTH), f"{prefix(0)}hidden_norm.weight": (WIDTH,), "norm.weight": (WIDTH,),
            "lm_head.weight": (DRAFT_VOCAB, WIDTH), **layer_shapes(prefix(0), config, wide=True, qk_norm=qk)}
  for i in range(1, layers):
    shapes.update(layer_shapes(prefix(i), config, qk_norm=qk))
  tensors = random_tensors(shapes, seed)
  ids = np.sort(np.random.default_rng(seed).choice(VOCAB, DRAFT_VOCAB, replace=False))
  tensors["d2t"] = torch.tensor(ids - np.arange(DRAFT_VOCAB), dtype=torch.int64)
  t2d = torch.zeros(VOCAB, dtype=torch.bool)
  t2d[ids] = True
  tensors["t2d"] = t2d
  return tensors


def eagle3_reference(family, tensors, prefix, layers, m, tokens, norm_before_residual=False):
  """speculators Eagle3DraftModel.forward / cnets.py: fc over the aux hidden states, [embed ; hidden] into
  the first layer, the rest as usual, `lm_head(norm(h))` over the draft vocabulary mapped by d2t (vLLM
  llama_eagle3: -inf elsewhere); the next step feeds the pre-norm output back (no fc: its width is h)."""
  config = family_config(family, num_hidden_layers=layers)
  first = Eagle3FirstLayer(family, config, norm_before_residual)
  first.load_state_dict({**{f"base.{k[len(prefix(0)):]}": v for k, v in tensors.items()
                            if k.startswith(prefix(0)) and "hidden_norm" not in k},
                         "hidden_norm.weight": tensors[f"{prefix(0)}hidden_norm.weight"]})
  rest = []
  for i in range(1, layers):
    layer, weights = decoder_layer(family, tensors, prefix(i), config)
    layer.load_state_dict(weights)
    rest.append(layer)
  seq = tokens.shape[1] - 2  # teacher-forced on features 0..seq-1, then one step on its own
  _, states = target_features(m, tokens[:, :seq])
  aux = torch.cat([states[i] for i in AUX_IDS], -1)
  with torch.no_grad():
    embeds = m.model.embed_tokens(tokens[:, 1:seq + 2])
    hidden = F.linear(aux, tensors["fc.weight"])
    out = run_layers([first, *rest], torch.cat([embeds[:, :seq], hidden], -1), config)
    x = torch.cat([embeds, torch.cat([hidden, out[:, -1:]], 1)], -1)
    out2 = run_layers([first, *rest], x, config)[:, -1:]
    h = torch.cat([out, out2], 1)
    draft = F.linear(F.rms_norm(h, (WIDTH,), tensors["norm.weight"], 1e-6), tensors["lm_head.weight"])[0]
  ids = np.arange(DRAFT_VOCAB) + tensors["d2t"].numpy()
  full = np.full((seq + 1, VOCAB), -np.inf, np.float32)
  full[:, ids] = draft.numpy()
  return full, aux


SPECULATORS = lambda family, layers, norm_before_residual=False: {
    "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
    "transformer_layer_config": {**family_config(family, num_hidden_layers=layers).to_dict()},
    "draft_vocab_size": DRAFT_VOCAB, "norm_before_residual": norm_before_residual, "target_hidden_size": WIDTH,
    "eagle_aux_hidden_state_layer_ids": AUX_IDS,
    "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                           "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                           "verifier": {"name_or_path": "target", "architectures": ["LlamaForCausalLM"]}}}


@pytest.mark.parametrize("layout,family,layers,nbr", [("eagle3", "llama", 1, False), ("speculators", "llama", 2, True),
                                                      ("speculators", "qwen3", 1, False)])
def test_eagle3_heads_draft_as_the_references(targets, tmp_path, layout, family, layers, nbr):
  m, target, _ = targets[family]
  prefix = (lambda i: "midlayer.") if layout == "eagle3" else (lambda i: f"layers.{i}.")
  tensors = eagle3_tensors(family, prefix, layers)
  if layout == "eagle3":
    fields = {**family_config(family, num_hidden_layers=1).to_dict(), "architectures": ["LlamaForCausalLMEagle3"],
              "draft_vocab_size": DRAFT_VOCAB, "target_hidden_size": WIDTH}
  else:
    fields = SPECULATORS(family, layers, nbr)
  heads = jspec.load(write(tmp_path / layout, fields, tensors))
  assert heads.drafter.is_eagle3 and heads.drafter.draft_vocab == DRAFT_VOCAB
  want, aux = eagle3_reference(family, tensors, prefix, layers, m, TOKENS, nbr)
  assert_logits_match(jspec_logits(heads, target, aux.numpy(), TOKENS[:, 1:].numpy()), want)


# -- Medusa (FasterDecoding `medusa/model/medusa_model.py`, vLLM `model_executor/models/medusa.py`) ---------------

def medusa_tensors(layout: str, heads: int = 3, layers: int = 2, seed: int = 3) -> dict:
  if layout == "fasterdecoding":  # Sequential(*[ResBlock] * layers, Linear(h, V, bias=False)) per head
    shapes = {f"{i}.{j}.linear.{p}": s for i in range(heads) for j in range(layers)
              for p, s in (("weight", (WIDTH, WIDTH)), ("bias", (WIDTH,)))}
    shapes.update({f"{i}.{layers}.weight": (VOCAB, WIDTH) for i in range(heads)})
  else:  # ResidualBlock(layers) per head, one shared lm_head (original_lm_head)
    shapes = {f"blocks.{i}.layers.{j}.{p}": s for i in range(heads) for j in range(layers)
              for p, s in (("weight", (WIDTH, WIDTH)), ("bias", (WIDTH,)))}
    shapes["lm_head.weight"] = (VOCAB, WIDTH)
  return random_tensors(shapes, seed)


def medusa_reference(layout, tensors, hidden, heads=3, layers=2):
  """ResBlock: x + SiLU(linear(x)); head i's LM head on its blocks' output."""
  out = []
  with torch.no_grad():
    for i in range(heads):
      x = hidden
      for j in range(layers):
        name = f"{i}.{j}.linear" if layout == "fasterdecoding" else f"blocks.{i}.layers.{j}"
        x = x + F.silu(F.linear(x, tensors[f"{name}.weight"], tensors[f"{name}.bias"]))
      head = tensors[f"{i}.{layers}.weight" if layout == "fasterdecoding" else "lm_head.weight"]
      out.append(F.linear(x, head))
  return torch.stack(out, 2)[0].numpy()  # [S, heads, V]


@pytest.mark.parametrize("layout", ["fasterdecoding", "vllm"])
def test_medusa_heads_draft_as_the_references(targets, tmp_path, layout):
  m, target, _ = targets["llama"]
  tensors = medusa_tensors(layout)
  path = tmp_path / layout
  if layout == "fasterdecoding":
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"medusa_num_heads": 3, "medusa_num_layers": 2,
                                                  "base_model_name_or_path": "target"}))
    save_file(tensors, str(path / "medusa_lm_head.safetensors"))
  else:
    write(path, {"model_type": "medusa", "num_heads": 3, "num_hidden_layers": 2, "hidden_size": WIDTH,
                 "vocab_size": VOCAB, "medusa_fc_bias": True, "original_lm_head": True}, tensors)
  heads = jspec.load(path)
  assert heads.drafter.num_layers == 2 and heads.drafter.own_heads == (3 if layout == "fasterdecoding" else 1)
  hidden, _ = target_features(m, TOKENS)
  want = medusa_reference(layout, tensors, hidden)
  np.testing.assert_allclose(jspec_logits(heads, target, hidden.numpy(), None), want, atol=1e-4, rtol=1e-4)


# -- decoding with loaded heads, the other direction, and what is refused ---------------------------------------

def test_decoding_with_published_heads_is_the_targets_greedy(targets, tmp_path):
  m, target, _ = targets["llama"]
  prompts = [TOKENS[0, :9].tolist(), TOKENS[0, 3:7].tolist()]
  plain = jspec.generate(target, prompts, max_new_tokens=16).token_ids
  tensors = eagle3_tensors("llama", lambda i: f"layers.{i}.")
  eagle3 = jspec.load(write(tmp_path / "e3", SPECULATORS("llama", 1), tensors))
  medusa = tmp_path / "medusa"
  write(medusa, {"model_type": "medusa", "num_heads": 3, "num_hidden_layers": 2, "hidden_size": WIDTH,
                 "vocab_size": VOCAB, "original_lm_head": True}, medusa_tensors("vllm"))
  # (jspec's own heads in these layouts decode in tests/test_drafters.py, trees and a draft vocabulary too)
  for heads, kind in [(eagle3, "eagle"), (jspec.load(medusa), "medusa")]:
    spec = testing.fixed_k(3, drafter=kind)
    assert jspec.generate(target, prompts, draft=heads, spec=spec, max_new_tokens=16).token_ids == plain


@pytest.mark.parametrize("fmt", ["speculators", "eagle3", "eagle"])
def test_trained_eagle3_heads_export_and_load_back_identically(targets, tmp_path, fmt):
  """A jspec EAGLE-3 head over a reduced vocabulary, written by `python -m jspec.convert --to` and read
  back: the same drafter, the same weights, the same logits."""
  _, target, target_dir = targets["llama"]
  heads = testing.random_eagle3(target, draft_vocab=DRAFT_VOCAB)  # the default layers of 8: 1, 3, 4
  drafter = heads.drafter
  jspec.formats.checkpoint.save_heads(heads, tmp_path / "ours")
  assert convert.main(["--to", fmt, str(tmp_path / "ours"), str(tmp_path / fmt), "--target", str(target_dir)]) == 0
  back = jspec.load(tmp_path / fmt)
  assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(load_shapes(tmp_path / fmt).params))
  aux = model.forward_full(target.params, jnp.asarray(TOKENS[:, :-1]), target.config, drafter.feature_layers)[1]
  tokens = TOKENS[:, 1:].numpy()
  np.testing.assert_array_equal(jspec_logits(back, target, aux, tokens), jspec_logits(heads, target, aux, tokens))
  assert back.drafter.for_pair(target, back, None) == drafter


def test_trained_eagle1_and_medusa_heads_export_and_load_back_identically(targets, tmp_path):
  _, target, target_dir = targets["llama"]
  feature = model.forward_full(target.params, jnp.asarray(TOKENS[:, :-1]), target.config)[1]
  tokens = TOKENS[:, 1:].numpy()
  for fmt, heads in [("eagle", testing.random_heads(jspec.drafters.EagleDrafter.for_target(target.config))),
                     ("medusa", testing.random_draft("medusa", target, heads=3))]:
    jspec.formats.checkpoint.save_heads(heads, tmp_path / fmt)
    assert convert.main(["--to", fmt, str(tmp_path / fmt), str(tmp_path / f"{fmt}-out"),
                         "--target", str(target_dir)]) == 0
    back = jspec.load(tmp_path / f"{fmt}-out")
    np.testing.assert_allclose(jspec_logits(back, target, feature, tokens),
                               jspec_logits(heads, target, feature, tokens), atol=1e-6)


@pytest.mark.slow
def test_the_default_pairs_head_exports_to_the_eagle_repositorys_layout(tmp_path):
  """The shipped default EAGLE head is in a published layout: `convert --to eagle` writes it, and the head it
  writes drafts with the same logits."""
  target = jspec.load("code")
  heads = jspec.load(shipped.DEFAULT.drafts["eagle"])
  assert convert.main(["--to", "eagle", str(shipped.DEFAULT.drafts["eagle"]), str(tmp_path / "out"),
                       "--target", "code"]) == 0
  back = jspec.load(tmp_path / "out")
  assert back.source == "an EAGLE-1/2 head (EAGLE repository)"
  tokens = np.random.default_rng(0).integers(0, target.config.vocab_size, (1, 14))
  feature = model.forward_full(target.params, jnp.asarray(tokens[:, :-1]), target.config)[1]
  np.testing.assert_allclose(jspec_logits(back, target, feature, tokens[:, 1:]),
                             jspec_logits(heads, target, feature, tokens[:, 1:]), atol=1e-5)


def test_refusals_are_one_line(targets, tmp_path, capsys):
  _, target, target_dir = targets["llama"]
  wide = SPECULATORS("llama", 1)
  wide["transformer_layer_config"]["hidden_size"] = 2 * WIDTH
  tensors = eagle3_tensors("llama", lambda i: f"layers.{i}.")
  with pytest.raises(ValueError, match="a head of width 128 on a target of width 64"):
    jspec.load(write(tmp_path / "wide", wide, tensors))
  path = write(tmp_path / "odd", {**SPECULATORS("llama", 1), "norm_before_fc": True}, tensors)
  with pytest.raises(ValueError, match="norm_before_fc: not supported"):
    jspec.load(path)
  path = write(tmp_path / "ids", {**SPECULATORS("llama", 1), "eagle_aux_hidden_state_layer_ids": [2, 4, 9]}, tensors)
  with pytest.raises(ValueError, match=r"reads target layers \[1, 3, 8\].*the target has 8"):
    jspec.generate(target, [[1, 2]], draft=jspec.load(path), spec=testing.fixed_k(2, drafter="eagle"))
  path = write(tmp_path / "extra", SPECULATORS("llama", 1), {**tensors, "layers.0.mystery.weight": torch.ones(3)})
  with pytest.raises(ValueError, match="tensors jspec does not run: layers.0.mystery.weight"):
    jspec.load(path)
  other = testing.random_model(testing.TINY)
  with pytest.raises(ValueError, match="width 64 and vocab 264, not 64 and 257"):
    jspec.generate(other, [[1, 2]], draft=jspec.load(write(tmp_path / "e3", SPECULATORS("llama", 1), tensors)),
                   spec=testing.fixed_k(2, drafter="eagle"))
  class Evil:
    def __reduce__(self):
      return (print, ("ran",))
  (tmp_path / "evil").mkdir()
  (tmp_path / "evil" / "config.json").write_text(json.dumps({**eagle1_head("llama")[0]}))
  torch.save({"fc.weight": Evil()}, tmp_path / "evil" / "pytorch_model.bin")
  with pytest.raises(ValueError, match="print, not only tensors; refusing"):
    jspec.load(tmp_path / "evil")
  assert "ran" not in capsys.readouterr().out
  assert convert.main(["--to", "medusa", str(shipped.SMALL.drafts["eagle"]), str(tmp_path / "x"),
                       "--target", "code-small"]) == 2
  assert "no published format has" in capsys.readouterr().err


def test_speculators_package_agrees(targets, tmp_path):
  """vLLM's speculators package, where it is installed: its config class accepts what jspec exports, and its
  Eagle3DraftModel, given the same weights, draws the greedy tokens jspec's logits give."""
  pytest.importorskip("speculators")
  from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

  m, target, target_dir = targets["llama"]
  heads = testing.random_eagle3(target, scale=1.0, draft_vocab=DRAFT_VOCAB)
  jspec.formats.checkpoint.save_heads(heads, tmp_path / "ours")
  out = tmp_path / "speculators"
  assert convert.main(["--to", "speculators", str(tmp_path / "ours"), str(out), "--target", str(target_dir)]) == 0
  config = Eagle3SpeculatorConfig(**{k: v for k, v in json.loads((out / "config.json").read_text()).items()})
  config.transformer_layer_config._attn_implementation = "eager"
  reference = Eagle3DraftModel(config).float().eval()
  from safetensors.torch import load_file
  weights = load_file(str(out / "model.safetensors"))
  weights["embed_tokens.weight"] = m.model.embed_tokens.weight.detach()
  missing, unexpected = reference.load_state_dict(weights, strict=False)
  assert not unexpected and set(missing) <= {"verifier_norm.weight", "verifier_lm_head.weight"}
  seq = TOKENS.shape[1] - 2  # the positions jspec_logits drafts teacher-forced
  _, states = target_features(m, TOKENS[:, :seq])
  aux = torch.cat([states[i] for i in AUX_IDS], -1)
  logits = []
  reference.lm_head.register_forward_hook(lambda module, inputs, output: logits.append(output))
  with torch.no_grad():
    drafted = reference(aux, TOKENS[:, 1:seq + 1], torch.zeros(1, seq, dtype=torch.long), ttt_steps=1)[0][0]
  ours = jspec_logits(heads, target, aux.numpy(), TOKENS[:, 1:].numpy())[:seq]
  ids = np.arange(DRAFT_VOCAB) + weights["d2t"].numpy()
  np.testing.assert_allclose(ours[:, ids], logits[0][0].numpy(), atol=1e-4, rtol=1e-4)
  assert ids[drafted.numpy()].tolist() == ours.argmax(-1).tolist()
