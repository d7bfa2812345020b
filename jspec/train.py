"""Training with optax: next-token cross-entropy, or distillation from a frozen target for drafts.

`python -m jspec.train --config configs/NAME.json`. The config names the model, the optimizer schedule and,
for a draft, the teacher checkpoint. Distillation minimizes KL(teacher || student) computed on the fly,
plus `ce_weight` times cross-entropy on the data.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

from jspec import checkpoint, data, model
from jspec.config import ModelConfig
from jspec.tokenizer import EOS_TOKEN, byte_tokenizer, encode


def loss_fn(params, batch_BxS1, config: ModelConfig, teacher=None, ce_weight: float = 1.0):
  inputs, targets = batch_BxS1[:, :-1], batch_BxS1[:, 1:]
  logits, _ = model.forward_full(params, inputs, config)
  logp = jax.nn.log_softmax(logits, axis=-1)
  ce = -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))
  if teacher is None:
    return ce, ce
  t_params, t_config = teacher
  t_logits, _ = model.forward_full(t_params, inputs, t_config)
  t_logp = jax.nn.log_softmax(t_logits, axis=-1)
  kl = jnp.mean(jnp.sum(jnp.exp(t_logp) * (t_logp - logp), axis=-1))
  return kl + ce_weight * ce, ce


def make_optimizer(cfg: dict) -> optax.GradientTransformation:
  schedule = optax.warmup_cosine_decay_schedule(0.0, cfg["lr"], cfg["warmup_steps"], cfg["steps"],
                                                end_value=cfg["lr"] * 0.1)
  return optax.chain(optax.clip_by_global_norm(cfg.get("clip", 1.0)),
                     optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=cfg.get("weight_decay", 0.1)))


def batches(stream: np.ndarray, batch: int, seq_len: int, rng: np.random.Generator):
  while True:
    starts = rng.integers(0, len(stream) - seq_len - 1, size=batch)
    yield np.stack([stream[s:s + seq_len + 1] for s in starts])


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="python -m jspec.train")
  ap.add_argument("--config", required=True)
  ap.add_argument("--steps", type=int, help="override the configured step count")
  args = ap.parse_args(argv)
  cfg = json.loads(pathlib.Path(args.config).read_text())
  tcfg = cfg["train"]
  if args.steps:
    tcfg["steps"] = args.steps
  tok = byte_tokenizer()
  eos = tok.token_to_id(EOS_TOKEN)
  config = ModelConfig.from_dict({**cfg["model"], "eos_id": eos})
  teacher = None
  if cfg.get("teacher"):
    t = checkpoint.load(cfg["teacher"])
    teacher = (t.params, t.config)

  print(f"reading the corpus under {data.stdlib_root().name}/ ...", flush=True)
  train_stream = data.token_stream(data.read_texts("train"), lambda s: encode(tok, s), eos)
  val_stream = data.token_stream(data.read_texts("validation"), lambda s: encode(tok, s), eos)
  print(f"train {len(train_stream):,} tokens, validation {len(val_stream):,}", flush=True)

  params = model.init_params(config, jax.random.PRNGKey(tcfg.get("seed", 0)))
  opt = make_optimizer(tcfg)
  opt_state = opt.init(params)
  ce_weight = cfg.get("ce_weight", 1.0)

  @jax.jit
  def train_step(params, opt_state, batch):
    (loss, ce), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch, config, teacher, ce_weight)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, ce

  @jax.jit
  def eval_ce(params, batch):
    return loss_fn(params, batch, config)[1]

  rng = np.random.default_rng(tcfg.get("seed", 0))
  train_it = batches(train_stream, tcfg["batch"], tcfg["seq_len"], rng)
  val_batches = list(zip(range(8), batches(val_stream, tcfg["batch"], tcfg["seq_len"], np.random.default_rng(1))))
  bar = tqdm(range(tcfg["steps"]), desc="train")
  tokens_per_step = tcfg["batch"] * tcfg["seq_len"]
  start = time.perf_counter()
  val = float("nan")
  for step in bar:
    params, opt_state, loss, ce = train_step(params, opt_state, next(train_it))
    if (step + 1) % tcfg.get("eval_every", 200) == 0 or step + 1 == tcfg["steps"]:
      val = float(np.mean([eval_ce(params, b) for _, b in val_batches]))
    if step % 10 == 0:
      bar.set_postfix(loss=f"{float(loss):.3f}", val_ce=f"{val:.3f}",
                      tok_s=f"{tokens_per_step * (step + 1) / (time.perf_counter() - start):.0f}")
  out = pathlib.Path(cfg["out"])
  checkpoint.save(checkpoint.Model(config, params, tok), out)
  (out / "train_log.json").write_text(json.dumps({"validation_ce": val, "steps": tcfg["steps"],
                                                  "wall_seconds": time.perf_counter() - start}, indent=2))
  print(f"saved {out}: validation cross-entropy {val:.3f} nats/token")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
