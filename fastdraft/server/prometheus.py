"""Prometheus metrics, named as vLLM names them with a ``fastdraft:`` prefix, so existing
dashboards translate. Each server has its own registry: nothing is global.

The metrics are made by a :class:`MetricKinds`: prometheus_client's in a registry of the
server's own by default; on Ray Serve replicas, Ray's (see ``fastdraft.server.ray_app``), which
Ray exports from every node with each replica's tags."""

from __future__ import annotations

from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from fastdraft.engine.output import RequestCollector, RequestDelta
from fastdraft.server.engine_client import StepStats

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)


class MetricKinds(Protocol):
    """Makes the metrics: each takes a name (without prefix), a description and its label
    names, and answers prometheus_client's calls (``labels``, ``inc``, ``set``, ``observe``)."""

    def counter(self, name: str, doc: str, label_names: list[str]) -> Any: ...

    def gauge(self, name: str, doc: str, label_names: list[str]) -> Any: ...

    def histogram(self, name: str, doc: str, label_names: list[str], buckets: tuple[float, ...]) -> Any: ...


class PrometheusKinds:
    """prometheus_client metrics named ``fastdraft:NAME``, in ``registry``."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()

    def counter(self, name: str, doc: str, label_names: list[str]) -> Counter:
        return Counter(f"fastdraft:{name}", doc, label_names, registry=self.registry)

    def gauge(self, name: str, doc: str, label_names: list[str]) -> Gauge:
        return Gauge(f"fastdraft:{name}", doc, label_names, registry=self.registry)

    def histogram(self, name: str, doc: str, label_names: list[str], buckets: tuple[float, ...]) -> Histogram:
        return Histogram(f"fastdraft:{name}", doc, label_names, buckets=buckets, registry=self.registry)


class ServerMetrics:
    """A server's request and engine figures, fed by :meth:`record_step` and
    :meth:`record_delta`; ``kinds`` makes them (prometheus_client's by default)."""

    def __init__(self, model_name: str, kinds: MetricKinds | None = None) -> None:
        kinds = PrometheusKinds() if kinds is None else kinds
        self.registry = getattr(kinds, "registry", None)
        labels = {"model_name": model_name}
        names = list(labels)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Any:
            return kinds.counter(name, doc, names + list(extra))

        def gauge(name: str, doc: str) -> Any:
            return kinds.gauge(name, doc, names).labels(**labels)

        def histogram(name: str, doc: str) -> Any:
            return kinds.histogram(name, doc, names, _LATENCY_BUCKETS).labels(**labels)

        self.labels = labels
        self.ttft = histogram("time_to_first_token_seconds", "Time to the first token of a request")
        self.tpot = histogram("time_per_output_token_seconds", "Time between two output tokens of a request")
        self.e2e = histogram("e2e_request_latency_seconds", "Time from arrival to the last token")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed").labels(**labels)
        self.generation_tokens = counter("generation_tokens", "Tokens generated").labels(**labels)
        self.request_success = counter("request_success", "Requests finished", ("finished_reason",))
        self.running = gauge("num_requests_running", "Requests in the running batch")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled")
        self.kv_cache_usage = gauge("kv_cache_usage_perc", "Share of KV-cache blocks in use (0 to 1)")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache").labels(
            **labels)
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache").labels(**labels)
        self.preemptions = counter("num_preemptions", "Sequences preempted for want of KV-cache blocks").labels(
            **labels)
        # Speculative decoding, counted when a request finishes (vLLM's spec_decode names).
        self.spec_drafts = counter("spec_decode_num_drafts", "Steps in which a request verified draft tokens").labels(
            **labels)
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed").labels(**labels)
        self.spec_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted").labels(
            **labels)
        self.spec_accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                             "Draft tokens accepted, by position in the draft", ("position",))
        self.spec_steps_per_k = counter("spec_decode_steps_per_draft_length",
                                        "Decode steps of speculating requests, by the draft length chosen",
                                        ("draft_length",))
        self._last = StepStats(0, 0, 0.0, 0, 0, 0)

    def record_step(self, stats: StepStats) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        self.prefix_queries.inc(stats.num_prefix_queries - self._last.num_prefix_queries)
        self.prefix_hits.inc(stats.num_prefix_hits - self._last.num_prefix_hits)
        self.preemptions.inc(stats.num_preemptions - self._last.num_preemptions)
        self._last = stats

    def record_delta(self, delta: RequestDelta, request: RequestCollector) -> None:
        """After each delta of a request (``request``: what its deltas added up to, this one
        included): its tokens' latency; at the end, the request's totals."""
        self.generation_tokens.inc(len(delta.new_token_ids))
        if delta.ttft_s is not None:
            self.ttft.observe(delta.ttft_s)
            self.prompt_tokens.inc(len(request.prompt_token_ids))
        elif delta.new_token_ids:
            self.tpot.observe(delta.token_gap_s)
        if not delta.is_finished:
            return
        metrics = request.metrics
        spec = metrics.spec
        if spec is not None:
            self.spec_drafts.inc(spec.num_steps)
            self.spec_draft_tokens.inc(spec.num_draft_tokens)
            self.spec_accepted_tokens.inc(spec.num_accepted_tokens)
            for position, accepted in enumerate(spec.accepted_per_position):
                self.spec_accepted_per_pos.labels(position=str(position), **self.labels).inc(accepted)
            for k, steps in enumerate(spec.steps_per_draft_length):
                self.spec_steps_per_k.labels(draft_length=str(k), **self.labels).inc(steps)
        self.e2e.observe(metrics.ttft_s + sum(metrics.token_latencies_s))
        self.request_success.labels(finished_reason=delta.finish_reason, **self.labels).inc()
