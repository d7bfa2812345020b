"""Training data a draft learns the target's own text from: the target's continuations of corpus windows.

A draft distilled only on the corpus sees human-written contexts, but at inference every context past the
prompt is the target's own output. Sequence-level distillation (as in DistillSpec) closes that gap: the
target continues random windows of the training split, and the draft is then distilled (KL to the
target, computed on the fly by `jspec.train`) on those sequences. Greedy continuations match greedy
decoding; sampled ones (temperature 1) keep the data varied and match sampled decoding.

`python -m jspec.train continuations --target checkpoints/code-target --data data/code --out data/code-continuations`
writes `train.npy` (every prompt window and its continuation, each followed by EOS) and copies the
source's validation split and tokenizer, so validation stays on the corpus.
"""
from __future__ import annotations

import argparse
import pathlib
import shutil

import numpy as np
from tqdm import tqdm

from jspec import api, flags
from jspec.formats import loading
from jspec.train import data


def prompt_windows(stream: np.ndarray, count: int, length: int, seed: int) -> list[list[int]]:
  """`count` windows of `length` tokens at random offsets of a token stream, seeded."""
  starts = np.random.default_rng(seed).integers(0, len(stream) - length, size=count)
  return [stream[s:s + length].astype(np.int32).tolist() for s in starts]


def continue_windows(target, windows: list[list[int]], new_tokens: int, temperature: float, seed: int,
                     batch: int, mesh=None, progress: tqdm | None = None) -> np.ndarray:
  """Each window followed by the target's continuation (ending at EOS or after `new_tokens`) and an EOS,
  joined into one stream; window r samples with seed + r. Decoded by continuous batching over `batch` rows
  (a finished row takes the next window at once), or, on a mesh that splits kv heads (whose caches cannot
  take a row in place), in static batches."""
  from jspec.model import sharding

  stops = target.config.stop_ids
  continued: dict[int, list[int]] = {i: [] for i in range(len(windows))}
  if mesh is not None and sharding.cache_layout(batch, target.config, mesh).heads_major:
    for first in range(0, len(windows), batch):
      group = windows[first:first + batch]
      result = api.generate(target, group, max_new_tokens=new_tokens, temperature=temperature, seed=seed + first,
                            mesh=mesh)
      continued.update(zip(range(first, first + len(group)), result.token_ids))
      if progress is not None:
        progress.update(len(group))
  else:
    for delta in api.stream(target, windows, max_new_tokens=new_tokens, temperature=temperature, seed=seed,
                            batch_size=batch, mesh=mesh):
      continued[delta.index].extend(delta.token_ids)
      if delta.finished and progress is not None:
        progress.update(1)
  out = []
  for i, window in enumerate(windows):
    out.extend(window)
    out.extend(t for t in continued[i] if t not in stops)
    out.append(stops[0])
  return np.asarray(out, np.uint16 if target.config.vocab_size <= 65536 else np.int32)


@flags.command
def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(prog="python -m jspec.train continuations")
  ap.add_argument("--target", required=True, help="the model whose continuations to write")
  ap.add_argument("--data", default="data/code",
                  help="token shards (`python -m jspec.train data`) to draw prompts from")
  ap.add_argument("--out", required=True)
  ap.add_argument("--sequences", type=int, default=4096, help="windows continued at each temperature")
  ap.add_argument("--prompt-len", type=int, default=64)
  ap.add_argument("--new-tokens", type=int, default=192)
  ap.add_argument("--temperatures", default="0,1", help="comma-separated; each continues its own windows")
  ap.add_argument("--batch", type=int, default=64, help="rows decoded together")
  ap.add_argument("--seed", type=int, default=0)
  args = ap.parse_args(argv)
  source, out = pathlib.Path(args.data), pathlib.Path(args.out)
  target = loading.load(args.target)
  stream = np.load(data.shard_path(source, "train"))
  temperatures = [float(t) for t in args.temperatures.split(",")]
  parts = []
  for i, temperature in enumerate(temperatures):
    windows = prompt_windows(stream, args.sequences, args.prompt_len, args.seed + i)
    with tqdm(total=len(windows), desc=f"continuing at temperature {temperature:g}") as bar:
      parts.append(continue_windows(target, windows, args.new_tokens, temperature, args.seed + i * args.sequences,
                                    args.batch, progress=bar))
  out.mkdir(parents=True, exist_ok=True)
  train = np.concatenate(parts)
  np.save(data.shard_path(out, "train"), train)
  shutil.copy(data.shard_path(source, "validation"), data.shard_path(out, "validation"))
  shutil.copy(source / "tokenizer.json", out / "tokenizer.json")
  print(f"{out}: {len(train):,} training tokens from {args.sequences} windows at each of {temperatures}")
  return 0
