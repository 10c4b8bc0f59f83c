"""`python -m gateway`: serve the gateway with uvicorn."""

from __future__ import annotations

import argparse
import logging

import uvicorn

from common.settings import GatewaySettings
from gateway.app import build_app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="ortfleet-gateway", description=__doc__)
    parser.add_argument("--host", help="listen address (ORTFLEET_HOST, default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="listen port (ORTFLEET_PORT, default 8000)")
    parser.add_argument("--redis-url", help="Redis URL (ORTFLEET_REDIS_URL)")
    args = parser.parse_args(argv)
    overrides = {"host": args.host, "port": args.port, "redis_url": args.redis_url}
    settings = GatewaySettings(**{k: v for k, v in overrides.items() if v is not None})
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    uvicorn.run(
        build_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=False,
        timeout_graceful_shutdown=5,
    )
