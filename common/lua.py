"""Redis Lua scripts kept in `.lua` files, read once and registered on a client.

A module's scripts live in the `scripts/` folder of its package (package data: pyproject.toml ships
`scripts/*.lua`), and a typed wrapper in the module turns keyword arguments into KEYS and ARGV and the
reply into a dataclass or an Enum: `lua.register(redis, __name__, "submit.lua")` registers
`scripts/submit.lua` beside the calling module.

Scripts share Lua through one mechanism: a line `-- include: NAME.lua`, alone on its line, is replaced
by the text of that file from the same folder. An included file may include others; each file enters
a script once, at its first include (later ones are dropped), so a fragment names the fragments it
needs and a script may list them too. Everything is plain text: what Redis runs is the files'
concatenation.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from importlib.resources import files

from redis.asyncio import Redis
from redis.commands.core import AsyncScript

FOLDER = "scripts"
_INCLUDE = re.compile(r"^-- include: (?P<name>[\w.-]+\.lua)[ \t]*$", re.MULTILINE)


def script_names(package: str) -> list[str]:
    """The `.lua` files of a package's scripts folder."""
    folder = files(package) / FOLDER
    return sorted(entry.name for entry in folder.iterdir() if entry.name.endswith(".lua"))


def source(module: str, name: str) -> str:
    """The text of the script `name` beside `module` (a module's __name__), its includes expanded."""
    return package_source(module.rpartition(".")[0], name)


@functools.cache
def package_source(package: str, name: str) -> str:
    """The text of the package's script `name`, its includes expanded."""
    return _expand(package, name, set())


def _expand(package: str, name: str, seen: set[str]) -> str:
    seen.add(name)
    text = (files(package) / FOLDER / name).read_text(encoding="utf-8")

    def include(match: re.Match[str]) -> str:
        wanted = match["name"]
        return "" if wanted in seen else _expand(package, wanted, seen).rstrip("\n")

    return _INCLUDE.sub(include, text)


def register(redis: Redis, module: str, name: str) -> AsyncScript:
    """The script `name` beside `module`, registered on `redis`: called, it runs by its SHA and loads
    itself when Redis lacks it."""
    return redis.register_script(source(module, name))


def flat_fields(fields: Mapping[str, str]) -> list[str]:
    """A field map as ARGV: how many fields, then name, value, ... (pairs.lua's pairs_at reads it)."""
    out: list[str] = [str(len(fields))]
    for key, value in fields.items():
        out += [key, value]
    return out
