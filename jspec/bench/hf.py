"""The peer comparison: Hugging Face transformers' assisted generation against jspec, on the same pair.

The jspec checkpoints are converted with `python -m jspec.convert --to-hf`, loaded by transformers, and both
libraries decode the same prompts greedily at batch 1 on the same CPU, interleaved (HF, jspec, HF, jspec ...),
each timed call right after an untimed one of its own.
Needs the `[interop]` extra (torch, transformers).
"""
from __future__ import annotations

import pathlib
import subprocess
import sys

import jspec
from jspec.core.timing import interleaved
from jspec.text.tokenizer import encode


def to_hf(src: str | pathlib.Path, out: pathlib.Path) -> pathlib.Path:
  subprocess.run([sys.executable, "-m", "jspec.convert", "--to-hf", str(src), str(out)], check=True,
                 stdout=subprocess.DEVNULL)
  return out


def compare(target_dir, draft_dir, prompts: list[str], max_new: int, repeats: int, work_dir: pathlib.Path,
            draft_len: int = 4) -> dict:
  """HF `generate(assistant_model=...)` and plain `generate`, against jspec's speculative and plain decoding."""
  import torch
  import transformers

  load_hf = lambda path: transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
  hf_target = load_hf(to_hf(target_dir, work_dir / "target"))
  hf_draft = load_hf(to_hf(draft_dir, work_dir / "draft"))
  target, draft = jspec.load(target_dir), jspec.load(draft_dir)
  walls = {"hf_assisted": 0.0, "hf_plain": 0.0, "jspec_spec": 0.0, "jspec_plain": 0.0}
  tokens = {name: 0 for name in walls}
  identical = 0
  for text in prompts:
    ids = encode(target.tokenizer, text)
    out = {}

    def hf(name, **kw):
      with torch.no_grad():
        # Both stop at the model's EOS or after max_new tokens.
        o = hf_target.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=max_new, **kw)
      out[name] = o[0, len(ids):].tolist()

    def ours(name, **kw):
      out[name] = jspec.generate(target, [ids], max_new_tokens=max_new, **kw).token_ids[0]

    fns = {"hf_assisted": lambda: hf("hf_assisted", assistant_model=hf_draft), "hf_plain": lambda: hf("hf_plain"),
           "jspec_spec": lambda: ours("jspec_spec", draft=draft, draft_len=draft_len),
           "jspec_plain": lambda: ours("jspec_plain")}
    # HF and jspec hold separate copies of the weights, each about the size of this CPU's L3 cache: every
    # timed call follows an untimed one of its own, so neither runs on the other's evicted weights.
    for name, t in interleaved(fns, repeats, warm_each=True).items():
      walls[name] += t
      tokens[name] += len(out[name])
    identical += len({tuple(v) for v in out.values()}) == 1
  rate = {f"{name}_tokens_per_second": tokens[name] / walls[name] for name in walls}
  return {"prompts": len(prompts), "max_new_tokens": max_new, "jspec_draft_len": draft_len,
          "transformers": transformers.__version__, "torch": torch.__version__,
          "torch_threads": torch.get_num_threads(), **rate,
          "jspec_over_hf_assisted": rate["jspec_spec_tokens_per_second"] / rate["hf_assisted_tokens_per_second"],
          "greedy_tokens_identical": f"{identical}/{len(prompts)}"}
