"""`python -m jspec.train drafter`: a drafter for any target (shipped, jspec or Hugging Face) from text files,
in one resumable command.

Stages, each kept in the workdir so that rerunning the same command resumes where the last one stopped:
1. `tokens/`: the files tokenized with the target's tokenizer, each document followed by EOS; documents whose
   name hashes into the held-out slice (about 2%, at least one) are kept apart for validation and for τ.
2. `continuations/`: the target's own continuations of random windows of the training tokens, at each
   temperature, decoded by jspec with continuous batching (on the mesh when one is given), written in parts.
3. `train/`: the drafter trained on the documents and the continuations (`jspec.train.trainer.fit`, orbax
   checkpoints): heads on the frozen target (its features computed on the fly), or a draft model distilled
   from it (KL + 0.1 × cross-entropy).
4. The output directory: the drafter's weights, its cost model measured here (`jspec.planning.calibration`) and its
   training log, which also records τ on held-out prompts.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import pathlib

import numpy as np
from tqdm import tqdm

from jspec import flags
from jspec.core import registry

TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst", ".jsonl")  # the files taken from a directory
HELDOUT_PERCENT = 2
PART = 256  # windows continued per saved part


# `--kind parallel`: a draft model (the `model` drafter) trained to draft several tokens a forward (PARD)
PARALLEL = "parallel"


def trainable() -> dict[str, type]:
  """The drafter kinds this command trains (those with a `learning_rate`) and `parallel`, by name."""
  classes = {kind: registry.drafter_class(kind) for kind in registry.kinds()}
  trained = {kind: cls for kind, cls in classes.items() if cls.learning_rate is not None}
  return {**trained, PARALLEL: classes["model"]}


def parser() -> argparse.ArgumentParser:
  kinds = trainable()
  p = argparse.ArgumentParser(
      prog="python -m jspec.train drafter", fromfile_prefix_chars="@",
      description="Train a drafter for a target: tokenize the data with the target's tokenizer, have the target "
                  "continue it, train on both, and write a drafter directory that `--draft` loads.",
      epilog="example: python -m jspec.train drafter --kind medusa --target code --data notes/ code.jsonl "
             "--out my-medusa")
  p.add_argument("--kind", choices=sorted(kinds), required=True,
                 help="EAGLE head, Medusa heads, an MTP layer, a DFlash block drafter, a small draft model, or a "
                      "parallel draft model (a draft model drafting several tokens a forward: PARD)")
  p.add_argument("--target", required=True, help="the target: a shipped pair's name, a jspec or Hugging Face dir")
  p.add_argument("--data", nargs="+", required=True, metavar="PATH",
                 help=f"text files, JSONL files (a `text` or `prompt` field per line), or directories (their "
                      f"{', '.join(TEXT_SUFFIXES)} files); @LIST reads arguments from LIST, one per line")
  p.add_argument("--out", required=True, help="the drafter directory to write")
  p.add_argument("--workdir", help="where the stages are kept (default: OUT.work); rerun to resume")
  p.add_argument("--steps", type=int, default=1000)
  p.add_argument("--batch", type=int, default=8, help="sequences per training step")
  p.add_argument("--seq-len", type=int, default=256)
  p.add_argument("--lr", type=float, help="peak learning rate (default: the kind's, "
                 + ", ".join(f"{k} {cls.learning_rate:g}" for k, cls in sorted(kinds.items())) + ")")
  p.add_argument("--sequences", type=int, default=1024, help="windows the target continues at each temperature")
  p.add_argument("--prompt-len", type=int, default=64, help="tokens in each window")
  p.add_argument("--new-tokens", type=int, default=192, help="tokens the target adds to each window")
  p.add_argument("--temperatures", default="0,1", help="comma-separated; each continues its own windows")
  p.add_argument("--mix", type=float, default=0.5,
                 help="share of training windows drawn from the continuations (the rest from the documents)")
  p.add_argument("--slots", type=int, default=32, help="rows decoded together while continuing")
  p.add_argument("--num-heads", type=int, default=5, help="Medusa heads")
  p.add_argument("--feature-layers", default="eagle3", metavar="eagle3|last|I,J,K",
                 help="EAGLE: the target layers the head reads: EAGLE-3's low, middle and high (default), the final "
                      "hidden state alone (EAGLE-1), or these 0-based layers; DFlash: these layers, or by default "
                      "one per draft layer spread as z-lab spreads them")
  p.add_argument("--draft-vocab", type=int, default=0, metavar="N",
                 help="EAGLE-3: draft over the N most frequent tokens of the data (as the published EAGLE-3 heads "
                      "do; 0: the whole vocabulary)")
  p.add_argument("--ttt-steps", type=int, default=4,
                 help="EAGLE-3: steps the head is unrolled on its own features in training (training-time test)")
  p.add_argument("--block-size", type=int, default=8,
                 help="DFlash: positions of the block drafted at once (drafts up to one fewer token)")
  p.add_argument("--draft-layers", type=int, default=1, help="DFlash: its decoder layers")
  p.add_argument("--mask-token", type=int, metavar="ID",
                 help="DFlash: the token id that fills the block's masked positions (default: the target's EOS); "
                      "parallel: its mask token (default: the training data's rarest token)")
  p.add_argument("--parallel-len", type=int, default=8,
                 help="parallel: tokens it learns to draft a forward (PARD's copies of the text: the text, then "
                      "N - 1 masks)")
  p.add_argument("--draft-shape", metavar="JSON",
                 help="the draft model's shape, ModelConfig fields (default: a fifth of the target's layers, half "
                      "its width)")
  p.add_argument("--warm-start", metavar="DIR",
                 help="start from this drafter's weights wherever a weight of the same name and shape exists (an "
                      "EAGLE-1 head for an EAGLE-3 one: all but the fusion), the rest freshly initialized")
  p.add_argument("--no-calibrate", action="store_true",
                 help="skip measuring the cost model (adaptive K then uses a calibration or neutral figures)")
  p.add_argument("--mesh", metavar="data=D,model=M", help="run the target (continuations, features) on this mesh")
  p.add_argument("--seed", type=int, default=0)
  return p


def read_documents(paths: list[str]) -> list[tuple[str, str]]:
  """(name, text) of every document: a text file is one, each line of a JSONL file one (its `text`, else its
  `prompt`); a directory holds the files under it with a suffix in TEXT_SUFFIXES."""
  files: list[pathlib.Path] = []
  for given in map(pathlib.Path, paths):
    if given.is_dir():
      files.extend(sorted(p for p in given.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES))
    elif given.is_file():
      files.append(given)
    else:
      raise ValueError(f"--data: {given}: no such file or directory")
  docs = []
  for path in files:
    text = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix != ".jsonl":
      docs.append((path.as_posix(), text))
      continue
    for number, line in enumerate(text.splitlines(), 1):
      if not line.strip():
        continue
      try:
        record = json.loads(line)
        docs.append((f"{path.as_posix()}:{number}", str(record["text"] if "text" in record else record["prompt"])))
      except (ValueError, KeyError, TypeError):
        raise ValueError(f"{path}:{number}: expected a JSON object with a `text` or `prompt` field") from None
  if not docs:
    raise ValueError(f"--data: no documents in {' '.join(paths)}")
  return docs


def is_heldout(name: str) -> bool:
  return int(hashlib.sha256(name.encode()).hexdigest(), 16) % 100 < HELDOUT_PERCENT


def tokenize(docs: list[tuple[str, str]], target, directory: pathlib.Path) -> tuple[dict[str, np.ndarray], str]:
  """The training and held-out token streams (each document followed by EOS) and a digest of the documents;
  kept in `directory` and read back when the same documents are tokenized again."""
  from jspec.text.tokenizer import encode

  names = [name for name, _ in docs]
  digest = hashlib.sha256("\n".join(f"{n}\t{len(t)}" for n, t in docs).encode()).hexdigest()
  record = directory / "documents.json"
  if record.is_file() and json.loads(record.read_text()).get("digest") == digest:
    return {s: np.load(directory / f"{s}.npy") for s in ("train", "heldout")}, digest
  heldout = {n for n in names if is_heldout(n)} or ({names[-1]} if len(names) > 1 else set())
  eos = target.config.stop_ids[0]
  streams: dict[str, list[int]] = {"train": [], "heldout": []}
  for name, text in tqdm(docs, desc="tokenizing"):
    part = streams["heldout" if name in heldout else "train"]
    part.extend(encode(target.tokenizer, text))
    part.append(eos)
  if not streams["heldout"]:  # one document: hold out its last tenth
    cut = len(streams["train"]) * 9 // 10
    streams = {"train": streams["train"][:cut], "heldout": streams["train"][cut:]}
  directory.mkdir(parents=True, exist_ok=True)
  out = {s: np.asarray(ids, np.int32) for s, ids in streams.items()}
  for split, ids in out.items():
    np.save(directory / f"{split}.npy", ids)
  record.write_text(json.dumps({"digest": digest, "documents": len(docs), "heldout": sorted(heldout),
                                **{split: len(ids) for split, ids in out.items()}}, indent=1))
  return out, digest


def continue_parts(target, stream: np.ndarray, directory: pathlib.Path, args: argparse.Namespace, mesh) -> np.ndarray:
  """The target's continuations of `args.sequences` windows at each temperature, decoded PART windows at a
  time; parts already in `directory` (named by every setting they depend on) are kept, so a rerun decodes
  only what is missing."""
  from jspec.train import continuations

  temperatures = [float(t) for t in args.temperatures.split(",")]
  if len(stream) <= args.prompt_len:
    raise ValueError(f"--data: {len(stream)} training tokens cannot hold a {args.prompt_len}-token window")
  directory.mkdir(parents=True, exist_ok=True)
  parts = []
  with tqdm(total=args.sequences * len(temperatures), desc="target continuations") as bar:
    for i, temperature in enumerate(temperatures):
      windows = continuations.prompt_windows(stream, args.sequences, args.prompt_len, args.seed + i)
      for first in range(0, len(windows), PART):
        name = f"p{args.prompt_len}-n{args.new_tokens}-s{args.seed}-t{temperature:g}-{first // PART:05d}"
        path = directory / f"{name}.npy"
        group = windows[first:first + PART]
        if path.is_file():
          bar.update(len(group))
        else:
          # Window r of temperature i samples with seed + i * 10^6 + r, whatever --sequences is.
          ids = continuations.continue_windows(target, group, args.new_tokens, temperature,
                                               args.seed + i * 10 ** 6 + first, args.slots, mesh, bar)
          np.save(path.with_suffix(".tmp.npy"), ids)
          path.with_suffix(".tmp.npy").rename(path)
        parts.append(np.load(path).astype(np.int32))
  return np.concatenate(parts)


def mixed(documents: np.ndarray, continued: np.ndarray, share: float) -> np.ndarray:
  """One training stream in which about `share` of uniformly drawn windows fall in the continuations: the
  documents, then the continuations repeated (or cut) to that share of the whole."""
  length = int(round(len(documents) * share / (1 - share)))
  return np.concatenate([documents, np.resize(continued, length)]) if length else documents


def draft_shape(config) -> dict:
  """A draft model for a target: a fifth of its layers (at least 1), half its width in whole heads of its
  head size, one KV head, an MLP three times its width."""
  heads = max(config.n_heads // 2, 1)
  dim = heads * config.head_dim
  return {"dim": dim, "n_layers": max(config.n_layers // 5, 1), "n_heads": heads, "n_kv_heads": 1,
          "head_dim": config.head_dim, "mlp_dim": 3 * dim, "rope_theta": config.rope_theta,
          "max_seq_len": config.max_seq_len}


def task_for(args: argparse.Namespace, target, token_counts: np.ndarray | None = None):
  import dataclasses

  import jspec
  from jspec.train import trainer

  tok = target.tokenizer
  cls = trainable()[args.kind]
  if cls.is_draft_model:
    if args.draft_shape:
      fields = json.loads(args.draft_shape)
    elif args.warm_start:  # the shape of the draft it starts from
      fields = {**dataclasses.asdict(jspec.load(args.warm_start).config), "dtype": "float32"}
    else:
      fields = draft_shape(target.config)
    fields = {**fields, "vocab_size": target.config.vocab_size, "eos_id": target.config.eos_id,
              "bos_id": target.config.bos_id}
    if args.kind != PARALLEL:
      return trainer.model_task(fields, tok, teacher=target, ce_weight=0.1)
    # The mask: an unused token, as PARD's are (the data's rarest).
    mask = args.mask_token if args.mask_token is not None else (
        int(np.argmin(token_counts)) if token_counts is not None else target.config.vocab_size - 1)
    if not 0 <= mask < target.config.vocab_size:
      raise ValueError(f"--mask-token {mask} outside the target's vocabulary of {target.config.vocab_size}")
    return trainer.model_task({**fields, "mask_id": mask}, tok, teacher=target, ce_weight=0.1,
                              parallel=args.parallel_len)
  return trainer.heads_task(target, args.kind, heads_options(args), tok, token_counts)


def heads_options(args: argparse.Namespace) -> dict:
  """The heads' training options (a training config's `heads`, which the drafter's `for_training` and `loss`
  read) from the flags. Medusa: `--num-heads`. EAGLE: `--feature-layers` eagle3 (the default layers, trained
  on its own predictions for `--ttt-steps`), last (EAGLE-1, with its feature regression), or the layers to
  fuse; `--draft-vocab`: EAGLE-3's vocabulary (the training data's most frequent tokens; 0: the target's).
  DFlash: `--block-size`, `--draft-layers`, `--mask-token` and the layers it reads."""
  options = {"num_heads": args.num_heads, "block_size": args.block_size, "draft_layers": args.draft_layers,
             "mask_token": args.mask_token}
  if args.feature_layers == "last":
    return {**options, "feature_weight": 1.0, "feature_noise": 0.2}
  try:
    layers = "eagle3" if args.feature_layers == "eagle3" else [int(i) for i in args.feature_layers.split(",")]
  except ValueError:
    raise ValueError(f"--feature-layers: expected eagle3, last or layers such as 1,4,6, got "
                     f"{args.feature_layers!r}") from None
  return {**options, "feature_layers": layers, "ttt_steps": args.ttt_steps, "draft_vocab": args.draft_vocab}


def warm_started(task, directory: str):
  """`task` whose initial weights take every leaf of `directory`'s drafter that matches one by path and shape."""
  import dataclasses

  import jax

  import jspec

  saved = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(jspec.load(directory).params)}

  def init(key):
    fresh = task.init(key)
    taken = lambda path, x: saved[jax.tree_util.keystr(path)].astype(x.dtype) if (
        jax.tree_util.keystr(path) in saved and saved[jax.tree_util.keystr(path)].shape == x.shape) else x
    return jax.tree_util.tree_map_with_path(taken, fresh)
  return dataclasses.replace(task, init=init, description=f"{task.description} (warm start from {directory})")


def heldout_tau(target, draft, stream: np.ndarray, prompts: int = 8, prompt_len: int = 128,
                new_tokens: int = 64) -> float:
  """Greedy τ at K = 4 (fixed) on windows of the held-out tokens."""
  import jspec

  length = min(prompt_len, max(len(stream) // (prompts + 1), 8))
  starts = np.linspace(0, max(len(stream) - length, 0), prompts).astype(int)
  windows = [stream[s:s + length].tolist() for s in starts]
  result = jspec.generate(target, windows, draft=draft, max_new_tokens=new_tokens, draft_len=4,
                          spec=jspec.SpecConfig(adaptive=None), ignore_eos=True)
  return float(result.stats.mean_accepted_length)


def run(args: argparse.Namespace) -> dict:
  import jax
  from jax.sharding import NamedSharding, PartitionSpec

  import jspec
  from jspec.formats import checkpoint
  from jspec.planning import calibration
  from jspec.train import trainer

  cls = trainable()[args.kind]
  if args.steps < 1 or args.batch < 1 or args.seq_len < 2 or args.sequences < 0 or args.slots < 1:
    raise ValueError("--steps, --batch, --slots must be >= 1, --seq-len >= 2, --sequences >= 0")
  if not 0.0 <= args.mix < 1.0:
    raise ValueError(f"--mix must be in [0, 1), got {args.mix}")
  docs = read_documents(args.data)
  mesh = jspec.make_mesh(args.mesh) if args.mesh else None
  target = jspec.load(args.target, mesh=mesh)
  if not isinstance(target, jspec.Model):
    raise ValueError(f"--target {args.target}: a drafter, not a target model")
  task_for(args, target)  # refuses bad options before any work
  out = pathlib.Path(args.out)
  workdir = pathlib.Path(args.workdir or f"{out}.work")
  streams, digest = tokenize(docs, target, workdir / "tokens")
  print(f"{len(docs)} documents: {len(streams['train']):,} training tokens, {len(streams['heldout']):,} held out",
        flush=True)
  train_ids = streams["train"]
  if args.sequences:
    continued = continue_parts(target, train_ids, workdir / "continuations" / digest[:16], args, mesh)
    train_ids = mixed(train_ids, continued, args.mix)
  task = task_for(args, target, np.bincount(streams["train"], minlength=target.config.vocab_size))
  if args.warm_start:
    task = warm_started(task, args.warm_start)
  shards = {"train": train_ids, "validation": streams["heldout"]}
  if len(shards["validation"]) <= args.seq_len + 1:  # a small held-out slice validates on shorter windows
    shards["validation"] = np.resize(shards["validation"], args.seq_len + 2)
  steps = args.steps
  tcfg = {"steps": steps, "batch": args.batch, "seq_len": args.seq_len, "lr": args.lr or cls.learning_rate,
          "warmup_steps": max(steps // 20, 1), "eval_every": max(steps // 10, 1), "save_every": max(steps // 20, 1),
          "seed": args.seed}
  place = lambda batch: batch
  if mesh is not None and args.batch % mesh.shape["data"] == 0:
    place = lambda batch: jax.device_put(batch, NamedSharding(mesh, PartitionSpec("data")))
  log = trainer.fit(task, shards, tcfg, workdir / "train", out, place=place)

  draft = jspec.load(out)
  kind = cls.kind
  if not args.no_calibrate:
    print("measuring its cost model here", flush=True)
    checkpoint.write_cost_models(out, {**checkpoint.read_cost_models(out),
                                       kind: calibration.measure(target, draft, kind, (1,), repeats=3)})
  log["heldout_tau_k4"] = heldout_tau(target, draft, streams["heldout"])
  (out / "train_log.json").write_text(json.dumps(log, indent=2))
  print(f"{out}: τ {log['heldout_tau_k4']:.2f} at K = 4 on held-out prompts (greedy); "
        f"use it with --draft {out}" + ("" if cls.is_draft_model else f" --drafter {kind}"))
  return log


@flags.command
def main(argv: list[str] | None = None) -> int:
  run(parser().parse_args(argv))
  return 0
