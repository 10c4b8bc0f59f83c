from __future__ import annotations

import json
from typing import TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from gateway.errors import ApiError, validation_error

Model = TypeVar("Model", bound=BaseModel)


async def parse_body(request: Request, model: type[Model], *, invalid_status: int = 422) -> Model:
    """The JSON body validated into `model`: 400 for broken JSON, 422 (`invalid_status`) naming the
    first bad field."""
    raw = await request.body()
    try:
        data = json.loads(raw) if raw else None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ApiError(invalid_status, "the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e, invalid_status) from e
