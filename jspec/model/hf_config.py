"""What a Hugging Face `config.json` says, in jspec's terms: the families jspec reads, their configs as a
`ModelConfig` (`config_from_hf`), and the module names of a decoder layer's weights. Reading and writing whole
directories (weights, tokenizer) is `jspec.model.hf`'s."""
from __future__ import annotations

from jspec.model.config import ModelConfig, MoeConfig, RopeScaling

FAMILIES = ("gemma2", "gemma3", "glm4_moe", "llama", "mistral", "mixtral", "phi3", "qwen2", "qwen3", "qwen3_moe")
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
# What a Gemma 3 text config leaves out means transformers' defaults (Hub files of the multimodal models
# give only a few fields of `text_config`).
GEMMA3_TEXT_DEFAULTS = dict(vocab_size=262208, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                            query_pre_attn_scalar=256, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
                            sliding_window=4096, sliding_window_pattern=6, rms_norm_eps=1e-6,
                            max_position_embeddings=131072, hidden_activation="gelu_pytorch_tanh")
# jspec's name for each per-layer weight -> the Hugging Face module that holds it (`...layers.{i}.`).
ATTENTION_NAMES = dict(wq="self_attn.q_proj", wk="self_attn.k_proj", wv="self_attn.v_proj", wo="self_attn.o_proj")
MLP_NAMES = dict(w_gate="mlp.gate_proj", w_up="mlp.up_proj", w_down="mlp.down_proj")
BIAS_NAMES = dict(bq="self_attn.q_proj", bk="self_attn.k_proj", bv="self_attn.v_proj")
# A sparse layer's modules (`...layers.{i}.`): the router, and each expert's gate, up and down projections
# (`{experts}.{e}.{name}`), by family; shared experts are `mlp.shared_experts.` + MLP_NAMES' last parts.
MOE_NAMES = {"mixtral": dict(router="block_sparse_moe.gate", experts="block_sparse_moe.experts",
                             we_gate="w1", we_up="w3", we_down="w2")}
MOE_NAMES["qwen3_moe"] = MOE_NAMES["glm4_moe"] = dict(router="mlp.gate", experts="mlp.experts", we_gate="gate_proj",
                                                     we_up="up_proj", we_down="down_proj")


def _text_config(hf: dict) -> dict:
  """The language model's config: a Gemma 3 multimodal wrapper's `text_config`, with defaults filled in."""
  if hf.get("model_type") == "gemma3":
    hf = {**hf.get("text_config", {}), "model_type": "gemma3_text"}
  if hf.get("model_type") == "gemma3_text":
    hf = {**GEMMA3_TEXT_DEFAULTS, **{k: v for k, v in hf.items() if v is not None}}
  return hf


def _rope(hf: dict, partial_default: float = 1.0) -> tuple[float, RopeScaling | None, float | None, float]:
  """(theta, scaling, the local layers' theta, partial rotary factor) from either generation of keys."""
  params = hf.get("rope_parameters") or {}
  local = None
  if "full_attention" in params:  # transformers 5, per layer type (Gemma 3)
    local = params.get("sliding_attention", {}).get("rope_theta")
    params = params["full_attention"]
  theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
  local = local if local is not None else hf.get("rope_local_base_freq")
  scaling = hf.get("rope_scaling") or params
  kind = scaling.get("rope_type", scaling.get("type", "default"))
  partial = float(hf.get("partial_rotary_factor") or params.get("partial_rotary_factor") or partial_default)
  if kind == "default":
    return theta, None, local, partial
  if kind == "longrope":
    raise ValueError("unsupported: rope_scaling.rope_type 'longrope' (Phi-3 long-context variants); jspec reads "
                     "linear, dynamic, llama3 and yarn")
  max_pos = hf.get("max_position_embeddings")
  original = scaling.get("original_max_position_embeddings") or max_pos
  factor = scaling.get("factor") or max_pos / original
  try:
    return theta, RopeScaling(
        type=kind, factor=float(factor), original_max_position_embeddings=original, max_position_embeddings=max_pos,
        low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
        high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
        beta_fast=float(scaling.get("beta_fast") or 32.0), beta_slow=float(scaling.get("beta_slow") or 1.0),
        attention_factor=scaling.get("attention_factor"), mscale=scaling.get("mscale"),
        mscale_all_dim=scaling.get("mscale_all_dim"), truncate=bool(scaling.get("truncate", True))), local, partial
  except ValueError as e:
    raise ValueError(f"rope_scaling: {e}") from None


def _windows(hf: dict, family: str, layers: int) -> tuple[int, ...]:
  """Each layer's sliding window (0: full attention)."""
  window = hf.get("sliding_window") or 0
  if not window or (family.startswith("qwen") and hf.get("use_sliding_window") is False):
    return ()
  types = hf.get("layer_types")
  if types is None:
    if family in ("mistral", "mixtral", "phi3"):
      return (window,) * layers
    if family == "gemma2":
      types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    elif family == "gemma3":
      pattern = hf.get("sliding_window_pattern", 6)
      types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]
    else:  # qwen2, qwen3
      start = hf.get("max_window_layers", layers)
      types = ["sliding_attention" if i >= start else "full_attention" for i in range(layers)]
  windows = tuple(window if t == "sliding_attention" else 0 for t in types)
  return windows if any(windows) else ()


def _compressed_tensors(q: dict) -> str:
  """The format of a compressed-tensors checkpoint's weights: 8-bit floats or ints, symmetric, one scale per
  output channel or per tensor. Its activation scales (static or dynamic) are not used: jspec computes
  weight-only, with activations in the model's dtype."""
  formats = set()
  for group in (q.get("config_groups") or {}).values():
    w = group.get("weights") or {}
    kind = {("float", 8): "fp8", ("int", 8): "int8"}.get((w.get("type"), w.get("num_bits")))
    if kind is None or w.get("strategy") not in ("channel", "tensor") or not w.get("symmetric", True) \
        or w.get("group_size") or q.get("format") not in (None, "float-quantized", "int-quantized", "naive-quantized"):
      raise ValueError(f"unsupported compressed-tensors weights ({w.get('type')} {w.get('num_bits')}-bit, strategy "
                       f"{w.get('strategy')!r}, format {q.get('format')!r}): jspec reads 8-bit float or int weights "
                       f"with a scale per channel or per tensor")
    formats.add(kind)
  if len(formats) != 1:
    raise ValueError(f"compressed-tensors config groups of {sorted(formats) or 'no'} weight formats: jspec reads one")
  return formats.pop()


def weight_format(hf: dict) -> str | None:
  """The stored format of a checkpoint's linear layers (`jspec.model.quantization`), from its
  `quantization_config`; None for float weights. Anything else is refused in one line."""
  q = hf.get("quantization_config")
  if not q:
    return None
  method = q.get("quant_method")
  if method == "compressed-tensors":
    return _compressed_tensors(q)
  if method == "fp8":
    block = q.get("weight_block_size")
    if list(block or []) != [128, 128] or q.get("fmt", "e4m3") != "e4m3":
      raise ValueError(f"unsupported fp8 checkpoint (fmt {q.get('fmt')!r}, weight_block_size {block}): jspec reads "
                       f"e4m3 weights in 128 x 128 blocks")
    return "fp8-block"
  detail = ", ".join(f"{k} {q[k]}" for k in ("bits", "group_size") if k in q)
  raise ValueError(f"unsupported quantization {method!r}" + (f" ({detail})" if detail else "") + ": jspec reads "
                   "compressed-tensors FP8/INT8 and block-wise fp8 checkpoints, or quantizes float ones "
                   "(--quantize)")


def _moe(hf: dict, family: str, layers: int) -> MoeConfig | None:
  """The mixture-of-experts part of a config: which layers are sparse and how their routers choose."""
  # transformers 5 writes every family's expert count as `num_local_experts`; published files have their own
  experts = hf.get("num_local_experts") or hf.get("num_experts") or hf.get("n_routed_experts")
  if family == "mixtral":
    return MoeConfig(experts=experts, top_k=hf["num_experts_per_tok"], expert_dim=hf["intermediate_size"])
  if family == "qwen3_moe" and experts:
    step, only = hf.get("decoder_sparse_step") or 1, set(hf.get("mlp_only_layers") or ())
    return MoeConfig(experts=experts, top_k=hf["num_experts_per_tok"],
                     expert_dim=hf["moe_intermediate_size"], normalize=bool(hf.get("norm_topk_prob", False)),
                     dense_layers=tuple(i for i in range(layers) if i in only or (i + 1) % step))
  if family == "glm4_moe":
    return MoeConfig(experts=experts, top_k=hf["num_experts_per_tok"], expert_dim=hf["moe_intermediate_size"],
                     routing="sigmoid",
                     normalize=bool(hf.get("norm_topk_prob", True)), scale=float(hf.get("routed_scaling_factor", 1.0)),
                     groups=hf.get("n_group") or 1, top_groups=hf.get("topk_group") or 1,
                     shared_dim=hf["moe_intermediate_size"] * (hf.get("n_shared_experts") or 0),
                     dense_layers=tuple(range(min(hf.get("first_k_dense_replace", 1), layers))))
  return None


def config_from_hf(hf: dict, dtype: str = "float32", generation: dict | None = None) -> ModelConfig:
  """A `ModelConfig` from a Hugging Face `config.json` (and `generation_config.json`)."""
  quantization = weight_format(hf)
  hf = _text_config(hf)
  family = {"gemma3_text": "gemma3"}.get(hf.get("model_type"), hf.get("model_type"))
  if family not in FAMILIES:
    raise ValueError(f"unsupported model_type {hf.get('model_type')!r}: jspec reads {', '.join(FAMILIES)}")
  act = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
  if act not in ACTIVATIONS:
    raise ValueError(f"unsupported hidden_act {act!r}: jspec reads {', '.join(ACTIVATIONS)}")
  if hf.get("mlp_bias") or (hf.get("attention_bias") and family not in ("qwen2", "glm4_moe")):
    raise ValueError("unsupported: attention_bias or mlp_bias (qwen2's and glm4_moe's q/k/v bias is supported)")
  moe = _moe(hf, family, hf["num_hidden_layers"])
  gemma = family.startswith("gemma")
  theta, scaling, local_theta, partial = _rope(hf, 0.5 if family == "glm4_moe" else 1.0)
  heads, layers = hf["num_attention_heads"], hf["num_hidden_layers"]
  context = hf.get("max_position_embeddings", 4096)
  if scaling is not None and scaling.type in ("linear", "dynamic", "yarn"):  # they stretch the context
    context = max(context, int((scaling.original_max_position_embeddings or context) * scaling.factor))
  stops = []
  for source in (hf, generation or {}):
    ids = source.get("eos_token_id")
    stops += [i for i in (ids if isinstance(ids, list) else [ids]) if i is not None and i not in stops]
  return ModelConfig(
      vocab_size=hf["vocab_size"], dim=hf["hidden_size"], n_layers=layers, n_heads=heads,
      n_kv_heads=hf.get("num_key_value_heads") or heads,
      head_dim=hf.get("head_dim") or hf["hidden_size"] // heads, mlp_dim=hf["intermediate_size"],
      rope_theta=theta, norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      qkv_bias=family == "qwen2" or bool(hf.get("attention_bias")),
      tie_embeddings=bool(hf.get("tie_word_embeddings", gemma)), max_seq_len=context, dtype=dtype,
      bos_id=hf.get("bos_token_id"), eos_id=stops[0] if len(stops) == 1 else tuple(stops) or None,
      rope_scaling=scaling, partial_rotary_factor=partial,
      local_rope_theta=float(local_theta) if family == "gemma3" and local_theta else None,
      sliding_windows=_windows(hf, family, layers), activation=ACTIVATIONS[act], norm_plus_one=gemma,
      sandwich_norms=gemma, qk_norm=family in ("qwen3", "qwen3_moe", "gemma3") or bool(hf.get("use_qk_norm")),
      scale_embeddings=gemma,
      query_scale=float(hf["query_pre_attn_scalar"]) if gemma else None,
      attn_softcap=hf.get("attn_logit_softcapping") if family == "gemma2" else None,
      final_softcap=hf.get("final_logit_softcapping") if family == "gemma2" else None, quantization=quantization,
      moe=moe, mask_id=pard if isinstance(pard := hf.get("pard_token"), int) and pard >= 0 else None)
