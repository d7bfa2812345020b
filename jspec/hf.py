"""Hugging Face model directories (llama, qwen2, mistral) read without torch.

Reads `config.json`, `model.safetensors` or the shards named by `model.safetensors.index.json`, and
`tokenizer.json`. HF checkpoints already store q/k projections in the rotate-half RoPE layout that
`jspec.model.rope` uses, so the weights map over with a transpose and no permutation.
"""
from __future__ import annotations

import json
import pathlib

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jspec.config import ModelConfig
from jspec.model import Model
from jspec.tokenizer import load_tokenizer

SUPPORTED = ("llama", "mistral", "qwen2")
# jspec's name for each per-layer weight -> the Hugging Face module that holds it (`model.layers.{i}.`).
LAYER_NAMES = dict(attn_norm="input_layernorm", wq="self_attn.q_proj", wk="self_attn.k_proj",
                   wv="self_attn.v_proj", wo="self_attn.o_proj", mlp_norm="post_attention_layernorm",
                   w_gate="mlp.gate_proj", w_up="mlp.up_proj", w_down="mlp.down_proj")
BIAS_NAMES = dict(bq="self_attn.q_proj", bk="self_attn.k_proj", bv="self_attn.v_proj")
_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F64": np.float64}


def is_hf_dir(path: pathlib.Path) -> bool:
  try:
    return "model_type" in json.loads((pathlib.Path(path) / "config.json").read_text())
  except (OSError, json.JSONDecodeError):
    return False


def config_from_hf(hf: dict, dtype: str = "float32") -> ModelConfig:
  model_type = hf.get("model_type")
  if model_type not in SUPPORTED:
    raise ValueError(f"unsupported model_type {model_type!r}: jspec reads {', '.join(SUPPORTED)}")
  if hf.get("hidden_act", "silu") != "silu":
    raise ValueError(f"unsupported hidden_act {hf['hidden_act']!r}: only silu (SwiGLU)")
  # transformers 5 keeps RoPE settings in `rope_parameters`; older files use rope_theta / rope_scaling.
  rope = hf.get("rope_parameters") or {}
  scaling = hf.get("rope_scaling") or ({} if rope.get("rope_type", "default") == "default" else rope)
  if scaling:
    raise ValueError(f"unsupported RoPE scaling {scaling!r}")
  if hf.get("mlp_bias") or hf.get("attention_bias"):
    raise ValueError("unsupported: attention_bias or mlp_bias (qwen2's q/k/v bias is supported)")
  heads = hf["num_attention_heads"]
  context = hf.get("max_position_embeddings", 4096)
  # Mistral attends over a sliding window; capping the context at it keeps jspec's full attention exact.
  if model_type == "mistral" and hf.get("sliding_window"):
    context = min(context, hf["sliding_window"])
  if model_type == "qwen2" and hf.get("use_sliding_window"):
    raise ValueError("unsupported: qwen2 with use_sliding_window")
  eos = hf.get("eos_token_id")
  return ModelConfig(
      vocab_size=hf["vocab_size"], dim=hf["hidden_size"], n_layers=hf["num_hidden_layers"], n_heads=heads,
      n_kv_heads=hf.get("num_key_value_heads") or heads,
      head_dim=hf.get("head_dim") or hf["hidden_size"] // heads, mlp_dim=hf["intermediate_size"],
      rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
      norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      qkv_bias=model_type == "qwen2",
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)), max_seq_len=context,
      bos_id=hf.get("bos_token_id"), eos_id=eos[0] if isinstance(eos, list) else eos, dtype=dtype)


def read_safetensors(path: pathlib.Path) -> dict[str, np.ndarray]:
  """Every tensor in one .safetensors file, as numpy arrays (an 8-byte header size, JSON, raw data)."""
  raw = path.read_bytes()
  size = int.from_bytes(raw[:8], "little")
  header = json.loads(raw[8:8 + size])
  tensors = {}
  for name, meta in header.items():
    if name == "__metadata__":
      continue
    if meta["dtype"] not in _DTYPES:
      raise ValueError(f"{path.name}: tensor {name} has unsupported dtype {meta['dtype']}")
    start, end = meta["data_offsets"]
    buf = raw[8 + size + start:8 + size + end]
    tensors[name] = np.frombuffer(buf, dtype=_DTYPES[meta["dtype"]]).reshape(meta["shape"])
  return tensors


def write_safetensors(path: pathlib.Path, tensors: dict[str, np.ndarray]) -> None:
  """The inverse of `read_safetensors`, for float32 tensors."""
  header, offset, blobs = {}, 0, []
  for name, x in tensors.items():
    blob = np.ascontiguousarray(x, np.float32).tobytes()
    header[name] = {"dtype": "F32", "shape": list(x.shape), "data_offsets": [offset, offset + len(blob)]}
    offset += len(blob)
    blobs.append(blob)
  raw = json.dumps(header).encode()
  raw += b" " * (-len(raw) % 8)  # the format aligns the data to 8 bytes
  path.write_bytes(len(raw).to_bytes(8, "little") + raw + b"".join(blobs))


def _read_weights(path: pathlib.Path) -> dict[str, np.ndarray]:
  index = path / "model.safetensors.index.json"
  files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else \
      ["model.safetensors"]
  tensors = {}
  for f in files:
    if not (path / f).is_file():
      raise ValueError(f"{path}: missing weights file {f}")
    tensors.update(read_safetensors(path / f))
  return tensors


def load_hf(path: str | pathlib.Path, dtype: str = "float32") -> Model:
  path = pathlib.Path(path).absolute()
  hf = json.loads((path / "config.json").read_text())
  config = config_from_hf(hf, dtype)
  tokenizer = load_tokenizer(path)
  tensors = _read_weights(path)
  dtype = config.jnp_dtype

  def take(name: str, transpose: bool = False) -> jnp.ndarray:
    if name not in tensors:
      raise ValueError(f"{path}: tensor {name} is missing from the safetensors files")
    x = np.asarray(tensors[name], np.float32)
    return jnp.asarray(x.T if transpose else x, dtype)

  layers = []
  for i in range(config.n_layers):
    pre = f"model.layers.{i}."
    # HF stores matrices as [out, in]; jspec as [in, out].
    layer = {ours: take(f"{pre}{theirs}.weight", transpose=not ours.endswith("norm"))
             for ours, theirs in LAYER_NAMES.items()}
    if config.qkv_bias:
      layer.update({ours: take(f"{pre}{theirs}.bias") for ours, theirs in BIAS_NAMES.items()})
    layers.append(layer)
  params = dict(embed=take("model.embed_tokens.weight"), layers=layers, final_norm=take("model.norm.weight"))
  if not config.tie_embeddings:
    params["lm_head"] = take("lm_head.weight", True)
  return Model(config=config, params=params, tokenizer=tokenizer)


def save_hf(m: Model, path: str | pathlib.Path) -> None:
  """Writes a jspec model as a Hugging Face Llama directory (`config.json`, `model.safetensors`,
  `tokenizer.json`) that `transformers.AutoModelForCausalLM.from_pretrained` loads, in float32."""
  c = m.config
  if c.qkv_bias:
    raise ValueError("a Hugging Face export is a Llama directory, which has no q/k/v bias; this model has one")
  path = pathlib.Path(path)
  path.mkdir(parents=True, exist_ok=True)
  hf = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": c.vocab_size,
        "hidden_size": c.dim, "intermediate_size": c.mlp_dim, "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads, "num_key_value_heads": c.n_kv_heads, "head_dim": c.head_dim,
        "hidden_act": "silu", "max_position_embeddings": c.max_seq_len, "rms_norm_eps": c.norm_eps,
        "rope_theta": c.rope_theta, "tie_word_embeddings": c.tie_embeddings, "attention_bias": False,
        "mlp_bias": False, "bos_token_id": c.bos_id, "eos_token_id": c.eos_id, "torch_dtype": "float32"}
  (path / "config.json").write_text(json.dumps(hf, indent=2))
  f32 = lambda x: np.asarray(x, np.float32)
  tensors = {"model.embed_tokens.weight": f32(m.params["embed"]), "model.norm.weight": f32(m.params["final_norm"])}
  for i, layer in enumerate(m.params["layers"]):
    for ours, theirs in LAYER_NAMES.items():
      x = f32(layer[ours])
      tensors[f"model.layers.{i}.{theirs}.weight"] = x if x.ndim == 1 else x.T  # HF stores [out, in]
  if not c.tie_embeddings:
    tensors["lm_head.weight"] = f32(m.params["lm_head"]).T
  write_safetensors(path / "model.safetensors", tensors)
  m.tokenizer.save(str(path / "tokenizer.json"))
