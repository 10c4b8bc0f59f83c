"""Entries of a job's Redis stream, and how they turn into SSE events."""

from __future__ import annotations

import json
from typing import Any

from common.wire import EventType, JobStatus

TOKEN = EventType.token.value  # the type of a token entry (an enum's .value is slow on hot paths)


def status_entry(status: JobStatus, **extra: Any) -> dict[str, str]:
    fields = {"type": EventType.status.value, "status": status.value}
    fields.update({k: str(v) for k, v in extra.items() if v is not None})
    return fields


def token_entry(
    text: str, token_ids: list[int], index: int, logprobs: list[dict[str, Any]] | None = None
) -> dict[str, str]:
    """`logprobs`, when the job asked for them: one entry per token id, in OpenAI's chat shape
    ({token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]})."""
    fields = {
        "type": TOKEN,
        "text": text,
        "ids": str(token_ids[0]) if len(token_ids) == 1 else ",".join(map(str, token_ids)),  # one: most steps
        "index": str(index),
    }
    if logprobs is not None:
        fields["logprobs"] = json.dumps(logprobs, ensure_ascii=False, separators=(",", ":"))
    return fields


def merge_token_entries(entries: list[dict[str, str]]) -> list[dict[str, str]]:
    """`entries` with each run of consecutive token entries of a job (each starting where the one before
    ends) made one token entry: its text and ids those of the run, in order, and its index the run's
    first. A reader gets the same tokens and text in fewer entries; the entries given are left as they
    are. Entries with log-probabilities stay apart: each is large already (up to 2 KB a token), and a
    joined one would pass the size a stream packs its entries in, costing Redis more memory, not less."""
    merged: list[dict[str, str]] = []
    run: list[dict[str, str]] = []  # the current run of plain token entries
    end = -1  # the index where the run's tokens end
    for entry in entries:
        if not _plain_token(entry):
            if run:
                merged.append(_one_entry(run))
                run = []
            merged.append(entry)
            continue
        index = int(entry["index"])
        if run and index != end:
            merged.append(_one_entry(run))
            run = []
        run.append(entry)
        end = index + entry_token_count(entry)
    if run:
        merged.append(_one_entry(run))
    return merged


def _plain_token(entry: dict[str, str]) -> bool:
    """A token entry with nothing but its text, ids and index (no log-probabilities)."""
    return len(entry) == 4 and entry.get("type") == TOKEN and "logprobs" not in entry  # token_entry's fields


def _one_entry(run: list[dict[str, str]]) -> dict[str, str]:
    if len(run) == 1:
        return run[0]
    return {
        "type": TOKEN,
        "text": "".join(entry["text"] for entry in run),
        "ids": ",".join(entry["ids"] for entry in run if entry["ids"]),
        "index": run[0]["index"],
    }


def prompt_entry(token_ids: list[int], logprobs: list[dict[str, Any]]) -> dict[str, str]:
    """The prompt's tokens and their log-probabilities (token_entry's shape; the first token's logprob
    and top_logprobs are null: nothing comes before it)."""
    return {
        "type": EventType.prompt.value,
        "ids": str(token_ids[0]) if len(token_ids) == 1 else ",".join(map(str, token_ids)),  # one: most steps
        "logprobs": json.dumps(logprobs, ensure_ascii=False, separators=(",", ":")),
    }


def entry_logprobs(fields: dict[str, str]) -> list[dict[str, Any]] | None:
    """A token entry's log-probabilities (see token_entry); None when the job did not ask for them."""
    raw = fields.get("logprobs")
    return json.loads(raw) if raw else None


def closed_early_of(fields: dict[str, str]) -> bool | None:
    """A done event's `closed_early` (see done_entry): True, False, or None when it has none."""
    return {"true": True, "false": False}.get(fields.get("closed_early", ""))


def done_entry(
    status: JobStatus,
    finish_reason: str | None,
    usage_json: str | None,
    *,
    closed_early: bool | None = None,
) -> dict[str, str]:
    fields = {"type": EventType.done.value, "status": status.value}
    if finish_reason:
        fields["finish_reason"] = finish_reason
    if closed_early is not None:
        fields["closed_early"] = "true" if closed_early else "false"
    if usage_json:
        fields["usage"] = usage_json
    return fields


def error_entry(status: JobStatus, message: str, code: str | None = None) -> dict[str, str]:
    fields = {"type": EventType.error.value, "status": status.value, "message": message}
    if code:
        fields["code"] = code
    return fields


def is_final(fields: dict[str, str]) -> bool:
    return fields.get("type") in (EventType.done.value, EventType.error.value)


def is_failure(fields: dict[str, str]) -> bool:
    """A final entry that ends the job failed: an error entry, or a done entry whose status says failed
    (how older workers ended an engine failure), so that no reader takes a failure for a success."""
    kind = fields.get("type")
    return kind == EventType.error.value or (
        kind == EventType.done.value and fields.get("status") == JobStatus.failed.value
    )


def entry_token_ids(fields: dict[str, str]) -> list[int]:
    ids = fields.get("ids", "")
    return [int(i) for i in ids.split(",")] if ids else []


def entry_token_count(fields: dict[str, str]) -> int:
    """How many token ids the entry carries (entry_token_ids' length, without parsing them)."""
    ids = fields.get("ids", "")
    return ids.count(",") + 1 if ids else 0


def event_payload(fields: dict[str, str]) -> dict[str, Any]:
    """The JSON an SSE client receives for one stream entry."""
    payload: dict[str, Any] = {}
    for key, value in fields.items():
        if key == "ids":
            payload["token_ids"] = entry_token_ids(fields)
        elif key in ("index", "attempt"):
            payload[key] = int(value)
        elif key in ("usage", "logprobs"):
            payload[key] = json.loads(value)
        else:
            payload[key] = value
    return payload
