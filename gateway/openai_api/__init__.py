"""The OpenAI-compatible API: chat and text completions, each choice an ortfleet job underneath."""

from __future__ import annotations

from gateway.openai_api import chat, completions

routes = [*chat.routes, *completions.routes]
