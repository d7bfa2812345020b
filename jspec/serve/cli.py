"""`python -m jspec.serve`: listen at once, load the models and compile what every request needs
(`jspec.serve.startup`), then serve HTTP until SIGTERM or Ctrl-C. With `--num-processes N`, process 0 does
so and the others follow it, each stepping its part of the same engine (`jspec.serve.hosts`).

The model, speculation, compilation and mesh flags are `python -m jspec.generate`'s. User errors (bad
flags, models that do not load or pair): one line on stderr, exit 2. Parsing imports no JAX.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import threading

import jspec
from jspec import flags
from jspec.engine.segments import SEGMENT_ROUNDS, STREAM_ROUNDS
from jspec.speculation import logprobs

EXAMPLES = """examples:
  python -m jspec.serve
  python -m jspec.serve --target HF_DIR --draft HF_DRAFT_DIR --batch-size 16 --max-model-len 4096
  # one model over two hosts' 8 devices in all: the same command on each, --process-id 0 and 1
  python -m jspec.serve --target HF_DIR --mesh model=8 --coordinator HOST0:1234 --num-processes 2 --process-id 0
  curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
      -d '{"model": "code", "prompt": "import os\\n\\n\\ndef read_lines(path):\\n", "max_tokens": 64}'
"""
log = logging.getLogger("jspec")


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m jspec.serve", formatter_class=flags.Formatter, epilog=EXAMPLES,
                              description="An OpenAI-compatible server that decodes speculatively when it "
                                          "pays and plainly under load.")
  p.add_argument("--version", action="version", version=f"jspec {jspec.__version__}")
  flags.add_model_args(p)
  g = p.add_argument_group("server")
  g.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
  g.add_argument("--port", type=int, default=8000)
  g.add_argument("--api-key", default=os.environ.get("JSPEC_API_KEY"), metavar="KEY",
                 help="every /v1 route needs `Authorization: Bearer KEY` (default: $JSPEC_API_KEY; none: open); "
                      "/health and /metrics stay open")
  g.add_argument("--ssl-keyfile", default=None, metavar="FILE", help="serve HTTPS with this private key (PEM)")
  g.add_argument("--ssl-certfile", default=None, metavar="FILE", help="and this certificate chain (PEM)")
  g.add_argument("--served-model-name", metavar="NAME", default=None,
                 help="the model name requests give (default: --target as given)")
  g.add_argument("--batch-size", type=int, default=None, metavar="B",
                 help="requests decoded together (slots; default: as many as fit, up to 8)")
  g.add_argument("--max-model-len", type=int, default=None, metavar="N",
                 help="tokens (prompt and output) a request may hold (default: the model's context)")
  g.add_argument("--memory-fraction", type=float, default=0.9, metavar="F",
                 help="share of the device's memory the server may use (vLLM's gpu_memory_utilization)")
  g.add_argument("--max-total-tokens", type=int, default=None, metavar="N",
                 help="tokens the paged KV cache holds across all requests, in pages of 128 (default: as many as "
                      "fit --memory-fraction, at most every slot's whole context)")
  g.add_argument("--max-prefill-tokens", type=int, default=512, metavar="N",
                 help="prompt tokens prefilled between two decode segments: a longer prompt goes in chunks, so "
                      "running streams keep moving (0: whole prompts)")
  g.add_argument("--no-prefix-caching", action="store_true",
                 help="prefill every prompt whole (default: a prompt shares the cached pages of its longest prefix "
                      "an earlier request left, and prefills the rest)")
  g.add_argument("--lazy-compile", action="store_true",
                 help="compile the programs of other batch widths and prompt buckets when a request first needs one "
                      "(default: all of them, in the background once the server is ready)")
  g.add_argument("--no-calibrate", action="store_true",
                 help="do not measure the pair's cost model once ready when none is kept for it (python -m "
                      "jspec.calibrate; a measured one applies from the next start); adaptive speculation uses "
                      "the checkpoint's or neutral figures")
  g.add_argument("--max-logprobs", type=int, default=logprobs.MAX_TOP, metavar="N",
                 help="the most log-probabilities a token may come with (logprobs, top_logprobs); 0: none, and no "
                      "buffers for them")
  g.add_argument("--max-queue", type=int, default=256, metavar="N",
                 help="requests that may wait for a slot; past it, requests get 503 and Retry-After")
  g.add_argument("--segment-rounds", type=int, default=SEGMENT_ROUNDS, metavar="R",
                 help="rounds per engine step: new requests, aborts and streamed text between steps")
  g.add_argument("--stream-rounds", type=int, default=STREAM_ROUNDS, metavar="R",
                 help="the fewest rounds per engine step while a streamed request is young and no request "
                      "waits for a slot (its steps run 1, 1, 2, 4, 8, ... rounds): its text comes soon, in "
                      "chunks that grow")
  flags.add_speculation_args(p)
  flags.add_runtime_args(p)
  return p


def check(args: argparse.Namespace) -> None:
  if not 0 <= args.port < 65536:
    raise ValueError(f"--port must be in [0, 65536), got {args.port}")
  for name in ("batch_size", "max_queue", "segment_rounds", "stream_rounds", "max_total_tokens"):
    if getattr(args, name) is not None and getattr(args, name) < 1:
      raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
  if args.max_prefill_tokens < 0:
    raise ValueError(f"--max-prefill-tokens must be >= 0, got {args.max_prefill_tokens}")
  if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
    raise ValueError("give --ssl-keyfile and --ssl-certfile together")
  for name in ("ssl_keyfile", "ssl_certfile"):
    if getattr(args, name) is not None and not os.path.isfile(getattr(args, name)):
      raise ValueError(f"--{name.replace('_', '-')}: no file {getattr(args, name)}")
  if args.api_key == "":
    raise ValueError("--api-key must not be empty")
  if not 0 < args.memory_fraction <= 1:
    raise ValueError(f"--memory-fraction must be in (0, 1], got {args.memory_fraction}")
  if (args.num_processes or 1) > 1 and not args.mesh:
    raise ValueError("a server of several processes shards the model over every process's devices: give --mesh, "
                     "e.g. --mesh model=N for N devices in all")


@flags.command
def main(argv: list[str] | None = None) -> int:
  args = parser().parse_args(argv)
  flags.show_status(True)
  check(args)
  leader = flags.init_distributed(args)
  from jspec.decoding import program_cache  # here: --help answers without the server's imports

  if not args.no_compile_cache:
    program_cache.use_compile_cache(args.compile_cache)
  if not leader:
    return follow(args)
  import uvicorn

  from jspec.serve.app import create_app
  from jspec.serve.metrics import Metrics
  from jspec.serve.startup import Startup

  scheme = "https" if args.ssl_certfile else "http"
  startup = Startup(args, Metrics(args.served_model_name or args.target), f"{scheme}://{args.host}:{args.port}")
  # uvicorn shuts down gracefully on SIGTERM and Ctrl-C, then raises the signal again for the handler it
  # found: these, so that a requested stop exits 0.
  for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, lambda *_: None)
  # log_config None: uvicorn's own would reconfigure logging, closing the handlers the process has.
  server = uvicorn.Server(uvicorn.Config(create_app(startup, args.api_key), host=args.host, port=args.port,
                                         log_level="warning", log_config=None, timeout_graceful_shutdown=5,
                                         ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile))
  stop = lambda: setattr(server, "should_exit", True)
  starter = threading.Thread(target=startup.run, args=(stop,), name="jspec-startup", daemon=True)
  starter.start()
  log.info("listening at %s (/health answers 503 until the server is ready)", startup.url)
  server.run()
  if startup.error is not None:
    return 2
  startup.end_progress()
  if starter.is_alive() or (startup.loop is not None and startup.loop.engine.num_compiling):
    leave_now()
  log.info("stopped")
  return 0


def leave_now() -> None:
  """Exits 0 at once while the start-up still loads, compiles or calibrates, or a program compiles in the
  background: XLA cannot stop a compile midway, and at exit Python would wait for the one running (up to a
  minute for a speculative segment). Nothing is left half-written: programs are stored whole or not at all."""
  log.info("stopped (without waiting for the programs compiling)")
  logging.shutdown()
  os._exit(0)


def follow(args: argparse.Namespace) -> int:
  """A process other than 0: loads and compiles as process 0 does, then steps its part of the engine as
  process 0 says until it says stop. SIGTERM or Ctrl-C asks process 0 to stop the server."""
  import jax

  from jspec.serve import hosts
  from jspec.serve.startup import build_engine

  signals = threading.Event()
  for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, lambda *_: signals.set())
  engine = build_engine(args)[2]
  log.info("process %d of %d: ready; following process 0", jax.process_index(), jax.process_count())
  served = hosts.follow(engine, signals.is_set)
  log.info("process %d: stopped after %d requests", jax.process_index(), served)
  return 0
