"""The OpenAI-compatible server, for real: `python -m jspec.serve` on a free port of 127.0.0.1 with the small
shipped pair, driven by the official `openai` client and by raw HTTP. One server for the module; the last
test stops it with SIGTERM."""
import asyncio
import dataclasses
import json
import random
import re
import signal
import ssl
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import jax
import numpy as np
import openai
import pytest

import jspec
from jspec import testing
from jspec.core import shipped
from jspec.serve import app
from jspec.serve.launch import free_port, start, stop
from jspec.text import tokenizer

pytestmark = pytest.mark.slow  # a real server in a subprocess

MODEL = "code-small"
MAX_MODEL_LEN = 128
MAX_QUEUE = 40
PROMPTS = ["def parse_args(", "import os\n", "class Config:\n    def __init__(self", "for i in range(",
           "# Read a file\nwith open(", "x = [", "def main():\n    ", "return "]


STARTING = []  # /health's answers while the module's server started


@pytest.fixture(scope="module")
def server():
  proc, url = start("--target", MODEL, "--max-model-len", str(MAX_MODEL_LEN), "--max-queue", str(MAX_QUEUE),
                    "--segment-rounds", "4", "--batch-size", "2", "--draft-len", "2", "--no-calibrate",
                    "--lazy-compile", starting=STARTING)
  # It serves plainly at once; first requests of one and two rows ask for the speculative programs of both
  # widths, compiled in the background: the tests start once they are ready.
  for n in (1, 2):
    httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2, "n": n}, timeout=120)
  deadline = time.monotonic() + 300
  while metric(url, "jspec:programs_compiling"):
    assert time.monotonic() < deadline, "programs still compiling"
    time.sleep(0.2)
  yield proc, url
  stop(proc)


def test_health_says_what_a_starting_server_does(server):
  """It listens at once: 503 with the phase (and Retry-After) until it can serve."""
  assert STARTING and all(r.status_code == 503 and r.headers["retry-after"] == "1" for r in STARTING)
  assert all(r.json()["error"]["message"].startswith("the server is starting: ") for r in STARTING)
  # Ready: /metrics says where the adaptive policy's cost model comes from, and that nothing calibrates.
  sources = re.findall(r'^jspec:cost_model_info{.*source="(\w+)".*} 1\.0$', httpx.get(f"{server[1]}/metrics").text,
                       re.M)
  assert len(sources) == 1 and sources[0] in ("calibrated", "checkpoint")
  assert metric(server[1], "jspec:calibrating") == 0


@pytest.fixture(scope="module")
def client(server):
  return openai.OpenAI(base_url=f"{server[1]}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def target():
  return jspec.load(shipped.SMALL.target)


def greedy(target, prompt: str, max_tokens: int) -> tuple[str, list[int]]:
  """The target's own greedy text (plain decoding: speculation must not change it)."""
  ids = jspec.generate(target, [prompt], max_new_tokens=max_tokens).token_ids[0]
  return tokenizer.detokenize(target.tokenizer, ids), ids


def metric(url: str, name: str, http=httpx) -> float:
  text = http.get(f"{url}/metrics").text
  return sum(float(m) for m in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def wait_idle(url: str, seconds: float = 10) -> None:
  deadline = time.monotonic() + seconds
  while metric(url, "jspec:num_requests_running") or metric(url, "jspec:num_requests_waiting"):
    assert time.monotonic() < deadline, "requests still running"
    time.sleep(0.1)


def test_completions_equal_the_targets_greedy_text(server, client, target):
  assert [m.id for m in client.models.list().data] == [MODEL]
  for prompt in PROMPTS[:3]:
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    text, ids = greedy(target, prompt, 24)
    assert out.choices[0].text == text
    assert out.choices[0].finish_reason == ("stop" if len(ids) < 24 else "length")
    prompt_tokens = len(tokenizer.encode(target.tokenizer, prompt))
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (prompt_tokens, len(ids))
    assert out.usage.total_tokens == prompt_tokens + len(ids)
    spec = out.model_extra["speculative_decoding"]
    assert spec["num_spec_steps"] > 0 and spec["num_draft_tokens"] >= spec["num_accepted_draft_tokens"]
  # Several prompts in one request: one choice each, in order.
  out = client.completions.create(model=MODEL, prompt=PROMPTS[3:5], max_tokens=10, temperature=0)
  assert [c.text for c in sorted(out.choices, key=lambda c: c.index)] == [greedy(target, p, 10)[0]
                                                                           for p in PROMPTS[3:5]]


def test_streamed_pieces_join_to_the_same_text_with_usage_last(server, client, target):
  text, ids = greedy(target, PROMPTS[0], 40)
  chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=40, temperature=0,
                                          stream=True, stream_options={"include_usage": True}))
  pieces = [c.choices[0].text for c in chunks if c.choices]
  # segments of 1, 1, 2 and 4 rounds (then --segment-rounds 4): at most 12 tokens a chunk with K = 2
  assert "".join(pieces) == text and len(pieces) >= 4 and "\ufffd" not in "".join(pieces)
  assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ids)
  assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
  assert "speculative_decoding" in chunks[-2].model_extra  # the finishing chunk


def test_sampling_is_reproducible_with_a_seed_and_stop_strings_cut(server, client, target):
  kw = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=30, temperature=0.8, top_p=0.9)
  a = client.completions.create(seed=7, extra_body={"top_k": 20}, **kw).choices[0].text
  b = client.completions.create(seed=7, extra_body={"top_k": 20}, **kw).choices[0].text
  assert a == b
  text, _ = greedy(target, PROMPTS[2], 30)
  stop = text[10:13]
  out = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=30, temperature=0, stop=[stop])
  assert out.choices[0].text == text[:text.index(stop)] and out.choices[0].finish_reason == "stop"
  # n choices of one prompt: choice j is what seed + j draws alone, and the prompt counts once.
  several = client.completions.create(seed=7, n=3, extra_body={"top_k": 20}, **kw)
  assert [c.text for c in sorted(several.choices, key=lambda c: c.index)][:2] == [
      a, client.completions.create(seed=8, extra_body={"top_k": 20}, **kw).choices[0].text]
  assert several.usage.prompt_tokens == client.completions.create(seed=7, **kw).usage.prompt_tokens
  plain = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=30, temperature=0,
                                    extra_body={"speculate": False, "ignore_eos": True, "suffix_cache": False})
  assert plain.model_extra["speculative_decoding"]["num_draft_tokens"] == 0
  assert plain.usage.completion_tokens == 30


def test_logprobs_and_echo_are_the_targets(server, client, target):
  """Each token's log-probability and the top ones at its position are the target's (a full forward's),
  streamed or whole; echo with max_tokens 0 scores the prompt (lm-evaluation-harness's loglikelihood)."""
  prompt_ids = tokenizer.encode(target.tokenizer, PROMPTS[0])
  text, ids = greedy(target, PROMPTS[0], 12)
  reference = np.asarray(jax.nn.log_softmax(testing.full_logits(target, [prompt_ids + ids])[0], -1))
  out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0, logprobs=3)
  lp = out.choices[0].logprobs
  assert out.choices[0].text == text == "".join(lp.tokens)
  np.testing.assert_allclose(lp.token_logprobs, reference[len(prompt_ids) - 1:][np.arange(len(ids)), ids], atol=1e-5)
  assert all(len(top) == 3 and max(top.values()) == pytest.approx(t) for top, t in zip(lp.top_logprobs,
                                                                                          lp.token_logprobs))
  assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(ids))]
  chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0, logprobs=3,
                                          stream=True))
  # The stream's first segments are other programs: the same values up to the order of their sums.
  np.testing.assert_allclose([t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.token_logprobs],
                             lp.token_logprobs, atol=1e-5)
  scored = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=0, echo=True, logprobs=1)
  lp = scored.choices[0].logprobs
  assert scored.choices[0].text == PROMPTS[0] and scored.usage.completion_tokens == 0
  assert lp.token_logprobs[0] is None and len(lp.tokens) == len(prompt_ids)
  np.testing.assert_allclose(lp.token_logprobs[1:], reference[np.arange(len(prompt_ids) - 1), prompt_ids[1:]],
                             atol=1e-5)


def test_chat_needs_a_template(server, client):
  with pytest.raises(openai.BadRequestError, match="no chat template"):
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])


BAD = [
    ({"model": MODEL, "prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, None),
    ({"model": MODEL, "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"model": MODEL, "prompt": "x", "top_k": -2}, 400, "top_k"),
    ({"model": MODEL, "prompt": "x", "n": 17}, 400, "n"),
    ({"model": MODEL, "prompt": "x", "stop": ["a"] * 17}, 400, "stop"),
    ({"model": MODEL, "prompt": "x", "stop": "a" * 257}, 400, None),
    ({"model": MODEL, "prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ({"model": MODEL, "prompt": "x", "seed": 2 ** 70}, 400, "seed"),
    ({"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}}, 400, None),
    ({"model": MODEL, "prompt": "x", "messages": []}, 400, "messages"),
    ({"model": MODEL, "prompt": [70000]}, 400, None),
    ({"model": MODEL, "prompt": []}, 400, None),
    ({"model": MODEL, "prompt": ""}, 400, None),
    ({"model": MODEL, "prompt": list(range(1, 300))}, 400, None),
    ({"model": MODEL, "prompt": "x", "max_tokens": MAX_MODEL_LEN}, 400, None),
    ({"model": MODEL, "prompt": "x", "stop_token_ids": list(range(9))}, 400, None),
    ({"model": MODEL, "prompt": "x", "guided_regex": "("}, 400, None),
    ({"model": MODEL, "prompt": "x", "guided_choice": []}, 400, None),
    ({"model": MODEL, "prompt": "x", "guided_json": {"type": "nope"}}, 400, None),
    ({"model": MODEL, "prompt": "x", "guided_regex": "a+", "guided_choice": ["a"]}, 400, None),
    ({"model": MODEL, "prompt": "x", "response_format": {"type": "json_schema"}}, 400, "response_format"),
    ({"model": MODEL, "prompt": "x", "guided_regex": "a+", "ignore_eos": True}, 400, None),
    ({"model": "other", "prompt": "x"}, 404, "model"),
    ({"prompt": "x"}, 400, "model"),
    ("{not json", 400, None),
    ([1, 2], 400, None),
]


@pytest.mark.parametrize("body,status,param", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_requests_get_4xx_with_an_error_body(server, target, body, status, param):
  url = server[1]
  content = body if isinstance(body, str) else json.dumps(body)
  r = httpx.post(f"{url}/v1/completions", content=content, headers={"Content-Type": "application/json"})
  assert r.status_code == status, r.text
  error = r.json()["error"]
  assert set(error) == {"message", "type", "param", "code"} and error["message"] and error["code"] == status
  if param is not None:
    assert error["param"] == param
  # The server keeps serving, and serves right.
  good = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x = ", "max_tokens": 4,
                                                    "temperature": 0}, timeout=60)
  assert good.status_code == 200 and good.json()["choices"][0]["text"] == greedy(target, "x = ", 4)[0]


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "line": {"type": "integer"}},
          "required": ["name", "line"]}
# The schema's automaton first: the regex's fits its bucket, so the batch runs one constrained program.
STRUCTURED = [({"response_format": {"type": "json_schema", "json_schema": {"name": "f", "schema": SCHEMA}}},
               jspec.JsonSchema(SCHEMA)),
              ({"guided_regex": "[a-z_]+, [a-z_]+\\)"}, jspec.Regex("[a-z_]+, [a-z_]+\\)"))]


def test_structured_output_is_the_constrained_targets_greedy_text(server, client, target):
  """vLLM's guided fields and OpenAI's response_format, at once and next to a free request (a choice's
  tables are a regex's: test_constraints)."""
  free = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=20, temperature=0, stream=True)
  ask = lambda extra: client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=40, temperature=0,
                                                extra_body=extra).choices[0]
  with ThreadPoolExecutor(len(STRUCTURED)) as pool:
    outs = list(pool.map(ask, [extra for extra, _ in STRUCTURED]))
  want = jspec.generate(target, [PROMPTS[0]] * len(STRUCTURED), max_new_tokens=40,
                        constraint=[constraint for _, constraint in STRUCTURED])
  for out, text, ids in zip(outs, want.texts, want.token_ids):
    assert out.text == text and out.finish_reason == ("stop" if len(ids) < 40 else "length")
  assert outs[0].finish_reason == "stop" and set(json.loads(outs[0].text)) == set(SCHEMA["properties"])
  assert "".join(c.choices[0].text for c in free) == greedy(target, PROMPTS[0], 20)[0]


def test_chat_fields_on_the_completions_route_and_unknown_routes(server):
  url = server[1]
  r = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "prompt": "x"})
  assert r.status_code == 400 and r.json()["error"]["param"] in ("messages", "prompt")
  r = httpx.get(f"{url}/v1/nothing")
  assert r.status_code == 404 and r.json()["error"]["code"] == 404


def test_a_client_that_leaves_mid_stream_frees_its_slot(server):
  url = server[1]
  body = {"model": MODEL, "prompt": "import os\n", "max_tokens": 100, "ignore_eos": True, "stream": True}
  with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
    assert r.status_code == 200
    next(r.iter_lines())
  wait_idle(url)
  before = metric(url, "jspec:generation_tokens_total")
  time.sleep(0.5)
  assert metric(url, "jspec:generation_tokens_total") == before  # nothing decodes for it any more
  assert metric(url, 'jspec:request_success_total{finished_reason="abort",model_name="code-small"}') >= 1


def test_a_client_that_leaves_before_a_whole_response_frees_its_slot(server):
  url = server[1]
  aborted = lambda: metric(url, 'jspec:request_success_total{finished_reason="abort",model_name="code-small"}')
  before = aborted()
  body = {"model": MODEL, "prompt": "import os\n", "max_tokens": 120, "ignore_eos": True, "speculate": False}
  with pytest.raises(httpx.TimeoutException):
    httpx.post(f"{url}/v1/completions", json=body, timeout=0.2)
  deadline = time.monotonic() + 10
  while aborted() == before and time.monotonic() < deadline:
    time.sleep(0.05)
  wait_idle(url)
  assert aborted() == before + 1


def test_a_full_queue_answers_503_at_once(server):
  url = server[1]

  async def flood():
    async with httpx.AsyncClient(timeout=60) as http:
      body = {"model": MODEL, "prompt": "import os\n", "max_tokens": 100, "ignore_eos": True, "stream": True}
      async def one():
        async with http.stream("POST", f"{url}/v1/completions", json=body) as r:
          return r.status_code, dict(r.headers), (await r.aread()) if r.status_code != 200 else b""
      tasks = [asyncio.create_task(one()) for _ in range(MAX_QUEUE + 20)]
      done = []
      for t in asyncio.as_completed(tasks):
        status, headers, content = await t
        done.append(status)
        if status == 503:
          assert headers["retry-after"] == "1" and json.loads(content)["error"]["code"] == 503
          break
      for t in tasks:
        t.cancel()
      await asyncio.gather(*tasks, return_exceptions=True)
      return done

  assert 503 in asyncio.run(flood())
  wait_idle(url, 30)


def test_load_100_requests_32_at_a_time_with_some_closed_mid_stream(server, target):
  # 32 at a time on 2 slots: most wait in the queue, and both widths (1 and 2) run.
  """Every request that stays gets its single-run greedy text; the ones closed mid-stream free their
  slots; nothing is left running, and no thread is left behind (beyond the request checkers' fixed pool)."""
  url = server[1]
  proc = server[0]
  threads = lambda: int(re.search(r"Threads:\s+(\d+)", open(f"/proc/{proc.pid}/status").read()).group(1))
  rng = random.Random(0)
  jobs = [(rng.choice(PROMPTS), rng.choice([4, 12, 24, 40]), i % 10 == 3) for i in range(104)]
  expected = {}
  for prompt, n, _ in jobs:
    if (prompt, n) not in expected:
      expected[prompt, n] = greedy(target, prompt, n)[0]
  before = threads()

  async def run():
    sem = asyncio.Semaphore(32)
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
      async def one(prompt, n, leave):
        async with sem:
          body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True}
          text = ""
          async with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
              if not line.startswith("data: ") or line == "data: [DONE]":
                continue
              text += json.loads(line[6:])["choices"][0]["text"]
              if leave:
                return None
          return text
      return await asyncio.gather(*(one(*job) for job in jobs))

  texts = asyncio.run(run())
  for (prompt, n, leave), text in zip(jobs, texts):
    if not leave:
      assert text == expected[prompt, n], (prompt, n)
  wait_idle(url)
  assert threads() <= before + app.CHECK_THREADS
  assert metric(url, "jspec:spec_decode_num_drafts_total") > 0
  # Every page back (prompts this short fill none, so none is cached), every prompt looked up.
  assert metric(url, "jspec:kv_cache_usage_perc") == 0 and metric(url, "jspec:prefix_cache_queries_total") > 0


def test_sigterm_exits_0_within_the_timeout(server):
  proc, url = server
  body = {"model": MODEL, "prompt": "import os\n", "max_tokens": 100, "ignore_eos": True, "stream": True}
  with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
    next(r.iter_lines())
    proc.send_signal(signal.SIGTERM)
    begin = time.monotonic()
    assert proc.wait(timeout=15) == 0
  assert time.monotonic() - begin < 10


def test_sigterm_while_programs_compile_exits_without_waiting_for_them(tmp_path):
  """Stopped right at ready, with the other programs compiling from an empty cache: exit 0, not after the
  program compiling (XLA cannot stop one midway)."""
  jspec.save(testing.random_model(testing.TINY), tmp_path / "tiny")
  proc, _ = start("--target", str(tmp_path / "tiny"), "--drafter", "ngram", "--batch-size", "2", "--max-model-len",
                  "128", "--no-calibrate", "--compile-cache", str(tmp_path / "cache"))
  try:
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
  finally:
    stop(proc)
  out = proc.stdout.read()
  assert out.rstrip().endswith("stopped (without waiting for the programs compiling)"), out[-500:]


def test_chat_completions_through_a_model_with_a_template_behind_a_key_over_tls(tmp_path):
  """Also: every /v1 route needs the API key (/health and /metrics do not), over HTTPS."""
  model = testing.random_model(testing.TINY)
  template = tokenizer.ChatTemplate("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                                    "{% if add_generation_prompt %}<assistant>{% endif %}")
  model = dataclasses.replace(model, chat_template=template)
  jspec.save(model, tmp_path / "chat")
  key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
  subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                  "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", key, "-out", cert], check=True,
                 capture_output=True)
  proc, url = start("--target", str(tmp_path / "chat"), "--drafter", "ngram", "--no-adaptive", "--batch-size", "1",
                    "--max-model-len", "128", "--served-model-name", "tiny", "--max-total-tokens", "128",
                    "--api-key", "s3cret", "--ssl-keyfile", str(key), "--ssl-certfile", str(cert), "--lazy-compile",
                    tls=str(cert))
  try:
    assert url.startswith("https://")
    tls = httpx.Client(verify=ssl.create_default_context(cafile=cert))
    with pytest.raises(openai.AuthenticationError, match="API key"):
      openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0, http_client=tls).models.list()
    assert tls.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "x"}).status_code == 401
    assert tls.get(f"{url}/metrics").status_code == tls.get(f"{url}/health").status_code == 200
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret", max_retries=0, http_client=tls)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                         logprobs=True, top_logprobs=2)
    prompt = template.render_messages(messages)
    ids = jspec.generate(model, [prompt], max_new_tokens=12).token_ids[0]
    assert out.choices[0].message.content == tokenizer.detokenize(model.tokenizer, ids)
    assert out.choices[0].message.role == "assistant"
    content = out.choices[0].logprobs.content
    assert len(content) == len(ids) and all(bytes(c.bytes).decode(errors="replace") == c.token for c in content)
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.logprob for c in content)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == out.choices[0].message.content
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    for fmt in ({"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "ok", "schema": schema}}):
      out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=60, temperature=0,
                                           response_format=fmt)
      assert isinstance(json.loads(out.choices[0].message.content), dict)
    # A pool of one page: a request whose row needs two is refused in one line, and the pool is whole again.
    r = tls.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": [1] * 10, "max_tokens": 118},
                 headers={"Authorization": "Bearer s3cret"})
    assert r.status_code == 400 and "KV pages" in r.json()["error"]["message"]
    free = lambda name: metric(url, name, tls)
    assert free("jspec:kv_cache_free_pages") == 1 and free("jspec:kv_cache_usage_perc") == 0
  finally:
    stop(proc)


def test_two_processes_serve_one_model_split_over_both(target):
  """`--num-processes 2`: process 0 serves HTTP and process 1 follows, the target's kv heads split over the
  two processes' devices, its paged KV cache too. Greedy texts are the target's; a prompt sent again finds
  its first page cached (counted in /metrics); an abort reaches both (the next request is still exact, so
  the engines stayed in step); SIGTERM to the follower stops both, with status 0."""
  flags = ["--target", MODEL, "--mesh", "model=2", "--coordinator", f"127.0.0.1:{free_port()}",
           "--num-processes", "2", "--batch-size", "2", "--max-model-len", "256", "--drafter", "ngram",
           "--draft-len", "2", "--no-adaptive"]
  follower = subprocess.Popen([sys.executable, "-m", "jspec.serve", *flags, "--process-id", "1"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  try:
    proc, url = start(*flags, "--process-id", "0", timeout=300)
    try:
      client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
      text = lambda prompt: client.completions.create(model=MODEL, prompt=prompt, max_tokens=16,
                                                      temperature=0).choices[0].text
      with ThreadPoolExecutor(3) as pool:  # three requests through two slots: one starts in a freed row
        assert list(pool.map(text, PROMPTS[:3])) == [greedy(target, p, 16)[0] for p in PROMPTS[:3]]
      long = "".join(f"def f{i}(x):\n    return x + {i}\n" for i in range(12))  # over one page of tokens
      assert text(long) == text(long) == greedy(target, long, 16)[0]
      assert metric(url, "jspec:prefix_cache_hits_total") >= 128
      body = {"model": MODEL, "prompt": PROMPTS[3], "max_tokens": 100, "ignore_eos": True, "stream": True}
      with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        next(r.iter_lines())
      wait_idle(url)
      assert metric(url, "jspec:request_success_total") == 6  # the abort counts
      assert text(PROMPTS[4]) == greedy(target, PROMPTS[4], 16)[0]
      follower.send_signal(signal.SIGTERM)
      assert proc.wait(timeout=30) == 0 and follower.wait(timeout=30) == 0
      assert "process 1: stopped after 7 requests" in follower.stdout.read()
    finally:
      stop(proc)
  finally:
    stop(follower)
