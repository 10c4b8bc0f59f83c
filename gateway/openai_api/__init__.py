"""The OpenAI-compatible API: chat and text completions, each choice an ortfleet job underneath, and the
list of served models."""

from __future__ import annotations

from gateway.openai_api import chat, completions, models

routes = [*chat.routes, *completions.routes, *models.routes]
