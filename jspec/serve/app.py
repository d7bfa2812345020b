"""The HTTP side: FastAPI routes in OpenAI's shapes over an `EngineLoop`.

Every error a request can cause is a 4xx with an OpenAI error body; a client that disconnects (mid-stream
or while waiting for a whole response) aborts its requests.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import secrets
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from jspec.engine.requests import Delta, Request
from jspec.model.model import Model
from jspec.serve import protocol
from jspec.serve.loop import EngineLoop
from jspec.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest
from jspec.serve.startup import Startup
from jspec.speculation.logprobs import TokenLogprob
from jspec.text.tokenizer import detokenize, encode

DEFAULT_MAX_TOKENS = 16  # a completion's max_tokens when not given (OpenAI's default)
MAX_BODY_BYTES = 4 << 20  # a /v1 request's body
DISCONNECT_POLL = 0.1  # seconds between checks that a client waiting for a whole response is still there
SHUTDOWN_SECONDS = 5.0
CHECK_THREADS = 4  # threads that check requests (a new constraint compiles there, off the event loop)


def _validation_message(error: RequestValidationError) -> tuple[str, str | None]:
  first = error.errors()[0]
  if first.get("type") == "json_invalid":
    return f"malformed JSON: {first.get('ctx', {}).get('error', first['msg'])}", None
  where = [str(p) for p in first.get("loc", ()) if p != "body"]
  param = ".".join(where) or None
  return (f"{param}: {first['msg']}" if param else first["msg"]), param


class _Guard:
  """Checks a `/v1` request before it is read: its API key, if the server has one (constant time), and its
  body's declared size. A plain ASGI middleware: Starlette's `BaseHTTPMiddleware` would hide a client's
  disconnect from the route, which aborts its request on it."""

  def __init__(self, app, api_key: str | None):
    self.app, self.api_key = app, api_key

  async def __call__(self, scope, receive, send):
    if scope["type"] == "http" and scope["path"].startswith("/v1"):
      headers = dict(scope["headers"])
      size = headers.get(b"content-length", b"0").decode("latin-1")
      error = None
      if self.api_key is not None and not secrets.compare_digest(headers.get(b"authorization", b""),
                                                                  f"Bearer {self.api_key}".encode()):
        error = APIError(401, "invalid or missing API key (Authorization: Bearer <key>)")
      elif not size.isdigit() or int(size) > MAX_BODY_BYTES:
        error = APIError(413, f"the request body has {size} bytes; at most {MAX_BODY_BYTES}")
      if error is not None:
        await JSONResponse(error.body(), status_code=error.status)(scope, receive, send)
        return
    await self.app(scope, receive, send)


class _Choice:
  """One choice's output as the client sees it: with echo, its prompt's text and log-probabilities first;
  with max_tokens 0 (the engine runs one token for it), none of the engine's."""

  def __init__(self, echo: str | None, keep_output: bool):
    self.echo, self.keep_output = echo, keep_output
    self.text, self.tokens, self.scored = "", 0, None
    self.reason, self.stats = None, None

  def add(self, delta: Delta) -> tuple[str, list[TokenLogprob] | None, int]:
    """The delta as the client sees it: its text, its tokens' log-probabilities, and the characters of the
    choice's text before them (accumulated for the whole response)."""
    text, scored = delta.text, delta.logprobs
    if not self.keep_output:
      text, scored = "", None if scored is None else []
    if self.echo is not None:
      text, self.echo = self.echo + text, None
      if delta.prompt_logprobs is not None:
        scored = delta.prompt_logprobs + (scored or [])
    offset = len(self.text)
    self.text += text
    self.tokens += len(delta.token_ids) if self.keep_output else 0
    if scored is not None:
      self.scored = (self.scored or []) + scored
    if delta.finished:
      self.reason, self.stats = delta.finish_reason, delta.stats
    return text, scored, offset


class _Handlers:
  """What the routes do, over the server that `startup` starts (`create_app` routes to them)."""

  def __init__(self, startup: Startup):
    self.startup, self.model_name = startup, startup.metrics.model_name
    self.checker = ThreadPoolExecutor(CHECK_THREADS, thread_name_prefix="jspec-check")
    self.created = int(time.time())

  @staticmethod
  @functools.lru_cache(maxsize=1)
  def spelling(tokenizer) -> protocol.Spelling:
    """The target's tokens as log-probabilities show them (its vocabulary's bytes read once)."""
    return protocol.Spelling(tokenizer)

  def serving(self) -> tuple[EngineLoop, Model]:
    """The engine loop and the target, or a 503 that says what the server is doing instead."""
    startup = self.startup
    loop = startup.loop
    if loop is None:
      raise APIError(503, startup.error and f"the server failed to start: {startup.error}" or
                     f"the server is starting: {startup.phase}", headers={"Retry-After": "1"})
    if loop.error is not None:
      raise APIError(503, loop.error)
    return loop, startup.target

  def shutdown(self) -> None:
    if self.startup.loop is not None:
      self.startup.loop.shutdown(SHUTDOWN_SECONDS)
    self.checker.shutdown(wait=False, cancel_futures=True)

  def models(self) -> dict:
    loop, _ = self.serving()
    return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                        "owned_by": "jspec", "max_model_len": loop.engine.max_len}]}

  def check_model(self, name: str) -> None:
    if name != self.model_name:
      raise APIError(404, f"the model `{name}` does not exist; this server serves `{self.model_name}`", "model")

  @staticmethod
  def engine_request(body, prompt_ids: list[int], max_tokens: int, seed: int, logprobs: int | None,
                     prompt_logprobs: int | None = None) -> Request:
    try:
      return Request(prompt_ids, max(max_tokens, 1), body.sampling(), seed, body.stops, body.stop_token_ids or (),
                     body.ignore_eos, body.speculate, body.constraint(), body.stream, logprobs, prompt_logprobs,
                     suffix_cache=body.suffix_cache)
    except ValueError as e:
      raise APIError(400, str(e)) from None

  def response(self, chat: bool, target: Model) -> protocol.Response:
    return protocol.Response(chat, self.model_name, self.spelling(target.tokenizer))

  async def completions(self, body: CompletionRequest, http: HTTPRequest):
    _, target = self.serving()
    self.check_model(body.model)
    seed = body.seed_value()
    requests, choices = [], []
    max_tokens = DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    for i, prompt in enumerate(body.prompts):  # choice i * n + j: prompt i's j-th
      ids = encode(target.tokenizer, prompt) if isinstance(prompt, str) else list(prompt)
      echo = (prompt if isinstance(prompt, str) else detokenize(target.tokenizer, ids)) if body.echo else None
      for j in range(body.n):
        requests.append(self.engine_request(body, ids, max_tokens, (seed + i * body.n + j) % 2 ** 32,
                                            body.logprobs, body.prompt_logprobs))
        choices.append(_Choice(echo, max_tokens > 0))
    return await self.respond(body, requests, choices, self.response(False, target), http)

  async def chat_completions(self, body: ChatCompletionRequest, http: HTTPRequest):
    loop, target = self.serving()
    self.check_model(body.model)
    if target.chat_template is None:
      raise APIError(400, f"the model `{self.model_name}` has no chat template; use /v1/completions")
    try:
      ids = encode(target.tokenizer, target.chat_template.render_messages([m.as_dict() for m in body.messages]))
    except ValueError as e:
      raise APIError(400, str(e), "messages") from None
    room = loop.engine.max_len - len(ids)
    if room < 1:
      raise APIError(400, f"the conversation has {len(ids)} tokens; the model's context is {loop.engine.max_len} "
                          "tokens", "messages")
    seed = body.seed_value()
    requests = [self.engine_request(body, ids, body.token_limit or room, (seed + j) % 2 ** 32, body.logprobs_top)
                for j in range(body.n)]
    return await self.respond(body, requests, [_Choice(None, True) for _ in requests], self.response(True, target),
                              http)

  async def respond(self, body, requests: list[Request], choices: list[_Choice], response: protocol.Response,
                    http: HTTPRequest):
    loop, _ = self.serving()
    engine = loop.engine
    try:
      # A new constraint compiles for up to seconds: off the event loop, so other streams keep flowing.
      await asyncio.get_running_loop().run_in_executor(self.checker, lambda: [engine.check(r) for r in requests])
      ids, queue = loop.submit(requests)
    except ValueError as e:
      raise APIError(400, str(e)) from None
    prompt_tokens = sum(len(r.prompt_ids) for r in requests[::body.n])  # a prompt counts once for its n choices
    if body.stream:
      return StreamingResponse(_stream(loop, ids, queue, choices, response, prompt_tokens, body.include_usage),
                               media_type="text/event-stream")
    return await _whole(loop, ids, queue, choices, response, prompt_tokens, http)


async def _whole(loop: EngineLoop, ids, queue: asyncio.Queue, choices: list[_Choice], response: protocol.Response,
                 prompt_tokens: int, http: HTTPRequest):
  """The whole response once every choice has finished; a client that leaves meanwhile aborts them."""
  left, checked = len(ids), time.monotonic()
  try:
    while left:
      if time.monotonic() - checked >= DISCONNECT_POLL:
        if await http.is_disconnected():
          return Response(status_code=499)
        checked = time.monotonic()
      try:
        index, delta = await asyncio.wait_for(queue.get(), DISCONNECT_POLL)
      except TimeoutError:
        continue
      if isinstance(delta, APIError):
        raise delta
      choices[index].add(delta)
      left -= delta.finished
  finally:
    if left:
      loop.abort(ids)
  return response.body([c.text for c in choices], [c.reason for c in choices], prompt_tokens,
                       sum(c.tokens for c in choices), [c.stats for c in choices if c.stats is not None],
                       [response.logprobs(c.scored) for c in choices])


async def _stream(loop: EngineLoop, ids, queue: asyncio.Queue, choices: list[_Choice], response: protocol.Response,
                  prompt_tokens: int, include_usage: bool) -> AsyncIterator[str]:
  """The response as server-sent events, a chunk per delta; a client that leaves aborts its choices."""
  event = lambda obj: f"data: {json.dumps(obj)}\n\n"
  left = len(ids)
  try:
    if response.chat:
      yield event(response.chunk(0, first=True))
    while left:
      index, delta = await queue.get()
      if isinstance(delta, APIError):
        yield event(delta.body())
        return
      text, scored, offset = choices[index].add(delta)
      if text or scored or delta.finished:
        yield event(response.chunk(index, delta, text=text, logprobs=response.logprobs(scored, offset)))
      left -= delta.finished
    if include_usage:
      yield event(response.usage_chunk(prompt_tokens, sum(c.tokens for c in choices),
                                       [c.stats for c in choices if c.stats is not None]))
    yield "data: [DONE]\n\n"
  finally:  # also when the client left: the response task is cancelled at its await
    if left:
      loop.abort(ids)


def create_app(startup: Startup, api_key: str | None = None) -> FastAPI:
  """The app over the server that `startup` starts: until it can serve, `/health` and every `/v1` route
  answer 503 with what it is doing. With `api_key`, every `/v1` route needs `Authorization: Bearer
  <api_key>` (checked in constant time); `/health` and `/metrics` stay open."""
  handlers = _Handlers(startup)

  @contextlib.asynccontextmanager
  async def lifespan(_: FastAPI):
    yield
    handlers.shutdown()

  app = FastAPI(title="jspec", lifespan=lifespan)

  @app.exception_handler(APIError)
  async def api_error(_, e: APIError):
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

  @app.exception_handler(RequestValidationError)
  async def invalid(_, e: RequestValidationError):
    message, param = _validation_message(e)
    return await api_error(None, APIError(400, message, param))

  @app.exception_handler(HTTPException)
  async def http_error(_, e: HTTPException):
    return await api_error(None, APIError(e.status_code, str(e.detail)))

  @app.exception_handler(Exception)
  async def server_error(_, e: Exception):
    return await api_error(None, APIError(500, f"internal error: {type(e).__name__}"))

  app.add_middleware(_Guard, api_key=api_key)

  @app.get("/health")
  async def health() -> Response:
    handlers.serving()
    return Response(status_code=200)

  @app.get("/v1/models")
  async def models() -> dict:
    return handlers.models()

  @app.get("/metrics")
  async def metrics() -> Response:
    return Response(generate_latest(startup.metrics.registry), media_type=CONTENT_TYPE_LATEST)

  @app.post("/v1/completions")
  async def completions(body: CompletionRequest, http: HTTPRequest):
    return await handlers.completions(body, http)

  @app.post("/v1/chat/completions")
  async def chat_completions(body: ChatCompletionRequest, http: HTTPRequest):
    return await handlers.chat_completions(body, http)

  return app
