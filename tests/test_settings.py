"""Every knob is described in code (docs/configuration.md is generated from the descriptions)."""

from __future__ import annotations

import pytest
from pydantic_settings import BaseSettings

from common.gateway_settings import GatewaySettings
from common.redis_url import mask_url
from common.settings import FleetSettings
from common.worker_settings import WorkerSettings

pytestmark = pytest.mark.unit  # no process: the first tier

ALL_SETTINGS: list[type[BaseSettings]] = [FleetSettings, GatewaySettings, WorkerSettings]


@pytest.mark.parametrize("settings", ALL_SETTINGS, ids=lambda s: s.__name__)
def test_every_setting_has_a_description(settings: type[BaseSettings]) -> None:
    for name, field in settings.model_fields.items():
        assert field.description, f"{settings.__name__}.{name} has no description"


def test_settings_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORTFLEET_MAX_QUEUED_JOBS", "7")
    monkeypatch.setenv("ORTFLEET_DEVICE", "cuda:1")
    assert GatewaySettings().max_queued_jobs == 7
    assert WorkerSettings().device == "cuda:1"


def test_a_password_in_a_redis_url_is_masked() -> None:
    assert mask_url("redis://:s3cret@redis.internal:6380/2") == "redis://:****@redis.internal:6380/2"
    assert mask_url("rediss://app:s3cret@host/0") == "rediss://app:****@host/0"
    assert mask_url("redis://localhost:6379/0") == "redis://localhost:6379/0"
