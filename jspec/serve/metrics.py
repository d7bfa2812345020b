"""Prometheus metrics at `/metrics`, named as vLLM's with a `jspec:` prefix so its dashboards port, plus the
adaptive policy's view: the acceptance EWMA, the draft length in use, and whether speculation is on."""
from __future__ import annotations

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

from jspec.speculation.stats import DecodeStats

disable_created_metrics()  # as vLLM: no `_created` series beside each counter and histogram

# vLLM's buckets for request latencies (seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)


class Metrics:
  """The server's metrics in their own registry; the engine thread updates them after each segment."""

  def __init__(self, model_name: str):
    self.registry = registry = CollectorRegistry()
    label = {"labelnames": ["model_name"], "registry": registry}
    gauge = lambda name, doc: Gauge(f"jspec:{name}", doc, **label).labels(model_name)
    counter = lambda name, doc: Counter(f"jspec:{name}", doc, **label).labels(model_name)
    self.running = gauge("num_requests_running", "Requests decoding in a slot.")
    self.waiting = gauge("num_requests_waiting", "Requests waiting for a slot.")
    self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of the requests started.")
    self.generation_tokens = counter("generation_tokens", "Tokens generated.")
    self.drafts = counter("spec_decode_num_drafts", "Rounds that verified a request's proposals.")
    self.draft_tokens = counter("spec_decode_num_draft_tokens", "Proposals verified.")
    self.accepted_tokens = counter("spec_decode_num_accepted_tokens", "Proposals accepted.")
    self._per_position = Counter("jspec:spec_decode_num_accepted_tokens_per_pos",
                                 "Proposals accepted at each draft position.", ["model_name", "position"],
                                 registry=registry)
    self.finished = Counter("jspec:request_success", "Requests finished, by reason.",
                            ["model_name", "finished_reason"], registry=registry)
    self.ttft = Histogram("jspec:time_to_first_token_seconds", "Time from arrival to the first token.",
                          buckets=TTFT_BUCKETS, **label).labels(model_name)
    self.tpot = Histogram("jspec:time_per_output_token_seconds", "Mean time between a request's tokens.",
                          buckets=TPOT_BUCKETS, **label).labels(model_name)
    self.e2e = Histogram("jspec:e2e_request_latency_seconds", "Time from arrival to the last token.",
                         buckets=E2E_BUCKETS, **label).labels(model_name)
    self.prefill = Histogram("jspec:request_prefill_time_seconds", "Prefilling a request into its slot.",
                             buckets=TTFT_BUCKETS, **label).labels(model_name)
    self.segment = Histogram("jspec:segment_time_seconds", "One engine step's segment of decode rounds.",
                             buckets=TTFT_BUCKETS, **label).labels(model_name)
    self.acceptance = gauge("spec_decode_acceptance_ewma",
                            "Mean over running requests of the acceptance rate's EWMA (the adaptive policy's).")
    self.draft_len = gauge("spec_decode_draft_len", "Mean tokens drafted per round in the last segment (0: plain).")
    self.enabled = gauge("spec_decode_enabled", "1 when the last segment speculated, 0 when it decoded plainly.")
    self.kv_usage = gauge("kv_cache_usage_perc", "Share of the paged KV cache's pages in use (1: all).")
    self.free_pages = gauge("kv_cache_free_pages", "Pages of the paged KV cache free.")
    self.preemptions = counter("num_preemptions", "Requests preempted for want of KV pages (they resume later).")
    self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
    self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache (not prefilled).")
    self.compiling = gauge("programs_compiling", "Programs the server compiles in the background now.")
    self.calibrating = gauge("calibrating", "1 while the server measures its drafter's cost model (kept; it applies "
                             "from the next start).")
    self._cost_model = Gauge("jspec:cost_model_info", "1 for where the adaptive policy's cost model in use comes "
                             "from: calibrated (measured here), checkpoint (the drafter's) or neutral.",
                             ["model_name", "source"], registry=registry)
    self.model_name = model_name
    self._last: DecodeStats | None = None
    self._counted = {"num_preemptions": 0, "prefix_queries": 0, "prefix_hits": 0}

  def cost_model(self, source: str | None) -> None:
    """Says where the running programs' cost model comes from (`jspec.speculation.costs.SOURCES`; None: no adaptive
    policy, nothing said)."""
    if source is not None:
      self._cost_model.labels(self.model_name, source).set(1)

  def observe_engine(self, engine) -> None:
    """The engine's queue and pages after a step (`jspec.engine.engine.Engine`)."""
    self.running.set(engine.num_running)
    self.waiting.set(engine.num_waiting)
    pages = engine.kv_pages
    if pages is not None:
      self.free_pages.set(pages.num_free)
      self.kv_usage.set(1 - pages.num_free / pages.pages)
      counts = {"num_preemptions": engine.num_preemptions, "prefix_queries": pages.prefix_queries,
                "prefix_hits": pages.prefix_hits}
      for name, counter in [("num_preemptions", self.preemptions), ("prefix_queries", self.prefix_queries),
                            ("prefix_hits", self.prefix_hits)]:
        counter.inc(counts[name] - self._counted[name])
        self._counted[name] = counts[name]

  def observe_segment(self, stats: DecodeStats, running_B: np.ndarray) -> None:
    """The counters' growth since the last segment (`stats`: the engine's, on the host), and the policy's
    state over the running rows."""
    last, self._last = self._last, stats
    grew = lambda name: int(getattr(stats, name)) - (int(getattr(last, name)) if last is not None else 0)
    self.drafts.inc(grew("verifies"))
    self.draft_tokens.inc(grew("drafted"))
    self.accepted_tokens.inc(grew("accepted"))
    before = last.accepted_at_K if last is not None else np.zeros_like(stats.accepted_at_K)
    for position, count in enumerate(np.asarray(stats.accepted_at_K) - np.asarray(before)):
      if count:
        self._per_position.labels(self.model_name, str(position)).inc(int(count))
    rounds_K1 = np.asarray(stats.draft_len_counts_K1) - (np.asarray(last.draft_len_counts_K1) if last is not None
                                                        else 0)
    if rounds_K1.sum():
      self.draft_len.set(float((rounds_K1 * np.arange(len(rounds_K1))).sum() / rounds_K1.sum()))
      self.enabled.set(float(rounds_K1[1:].sum() > 0))
    acceptance = stats.acceptance
    tested = np.asarray(acceptance.ewma_tested_B)[running_B]
    ewma = np.asarray(acceptance.ewma_accepted_B)[running_B][tested > 0] / tested[tested > 0]
    if ewma.size:
      self.acceptance.set(float(ewma.mean()))
