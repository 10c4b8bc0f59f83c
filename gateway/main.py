"""`python -m gateway`: serve the gateway with uvicorn."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import sys

import uvicorn

from common.settings import GatewaySettings
from gateway.app import build_app
from gateway.http_protocol import guarded_protocol
from gateway.metrics import GatewayMetrics


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def main(argv: list[str] | None = None) -> None:
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
    args = parser.parse_args(argv)
    overrides = {
        "host": args.host,
        "port": args.port,
        "redis_url": args.redis_url,
        "allow_anonymous": args.allow_anonymous,
    }
    settings = GatewaySettings(**{k: v for k, v in overrides.items() if v is not None})
    keys_configured = settings.api_keys is not None or settings.api_keys_file is not None
    if not is_loopback(settings.host) and not keys_configured and not settings.allow_anonymous:
        sys.exit(
            f"ortfleet-gateway: refusing to listen on {settings.host} with no API keys: anyone who can reach "
            "it could read every job. Configure keys (ORTFLEET_API_KEYS_FILE, see `ortfleet keys create`) "
            "or pass --allow-anonymous to accept that."
        )
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    gateway_metrics = GatewayMetrics()
    protocol = guarded_protocol(
        settings.max_header_bytes,
        settings.header_timeout_s,
        settings.body_timeout_s,
        lambda reason: gateway_metrics.rejected.labels(reason).inc(),
    )
    uvicorn.run(
        build_app(settings, gateway_metrics),
        http=protocol,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=False,
        timeout_graceful_shutdown=5,
    )
