"""`GET /metrics`: the gateway's Prometheus metrics, with the fleet figures read from Redis at scrape time."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.operations import STRING, Operation, Reply
from gateway.state import app_state


@Operation(
    "Prometheus metrics of this gateway, and queue depth per model from Redis",
    responses={200: Reply("Prometheus text exposition format", STRING, media_type="text/plain")},
)
async def metrics_endpoint(request: Request) -> Response:
    state = app_state(request)
    await state.metrics.refresh(state.shards, state.fleet)
    body = generate_latest(state.metrics.registry)
    return Response(body, headers={"Content-Type": CONTENT_TYPE_LATEST})


routes = [Route("/metrics", metrics_endpoint, methods=["GET"])]
