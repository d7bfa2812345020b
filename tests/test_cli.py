"""Bad input: one clear line, exit status 2 from the CLI and ValueError from the API; and a save/load trip."""
import dataclasses
import json
import pathlib
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

import jspec
from jspec import cli, drafters, flags, testing
from jspec.formats import checkpoint

REPO = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
  root = tmp_path_factory.mktemp("ckpt")
  target = testing.random_model(testing.TINY, seed=0, scale=2.0)
  jspec.save(target, root / "target")
  jspec.save(testing.random_model(testing.TINY_DRAFT, seed=1), root / "draft")
  (root / "corrupt").mkdir()
  (root / "corrupt" / "config.json").write_text((root / "target" / "config.json").read_text())
  (root / "corrupt" / "tokenizer.json").write_text((root / "target" / "tokenizer.json").read_text())
  (root / "corrupt" / "params").mkdir()
  (root / "corrupt" / "params" / "garbage").write_text("not a checkpoint")
  cross = dataclasses.replace(testing.random_model(testing.TINY_DRAFT, seed=1),
                              tokenizer=testing.char_tokenizer([chr(c) for c in range(97, 123)]))
  jspec.save(cross, root / "cross")  # a draft with another tokenizer: its 26 letters are all the target's
  low = dataclasses.replace(cross, tokenizer=testing.char_tokenizer(["ab", "cd", "ef", "gh", "ij", "kl", "mn", "a"]))
  jspec.save(low, root / "low-share")
  (root / "other.jsonl").write_text(json.dumps({"index": 0, "prompt": "another prompt", "text": ""}) + "\n")
  (root / "garbage.jsonl").write_text("not json\n")
  (root / "number.jsonl").write_text('{"prompt": 5}\n')
  (root / "latin1.txt").write_bytes("caf\u00e9\n".encode("latin-1"))
  return root


def test_save_load_round_trip(ckpts):
  original = testing.random_model(testing.TINY, seed=0, scale=2.0)
  loaded = jspec.load(ckpts / "target")
  assert loaded.config == original.config
  jax.tree.map(np.testing.assert_array_equal, loaded.params, original.params)
  a = jspec.generate(loaded, ["hello"], max_new_tokens=8)
  b = jspec.generate(original, ["hello"], max_new_tokens=8)
  assert a.token_ids == b.token_ids
  # The accelerator default, bf16, runs the same code. (Greedy equality is not asserted: a K+1-token verify
  # and a 1-token step round differently in bf16, so near-ties may flip.)
  half = jspec.load(ckpts / "target", dtype="bfloat16")
  assert jax.tree.leaves(half.params)[0].dtype == jax.numpy.bfloat16
  draft = jspec.load(ckpts / "draft", dtype="bfloat16")
  c = jspec.generate(half, ["hello"], draft=draft, max_new_tokens=8, spec=testing.fixed_k(3))
  assert len(c.token_ids[0]) == 8 and c.stats.drafted_tokens > 0


def _cli(ckpts, *args):
  # Adaptive K (the default) up to 2: fewer branches to compile than the default 4, the same paths.
  argv = ["--target", str(ckpts / "target"), "--draft", str(ckpts / "draft"), "--max-new-tokens", "5",
          "--draft-len", "2", *args]
  return argv


BAD = [
    (["--target", "/nonexistent/dir"], "no such checkpoint directory"),
    (["--target", "{root}/corrupt"], "cannot restore parameters"),
    (["--prompt", "x" * 2000], "exceeds the model's context"),
    # Settings and output paths are checked before anything loads (the target here does not exist).
    (["--target", "/nonexistent/dir", "--prompt", ""], "prompt 0 is empty"),
    (["--target", "/nonexistent/dir", "--max-new-tokens", "0"], "max_new_tokens must be an integer >= 1"),
    (["--target", "/nonexistent/dir", "--output", "{root}/no/such/dir/out.jsonl"], "--output: no directory"),
    (["--prompt-file", "{root}/number.jsonl"], 'number.jsonl:1: "prompt" must be a string'),
    (["--prompt-file", "{root}/latin1.txt"], "latin1.txt: not UTF-8 text"),
    (["--temperature", "-1"], "temperature must be a finite number >= 0"),
    (["--temperature", "nan"], "temperature must be a finite number >= 0, got nan"),
    (["--temperature", "inf"], "temperature must be a finite number >= 0, got inf"),
    (["--top-p", "0"], "top_p must be in (0, 1]"),
    (["--top-p", "1.5"], "top_p must be in (0, 1]"),
    (["--top-p", "nan"], "top_p must be in (0, 1]"),
    (["--top-k", "-2"], "top_k must be an integer >= 0"),
    (["--draft-len", "0"], "draft_len must be an integer in [1, 16], got 0"),
    (["--draft-len", "1000"], "draft_len must be an integer in [1, 16], got 1000"),
    (["--max-ngram", "0"], "max_ngram must be an integer in [1, 8]"),
    (["--disable-at-batch-size", "0"], "disable_at_batch_size must be an integer >= 1"),
    (["--adaptive", "--fallback-threshold", "1.5"], "fallback_threshold must be in [0, 1]"),
    (["--adaptive", "--fallback-threshold", "nan"], "fallback_threshold must be in [0, 1]"),
    (["--adaptive", "--probe-interval", "0"], "probe_interval must be an integer >= 1"),
    (["--adaptive", "--cost-ratio", "-0.1"], "cost_ratio must be a finite number >= 0"),
    (["--adaptive", "--verify-cost", "nan"], "verify_cost must be a finite number >= 0"),
    (["--adaptive", "--round-overhead", "inf"], "round_overhead must be a finite number >= 0"),
    (["--adaptive-draft-lens", "1,x"], "--adaptive-draft-lens takes integers separated by commas, got '1,x'"),
    (["--adaptive-draft-lens", "0,2"], "draft_lens must be integers >= 1"),
    (["--seed", "-1"], "seeds must be in [0, 2**32)"),
    ([], "no prompt given"),
    (["--drafter", "medusa"], "the medusa drafter was given model weights"),
    (["--drafter", "ngram"], "the ngram drafter takes no draft weights"),
    (["--chat"], "chat: the target has no chat template"),
    (["--baseline", "--repeats", "0"], "--repeats must be >= 1"),
    (["--baseline", "--stream"], "--baseline times one batch"),
    (["--batch-size", "0"], "--batch-size must be >= 1"),
    (["--output", "{root}/other.jsonl"], "prompt 0 is not the same prompt in this run's prompts"),
    (["--output", "{root}/garbage.jsonl"], "garbage.jsonl:1: not an output line of jspec"),
    (["--tree", "--tree-top-k", "0"], "tree top_k must be an integer in [1, 64]"),
    (["--tree", "--tree-nodes", "65"], "tree nodes must be an integer in [1, 64]"),
    (["--tree", "--tree-nodes", "40", "--draft-len", "2", "--tree-top-k", "3"],
     "makes 12 candidate nodes, fewer than the 40 asked for"),
    (["--tree", "--tree-choices", "[[0], [0, 1"], "--tree-choices must be a JSON list"),
    (["--tree", "--tree-choices", "[[0], [1, 0]]"], "every tree choice's parent path must be a choice"),
    (["--tree-choices", "[[0]]"], "--tree-choices and --tree-sampled need --tree"),
    (["--tree", "--tree-sampled", "--tree-choices", "[[0]]"], "sampled children need a dynamic tree, not choices"),
    (["--tree", "--tree-choices", "[[0]]"], "the model drafter grows its tree dynamically"),
    (["--draft", "{root}/cross", "--tree"], "a draft with another tokenizer than the target's drafts chains only"),
    (["--draft", "{root}/low-share"], "the draft's tokenizer shares 22.2% of its vocabulary with the target's, "
                                       "under the 25% a cross-tokenizer draft needs"),
    (["--regex", "("], "cannot compile the constraint '('"),
    (["--regex", "a", "--choice", "b"], "give one of --regex, --json-schema and --choice"),
    (["--json-schema", "{root}/missing.json"], "--json-schema: neither a readable file nor a valid schema"),
    (["--json-schema", '{"type": "nope"}'], "cannot compile the JSON Schema: Unsupported type: nope"),
    (["--choice", "yes", "--ignore-eos"], "ignore_eos cannot be combined with a constraint"),
]


@pytest.mark.parametrize("extra,message", BAD, ids=[m for _, m in BAD])
def test_bad_input_exits_2_with_one_line(ckpts, capsys, extra, message):
  extra = [e.replace("{root}", str(ckpts)) for e in extra]
  if "--prompt" not in extra and message != "no prompt given":
    extra = extra + ["--prompt", "hi"]
  code = cli.main(_cli(ckpts, *extra, "--quiet"))
  err = capsys.readouterr().err
  assert code == 2
  assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_the_adaptive_draft_lengths_flag_sets_what_k_chooses_among():
  spec = lambda *argv: flags.speculation(cli.parser().parse_args(["--prompt", "x", *argv]))
  assert spec().adaptive.lens(8) == (1, 2, 4, 8)
  assert spec("--adaptive-draft-lens", "1,2,3,5,8").adaptive.lens(8) == (1, 2, 3, 5, 8)


def test_api_raises_value_error(ckpts):
  target = jspec.load(ckpts / "target")
  with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
    jspec.generate(target, ["x"], temperature=-0.5)
  with pytest.raises(ValueError, match="draft_len must be an integer in"):
    jspec.generate(target, ["x"], draft_len=17)
  with pytest.raises(ValueError, match="top_k must be an integer"):
    jspec.generate(target, ["x"], top_k=1.5)
  with pytest.raises(ValueError, match="shares 22.2% of its vocabulary"):
    jspec.generate(target, ["x"], draft=jspec.load(ckpts / "low-share"))


@pytest.mark.slow
def test_cli_json_end_to_end_in_a_subprocess(ckpts, tmp_path):
  prompts = tmp_path / "p.jsonl"
  prompts.write_text(json.dumps({"prompt": "def f("}) + "\n" + json.dumps({"prompt": "x = "}) + "\n")
  proc = subprocess.run([sys.executable, "-m", "jspec.generate", *_cli(ckpts, "--prompt-file", str(prompts),
                                                                       "--json", "--baseline")],
                        capture_output=True, text=True, cwd=REPO, timeout=300)
  assert proc.returncode == 0, proc.stderr
  out = json.loads(proc.stdout)
  assert [o["prompt"] for o in out["outputs"]] == ["def f(", "x = "]
  assert all(len(o["token_ids"]) == 5 for o in out["outputs"])
  base = out["baseline"]
  assert base["token_ids_match"] is True and out["speedup"] > 0 and base["repeats"] == 3
  assert base["speedup_min"] <= out["speedup"] <= base["speedup_max"]
  for key in ["acceptance_rate", "mean_accepted_length", "rounds", "target_forwards", "draft_forwards",
              "drafted_tokens", "accepted_tokens", "emitted_tokens", "per_position_acceptance",
              "tokens_per_second", "wall_seconds", "compile_seconds"]:
    assert key in out["stats"]
  bad = subprocess.run([sys.executable, "-m", "jspec.generate", "--target", "/nonexistent", "--prompt", "x", "--quiet"],
                       capture_output=True, text=True, cwd=REPO, timeout=300)
  assert bad.returncode == 2 and bad.stderr.startswith("error:") and bad.stderr.count("\n") == 1


@pytest.mark.slow
def test_cli_runs_every_drafter_kind(ckpts, capsys):
  target = jspec.load(ckpts / "target")
  heads = testing.random_heads(drafters.MedusaDrafter(target.config, 4))
  checkpoint.save_heads(heads, ckpts / "medusa")
  base = ["--target", str(ckpts / "target"), "--prompt", "abcabcabc", "--max-new-tokens", "6", "--json"]
  assert cli.main(base + ["--no-draft"]) == 0
  plain = json.loads(capsys.readouterr().out)["outputs"][0]["token_ids"]
  for extra, kind in [(["--drafter", "ngram"], "ngram"), (["--draft", str(ckpts / "medusa")], "medusa"),
                      (["--draft", str(ckpts / "draft")], "model"), (["--draft", str(ckpts / "cross")], "model")]:
    assert cli.main(base + extra + ["--draft-len", "3", "--no-adaptive"]) == 0  # adaptive K: test_adaptive.py
    out = json.loads(capsys.readouterr().out)
    assert out["stats"]["drafter"] == kind and out["outputs"][0]["token_ids"] == plain
  assert cli.main(base + ["--drafter", "eagle"]) == 2
  assert "needs --draft DIR for a target other than the shipped ones" in capsys.readouterr().err
  for extra in (["--draft", str(ckpts / "medusa"), "--tree-choices", "[[0], [1], [0, 0]]"],
                ["--draft", str(ckpts / "draft"), "--tree-nodes", "5"]):
    assert cli.main(base + extra + ["--tree", "--draft-len", "2", "--tree-top-k", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["outputs"][0]["token_ids"]) == 6 and out["stats"]["adaptive"] is False
    assert out["stats"]["tree"] == {"depth": 2, "top_k": 2, "nodes": 3 if "--tree-choices" in extra else 5}


@pytest.mark.slow
def test_cli_dtype(ckpts, capsys):
  base = ["--target", str(ckpts / "target"), "--draft", str(ckpts / "draft"), "--prompt", "abc", "--json",
          "--max-new-tokens", "4", "--draft-len", "2"]
  assert cli.main(base + ["--dtype", "bfloat16"]) == 0
  assert len(json.loads(capsys.readouterr().out)["outputs"][0]["token_ids"]) == 4
  with pytest.raises(SystemExit):
    cli.main(base + ["--dtype", "float16"])
  assert "invalid choice" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_ignore_eos_decodes_past_eos(ckpts, capsys):
  # With this seed the prompt's first sampled token is EOS: plain decoding stops there, --ignore-eos does not.
  base = ["--target", str(ckpts / "target"), "--no-draft", "--prompt", "x", "--temperature", "1", "--seed", "7",
          "--max-new-tokens", "12", "--json"]
  lengths = []
  for extra in ([], ["--ignore-eos"]):
    assert cli.main(base + extra) == 0
    lengths.append(len(json.loads(capsys.readouterr().out)["outputs"][0]["token_ids"]))
  assert lengths == [1, 12]


@pytest.mark.slow
def test_cli_structured_output(ckpts, capsys, tmp_path):
  schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
  (tmp_path / "schema.json").write_text(json.dumps(schema))
  base = ["--target", str(ckpts / "target"), "--draft", str(ckpts / "draft"), "--prompt", "x", "--prompt", "yes? ",
          "--max-new-tokens", "40", "--draft-len", "2", "--json", "--quiet"]
  for extra, valid in [(["--choice", "yes", "--choice", "no"], lambda t: t in ("yes", "no")),
                       (["--regex", "[0-9]{2}-[a-z]{2}"], lambda t: re.fullmatch("[0-9]{2}-[a-z]{2}", t)),
                       (["--json-schema", str(tmp_path / "schema.json"), "--temperature", "0.8"],
                        lambda t: set(json.loads(t)) == {"ok"})]:
    assert cli.main(base + extra) == 0
    assert all(valid(o["text"]) for o in json.loads(capsys.readouterr().out)["outputs"])


@pytest.mark.slow
def test_cli_prompt_file_with_continuous_batching_writes_and_resumes_its_output(ckpts, tmp_path, capsys):
  prompts = tmp_path / "prompts.txt"
  prompts.write_text("".join(f"def f{i}(x):\\n    return\n" for i in range(5)))
  output = tmp_path / "out.jsonl"
  argv = _cli(ckpts, "--prompt-file", str(prompts), "--batch-size", "2", "--output", str(output), "--json",
              "--temperature", "1", "--max-new-tokens", "12", "--no-adaptive")
  assert cli.main(argv) == 0
  first = json.loads(capsys.readouterr().out)
  lines = [json.loads(line) for line in output.read_text().splitlines()]
  assert sorted(e["index"] for e in lines) == list(range(5))
  by_index = {e["index"]: e for e in lines}
  for e in first["outputs"]:
    assert by_index[e["index"]] == e and e["prompt"] == f"def f{e['index']}(x):\n    return"
    assert e["stats"]["emitted_tokens"] == len(e["token_ids"]) <= 12
  assert first["stats"]["emitted_tokens"] == sum(len(e["token_ids"]) for e in lines)
  # An interrupted run: three lines written, the fourth cut short. The rerun decodes only the other two,
  # with the same per-prompt seeds, and the file ends with every prompt once.
  kept = output.read_text().splitlines(keepends=True)
  output.write_text("".join(kept[:3]) + kept[3][:10])
  assert cli.main(argv) == 0
  second = json.loads(capsys.readouterr().out)
  done_first = {json.loads(line)["index"] for line in kept[:3]}
  assert {e["index"] for e in second["outputs"]} == set(range(5)) - done_first
  for e in second["outputs"]:
    assert e["token_ids"] == by_index[e["index"]]["token_ids"]
  assert sorted(json.loads(line)["index"] for line in output.read_text().splitlines()) == list(range(5))
  assert cli.main(argv) == 0  # nothing left to do
  assert json.loads(capsys.readouterr().out)["outputs"] == []


@pytest.mark.slow
def test_cli_stream_prints_what_the_batch_prints(ckpts, capsys):
  base = _cli(ckpts, "--prompt", "abc", "--prompt", "hello there", "--max-new-tokens", "10", "--quiet")
  assert cli.main(base + ["--no-stream"]) == 0
  batch = capsys.readouterr().out.splitlines()
  assert cli.main(base + ["--stream"]) == 0
  streamed = capsys.readouterr().out.splitlines()
  assert streamed[:-1] == batch[:-1] and len(batch) > 3  # the texts; the last line is the statistics
