"""Serving from several processes (`jax.distributed`): one model sharded over every process's devices.

Process 0 takes HTTP and decides; the others follow. Before each engine step process 0 publishes what it
changes (the requests it adds and aborts, or that the server stops) in the coordinator's key-value store,
and every process applies the same commands to its own engine and steps it: all of them run the same SPMD
programs on the same inputs in the same order. The engine decides everything else from what its segments
report, which every process reads whole (`jspec.decoding.programs.fetch`), and it compiles a program where a step
first needs it, so the processes never part ways. A follower asked to stop (SIGTERM) asks process 0, which
stops the server, and the stop reaches every process as the last message.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable

import jax

from jspec.core.settings import SamplingConfig
from jspec.engine.engine import Engine
from jspec.engine.requests import Request
from jspec.text import constraints

log = logging.getLogger("jspec")
PREFIX = "jspec/serve/"
WAIT_MS = 1000  # how long a follower waits for the next step before it looks at its own signals again
STOP_POLL_SECONDS = 0.5  # how often process 0 looks for a follower's request to stop
# Steps whose messages stay in the store. A follower trails process 0 by the steps process 0 can take without
# waiting on a collective that needs the follower: a segment's read waits for it, so a few (not enforced: a
# follower whose step was deleted would wait for it forever).
KEPT_STEPS = 256
CONSTRAINTS = {cls.__name__: cls for cls in (constraints.Regex, constraints.JsonSchema, constraints.Choice)}


@dataclasses.dataclass
class Commands:
  """What changes before one engine step: requests added (with their ids) and aborted, or the end."""
  add: list[tuple[int, Request]] = dataclasses.field(default_factory=list)
  abort: list[int] = dataclasses.field(default_factory=list)
  stop: bool = False

  def apply(self, engine: Engine) -> None:
    for request_id, req in self.add:
      engine.add(req, request_id)
    for request_id in self.abort:
      engine.abort(request_id)


def encode(commands: Commands) -> str:
  """`commands` as JSON (no pickle: the store is a network service)."""
  def request(req: Request) -> dict:
    fields = {f.name: getattr(req, f.name) for f in dataclasses.fields(req)}
    c = req.constraint
    return {**fields, "prompt_ids": [int(t) for t in req.prompt_ids], "stop_ids": [int(t) for t in req.stop_ids],
            "stop": list(req.stop), "sampling": dataclasses.asdict(req.sampling),
            "constraint": None if c is None else [type(c).__name__, getattr(c, dataclasses.fields(c)[0].name)]}
  return json.dumps({"add": [[i, request(r)] for i, r in commands.add], "abort": commands.abort,
                     "stop": commands.stop})


def decode(text: str) -> Commands:
  def request(fields: dict) -> Request:
    c = fields["constraint"]
    return Request(**{**fields, "sampling": SamplingConfig(**fields["sampling"]),
                      "constraint": None if c is None else CONSTRAINTS[c[0]](c[1])})
  message = json.loads(text)
  return Commands([(i, request(r)) for i, r in message["add"]], message["abort"], message["stop"])


def _client():
  """The coordinator's key-value store, as `jax.distributed.initialize` connected it (orbax reads it so)."""
  from jax._src import distributed
  if distributed.global_state.client is None:
    raise RuntimeError("jax.distributed is not initialized")
  return distributed.global_state.client


class Leader:
  """Process 0's side: publishes each step's commands; hears a follower's request to stop."""

  def __init__(self):
    self._client, self._step, self._polled = _client(), 0, 0.0

  def publish(self, commands: Commands) -> None:
    self._client.key_value_set(f"{PREFIX}step/{self._step}", encode(commands))
    if self._step >= KEPT_STEPS:
      self._client.key_value_delete(f"{PREFIX}step/{self._step - KEPT_STEPS}")
    self._step += 1

  def stop_asked(self) -> bool:
    """Whether a follower asked the server to stop (looked up at most every `STOP_POLL_SECONDS`)."""
    now = time.monotonic()
    if now - self._polled < STOP_POLL_SECONDS:
      return False
    self._polled = now
    try:
      self._client.key_value_try_get(f"{PREFIX}stop")
    except jax.errors.JaxRuntimeError as e:
      if "NOT_FOUND" in str(e):
        return False
      raise
    return True


def follow(engine: Engine, stopping: Callable[[], bool]) -> int:
  """A follower's life: applies each step's commands to `engine` and steps it, until process 0 says stop.
  When `stopping()` turns true (a signal), asks process 0 to stop the server. Returns the requests it ran."""
  client, step, asked, served = _client(), 0, False, 0
  while True:
    if stopping() and not asked:
      client.key_value_set(f"{PREFIX}stop", "1")
      asked = True
    try:
      text = client.blocking_key_value_get(f"{PREFIX}step/{step}", WAIT_MS)
    except jax.errors.JaxRuntimeError as e:  # a timeout (the server is idle) looks again
      if "DEADLINE_EXCEEDED" in str(e):
        continue
      raise
    step += 1
    commands = decode(text)
    if commands.stop:
      return served
    commands.apply(engine)
    served += len(commands.add)
    engine.step()

