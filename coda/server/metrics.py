"""Prometheus metrics with vLLM-style names, one registry per app (issue 4 item 6; SPEC P5, L4).

Latencies are observed once per request, once its terminal event is appended (woken by the
wake-up channel on the server's event loop, never on the engine thread; one listener for every
request's end, :meth:`coda.wakeup.WakeChannel.on_end`, not a subscription per request): time to
first token, inter-token latency (gaps between deltas), queue time, end-to-end latency, and the
exact finish reason: a FINISHED or CANCELLED request counts in ``request_success`` by its
reason, a FAILED one (a K3 decoding error keeps a normal reason such as ``max_output_tokens``)
in ``request_failure`` by its reason and error code, never as a success (issue 20 D7). Gauges
(running, waiting, KV usage) are read from the engine at scrape.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from coda.lifecycle import State
from coda.reader import replay
from coda.stream import EventType
from coda.wakeup import CHANNEL

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75,
                    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class ServerMetrics:
    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.registry = CollectorRegistry(auto_describe=True)
        # NOTE: the streams of this app's requests not yet ended, and the loop listening
        self._tracked: set[object] = set()
        self._listening: tuple[asyncio.AbstractEventLoop, Callable[[], None]] | None = None
        r = self.registry
        self.ttft = Histogram("coda:time_to_first_token_seconds",
                              "Arrival to first selected token.", registry=r,
                              buckets=_LATENCY_BUCKETS)
        self.itl = Histogram("coda:inter_token_latency_seconds",
                             "Gap between consecutive stream deltas.", registry=r,
                             buckets=_LATENCY_BUCKETS)
        self.queue = Histogram("coda:request_queue_time_seconds", "Time spent queued.",
                               registry=r, buckets=_LATENCY_BUCKETS)
        self.e2e = Histogram("coda:e2e_request_latency_seconds", "Arrival to terminal event.",
                             registry=r, buckets=_LATENCY_BUCKETS)
        self.success = Counter("coda:request_success", "Finished requests by exact reason.",
                               ["finished_reason"], registry=r)
        self.failure = Counter("coda:request_failure",
                               "FAILED requests by exact reason and error code.",
                               ["finished_reason", "error"], registry=r)
        self.prompt_tokens = Counter("coda:prompt_tokens", "Prompt tokens.", registry=r)
        self.generation_tokens = Counter("coda:generation_tokens",
                                         "Selected output tokens.", registry=r)
        self.running = Gauge("coda:num_requests_running", "Requests in the batch.", registry=r)
        self.waiting = Gauge("coda:num_requests_waiting", "Requests queued.", registry=r)
        self.kv_usage = Gauge("coda:kv_cache_usage_perc", "KV cache usage (0-1).", registry=r)
        self.preemptions = Gauge("coda:num_preemptions", "Preemptions so far.", registry=r)
        self.embed_chunks = Gauge("coda:embedding_chunks", "Embedding chunks run so far.",
                                  registry=r)
        self.embeds_cancelled = Gauge("coda:embeddings_cancelled", "Embeddings stopped at a "
                                      "chunk boundary, their caller gone, so far.", registry=r)
        # NOTE: issue 19 item 3: the cache is reserved at load and committed as it is written
        self.kv_reserved = Gauge("coda:kv_cache_reserved_bytes", "KV cache mapping (bytes).",
                                 registry=r)
        self.kv_committed = Gauge("coda:kv_cache_committed_bytes",
                                  "KV cache bytes ever written (committed).", registry=r)

    def listen(self) -> None:
        """Listen for request ends on the running loop (call on it before submitting, so no
        end is posted before the listener: a request may end before :meth:`track`). An app
        served from a new loop (a test client's) moves the listener there."""
        loop = asyncio.get_running_loop()
        if self._listening is not None and self._listening[0] is loop:
            return
        if self._listening is not None:
            self._listening[1]()
        self._listening = (loop, CHANNEL.on_end(self._ended, loop))

    def track(self, handle: Any) -> None:
        """Observe ``handle``'s latencies once, after its terminal event (call on the loop,
        after :meth:`listen` and before the loop runs anything else)."""
        self._tracked.add(handle.stream)

    def _ended(self, stream: object) -> None:
        if stream in self._tracked:
            self._tracked.discard(stream)
            self._observe(stream)

    def _observe(self, stream: Any) -> None:
        events = replay(stream)
        terminal = stream.terminal
        if terminal is None:
            return
        if terminal.first_token_s is not None:
            self.ttft.observe(terminal.first_token_s)
        self.queue.observe(terminal.queue_s)
        self.e2e.observe(terminal.total_s)
        stamps = [e.ts for e in events if e.type is EventType.DELTA]
        for a, b in zip(stamps, stamps[1:], strict=False):
            self.itl.observe(max(0.0, b - a))
        reason = terminal.finish_reason.value
        if terminal.state is State.FAILED:  # NOTE: issue 20 D7: a failure, whatever its reason
            code = terminal.error_code.value if terminal.error_code is not None else "model_error"
            self.failure.labels(finished_reason=reason, error=code).inc()
        else:
            self.success.labels(finished_reason=reason).inc()
        self.prompt_tokens.inc(terminal.usage.prompt_tokens)
        self.generation_tokens.inc(terminal.usage.selected_tokens)

    def render(self) -> bytes:
        stats = self.engine.stats()
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        self.preemptions.set(stats.num_preemptions_total)
        self.embed_chunks.set(stats.embed_chunks_total)
        self.embeds_cancelled.set(stats.embeds_cancelled_total)
        self.kv_reserved.set(stats.kv_cache_reserved_bytes)
        self.kv_committed.set(stats.kv_cache_committed_bytes)
        return generate_latest(self.registry)
