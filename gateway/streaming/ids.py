"""A job stream's entries and their ids, as Redis gives them and as a client sends them back
(`after`, Last-Event-ID)."""

from __future__ import annotations

import re

EntryId = tuple[int, int]  # milliseconds, sequence: ordered as Redis orders them
Entry = tuple[str, dict[str, str]]  # entry id, fields
KeyedEntry = tuple[str, str, dict[str, str]]  # stream key, entry id, fields

_ENTRY_ID = re.compile(r"([0-9]{1,20})-([0-9]{1,20})", re.ASCII)
_MAX_PART = 2**64 - 1


def parse_id(entry_id: str) -> EntryId:
    """An id Redis gave (or one `valid_entry_id` passed) as a pair that compares as Redis does."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def valid_entry_id(text: str) -> bool:
    """A Redis stream id as `after` or Last-Event-ID may give it: ASCII digits, each part below 2**64."""
    match = _ENTRY_ID.fullmatch(text)
    return match is not None and all(int(part) <= _MAX_PART for part in match.groups())
