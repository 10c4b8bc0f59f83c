"""A worker's Prometheus metrics (its own registry, served on its own port) and its job outcome notes.

Names follow vLLM's where one exists (``vllm:time_to_first_token_seconds`` ->
``ortfleet_time_to_first_token_seconds``); every series carries the worker's model, device and GPU index.
"""

from __future__ import annotations

import importlib.metadata
import itertools
import platform
import selectors
import socket
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from socketserver import BaseRequestHandler, ThreadingMixIn
from threading import Thread
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Histogram, Info, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric

from common.store_watch import StoreMetrics, StoreWatch
from common.wire import TERMINAL, FinishReason, JobStatus

if TYPE_CHECKING:
    from worker.job_runner import JobRun
    from worker.service import WorkerService


NAMESPACE = "ortfleet"
LABELS = ("model", "device", "gpu")
# From a GPU's milliseconds to a busy CPU's minutes: one set of buckets serves both kinds of worker.
TTFT_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
)  # fmt: skip
INTER_TOKEN_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
    0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
REQUEST_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0,
)  # fmt: skip
SUCCESS_REASONS = (FinishReason.stop, FinishReason.length)
_WILDCARD_HOSTS = {"0.0.0.0", "::", ""}


class WorkerMetrics:
    """Observes each job when it ends (through the service's hooks) and the engine's load at scrape time."""

    def __init__(self, registry: CollectorRegistry, service: WorkerService) -> None:
        self.registry = registry
        self.service = service
        info = service.info
        values = (info.model, info.device, info.gpu)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            metric = Histogram(name, doc, LABELS, namespace=NAMESPACE, registry=registry, buckets=buckets)
            return metric.labels(*values)

        self.ttft = histogram(
            "time_to_first_token_seconds", "Submission to the first generated token.", TTFT_BUCKETS
        )
        self.inter_token = GapHistogram(
            f"{NAMESPACE}_inter_token_latency_seconds",
            "Time between successive generated tokens.",
            INTER_TOKEN_BUCKETS,
            values,
        )
        registry.register(self.inter_token)
        self.e2e = histogram(
            "e2e_request_latency_seconds", "Submission to the end of the job.", REQUEST_BUCKETS
        )
        self.queue_time = histogram(
            "request_queue_time_seconds",
            "Submission to the start on a worker (first attempt).",
            REQUEST_BUCKETS,
        )
        prompt = Counter(
            "prompt_tokens", "Prompt tokens prefilled.", LABELS, namespace=NAMESPACE, registry=registry
        )
        self.prompt_tokens = prompt.labels(*values)
        finished = Counter(
            "jobs_finished",
            "Jobs that finished on this worker, by final status.",
            [*LABELS, "status"],
            namespace=NAMESPACE,
            registry=registry,
        )
        self.finished = {s: finished.labels(*values, s.value) for s in TERMINAL}
        success = Counter(
            "request_success",
            "Jobs that succeeded on this worker, by finish reason (stop or length).",
            [*LABELS, "finished_reason"],
            namespace=NAMESPACE,
            registry=registry,
        )
        self.success = {r: success.labels(*values, r.value) for r in SUCCESS_REASONS}
        self.preemptions = Counter(
            "num_preemptions",
            "Jobs this worker sent back to the queue for other work (they resume later): batch jobs for "
            "interactive ones, and jobs of a key above its share of the rows for another key's.",
            LABELS,
            namespace=NAMESPACE,
            registry=registry,
        ).labels(*values)
        self.adapters = AdapterCounts(registry, values, service.info.adapters)
        Info("worker", "What this worker serves and runs on.", namespace=NAMESPACE, registry=registry).info(
            worker_labels(service)
        )
        registry.register(EngineLoad(service, values))

    def job_done(self, run: JobRun) -> None:
        submitted = run.spec.submitted_at
        times = run.token_times
        self.prompt_tokens.inc(run.prompt_tokens)
        self.adapters.attempt_done(run)
        if times and not run.progress.token_ids:  # this attempt generated the job's first token
            self.ttft.observe(times[0] - submitted)
        self.inter_token.observe_gaps(times)
        if run.claim.attempt == 1:
            self.queue_time.observe(max(0.0, run.started_at - submitted))
        if run.preempted:
            self.preemptions.inc()
        outcome = run.outcome
        if outcome is None:  # handed back, lost its lease, or failed (counted by job_failed)
            return
        self.e2e.observe(time.time() - submitted)
        self.finished[outcome.status].inc()
        if outcome.status is JobStatus.succeeded and outcome.finish_reason in self.success:
            self.success[outcome.finish_reason].inc()

    def job_failed(self) -> None:
        self.finished[JobStatus.failed].inc()


class AdapterCounts:
    """Jobs and generated tokens per LoRA adapter (label `adapter`; "": the model itself); the model's
    own series count every job whatever its adapter."""

    def __init__(self, registry: CollectorRegistry, values: tuple[str, ...], adapters: Iterable[str]) -> None:
        labels = [*LABELS, "adapter"]
        self.values = values
        self.requests = Counter(
            "adapter_requests",
            'Jobs that ended on this worker, by the LoRA adapter they ran with ("": the model itself).',
            labels,
            namespace=NAMESPACE,
            registry=registry,
        )
        self.tokens = Counter(
            "adapter_generation_tokens",
            'Tokens generated by the LoRA adapter they ran with ("": the model itself), counted as each '
            "attempt ends.",
            labels,
            namespace=NAMESPACE,
            registry=registry,
        )
        for adapter in ["", *adapters]:  # every series from the start, at 0
            self.add(adapter)

    def add(self, adapter: str) -> None:
        """The adapter's series, at 0 until its first job ends (from its load, for one loaded at run time)."""
        self.requests.labels(*self.values, adapter)
        self.tokens.labels(*self.values, adapter)

    def attempt_done(self, run: JobRun) -> None:
        adapter = run.spec.adapter or ""
        self.tokens.labels(*self.values, adapter).inc(run.tokens_generated)
        if run.outcome is not None:
            self.requests.labels(*self.values, adapter).inc()


class GapHistogram:
    """A histogram of the gaps between successive times, observed a job's whole list at once: at a GPU's
    rates a worker observes every gap between its jobs' tokens, and prometheus_client's Histogram.observe
    (a lock and a bucket search each) cost 2.5 µs a token of the event loop's time. Exposed as Histogram's
    series are (_bucket by le, _sum, _count), with one label set."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...], values: tuple[str, ...]):
        self.name = name
        self.documentation = documentation
        self.bounds = list(buckets)
        self._bounds = np.asarray(buckets, np.float64)
        self.values = list(values)
        self._counts = [0] * (len(buckets) + 1)  # the last: above every bound (+Inf)
        self._sum = 0.0
        self._lock = threading.Lock()  # the event loop observes, the /metrics thread reads

    def observe_gaps(self, times: list[float]) -> None:
        if len(times) < 2:
            return
        gaps = np.diff(np.asarray(times, np.float64))
        # bisect_left's bucket of each gap: the first bound it is at or below
        buckets = np.bincount(np.searchsorted(self._bounds, gaps, side="left"), minlength=len(self._counts))
        total = float(gaps.sum())
        with self._lock:
            counts = self._counts
            for bucket, count in enumerate(buckets.tolist()):
                counts[bucket] += count
            self._sum += total

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            counts, total = list(self._counts), self._sum
        family = HistogramMetricFamily(self.name, self.documentation, labels=LABELS)
        cumulative = list(itertools.accumulate(counts))
        edges = [*(repr(float(bound)) for bound in self.bounds), "+Inf"]  # as prometheus_client writes le
        family.add_metric(self.values, list(zip(edges, cumulative, strict=True)), total)
        return [family]


class EngineLoad:
    """Running requests, capacity and generated tokens, read from the service when Prometheus scrapes."""

    def __init__(self, service: WorkerService, values: tuple[str, ...]) -> None:
        self.service = service
        self.values = list(values)

    def collect(self) -> Iterable[Metric]:
        service = self.service
        running = GaugeMetricFamily(
            f"{NAMESPACE}_num_requests_running", "Jobs generating on this worker now.", labels=LABELS
        )
        running.add_metric(self.values, len(service.runs))
        capacity = GaugeMetricFamily(
            f"{NAMESPACE}_engine_capacity",
            "Requests the engine generates together (its slots).",
            labels=LABELS,
        )
        capacity.add_metric(self.values, service.engine.capacity)
        # The heartbeat's snapshot: written by the event loop in one step, so it never goes backwards.
        generated = CounterMetricFamily(
            f"{NAMESPACE}_generation_tokens", "Tokens generated (running jobs included).", labels=LABELS
        )
        generated.add_metric(self.values, service.info.generated_tokens)
        restarts = CounterMetricFamily(
            f"{NAMESPACE}_engine_restarts",
            "Failed engines this worker replaced with a new one, without restarting the process.",
            labels=LABELS,
        )
        restarts.add_metric(self.values, service.engine_restarts)
        return [running, capacity, generated, restarts, *self._batcher()]

    def _batcher(self) -> list[Metric]:
        """The figures of ortfleet's batcher (worker/engines/batcher), on workers that run it."""
        engine: Any = self.service.engine
        counters = getattr(engine, "counters", None)
        if counters is None:
            return []
        waiting, prefilling, decoding = engine.rows()
        rows = GaugeMetricFamily(
            f"{NAMESPACE}_batcher_rows",
            "Requests in the batcher by phase: waiting (for a slot or KV), prefill, decode.",
            labels=[*LABELS, "phase"],
        )
        for phase, count in (("waiting", waiting), ("prefill", prefilling), ("decode", decoding)):
            rows.add_metric([*self.values, phase], count)
        figures: list[tuple[type[GaugeMetricFamily] | type[CounterMetricFamily], str, str, float]] = [
            (
                GaugeMetricFamily,
                "kv_cache_reserved_tokens",
                "KV cache tokens the running requests reserved (prompt plus max_tokens each).",
                engine.kv_tokens_reserved,
            ),
            (
                GaugeMetricFamily,
                "kv_cache_budget_tokens",
                "KV cache tokens the running requests may reserve together (ORTFLEET_KV_BUDGET_TOKENS).",
                engine.kv_budget_tokens,
            ),
            (
                CounterMetricFamily,
                "prefill_tokens",
                "Prompt tokens the batcher prefilled.",
                counters.prefill_tokens,
            ),
            (
                CounterMetricFamily,
                "decode_steps",
                "Decode steps the batcher ran (a token for each row).",
                counters.decode_steps,
            ),
            (
                CounterMetricFamily,
                "prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache (vLLM's prefix_cache_queries).",
                counters.prefix_tokens_queried,
            ),
            (
                CounterMetricFamily,
                "prefix_cache_hits",
                "Prompt tokens whose KV came from the prefix cache, not prefilled "
                "(vLLM's prefix_cache_hits).",
                counters.prefix_tokens_reused,
            ),
            (
                CounterMetricFamily,
                "grammar_starts_computed",
                "Structured-output grammars whose start (compiled matcher, first ending, fewest tokens) the "
                "worker computed, off the engine's thread.",
                counters.grammar_starts,
            ),
            (
                CounterMetricFamily,
                "grammar_starts_reused",
                "Structured requests that started from a grammar start computed before.",
                counters.grammar_starts_reused,
            ),
            (
                GaugeMetricFamily,
                "prefix_cache_tokens",
                "Tokens of prompt KV kept in free slots for reuse.",
                engine.prefix_cache_tokens,
            ),
        ]
        families: list[Metric] = [rows]
        for family, name, description, value in figures:
            metric = family(f"{NAMESPACE}_{name}", description, labels=LABELS)
            metric.add_metric(self.values, value)
            families.append(metric)
        return families


def worker_labels(service: WorkerService) -> dict[str, str]:
    info = service.info
    return {
        "model": info.model,
        "device": info.device,
        "gpu": info.gpu,
        "worker": info.id,
        "host": info.host,
        "batching": "continuous" if info.continuous_batching else "static",
        "context_length": str(info.context_length),
        "ortfleet_version": _version("ortfleet"),
        "onnxruntime_genai_version": _version("onnxruntime-genai", "onnxruntime-genai-cuda"),
        "onnxruntime_version": _version("onnxruntime", "onnxruntime-gpu"),
        "python_version": platform.python_version(),
    }


def _version(*distributions: str) -> str:
    for name in distributions:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


@dataclass
class MetricsServer:
    server: _ThreadingServer
    thread: Thread
    url: str
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def observe(self, service: WorkerService, watch: StoreWatch | None = None) -> None:
        """Hooks the worker's metrics into its service (and the watch over its Redis) and serves them;
        their URL goes in its registry entry."""
        metrics = WorkerMetrics(self.registry, service)
        if watch is not None:
            self.registry.register(StoreMetrics(lambda: [watch], NAMESPACE))
        service.on_job_done = metrics.job_done
        service.on_job_failed = metrics.job_failed
        service.on_adapter_loaded = metrics.adapters.add
        service.info.metrics_url = self.url

    def close(self) -> None:
        self.server.stop()
        self.thread.join()
        self.server.server_close()


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    """A WSGI server whose thread sleeps until a request comes or `stop` is called. (`serve_forever`
    wakes every `poll_interval` to look for a stop: 20 times a second, with the 0.05 s poll that closing
    quickly needs, each wake taking the interpreter from the event loop and the engine.)"""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[BaseRequestHandler]) -> None:
        # Made before the socket is bound: socketserver calls server_close when binding fails.
        self._stop_reader, self._stop_writer = socket.socketpair()
        super().__init__(address, handler)

    def serve_until_stopped(self) -> None:
        with selectors.DefaultSelector() as selector:
            selector.register(self, selectors.EVENT_READ)
            selector.register(self._stop_reader, selectors.EVENT_READ)
            while all(key.fileobj is self for key, _ in selector.select()):
                self.handle_request()  # a connection is waiting: accepted without blocking

    def stop(self) -> None:
        self._stop_writer.send(b"x")

    def server_close(self) -> None:
        super().server_close()
        self._stop_reader.close()
        self._stop_writer.close()


class _ThreadingServer6(_ThreadingServer):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


def serve(registry: CollectorRegistry, host: str, port: int) -> tuple[_ThreadingServer, Thread]:
    """prometheus_client's start_http_server, with a thread that sleeps between requests."""
    server_class = _ThreadingServer6 if ":" in host else _ThreadingServer
    server = make_server(host, port, make_wsgi_app(registry), server_class, handler_class=_QuietHandler)
    server.timeout = 0  # handle_request does not wait: serve_until_stopped has seen a connection
    thread = Thread(target=server.serve_until_stopped, daemon=True, name="metrics-http")
    thread.start()
    return server, thread


def open_metrics(host: str, port: int) -> MetricsServer:
    """Serves /metrics on host:port (0: a free port), empty until `observe`; OSError when it cannot have
    the port. Opened before the model loads, so that a port in use ends the worker at once."""
    registry = CollectorRegistry()
    server, thread = serve(registry, host, port)
    bound = server.server_address[1]
    shown = socket.gethostname() if host in _WILDCARD_HOSTS else host
    if ":" in shown:
        shown = f"[{shown}]"
    return MetricsServer(server, thread, f"http://{shown}:{bound}/metrics", registry)
