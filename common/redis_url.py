from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit


def mask_url(url: str) -> str:
    """The URL with its password replaced by stars, fit for logs and `ortfleet config`."""
    parts = urlsplit(url)
    if not parts.password:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    if parts.port:
        host = f"{host}:{parts.port}"
    netloc = f"{user}:****@{host}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
