"""Training with optax: language models, distilled draft models, and Medusa/EAGLE heads.

`python -m jspec.train --config configs/NAME.json`. The config names the data directory (token shards and
tokenizer from `python -m jspec.train data`), the optimizer schedule, and what to train:
- `model`: a language model; with a `teacher` checkpoint it is distilled: KL(teacher || student) with the
  teacher's distribution computed on the fly, plus `ce_weight` times cross-entropy on the data;
- `drafter` ("medusa" or "eagle") with a frozen `target` checkpoint and `heads` options: heads trained on
  the target's own features and distributions (see each drafter's `loss`).
An orbax CheckpointManager in `workdir` keeps the latest steps, and a rerun of the same command resumes.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from tqdm import tqdm

from jspec import drafters, flags
from jspec.core import registry
from jspec.drafters import losses
from jspec.drafters.draft_model import parallel_loss
from jspec.formats import checkpoint
from jspec.formats.loading import load
from jspec.model import model
from jspec.model.config import ModelConfig
from jspec.text.tokenizer import EOS_TOKEN, load_tokenizer, same_vocab
from jspec.train import data


def loss_fn(params, batch_BxS1, config: ModelConfig, teacher=None, ce_weight: float = 1.0):
  """Returns (loss, cross-entropy). With a teacher (params, config), loss = KL + ce_weight * CE."""
  inputs, targets = batch_BxS1[:, :-1], batch_BxS1[:, 1:]
  logits, _ = model.forward_full(params, inputs, config)
  logp = jax.nn.log_softmax(logits, axis=-1)
  ce = -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))
  if teacher is None:
    return ce, ce
  t_params, t_config = teacher
  return losses.kl(model.forward_full(t_params, inputs, t_config)[0], logits) + ce_weight * ce, ce


@dataclasses.dataclass(frozen=True)
class Task:
  description: str
  init: Callable[[jax.Array], Any]  # key -> parameters
  loss: Callable[[Any, jax.Array], tuple[jax.Array, jax.Array]]  # (params, batch [B,S+1]) -> (loss, metric)
  metric: str  # the validation metric's name in the log
  save: Callable[[Any, pathlib.Path], None]


def model_task(fields: dict, tok, teacher: model.Model | None = None, ce_weight: float = 1.0,
               parallel: int = 0) -> Task:
  """A language model of the given shape (`ModelConfig` fields) over the tokenizer `tok`; with a `teacher`
  it is distilled: KL(teacher || student) + `ce_weight` × cross-entropy. `parallel` (with a teacher and a
  `mask_id`): a parallel draft model drafting that many tokens a forward, trained on PARD's layout
  (`jspec.drafters.draft_model.parallel_loss`)."""
  config = ModelConfig.from_dict({**fields, "vocab_size": fields.get("vocab_size", tok.get_vocab_size()),
                                  "eos_id": fields.get("eos_id", tok.token_to_id(EOS_TOKEN))})
  if teacher is not None and not same_vocab(teacher.tokenizer, tok):
    raise SystemExit("the teacher's tokenizer differs from the data's")
  pair = None if teacher is None else (teacher.params, teacher.config)
  loss = lambda params, batch: loss_fn(params, batch, config, pair, ce_weight)
  if parallel:
    if teacher is None or config.mask_id is None:
      raise ValueError("a parallel draft model is distilled from a teacher and has a mask token")

    def loss(params, batch):
      teacher_logits = jax.lax.stop_gradient(model.forward_full(teacher.params, batch[:, :-1], teacher.config)[0])
      key = jax.random.fold_in(jax.random.PRNGKey(0), jnp.sum(batch))  # the kept positions vary with the batch
      return parallel_loss(params, config, batch, teacher_logits, parallel, key, ce_weight)
  return Task(
      description=f"{config.n_layers} layers, width {config.dim}" + (f", {parallel} tokens a forward" * bool(parallel)),
      init=lambda key: model.init_params(config, key),
      loss=loss,
      metric="validation_ce",
      save=lambda params, out: checkpoint.save(model.Model(config, params, tok), out,
                                               storage_dtype="bfloat16"))


def heads_task(target: model.Model, kind: str, opts: dict, tok, token_counts: np.ndarray | None = None) -> Task:
  """Heads (Medusa, EAGLE, or any drafter whose `for_training` builds one) on a frozen target, trained with
  the drafter's own `loss`; the metric is that loss on validation data. `token_counts`: how often each target
  token occurs in the training data (what an EAGLE-3 draft vocabulary is chosen from; default: all alike)."""
  if not same_vocab(target.tokenizer, tok):
    raise SystemExit("the target's tokenizer differs from the data's")
  drafter = registry.drafter_class(kind).for_training(target.config, opts)
  counts = np.ones(target.config.vocab_size) if token_counts is None else token_counts
  frozen = drafter.training_init(jax.random.PRNGKey(0), target.params, counts)[1]

  def loss(params, batch_BxS1):
    tokens = batch_BxS1[:, :-1]
    logits, hidden = jax.lax.stop_gradient(model.forward_full(target.params, tokens, target.config,
                                                              drafter.feature_layers))
    key = jax.random.fold_in(jax.random.PRNGKey(0), jnp.sum(batch_BxS1))  # noise varies with the batch
    value = drafter.loss(drafters.DraftWeights({**params, **frozen}, target.params), hidden, logits, tokens, key,
                         opts)
    return value, value

  return Task(description=f"{drafter.kind} heads",
              init=lambda key: drafter.training_init(key, target.params, counts)[0], loss=loss,
              metric="validation_loss",
              save=lambda params, out: checkpoint.save_heads(drafters.Heads(drafter, {**params, **frozen}), out,
                                                           storage_dtype="bfloat16"))


def task_of(cfg: dict, tok) -> Task:
  """The task a config file describes: a `drafter` on a `target`, or a `model` (distilled from `teacher`)."""
  if cfg.get("drafter"):
    return heads_task(load(cfg["target"]), cfg["drafter"], cfg.get("heads", {}), tok)
  return model_task(cfg["model"], tok, load(cfg["teacher"]) if cfg.get("teacher") else None,
                    cfg.get("ce_weight", 1.0))


def make_optimizer(cfg: dict) -> optax.GradientTransformation:
  """AdamW with linear warmup, cosine decay to 10%, and global-norm clipping."""
  warmup = min(cfg["warmup_steps"], max(cfg["steps"] // 10, 1))  # short smoke runs still decay
  schedule = optax.warmup_cosine_decay_schedule(0.0, cfg["lr"], warmup, cfg["steps"],
                                                end_value=cfg["lr"] * 0.1)
  return optax.chain(optax.clip_by_global_norm(cfg.get("clip", 1.0)),
                     optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=cfg.get("weight_decay", 0.1)))


def batch_at(stream: np.ndarray, step: int, batch: int, seq_len: int, seed: int) -> np.ndarray:
  """The batch of a given step: random windows drawn from (seed, step), so a resumed run sees the same data."""
  starts = np.random.default_rng([seed, step]).integers(0, len(stream) - seq_len - 1, size=batch)
  return np.stack([stream[s:s + seq_len + 1] for s in starts]).astype(np.int32)


def load_shards(directory: pathlib.Path) -> dict[str, np.ndarray]:
  if not data.shard_path(directory, "train").is_file():
    raise SystemExit(f"no token shards in {directory}: run `python -m jspec.train data --out {directory}` first")
  return {s: np.load(data.shard_path(directory, s)) for s in ("train", "validation")}


def fit(task: Task, shards: dict[str, np.ndarray], tcfg: dict, workdir: pathlib.Path, out: pathlib.Path, *,
        init_from: str | None = None, start_step: int = 0, save_latest: bool = False,
        place: Callable[[np.ndarray], Any] = lambda batch: batch) -> dict:
  """Trains `task` on random windows of `shards["train"]`, validates on `shards["validation"]`, keeps orbax
  checkpoints in `workdir` (a rerun resumes from the latest), writes the weights and `train_log.json` to
  `out`, and returns the log. `place` puts each batch where the step runs (a mesh's data axis)."""
  num_params = sum(x.size for x in jax.tree.leaves(jax.eval_shape(task.init, jax.random.PRNGKey(0))))
  print(f"{task.description}: {num_params:,} parameters; train {len(shards['train']):,} tokens, "
        f"validation {len(shards['validation']):,}", flush=True)

  opt = make_optimizer(tcfg)
  seed = tcfg.get("seed", 0)
  params = task.init(jax.random.PRNGKey(seed))
  state = {"params": params, "opt_state": opt.init(params)}
  manager = ocp.CheckpointManager(workdir.absolute(), options=ocp.CheckpointManagerOptions(
      max_to_keep=2, save_interval_steps=tcfg.get("save_every", 200)))
  if init_from and manager.latest_step() is None:
    init = load(init_from).params
    if jax.tree.structure(init) != jax.tree.structure(params):
      raise SystemExit(f"{init_from} holds other weights than this config trains")
    state = {"params": init, "opt_state": opt.init(init)}
    print(f"starting from {init_from} at step {start_step}, with a fresh optimizer state", flush=True)
  elif manager.latest_step() is not None:
    start_step = manager.latest_step()
    state = manager.restore(start_step, args=ocp.args.StandardRestore(jax.eval_shape(lambda: state)))
    print(f"resumed from step {start_step} in {workdir}", flush=True)
  else:
    start_step = 0

  @jax.jit
  def train_step(state, batch):
    grad_fn = jax.value_and_grad(task.loss, has_aux=True)
    (loss, _), grads = grad_fn(state["params"], batch)
    updates, opt_state = opt.update(grads, state["opt_state"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}, loss

  eval_metric = jax.jit(lambda params, batch: task.loss(params, batch)[1])
  val_batches = [place(batch_at(shards["validation"], i, tcfg["batch"], tcfg["seq_len"], seed + 1))
                 for i in range(8)]
  validate = lambda: float(np.mean([eval_metric(state["params"], b) for b in val_batches]))

  tokens_per_step = tcfg["batch"] * tcfg["seq_len"]
  last = start_step if save_latest else tcfg["steps"]
  bar = tqdm(range(start_step, last), desc="train", initial=start_step, total=tcfg["steps"])
  start, val, history = time.perf_counter(), float("nan"), []
  if start_step == 0 and not save_latest:
    history.append({"step": 0, task.metric: validate()})
  for step in bar:
    batch = place(batch_at(shards["train"], step, tcfg["batch"], tcfg["seq_len"], seed))
    state, loss = train_step(state, batch)
    done = step + 1
    if done % tcfg.get("eval_every", 200) == 0 or done == last:
      val = validate()
      history.append({"step": done, task.metric: val})
    manager.save(done, args=ocp.args.StandardSave(state))
    if step % 10 == 0 or done == last:
      rate = tokens_per_step * (done - start_step) / (time.perf_counter() - start)
      bar.set_postfix(loss=f"{float(loss):.3f}", val=f"{val:.3f}", tok_s=f"{rate:.0f}")
  manager.wait_until_finished()
  task.save(state["params"], out)
  val = validate()
  log = {task.metric: val, "steps": last, "tokens_seen": last * tokens_per_step,
         "wall_seconds_this_run": time.perf_counter() - start, "history": history}
  (out / "train_log.json").write_text(json.dumps(log, indent=2))
  print(f"saved {out}: {task.metric} {val:.3f}")
  return log


@flags.command
def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(prog="python -m jspec.train",
                               epilog="`python -m jspec.train drafter --help`: a drafter for any target; "
                                      "`data --help`: the corpus's tokenizer and token shards; `continuations --help`: "
                                      "a target's own text")
  ap.add_argument("--config", required=True)
  ap.add_argument("--steps", type=int, help="override the configured step count (smoke runs)")
  ap.add_argument("--workdir", help="override the configured workdir")
  ap.add_argument("--init-from", metavar="DIR",
                  help="start from these saved weights (a checkpoint of the model trained) at --start-step, with "
                       "a fresh optimizer state: a run continued on a machine without its workdir")
  ap.add_argument("--start-step", type=int, default=0, help="with --init-from: the schedule's step to resume at")
  ap.add_argument("--save-latest", action="store_true",
                  help="write the weights of the workdir's latest step to the configured output and stop (its step "
                       "is in train_log.json; --init-from continues from there)")
  args = ap.parse_args(argv)
  cfg = json.loads(pathlib.Path(args.config).read_text())
  tcfg = dict(cfg["train"], **({"steps": args.steps} if args.steps else {}))
  data_dir = pathlib.Path(cfg["data"])
  tok = load_tokenizer(data_dir)
  task = task_of(cfg, tok)
  fit(task, load_shards(data_dir), tcfg, pathlib.Path(args.workdir or cfg["workdir"]), pathlib.Path(cfg["out"]),
      init_from=args.init_from, start_step=args.start_step, save_latest=args.save_latest)
  return 0
