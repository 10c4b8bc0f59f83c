"""`python -m gateway`: serve the gateway with uvicorn."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import ipaddress
import logging
import resource
import socket
import sys
import time
from collections.abc import Callable
from types import FrameType

import uvicorn
from starlette.applications import Starlette
from uvicorn.config import STARTUP_FAILURE

from common.aio import wait_set
from common.collector import calm_garbage_collector
from common.gateway_settings import GatewaySettings
from common.redis_client import RedisRefused, RedisUnreachable, check_redis
from common.redis_url import URL_FORMAT, mask_url
from common.startup import (
    CannotStart,
    check_store_config,
    debug_wanted,
    exit_with,
    log_to_stderr,
    settings_or_exit,
    store_label,
)
from common.store_watch import quiet_out_of_memory_lines
from gateway.app import build_app
from gateway.http_protocol import guarded_protocol
from gateway.metrics import GatewayMetrics

PROG = "ortfleet-gateway"
FLAGS = {
    "host": "--host",
    "port": "--port",
    "redis_url": "--redis-url",
    "allow_anonymous": "--allow-anonymous",
}

logger = logging.getLogger("gateway")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def raise_open_file_limit() -> int:
    """Raises this process's open-file limit to the most it may have: each SSE client and each
    keep-alive connection holds a socket, and distributions often start processes at 1,024."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


GC_YOUNG_THRESHOLD = 50_000  # allocations between collections of the youngest generation (Python: 700)
# (a stream's objects: a wait, a timer, a buffer each, thousands of streams open at once)


def time_garbage_collections(observe: Callable[[int, float], None]) -> None:
    """Calls `observe(generation, seconds)` after each garbage collection of this process."""
    started = 0.0

    def on_collection(phase: str, info: dict[str, int]) -> None:
        nonlocal started
        if phase == "start":
            started = time.perf_counter()
        else:
            observe(info["generation"], time.perf_counter() - started)

    gc.callbacks.append(on_collection)


class CalmServer(uvicorn.Server):
    """uvicorn's server, waking once a second while idle instead of ten times.

    uvicorn's main loop sleeps 0.1 s between looks at its exit flag, refreshing the Date header every
    tenth look: an idle gateway woke ten times a second for it, each wake costing CPU on a shared host.
    This loop refreshes the header once a second, as before, and a signal wakes it at once, so a
    SIGTERM or Ctrl-C stops the gateway as quickly as before."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None] | None = None) -> None:
        super().__init__(config)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._exit_requested = asyncio.Event()
        self._on_exit = on_exit

    async def main_loop(self) -> None:
        self._loop = asyncio.get_running_loop()
        counter = 0  # uvicorn refreshes the Date header on ticks that are multiples of 10
        while not await self.on_tick(counter):
            counter = (counter + 10) % 864_000
            await wait_set(self._exit_requested, 1.0)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        for listener in sockets or []:  # uvicorn says where it listens only for the host and port it binds
            host, port = listener.getsockname()[:2]
            logger.info("listening on http://%s:%d", f"[{host}]" if ":" in host else host, port)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._exit_requested.set)
            if self._on_exit is not None:
                self._loop.call_soon_threadsafe(self._on_exit)


def serve(
    app: Callable[..., object],
    listener: socket.socket,
    on_exit: Callable[[], None] | None = None,
    **options: object,
) -> None:
    """Serves the app on the bound socket as `uvicorn.run` does (one process, no reload), on the calm
    server; `on_exit` is called in the event loop once the server is told to stop."""
    config = uvicorn.Config(app, **options)  # type: ignore[arg-type]
    server = CalmServer(config, on_exit)
    with contextlib.suppress(KeyboardInterrupt):
        server.run(sockets=[listener])
    if not server.started:
        sys.exit(STARTUP_FAILURE)


def bind_listener(host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    """The gateway's socket, bound before anything else starts, so that a port in use ends the process at
    once. It listens only once the app has started (uvicorn's listen): until then connections are refused,
    as before, and a launcher waiting for the port waits for a gateway that serves."""
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:  # several gateway processes share the port (GatewaySettings.reuse_port)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        listener.bind((host.strip("[]"), port))
    except OSError as e:
        listener.close()
        where = f"[{host.strip('[]')}]:{port}" if ":" in host else f"{host}:{port}"
        raise CannotStart(
            f"cannot listen on {where}: {e.strerror or e}; stop what holds it or give another port "
            "(--port, ORTFLEET_PORT)"
        ) from e
    return listener


def check_redis_urls(settings: GatewaySettings) -> None:
    """CannotStart for a Redis that refuses its URL (a password wanted or wrong: a mistake in the
    configuration), evicts keys (unless allowed), is a Redis Cluster node where the shard map lists a
    whole server, or is not a cluster where the map gives a model stores on one. An unreachable one is
    only logged: the gateway starts, and answers 503 on /readyz until Redis is back, as a load balancer
    in front expects of it."""
    home = settings.redis_url.get_secret_value()
    urls = {home: ("ORTFLEET_REDIS_URL (or --redis-url)", "")}
    for model, stores in settings.redis_shards.items():
        if isinstance(stores, int):
            continue
        for i, store in enumerate(stores):
            setting, named = f"ORTFLEET_REDIS_SHARDS[{model}]", ""
            if len(stores) > 1:  # named by its position, as ORTFLEET_STORE counts them
                setting, named = f"{setting}[{i}]", f"{store_label(model, i, len(stores))}: "
            urls.setdefault(store.get_secret_value(), (setting, named))
    for url, (setting, named) in urls.items():
        try:
            config = check_redis(url, settings.redis_connect_timeout_s, allow_cluster=url == home)
        except RedisRefused as e:
            raise CannotStart(f"{named}{e}; correct the URL in {setting}: {URL_FORMAT}") from e
        except RedisUnreachable as e:
            logger.warning("%s%s; starting anyway: /readyz answers 503 until it is reachable", named, e)
            continue
        if url == home and settings.cluster_stores and not config.cluster:
            raise CannotStart(
                f"ORTFLEET_REDIS_SHARDS gives models stores on a Redis Cluster, but the Redis at "
                f"{mask_url(url)} ({setting}) is not a cluster node: give the cluster as ORTFLEET_REDIS_URL, "
                "or list each model's Redis servers by URL"
            )
        try:
            check_store_config(config, mask_url(url), settings.allow_evicting_redis)
        except CannotStart as e:
            raise CannotStart(f"{named}{e}") from e


def stopping(app: Starlette) -> None:
    """The gateway was told to stop: what waits for a job answers now (see AppState.stopping)."""
    state = getattr(app.state, "ortfleet", None)
    if state is not None:
        state.stopping.set()


def check_exposure(settings: GatewaySettings) -> None:
    keys_configured = settings.api_keys is not None or settings.api_keys_file is not None
    if not is_loopback(settings.host) and not keys_configured and not settings.allow_anonymous:
        raise CannotStart(
            f"refusing to listen on {settings.host} with no API keys: anyone who can reach it could read "
            "every job. Configure keys (ORTFLEET_API_KEYS_FILE, see `ortfleet keys create`) or pass "
            "--allow-anonymous to accept that."
        )


def build_parser() -> argparse.ArgumentParser:
    """The gateway's command line; each flag overrides the setting of the same name."""
    parser = argparse.ArgumentParser(prog="ortfleet-gateway", description=__doc__)
    parser.add_argument("--host", help="listen address (ORTFLEET_HOST, default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="listen port (ORTFLEET_PORT, default 8000)")
    parser.add_argument("--redis-url", help="Redis URL (ORTFLEET_REDIS_URL)")
    parser.add_argument(
        "--allow-anonymous",
        action="store_true",
        default=None,
        help="listen on a non-loopback address without API keys (ORTFLEET_ALLOW_ANONYMOUS)",
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    settings = settings_or_exit(PROG, GatewaySettings, args, FLAGS)
    log_to_stderr(settings)
    quiet_out_of_memory_lines()
    try:
        check_exposure(settings)
        listener = bind_listener(settings.host, settings.port, reuse_port=settings.reuse_port)
        check_redis_urls(settings)
    except CannotStart as e:
        exit_with(PROG, [str(e)], e, debug=debug_wanted(settings))
    open_files = raise_open_file_limit()
    logger.info("open-file limit %s: at most about that many client connections at once", open_files)
    gateway_metrics = GatewayMetrics(per_key=settings.metrics_per_key)
    protocol = guarded_protocol(
        settings.max_header_bytes,
        settings.header_timeout_s,
        settings.body_timeout_s,
        lambda reason: gateway_metrics.rejected.labels(reason).inc(),
    )
    app = build_app(settings, gateway_metrics)
    pauses = [gateway_metrics.gc_pauses.labels(str(generation)) for generation in range(3)]
    time_garbage_collections(lambda generation, seconds: pauses[generation].observe(seconds))
    # its pauses were most of the relay's latency past 50 ms: a full collection walks every open stream
    calm_garbage_collector(GC_YOUNG_THRESHOLD)
    serve(
        app,
        listener,
        lambda: stopping(app),
        http=protocol,
        log_level=settings.log_level,
        access_log=False,
        timeout_keep_alive=settings.keep_alive_s,
        timeout_graceful_shutdown=5,
        proxy_headers=False,  # nothing reads the client address; one frame less per open request
    )
