"""The OpenAI request and response shapes the server speaks, as the official `openai` client sends and
reads them, with vLLM's extra fields (`top_k`, `ignore_eos`, `seed`, `stop_token_ids`, and structured
output's `guided_regex`, `guided_choice`, `guided_json` beside OpenAI's `response_format`) and jspec's
`speculate` (False: decode this request plainly) and `suffix_cache` (False: keep this request's text out of
the suffix drafter's index, and draft it from its own text only). Log-probabilities (`logprobs`, `top_logprobs`, `echo`)
are the target's (`jspec.speculation.logprobs`), in OpenAI's shapes: the completions route's token lists, the chat
route's `content` entries with their bytes.

Requests are validated strictly: wrong types, out-of-range values and fields the endpoint does not take
are errors (HTTP 400 with an OpenAI error body), never silently ignored. Fields the engine cannot honour
(penalties) are accepted only at their neutral values. What one request may ask is
bounded (`MAX_N` choices, `MAX_STOPS` stop strings of `MAX_STOP_CHARS`; the server bounds the body's size).
"""
from __future__ import annotations

import secrets
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from jspec.core.settings import SamplingConfig
from jspec.engine.requests import Delta
from jspec.speculation.logprobs import MAX_TOP, TokenLogprob
from jspec.speculation.stats import RequestStats
from jspec.text.constraints import JSON_OBJECT, Choice, Constraint, JsonSchema, Regex
from jspec.text.tokenizer import token_bytes

MAX_SEED = 2 ** 63
MAX_N = 16  # choices one request may ask for
MAX_STOPS = 16  # stop strings one request may give
MAX_STOP_CHARS = 256  # characters of one stop string


class APIError(Exception):
  """An error the client caused (4xx) or the server cannot take now (503), as an OpenAI error body."""

  def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None):
    super().__init__(message)
    self.status, self.message, self.param, self.headers = status, message, param, headers

  def body(self) -> dict:
    kind = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "MethodNotAllowed",
            413: "RequestTooLarge", 503: "ServiceUnavailableError"}.get(
                self.status, "InvalidRequestError" if self.status < 500 else "InternalServerError")
    return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.status}}


def _unsupported(**asked: bool) -> None:
  """Refuses the features asked for that the server does not have."""
  names = [name for name, on in asked.items() if on]
  if names:
    raise ValueError(f"not supported: {', '.join(names)}")


class _Strict(BaseModel):
  model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
  include_usage: bool = False


class JsonSchemaFormat(_Strict):
  name: str
  schema_: dict[str, Any] = Field(alias="schema")
  strict: bool | None = None
  description: str | None = None


class ResponseFormat(_Strict):
  """OpenAI's `response_format`: free text, any JSON object, or JSON valid under a schema."""
  type: Literal["text", "json_object", "json_schema"]
  json_schema: JsonSchemaFormat | None = None

  @model_validator(mode="after")
  def _schema_with_its_type(self):
    if (self.type == "json_schema") != (self.json_schema is not None):
      raise ValueError("response_format: json_schema is given exactly with type \"json_schema\"")
    return self


class _Sampling(_Strict):
  """What both endpoints take."""
  model: str
  max_tokens: int | None = Field(None, ge=1)
  temperature: float = Field(1.0, ge=0.0, le=100.0)
  top_p: float = Field(1.0, gt=0.0, le=1.0)
  top_k: int = Field(0, ge=-1)  # 0 or -1 (vLLM's "off"): every token
  seed: int | None = Field(None, ge=-MAX_SEED, lt=MAX_SEED)
  stop: str | list[str] | None = Field(None, max_length=MAX_STOPS)
  stop_token_ids: list[int] | None = None
  ignore_eos: bool = False
  stream: bool = False
  stream_options: StreamOptions | None = None
  n: int = Field(1, ge=1, le=MAX_N)
  presence_penalty: float = Field(0.0, ge=0.0, le=0.0)
  frequency_penalty: float = Field(0.0, ge=0.0, le=0.0)
  user: str | None = None
  speculate: bool = True
  suffix_cache: bool = True
  response_format: ResponseFormat | None = None
  guided_regex: str | None = None
  guided_choice: list[str] | None = None
  guided_json: dict[str, Any] | str | None = None

  @model_validator(mode="after")
  def _one_constraint(self):
    asked = [name for name in ("guided_regex", "guided_choice", "guided_json") if getattr(self, name) is not None]
    if self.response_format is not None and self.response_format.type != "text":
      asked.append("response_format")
    if len(asked) > 1:
      raise ValueError(f"give one structured output constraint, not {' and '.join(asked)}")
    return self

  def constraint(self) -> Constraint | None:
    """The structured output asked for (a ValueError for one that cannot be read), or None."""
    if self.guided_regex is not None:
      return Regex(self.guided_regex)
    if self.guided_choice is not None:
      return Choice(self.guided_choice)
    if self.guided_json is not None:
      return JsonSchema(self.guided_json)
    fmt = self.response_format
    if fmt is None or fmt.type == "text":
      return None
    return JSON_OBJECT if fmt.type == "json_object" else JsonSchema(fmt.json_schema.schema_)

  @model_validator(mode="after")
  def _stream_options_need_stream(self):
    if self.stream_options is not None and not self.stream:
      raise ValueError("stream_options is only allowed with stream: true")
    return self

  def sampling(self) -> SamplingConfig:
    return SamplingConfig(self.temperature, max(self.top_k, 0), self.top_p)

  def seed_value(self) -> int:
    """The engine's 32-bit seed: the request's, else a fresh random one (as OpenAI does without one)."""
    return secrets.randbits(32) if self.seed is None else self.seed % 2 ** 32

  @model_validator(mode="after")
  def _short_stops(self):
    if any(len(s) > MAX_STOP_CHARS for s in self.stops):
      raise ValueError(f"stop strings may have at most {MAX_STOP_CHARS} characters")
    return self

  @property
  def stops(self) -> list[str]:
    return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

  @property
  def include_usage(self) -> bool:
    return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
  prompt: str | list[str] | list[int] | list[list[int]]
  max_tokens: int | None = Field(None, ge=0)  # 0 with echo: the prompt's log-probabilities only
  echo: bool = False
  logprobs: int | None = Field(None, ge=0, le=MAX_TOP)
  suffix: str | None = None
  best_of: int | None = None

  @model_validator(mode="after")
  def _supported(self):
    if isinstance(self.prompt, list) and not self.prompt:
      raise ValueError("prompt must not be an empty list")
    if self.max_tokens == 0 and not self.echo:
      raise ValueError("max_tokens 0 needs echo (it returns only the prompt)")
    _unsupported(suffix=self.suffix is not None, best_of=self.best_of not in (None, 1))
    return self

  @property
  def prompt_logprobs(self) -> int | None:
    """The prompt's log-probabilities asked for (echo with logprobs), with that many alternatives."""
    return self.logprobs if self.echo else None

  @property
  def prompts(self) -> list[str | list[int]]:
    """One entry per choice: a text or token ids."""
    p = self.prompt
    if isinstance(p, str) or (p and isinstance(p[0], int)):
      return [p]
    return list(p)


class TextPart(_Strict):
  type: Literal["text"]
  text: str


class ChatMessage(_Strict):
  role: Literal["system", "developer", "user", "assistant", "tool"]
  content: str | list[TextPart] | None = None
  name: str | None = None

  def as_dict(self) -> dict[str, str]:
    content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
    return {"role": self.role, "content": content}


class ChatCompletionRequest(_Sampling):
  messages: list[ChatMessage] = Field(min_length=1)
  max_completion_tokens: int | None = Field(None, ge=1)
  logprobs: bool = False
  top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP)

  @model_validator(mode="after")
  def _top_needs_logprobs(self):
    if self.top_logprobs is not None and not self.logprobs:
      raise ValueError("top_logprobs needs logprobs: true")
    return self

  @property
  def logprobs_top(self) -> int | None:
    """The log-probabilities asked for, with that many alternatives (None: none)."""
    return (self.top_logprobs or 0) if self.logprobs else None

  @property
  def token_limit(self) -> int | None:
    return self.max_completion_tokens or self.max_tokens


def speculation_figures(stats: list[RequestStats]) -> dict[str, Any]:
  """Per-request speculation figures (vLLM's names), summed over a response's choices."""
  drafts = sum(s.drafts for s in stats)
  drafted = sum(s.drafted_tokens for s in stats)
  accepted = sum(s.accepted_tokens for s in stats)
  return {"num_spec_steps": drafts, "num_draft_tokens": drafted, "num_accepted_draft_tokens": accepted,
          "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
          "draft_acceptance_rate": accepted / drafted if drafted else None}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
  return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
          "total_tokens": prompt_tokens + completion_tokens}


class Spelling:
  """Each token's bytes and text as log-probabilities show them (OpenAI's "bytes:\\xNN" for bytes that
  are not whole UTF-8 characters); the vocabulary's bytes are read on first use."""

  def __init__(self, tokenizer):
    self.tokenizer, self._bytes = tokenizer, None

  def bytes(self, token_id: int) -> bytes:
    if self._bytes is None:
      self._bytes = token_bytes(self.tokenizer)
    spelled = self._bytes.get(token_id)  # a special token has none: its text
    return spelled if spelled is not None else self.tokenizer.decode([token_id], skip_special_tokens=False).encode()

  def text(self, token_id: int) -> str:
    raw = self.bytes(token_id)
    try:
      return raw.decode()
    except UnicodeDecodeError:
      return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


class Response:
  """Builds one response's bodies and stream chunks, for either endpoint."""

  def __init__(self, chat: bool, model: str, spelling: Spelling | None = None):
    self.chat, self.model, self.spelling = chat, model, spelling
    self.id = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
    self.created = int(time.time())
    self.object = "chat.completion" if chat else "text_completion"

  def _envelope(self, obj: str, choices: list[dict]) -> dict:
    return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

  def logprobs(self, scored: list[TokenLogprob] | None, offset: int = 0) -> dict | None:
    """A choice's `logprobs` for these tokens: the completions route's token lists (their text offsets from
    `offset`, the characters of the choice's text before them), or the chat route's `content` entries."""
    if scored is None:
      return None
    text = self.spelling.text
    if self.chat:
      entry = lambda t, lp: {"token": text(t), "logprob": lp, "bytes": list(self.spelling.bytes(t))}
      return {"content": [{**entry(s.token_id, s.logprob), "top_logprobs": [entry(t, lp) for t, lp in s.top]}
                          for s in scored]}
    tokens = [text(s.token_id) for s in scored]
    offsets = [offset + sum(map(len, tokens[:i])) for i in range(len(tokens))]
    return {"tokens": tokens, "token_logprobs": [s.logprob for s in scored],
            "top_logprobs": [None if s.logprob is None else {text(t): lp for t, lp in s.top} for s in scored],
            "text_offset": offsets}

  def body(self, texts: list[str], reasons: list[str], prompt_tokens: int, completion_tokens: int,
           stats: list[RequestStats], logprobs: list[dict | None]) -> dict:
    """A whole (non-streamed) response."""
    if self.chat:
      choices = [{"index": i, "message": {"role": "assistant", "content": t}, "logprobs": lp, "finish_reason": r}
                 for i, (t, r, lp) in enumerate(zip(texts, reasons, logprobs))]
    else:
      choices = [{"index": i, "text": t, "logprobs": lp, "finish_reason": r}
                 for i, (t, r, lp) in enumerate(zip(texts, reasons, logprobs))]
    return {**self._envelope(self.object, choices), "usage": usage(prompt_tokens, completion_tokens),
            "speculative_decoding": speculation_figures(stats)}

  def chunk(self, index: int, delta: Delta | None = None, first: bool = False, text: str | None = None,
            logprobs: dict | None = None) -> dict:
    """A stream chunk: choice `index`'s new text (`text`, default the delta's) and its tokens' `logprobs`
    (and its finish reason and speculation figures when the delta is its last), or a chat stream's opening
    chunk (`first`: the assistant's role)."""
    obj = "chat.completion.chunk" if self.chat else "text_completion"
    text = ("" if delta is None else delta.text) if text is None else text
    reason = delta.finish_reason if delta is not None and delta.finished else None
    if self.chat:
      content = {"role": "assistant", "content": ""} if first else {"content": text} if text or not reason else {}
      choice = {"index": index, "delta": content, "logprobs": logprobs, "finish_reason": reason}
    else:
      choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}
    out = self._envelope(obj, [choice])
    if reason is not None and delta.stats is not None:
      out["speculative_decoding"] = speculation_figures([delta.stats])
    return out

  def usage_chunk(self, prompt_tokens: int, completion_tokens: int, stats: list[RequestStats]) -> dict:
    """`stream_options.include_usage`'s last chunk: no choices, the usage."""
    obj = "chat.completion.chunk" if self.chat else "text_completion"
    return {**self._envelope(obj, []), "usage": usage(prompt_tokens, completion_tokens),
            "speculative_decoding": speculation_figures(stats)}
