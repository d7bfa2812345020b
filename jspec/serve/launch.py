"""A server in a child process, for benchmarks, tests and notebooks: `with launch("--target", "code") as url`."""
from __future__ import annotations

import contextlib
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx


def free_port() -> int:
  """A port of 127.0.0.1 no one listens on now."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def start(*flags: str, timeout: float = 600, starting: list | None = None,
          tls: str | None = None) -> tuple[subprocess.Popen, str]:
  """`python -m jspec.serve` with these flags on a free port of 127.0.0.1, once its /health answers 200:
  the process and its base URL. Its output (status lines, errors) goes to the process's stdout pipe.
  `starting` gets the answers /health gave before (responses); `tls`: the certificate of a server started
  with --ssl-certfile (its URL is https)."""
  port = free_port()
  proc = subprocess.Popen([sys.executable, "-m", "jspec.serve", "--host", "127.0.0.1", "--port", str(port), *flags],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  url = f"{'https' if tls else 'http'}://127.0.0.1:{port}"
  verify = ssl.create_default_context(cafile=tls) if tls else True
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if proc.poll() is not None:
      raise RuntimeError(f"the server exited with status {proc.returncode}:\n{proc.stdout.read()}")
    try:
      health = httpx.get(f"{url}/health", timeout=1, verify=verify)
      if health.status_code == 200:
        return proc, url
      if starting is not None:
        starting.append(health)
    except httpx.TransportError:
      pass
    time.sleep(0.25)
  proc.kill()
  raise RuntimeError(f"the server did not answer /health within {timeout:.0f} s")


def stop(proc: subprocess.Popen) -> None:
  if proc.poll() is None:
    proc.kill()
    proc.wait()


@contextlib.contextmanager
def launch(*flags: str, timeout: float = 600) -> Iterator[str]:
  """A server for the `with` block; yields its base URL (`.../v1` is the OpenAI API)."""
  proc, url = start(*flags, timeout=timeout)
  try:
    yield url
  finally:
    stop(proc)
