"""fastdraft behind Ray Serve: engine replicas across a cluster, one OpenAI-compatible ingress.

* :class:`EngineDeployment` holds one fastdraft engine per replica (its step loop on a thread,
  as ``fastdraft serve`` runs it) and streams each request's deltas back through Ray.
* :class:`Ingress` serves the same FastAPI routes, checks and error shapes as the single-process
  server; its engine client (:class:`RayEngineClient`) sends each request to a replica through a
  streaming ``DeploymentHandle`` and hands the deltas on as they arrive.

``build_ray_app(args)`` is the application ``serve run fastdraft.server.ray_app:build_ray_app``
and ``serve deploy`` load; ``fastdraft serve --backend ray`` builds and runs the same.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import ray
from ray import serve
from ray.serve import metrics as serve_metrics
from ray.serve.autoscaling_policy import replica_queue_length_autoscaling_policy
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from fastdraft.engine.llm_engine import EngineConfig, LLMEngine
from fastdraft.engine.loader import load_model
from fastdraft.engine.output import RequestDelta
from fastdraft.models.registry import DEFAULT_MODEL
from fastdraft.process import configure_process
from fastdraft.server.app import ServerConfig, build_fastapi_app
from fastdraft.server.async_engine import AsyncEngine
from fastdraft.server.prometheus import ServerMetrics
from fastdraft.server.engine_client import (EngineError, EngineInfo, QueuedRequest, QueueFullError, RequestStream,
                                            StepStats, merge_streams)
from fastdraft.server.ray_routing import ROUTERS

logger = logging.getLogger(__name__)

# Seconds a replica being removed waits for its open streams to finish.
GRACEFUL_SHUTDOWN_S = 120.0

# Seconds between a replica's routing stats (its cache size, which the prefix router bounds its
# map of the replica's blocks by, and its queue).
ROUTING_STATS_PERIOD_S = 2.0

# Each streamed token crosses the replica and ingress event loops; Serve's default runs user code
# and the handle's router on loops of their own threads, so every token would also cross threads.
# One loop per replica halves the ingress's CPU per token (the engine steps on its own thread).
REPLICA_ENV = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}


@dataclass
class RayServeConfig:
    """How the replicas run; checked with ``ValueError``.

    ``autoscaling`` (Ray Serve's ``autoscaling_config``: ``min_replicas``, ``max_replicas``,
    ``target_ongoing_requests``, ...) replaces the fixed ``num_replicas`` when given; unless it
    names a ``policy``, :class:`QueueAutoscalingPolicy` decides.
    ``stream_interval``: the engine steps a replica gathers before sending a request's new tokens
    on (a request's first and last tokens go at once); each send is one Ray object, so a larger
    interval trades token smoothness for less work per token on the ingress (vLLM's
    ``--stream-interval``). ``router`` picks the replica for each request: ``pow2`` (Ray Serve's
    default, power of two choices), ``round-robin`` or ``prefix`` (the replica whose prefix cache
    most likely holds the prompt's leading blocks; see :mod:`fastdraft.server.ray_routing`)."""

    num_replicas: int = 1
    num_cpus_per_replica: int = 1
    max_ongoing_requests: int = 64
    autoscaling: dict[str, Any] | None = None
    graceful_shutdown_timeout_s: float = GRACEFUL_SHUTDOWN_S
    stream_interval: int = 1
    router: str = "pow2"

    def __post_init__(self) -> None:
        if self.router not in ROUTERS:
            raise ValueError(f"router must be one of {sorted(ROUTERS)}, got {self.router!r}")
        if min(self.num_replicas, self.num_cpus_per_replica, self.max_ongoing_requests, self.stream_interval) < 1:
            raise ValueError("num_replicas, num_cpus_per_replica, max_ongoing_requests and stream_interval must be "
                             "positive")
        if self.autoscaling is not None and not isinstance(self.autoscaling, dict):
            raise ValueError("autoscaling must be a dict of Ray Serve's autoscaling_config fields")
        if self.graceful_shutdown_timeout_s <= 0:
            raise ValueError("graceful_shutdown_timeout_s must be positive")


class _RayMetric:
    """A ``ray.serve.metrics`` metric behind prometheus_client's calls, with its label values."""

    def __init__(self, metric: Any, tags: dict[str, str] | None = None) -> None:
        self.metric, self.tags = metric, tags or {}

    def labels(self, **tags: str) -> _RayMetric:
        return _RayMetric(self.metric, {**self.tags, **tags})

    def inc(self, amount: float = 1.0) -> None:
        if amount > 0:
            self.metric.inc(amount, tags=self.tags)

    def set(self, value: float) -> None:
        self.metric.set(value, tags=self.tags)

    def observe(self, value: float) -> None:
        self.metric.observe(value, tags=self.tags)


class RayMetricKinds:
    """Ray Serve's metrics for :class:`~fastdraft.server.prometheus.ServerMetrics`: made in a
    replica, they carry its ``deployment``, ``replica`` and ``application`` tags, and Ray
    exports them from each node as ``ray_fastdraft_NAME``."""

    def counter(self, name: str, doc: str, label_names: list[str]) -> _RayMetric:
        return _RayMetric(serve_metrics.Counter(f"fastdraft_{name}", doc, tag_keys=tuple(label_names)))

    def gauge(self, name: str, doc: str, label_names: list[str]) -> _RayMetric:
        return _RayMetric(serve_metrics.Gauge(f"fastdraft_{name}", doc, tag_keys=tuple(label_names)))

    def histogram(self, name: str, doc: str, label_names: list[str], buckets: tuple[float, ...]) -> _RayMetric:
        return _RayMetric(serve_metrics.Histogram(f"fastdraft_{name}", doc, boundaries=list(buckets),
                                                  tag_keys=tuple(label_names)))


class EngineDeployment:
    """One replica: a fastdraft engine, its step loop on a thread (made a Ray Serve deployment
    by :func:`application`). Its engine figures (latency, queue, KV use, prefix hits,
    speculation) go to Ray's metrics, named as the single-process server's ``/metrics`` names
    them."""

    def __init__(self, load_engine: Callable[[], LLMEngine], num_threads: int, max_queue: int,
                 stream_interval: int = 1, served_model_name: str = "") -> None:
        configure_process(num_threads=num_threads)
        self.engine = AsyncEngine(load_engine(), max_queue, self._on_step)
        self.stream_interval = stream_interval
        self.metrics = ServerMetrics(served_model_name, RayMetricKinds())
        self._last_step: StepStats | None = None
        self._started = False

    def _on_step(self, stats: StepStats) -> None:
        self._last_step = stats
        self.metrics.record_step(stats)

    def _start(self) -> None:
        if not self._started:  # on the replica's event loop, which the constructor does not run on
            self.engine.start(asyncio.get_running_loop())
            self._started = True

    async def info(self) -> EngineInfo:
        return self.engine.info

    async def generate(self, requests: list[QueuedRequest]) -> AsyncIterator[list[tuple[int, RequestDelta]]]:
        """Queue ``requests`` together and yield their deltas as [(index, delta)] until each has
        finished: at once for a first or last delta, else every ``stream_interval`` deltas of a
        request. The caller going away (the stream cancelled) aborts the unfinished ones."""
        self._start()
        streams = await self.engine.add_requests(requests)
        held: list[tuple[int, RequestDelta]] = []
        num_held = [0] * len(streams)
        try:
            async for batch in merge_streams(streams):
                is_due = False
                for index, item in batch:
                    if isinstance(item, EngineError):
                        raise item
                    self.metrics.record_delta(item, streams[index].collector)
                    num_held[index] += 1
                    is_due |= item.ttft_s is not None or item.is_finished or num_held[index] >= self.stream_interval
                held.extend(batch)
                if is_due:
                    yield held
                    held, num_held = [], [0] * len(streams)
        finally:
            for stream in streams:
                stream.close()

    def record_routing_stats(self) -> dict[str, Any]:
        """What the routers read of this replica (Ray Serve polls it): its queue and running
        requests at the last step, and its KV cache's size, use and block size."""
        blocks = self.engine.engine.block_manager
        stats = {"num_blocks": blocks.num_blocks, "block_size": blocks.block_size}
        if self._last_step is not None:
            stats.update(num_waiting=self._last_step.num_waiting, num_running=self._last_step.num_running,
                         kv_cache_usage=self._last_step.kv_cache_usage)
        return stats

    def record_autoscaling_stats(self) -> dict[str, float]:
        """What :class:`QueueAutoscalingPolicy` reads of this replica (Ray Serve polls it): the
        requests waiting in its engine's queue at the last step."""
        return {"num_waiting": float(self._last_step.num_waiting if self._last_step else 0)}

    def check_health(self) -> None:
        """Ray Serve's health probe: the engine's step loop must be alive."""
        if self._started and not self.engine.is_alive:
            raise RuntimeError("the engine loop has stopped")


class QueueAutoscalingPolicy:
    """Ray Serve's default autoscaling (ongoing requests per replica against
    ``target_ongoing_requests``), and one replica more per ``waiting_per_replica`` requests
    waiting in the engines' own queues. Ongoing requests alone miss the engine's view: a
    replica's requests may all be ongoing and yet wait, for a full batch or a full KV cache."""

    def __init__(self, waiting_per_replica: int = 8) -> None:
        if waiting_per_replica < 1:
            raise ValueError("waiting_per_replica must be positive")
        self.waiting_per_replica = waiting_per_replica

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        num_replicas, state = replica_queue_length_autoscaling_policy(ctx)
        num_waiting = sum((ctx.aggregated_metrics or {}).get("num_waiting", {}).values())
        if num_waiting >= self.waiting_per_replica:
            wanted = ctx.current_num_replicas + int(num_waiting // self.waiting_per_replica)
            num_replicas = max(num_replicas, min(wanted, ctx.capacity_adjusted_max_replicas))
        return num_replicas, state


QUEUE_POLICY = {"policy_function": f"{__name__}:QueueAutoscalingPolicy"}


@dataclass
class _Call:
    """One streaming call to a replica: the task relaying it, and its requests still open."""

    task: asyncio.Task | None = None
    open_ids: set[str] = field(default_factory=set)


class RayEngineClient:
    """The ingress's :class:`~fastdraft.server.engine_client.EngineClient` over a handle to
    the engine replicas: each add is one streaming call to a replica, whose deltas go to the
    requests' streams as they arrive. Aborting every request of a call cancels it, and the
    replica aborts them."""

    def __init__(self, handle: DeploymentHandle, max_queue: int,
                 on_step: Callable[[StepStats], None] | None = None) -> None:
        # on_step: the replicas' step counters are not gathered to the ingress (yet).
        self.handle = handle
        self.max_queue = max_queue
        self.info: EngineInfo | None = None
        self._num_waiting = 0  # requests sent and not yet past their first delta
        self._calls: dict[str, _Call] = {}  # request id -> its call

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Fetch the engine's tokenizer and limits (call it off the event loop)."""
        self.info = asyncio.run_coroutine_threadsafe(self._fetch_info(), loop).result()

    async def _fetch_info(self) -> EngineInfo:
        return await self.handle.info.remote()

    def stop(self, timeout: float = 10.0) -> None:
        for call in list(self._calls.values()):
            if call.task is not None:
                call.task.cancel()

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    async def add_requests(self, requests: list[QueuedRequest]) -> list[RequestStream]:
        if self._num_waiting + len(requests) > self.max_queue:
            raise QueueFullError(f"{self._num_waiting} requests are waiting; the limit is {self.max_queue}")
        streams = [RequestStream(self, request_id, prompt) for prompt, _, request_id in requests]
        call = _Call(open_ids={stream.request_id for stream in streams})
        for stream in streams:
            self._calls[stream.request_id] = call
        accepted: asyncio.Future = asyncio.get_running_loop().create_future()
        response = self.handle.options(stream=True).generate.remote(requests)
        call.task = asyncio.create_task(self._relay(response, streams, accepted))
        try:
            await accepted  # the first delta, or the engine's refusal
        except BaseException:
            call.task.cancel()
            raise
        return streams

    async def _relay(self, response, streams: list[RequestStream], accepted: asyncio.Future) -> None:
        is_waiting = [True] * len(streams)
        self._num_waiting += len(streams)
        try:
            async for deltas in response:
                if not accepted.done():
                    accepted.set_result(None)
                for index, delta in deltas:
                    if is_waiting[index]:
                        is_waiting[index] = False
                        self._num_waiting -= 1
                    streams[index].queue.put_nowait(delta)
            if not accepted.done():
                accepted.set_result(None)
        except asyncio.CancelledError:
            response.cancel()  # the replica aborts what is unfinished
            raise
        except Exception as e:  # a refusal before any delta reaches the route as the engine's error
            if not accepted.done():
                accepted.set_exception(e)
            else:
                for stream in streams:
                    stream.queue.put_nowait(EngineError(f"the engine replica failed: {e}"))
        finally:
            self._num_waiting -= sum(is_waiting)
            for stream in streams:
                self._calls.pop(stream.request_id, None)

    def abort(self, request_id: str) -> None:
        call = self._calls.pop(request_id, None)
        if call is None:
            return
        call.open_ids.discard(request_id)
        if not call.open_ids and call.task is not None:
            call.task.cancel()


ENGINE_DEPLOYMENT = "FastdraftEngine"


def _ingress_app(config: ServerConfig) -> Any:
    """The ingress replica's FastAPI app: the single-process server's routes over the replicas
    of its own application (whatever ``serve run`` or ``serve deploy`` named it)."""
    app_name = serve.get_replica_context().app_name
    handle = serve.get_deployment_handle(ENGINE_DEPLOYMENT, app_name=app_name)
    return build_fastapi_app(None, config, connect=functools.partial(RayEngineClient, handle, config.max_queue))


def application(load_engine: Callable[[], LLMEngine], server: ServerConfig, ray_config: RayServeConfig):
    """The Ray Serve application: ``ray_config``'s engine replicas, each running
    ``load_engine()``, behind one ingress serving the OpenAI routes as ``server`` says. Run it
    with ``serve.run(application(...), name=...)``."""
    scaling: dict[str, Any] = ({"autoscaling_config": {"policy": QUEUE_POLICY, **ray_config.autoscaling}}
                               if ray_config.autoscaling else {"num_replicas": ray_config.num_replicas})
    routing: dict[str, Any] = {}
    if ROUTERS[ray_config.router] is not None:
        routing["request_router_config"] = RequestRouterConfig(
            request_router_class=ROUTERS[ray_config.router], request_routing_stats_period_s=ROUTING_STATS_PERIOD_S)
    engine = serve.deployment(EngineDeployment, name=ENGINE_DEPLOYMENT).options(
        ray_actor_options={"num_cpus": ray_config.num_cpus_per_replica, "runtime_env": {"env_vars": REPLICA_ENV}},
        max_ongoing_requests=ray_config.max_ongoing_requests,
        graceful_shutdown_timeout_s=ray_config.graceful_shutdown_timeout_s,
        health_check_period_s=10, **scaling, **routing)

    def ingress_app() -> Any:  # a function (not a partial), which Serve calls on each ingress replica
        return _ingress_app(server)

    # The ingress waits on I/O: it reserves no CPU, so that replicas can take every core.
    ingress = serve.deployment(serve.ingress(ingress_app)(_Ingress), name="FastdraftIngress").options(
        ray_actor_options={"num_cpus": 0, "runtime_env": {"env_vars": REPLICA_ENV}},
        graceful_shutdown_timeout_s=ray_config.graceful_shutdown_timeout_s, max_ongoing_requests=1024)
    return ingress.bind(engine.bind(load_engine, ray_config.num_cpus_per_replica, server.max_queue,
                                    ray_config.stream_interval, server.served_model_name))


class _Ingress:
    """The ingress deployment's class: the routes come from :func:`_ingress_app`; the engine
    handle bound here puts the engine deployment in the application."""

    def __init__(self, engine: DeploymentHandle) -> None:
        self.engine = engine


def serving_engine(model: str, dtype: str, engine_config: EngineConfig) -> LLMEngine:
    """A replica's engine: ``model`` loaded in ``dtype``, sized by ``engine_config``."""
    engine = LLMEngine(load_model(model, dtype=dtype), engine_config)
    engine.structured.prepare()  # a server expects constrained requests: be ready for the first
    return engine


def build_ray_app(args: dict[str, Any]):
    """The application for ``serve run fastdraft.server.ray_app:build_ray_app model=NAME`` and
    ``serve deploy``: ``args`` are the config's ``args`` (``model``, ``dtype``,
    ``served_model_name``, ``num_replicas``, ``num_cpus_per_replica``, ``max_num_seqs``,
    ``max_model_len``, ``max_queue``, ``autoscaling_config``, ``stream_interval``, ``router``)."""
    known = {"model", "dtype", "served_model_name", "num_replicas", "num_cpus_per_replica", "max_num_seqs",
             "max_model_len", "max_queue", "autoscaling_config", "stream_interval", "router"}
    unknown = set(args) - known
    if unknown:
        raise ValueError(f"unknown application args {sorted(unknown)}; known: {sorted(known)}")
    model = args.get("model", DEFAULT_MODEL)
    engine_config = EngineConfig(max_num_seqs=int(args.get("max_num_seqs", 64)),
                                 max_model_len=int(args.get("max_model_len", 4096)))
    server = ServerConfig(served_model_name=args.get("served_model_name", model),
                          max_queue=int(args.get("max_queue", 256)))
    ray_config = RayServeConfig(num_replicas=int(args.get("num_replicas", 1)),
                                num_cpus_per_replica=int(args.get("num_cpus_per_replica", 1)),
                                max_ongoing_requests=engine_config.max_num_seqs,
                                autoscaling=args.get("autoscaling_config"),
                                stream_interval=int(args.get("stream_interval", 1)),
                                router=str(args.get("router", "pow2")))
    load_engine = functools.partial(serving_engine, model, args.get("dtype", "bf16"), engine_config)
    return application(load_engine, server, ray_config)


def run_on_ray(load_engine: Callable[[], LLMEngine], server: ServerConfig, ray_config: RayServeConfig, host: str,
               port: int, address: str | None, app_name: str = "fastdraft") -> None:
    """Start a Ray cluster of its own (``address`` None) or join one, serve the application on
    ``host:port`` until SIGTERM or SIGINT, then delete it (open streams drain). Serve itself is
    shut down only on a cluster this call started: a joined cluster's other applications stay.
    Call it from the main thread, which receives the signals."""
    is_own_cluster = address is None
    # "local" starts a new cluster even where another one runs on this machine.
    ray.init(address="local" if is_own_cluster else address, include_dashboard=False, configure_logging=False)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # after ray.init, whose SIGTERM handler exits at once
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(application(load_engine, server, ray_config), name=app_name, route_prefix="/")
        logger.info("serving %s on Ray at http://%s:%d", server.served_model_name, host, port)
        stop.wait()
        serve.delete(app_name)
        if is_own_cluster:
            serve.shutdown()
    finally:
        ray.shutdown()
