"""Corpus split, BPE round trip, and training smoke runs: the loss goes down, distillation works, resume works."""
import json

import jax
import numpy as np
import pytest

import jspec
from jspec import testing
from jspec.formats import checkpoint
from jspec.text import tokenizer
from jspec.train import cli as entry
from jspec.train import continuations, data, trainer

TINY_MODEL = {"dim": 32, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1, "head_dim": 16, "mlp_dim": 64,
              "max_seq_len": 256}


def test_split_is_deterministic_and_about_96_2_2(capsys):
  splits = [data.split_of(f"pkg/module_{i}.py") for i in range(5000)]
  share = {s: splits.count(s) / len(splits) for s in ("train", "validation", "heldout")}
  assert 0.94 < share["train"] < 0.98 and 0.01 < share["validation"] < 0.03 and 0.01 < share["heldout"] < 0.03
  assert splits == [data.split_of(f"pkg/module_{i}.py") for i in range(5000)]
  assert not set(data.corpus_files("heldout")) & set(data.corpus_files("validation"))
  assert entry.main(["data", "--list", "heldout"]) == 0  # `python -m jspec.train data`
  assert capsys.readouterr().out.split() == [str(f) for f in data.corpus_files("heldout")]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  """A small BPE and token shards from part of the real corpus."""
  out = tmp_path_factory.mktemp("data")
  texts = data.read_texts("validation")[:40]
  tok = tokenizer.train_bpe(texts, 600)
  tok.save(str(out / "tokenizer.json"))
  eos = tok.token_to_id(tokenizer.EOS_TOKEN)
  stream = data.token_stream(texts, lambda t: tokenizer.encode(tok, t), eos).astype(np.uint16)
  for split in ("train", "validation"):
    np.save(data.shard_path(out, split), stream)
  return out


def test_bpe_round_trips_source_exactly(data_dir):
  tok = tokenizer.load_tokenizer(data_dir)
  for text in data.read_texts("heldout")[:20] + ["\tdef f(x):\n        return  x  \n\n\n  # é 你好\r\n"]:
    assert tokenizer.detokenize(tok, tokenizer.encode(tok, text)) == text


def _config(tmp_path, name, steps, **extra):
  cfg = {"model": TINY_MODEL, "data": str(tmp_path / "data"), "workdir": str(tmp_path / f"run-{name}"),
         "out": str(tmp_path / name),
         "train": {"steps": steps, "batch": 4, "seq_len": 32, "lr": 0.01, "warmup_steps": 2, "eval_every": 10,
                   "save_every": 10}, **extra}
  path = tmp_path / f"{name}.json"
  path.write_text(json.dumps(cfg))
  return path


@pytest.mark.slow
def test_training_lowers_the_loss_distills_and_resumes(tmp_path, data_dir):
  (tmp_path / "data").symlink_to(data_dir)
  assert trainer.main(["--config", str(_config(tmp_path, "target", 20))]) == 0
  log = json.loads((tmp_path / "target" / "train_log.json").read_text())
  assert log["history"][0]["step"] == 0
  assert log["history"][-1]["validation_ce"] < log["history"][0]["validation_ce"] - 0.5
  target = jspec.load(tmp_path / "target")
  assert len(jspec.generate(target, ["def f("], max_new_tokens=5).token_ids[0]) >= 1

  # Resume: a second run of the same config with more steps starts from the saved step.
  assert trainer.main(["--config", str(_config(tmp_path, "target", 30))]) == 0
  log2 = json.loads((tmp_path / "target" / "train_log.json").read_text())
  assert [h["step"] for h in log2["history"]] == [30]

  # --save-latest writes the workdir's latest step again, without training.
  before = jspec.load(tmp_path / "target").params
  assert trainer.main(["--config", str(_config(tmp_path, "target", 30)), "--save-latest"]) == 0
  assert json.loads((tmp_path / "target" / "train_log.json").read_text())["steps"] == 30
  jax.tree.map(np.testing.assert_array_equal, jspec.load(tmp_path / "target").params, before)

  # Continued from saved weights alone (another machine, no workdir): it starts at the given step and
  # keeps what the weights had learned.
  fresh = _config(tmp_path, "continued", 40)
  assert trainer.main(["--config", str(fresh), "--init-from", str(tmp_path / "target"), "--start-step", "30"]) == 0
  log3 = json.loads((tmp_path / "continued" / "train_log.json").read_text())
  assert [h["step"] for h in log3["history"]] == [40]
  assert log3["validation_ce"] < log["history"][0]["validation_ce"] - 0.5

  draft_cfg = _config(tmp_path, "draft", 20, teacher=str(tmp_path / "target"), ce_weight=0.1)
  assert trainer.main(["--config", str(draft_cfg)]) == 0
  draft = jspec.load(tmp_path / "draft")
  r = jspec.generate(target, ["def f("], draft=draft, max_new_tokens=16, draft_len=3)
  assert r.token_ids == jspec.generate(target, ["def f("], max_new_tokens=16).token_ids


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory, data_dir):
  root = tmp_path_factory.mktemp("heads")
  (root / "data").symlink_to(data_dir)
  assert trainer.main(["--config", str(_config(root, "target", 10))]) == 0
  return root


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["medusa", "eagle", "mtp", "dflash"])  # mtp: an MTP layer for a target that has none
def test_head_training_lowers_the_loss_and_heads_decode_losslessly(tiny_target, kind):
  tmp_path = tiny_target
  options = {"medusa": {"num_heads": 3}, "dflash": {"block_size": 4}}.get(kind, {"feature_noise": 0.1})
  heads_cfg = _config(tmp_path, kind, 20, drafter=kind, target=str(tmp_path / "target"), heads=options)
  assert trainer.main(["--config", str(heads_cfg)]) == 0
  log = json.loads((tmp_path / kind / "train_log.json").read_text())
  assert log["history"][-1]["validation_loss"] < log["history"][0]["validation_loss"]
  target, heads = jspec.load(tmp_path / "target"), jspec.load(tmp_path / kind)
  assert heads.drafter.kind == kind
  r = jspec.generate(target, ["def f("], draft=heads, max_new_tokens=12, draft_len=3)
  assert r.token_ids == jspec.generate(target, ["def f("], max_new_tokens=12).token_ids


@pytest.mark.slow
def test_continuations_are_the_targets_text_and_a_draft_distills_on_them(tiny_target):
  root = tiny_target
  out = root / "continuations"
  assert continuations.main(["--target", str(root / "target"), "--data", str(root / "data"), "--out", str(out),
                             "--sequences", "3", "--prompt-len", "8", "--new-tokens", "6",
                             "--temperatures", "0,1", "--batch", "2"]) == 0
  # Each window, the target's continuation (row r of a temperature's windows samples with its seed + r,
  # as when decoded alone) without EOS, then one EOS.
  target = jspec.load(root / "target")
  eos = target.config.stop_ids[0]
  source = np.load(data.shard_path(root / "data", "train"))
  expected = []
  for i, temperature in enumerate((0.0, 1.0)):
    for r, window in enumerate(continuations.prompt_windows(source, 3, 8, seed=i)):
      result = jspec.generate(target, [window], max_new_tokens=6, temperature=temperature, seed=3 * i + r)
      expected += window + [t for t in result.token_ids[0] if t != eos] + [eos]
  assert np.load(data.shard_path(out, "train")).tolist() == expected
  assert (out / "tokenizer.json").read_bytes() == (root / "data" / "tokenizer.json").read_bytes()
  np.testing.assert_array_equal(np.load(data.shard_path(out, "validation")),
                                np.load(data.shard_path(root / "data", "validation")))

  draft_cfg = _config(root, "draft-continued", 10, teacher=str(root / "target"), ce_weight=0.1, data=str(out))
  assert trainer.main(["--config", str(draft_cfg)]) == 0
  draft = jspec.load(root / "draft-continued")
  r = jspec.generate(target, ["def f("], draft=draft, max_new_tokens=12, draft_len=3)
  assert r.token_ids == jspec.generate(target, ["def f("], max_new_tokens=12).token_ids


@pytest.mark.slow
def test_drafter_recipe_trains_each_kind_for_a_target_and_resumes(tiny_target, tmp_path):
  """`python -m jspec.train drafter`: text files and JSONL in, the target's continuations, training, and a
  drafter directory out (weights, cost model, τ on held-out prompts) that decodes losslessly; a rerun
  resumes (continuations kept, training from its last step)."""
  docs = tmp_path / "docs"
  docs.mkdir()
  for i, text in enumerate(data.read_texts("validation")[:12]):
    (docs / f"m{i}.py").write_text(text)
  (docs / "notes.jsonl").write_text("\n".join(json.dumps({"text": f"def f{i}(x):\n    return x + {i}\n"})
                                              for i in range(20)))
  target_dir = tiny_target / "target"
  target = jspec.load(target_dir)
  common = ["--target", str(target_dir), "--data", str(docs), "--sequences", "4", "--prompt-len", "8",
            "--new-tokens", "6", "--slots", "2", "--batch", "2", "--seq-len", "24"]
  for kind in ("eagle", "medusa", "model", "parallel"):
    out = tmp_path / kind
    # EAGLE is measured once (it compiles several loops), over the data's most frequent half of the vocabulary;
    # the parallel draft is the draft model fine-tuned to draft 3 tokens a forward
    half = target.config.vocab_size // 2
    extra = {"eagle": ["--draft-vocab", str(half)],
             "parallel": ["--no-calibrate", "--warm-start", str(tmp_path / "model"), "--parallel-len", "3"]}.get(
                 kind, ["--no-calibrate"])
    assert entry.main(["drafter", "--kind", kind, "--out", str(out), "--steps", "4", *common, *extra]) == 0
    draft = jspec.load(out)
    log = json.loads((out / "train_log.json").read_text())
    assert log["steps"] == 4 and log["heldout_tau_k4"] >= 1.0
    assert (kind in checkpoint.read_cost_models(out)) == (kind == "eagle")
    if kind == "eagle":
      assert draft.drafter.version == 3 and draft.drafter.draft_vocab == half  # EAGLE-3 by default
      ids = np.asarray(draft.params["target_ids"])
      counts = np.bincount(np.concatenate([target.tokenizer.encode(f.read_text()).ids for f in docs.glob("*.py")]))
      assert (np.diff(ids) > 0).all() and counts.argmax() in ids  # the most frequent tokens, in id order
    if kind == "parallel":  # the model's shape, and a mask token it reads from its checkpoint
      assert draft.config.mask_id is not None and draft.config.dim == jspec.load(tmp_path / "model").config.dim
    r = jspec.generate(target, ["def f("], draft=draft, max_new_tokens=12, spec=testing.fixed_k(3))
    assert r.token_ids == jspec.generate(target, ["def f("], max_new_tokens=12).token_ids

  # A rerun with more steps: the continuation parts are kept and training resumes at step 4.
  work = tmp_path / "medusa.work"
  parts = {p: p.stat().st_mtime_ns for p in work.rglob("*.npy") if "continuations" in p.parts}
  assert len(parts) == 2  # one part per temperature
  assert entry.main(["drafter", "--kind", "medusa", "--out", str(tmp_path / "medusa"), "--steps", "6", *common,
                     "--no-calibrate"]) == 0
  assert {p: p.stat().st_mtime_ns for p in parts} == parts
  assert [h["step"] for h in json.loads((tmp_path / "medusa" / "train_log.json").read_text())["history"]] == [5, 6]


@pytest.mark.parametrize("argv,message", [
    (["--data", "missing-dir"], "no such file or directory"),
    (["--data", "{bad}"], "expected a JSON object with a `text` or `prompt` field"),
    (["--feature-layers", "low"], "--feature-layers: expected eagle3, last or layers"),
    (["--feature-layers", "0,99"], "outside the target's"),
    (["--draft-vocab", "10000000"], "choose at most the target's"),
])
def test_drafter_recipe_refuses_bad_input_with_one_line(tiny_target, tmp_path, capsys, argv, message):
  good = tmp_path / "good.txt"
  good.write_text("def f(x):\n    return x\n" * 50)
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"text": "ok"}\n[1, 2]\n')
  argv = [str(bad) if a == "{bad}" else a for a in argv]
  base = ["drafter", "--kind", "eagle", "--target", str(tiny_target / "target"), "--out", str(tmp_path / "o"),
          "--sequences", "0", "--steps", "1"]
  if "--data" not in argv:
    argv = ["--data", str(good), *argv]
  assert entry.main(base + argv) == 2
  err = capsys.readouterr().err.strip()
  assert message in err and len(err.splitlines()) == 1


def test_third_party_prompts_come_from_installed_packages_never_the_corpus():
  from jspec.bench import prompts

  root = data.stdlib_root()
  files = [f for name in prompts.THIRD_PARTY for f in prompts.package_files(name)]
  assert files and not any(f.is_relative_to(root) and "site-packages" not in f.parts for f in files)
  texts = prompts.thirdparty_prompts(4)
  assert len(texts) == 4 and all(t.rstrip().split("\n")[-1].lstrip().startswith("def ") for t in texts)
