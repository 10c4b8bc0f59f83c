"""API keys: stored only as SHA-256 hashes in a keys file (or given in ORTFLEET_API_KEYS), compared in
constant time, each with optional limits of its own."""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

KEY_PREFIX = "ofk_"
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class ApiKeyError(ValueError):
    pass


@dataclass(frozen=True)
class ApiKey:
    name: str
    sha256: str
    created_at: float = 0.0
    max_concurrent_jobs: int | None = None
    requests_per_minute: int | None = None
    weight: float = 1.0  # its share of the fleet's tokens against other keys of the same class
    max_class: str = "interactive"  # the highest priority class its jobs may take


@dataclass(frozen=True)
class Principal:
    """Who is calling: the key's name owns the jobs it creates ("" when keys are off)."""

    name: str
    max_concurrent_jobs: int | None = None
    requests_per_minute: int | None = None
    weight: float = 1.0
    max_class: str = "interactive"
    max_prompt_tokens_in_flight: int | None = None  # estimated prompt tokens of its active jobs
    tokenize_chars_per_s: int | None = None


ANONYMOUS = Principal("")


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


CLASSES = ("interactive", "batch")  # highest first, as common.wire.PRIORITY_ORDER
MAX_WEIGHT = 1000.0


def check_weight(weight: float) -> float:
    if not 0 < weight <= MAX_WEIGHT:
        raise ApiKeyError(f"weight: {weight:g} must be above 0 and at most {MAX_WEIGHT:g}")
    return weight


def check_class(max_class: str) -> str:
    if max_class not in CLASSES:
        raise ApiKeyError(f"max class: {max_class!r} is not one of {', '.join(CLASSES)}")
    return max_class


def check_name(name: str) -> str:
    if not NAME.match(name):
        raise ApiKeyError(
            f"key name {name!r}: use 1-64 letters, digits, '_', '.' or '-', starting with a letter or digit"
        )
    return name


@dataclass
class KeyFile:
    """The keys file: JSON with one entry per key (its name, hash and limits); never the key itself."""

    path: Path
    keys: list[ApiKey] = field(default_factory=list)

    @classmethod
    def load(cls, path: Path) -> KeyFile:
        if not path.exists():
            return cls(path)
        try:
            data = json.loads(path.read_text())
            keys = [ApiKey(**entry) for entry in data.get("keys", [])]
            for key in keys:
                check_weight(key.weight)
                check_class(key.max_class)
        except (ValueError, TypeError) as e:
            raise ApiKeyError(f"{path} is not an ortfleet keys file: {e}") from e
        return cls(path, keys)

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps({"keys": [asdict(k) for k in self.keys]}, indent=2) + "\n"
        fd, staged = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.")
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.chmod(staged, 0o600)
        os.replace(staged, self.path)

    def create(
        self,
        name: str,
        *,
        max_concurrent_jobs: int | None,
        requests_per_minute: int | None,
        weight: float = 1.0,
        max_class: str = "interactive",
    ) -> str:
        """Add a key and return it: the only time it is ever shown."""
        check_name(name)
        check_weight(weight)
        check_class(max_class)
        if any(k.name == name for k in self.keys):
            raise ApiKeyError(f"a key named {name!r} exists already; revoke it first or pick another name")
        key = new_key()
        self.keys.append(
            ApiKey(
                name, digest(key), time.time(), max_concurrent_jobs, requests_per_minute, weight, max_class
            )
        )
        return key

    def revoke(self, name: str) -> None:
        kept = [k for k in self.keys if k.name != name]
        if len(kept) == len(self.keys):
            raise ApiKeyError(f"no key named {name!r}")
        self.keys = kept


def parse_env_keys(raw: str) -> list[ApiKey]:
    """ORTFLEET_API_KEYS: comma-separated NAME:KEY[:WEIGHT[:MAX_CLASS]] (a bare KEY is named key-1, ...)."""
    keys: list[ApiKey] = []
    for index, item in enumerate(part.strip() for part in raw.split(",")):
        if not item:
            continue
        parts = item.split(":")
        if len(parts) == 1:
            parts = [f"key-{index + 1}", item]
        if len(parts) > 4:
            raise ApiKeyError(f"ORTFLEET_API_KEYS: {parts[0]!r} is not NAME:KEY[:WEIGHT[:MAX_CLASS]]")
        name, key = parts[0], parts[1]
        if len(key) < 16:
            raise ApiKeyError(f"ORTFLEET_API_KEYS: the key named {name!r} is shorter than 16 characters")
        try:
            weight = check_weight(float(parts[2])) if len(parts) > 2 else 1.0
            max_class = check_class(parts[3]) if len(parts) > 3 else "interactive"
        except ValueError as e:
            raise ApiKeyError(f"ORTFLEET_API_KEYS: the key named {name!r}: {e}") from e
        keys.append(ApiKey(check_name(name), digest(key), weight=weight, max_class=max_class))
    return keys


class KeyRing:
    """The keys a gateway accepts; the keys file is re-read when it changes: revoking needs no restart."""

    def __init__(self, env_keys: list[ApiKey], path: Path | None, reload_every_s: float = 1.0) -> None:
        self._env_keys = env_keys
        self._path = path
        self._reload_every_s = reload_every_s
        self._checked_at = 0.0
        self._mtime: float | None = None
        self._keys: list[ApiKey] = list(env_keys)
        self._refresh(force=True)

    @property
    def enabled(self) -> bool:
        return bool(self._env_keys) or self._path is not None

    def authenticate(self, presented: str) -> ApiKey | None:
        self._refresh()
        wanted = digest(presented)
        found = None
        for key in self._keys:  # every hash is compared, match or not: no timing signal
            if secrets.compare_digest(key.sha256, wanted):
                found = key
        return found

    def named(self, name: str) -> ApiKey | None:
        """The key of that name, while it is not revoked."""
        self._refresh()
        return next((key for key in self._keys if key.name == name), None)

    def _refresh(self, force: bool = False) -> None:
        now = time.monotonic()
        if self._path is None or (not force and now - self._checked_at < self._reload_every_s):
            return
        self._checked_at = now
        try:
            mtime = self._path.stat().st_mtime
        except FileNotFoundError:
            mtime = None
        if mtime != self._mtime or force:
            self._mtime = mtime
            self._keys = self._env_keys + KeyFile.load(self._path).keys
