"""LoRA adapters loaded and unloaded while the batcher runs: a loaded adapter gives the tokens it gives
when loaded at start, the session is replaced only where the adapter targets projections the graph was not
rewritten for, and an unloaded adapter's running rows end as they would have while new requests naming it
are refused."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from tests.test_batcher import collect
from tests.test_lora import alone, write_adapter
from worker.engine import Finish, GenerationRequest
from worker.engines.batcher.engine import AdapterTaken, BatchingEngine
from worker.engines.batcher.lora import AdapterMismatch, AdapterUnreadable

PROMPT = "Once upon a time"
TOKENS = 12


@pytest.fixture
def folders(tmp_path: Path, tiny_model: Path) -> dict[str, Path]:
    return {
        "sql": write_adapter(tmp_path / "sql", tiny_model, seed=1, strength=2.0),
        "qv": write_adapter(tmp_path / "qv", tiny_model, seed=2, strength=2.0, modules=["q_proj", "v_proj"]),
        "chat": write_adapter(tmp_path / "chat", tiny_model, seed=3, strength=2.0),
    }


async def test_an_adapter_loaded_at_run_time_gives_the_tokens_it_gives_when_loaded_at_start(
    tiny_model: Path, folders: dict[str, Path], engines: list[BatchingEngine]
) -> None:
    at_start = BatchingEngine(tiny_model, adapters=folders)
    running = BatchingEngine(tiny_model)
    engines += [at_start, running]
    prompt = running.tokenizer.encode(PROMPT)
    base = await alone(running, prompt, None, TOKENS)

    for name in ("qv", "sql", "chat"):
        await running.load_adapter(name, folders[name])

    for name in ("qv", "sql", "chat", None):
        assert await alone(running, prompt, name, TOKENS) == await alone(at_start, prompt, name, TOKENS)
    assert await alone(running, prompt, "sql", TOKENS) != base


async def test_the_session_is_replaced_only_for_an_adapter_on_projections_the_graph_lacks(
    tiny_model: Path, folders: dict[str, Path], engines: list[BatchingEngine]
) -> None:
    engine = BatchingEngine(tiny_model)
    engines.append(engine)
    sessions = [engine._graph.session]

    for name in ("qv", "sql", "chat"):
        await engine.load_adapter(name, folders[name])
        sessions.append(engine._graph.session)

    base, qv, every, same = sessions
    assert qv is not base  # the base graph has no LoRA input: rewritten for q and v
    assert every is not qv  # sql targets every projection
    assert same is every  # chat targets none the graph lacks


async def test_an_adapter_that_does_not_fit_or_is_taken_is_refused_and_the_engine_serves_on(
    tiny_model: Path, folders: dict[str, Path], engines: list[BatchingEngine], tmp_path: Path
) -> None:
    engine = BatchingEngine(tiny_model, adapters={"sql": folders["sql"]})
    engines.append(engine)
    prompt = engine.tokenizer.encode(PROMPT)
    before = await alone(engine, prompt, "sql", TOKENS)
    wrong = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": np.zeros((4, 7), np.float32)}
    misfit = write_adapter(tmp_path / "misfit", tiny_model, tensors=wrong)
    (tmp_path / "empty").mkdir()

    with pytest.raises(AdapterMismatch, match=r"q_proj.*\[4, 7\]"):
        await engine.load_adapter("misfit", misfit)
    with pytest.raises(AdapterUnreadable, match="No such file"):
        await engine.load_adapter("nothing", tmp_path / "empty")
    with pytest.raises(AdapterTaken, match="'sql' is already loaded"):
        await engine.load_adapter("sql", folders["chat"])

    assert engine.adapters is not None and engine.adapters.names == ["sql"]
    assert await alone(engine, prompt, "sql", TOKENS) == before


async def test_an_unloaded_adapters_running_rows_end_as_they_would_and_new_ones_are_refused(
    tiny_model: Path, folders: dict[str, Path], engines: list[BatchingEngine]
) -> None:
    engine = BatchingEngine(tiny_model, adapters=folders, step_delay_s=0.005)
    engines.append(engine)
    prompt = engine.tokenizer.encode(PROMPT)
    expected = await alone(engine, prompt, "sql", 48)
    [running] = engine.submit([GenerationRequest(prompt, 48, adapter="sql")])
    first = await running.updates.get()
    assert first.token_ids  # the row runs

    await engine.unload_adapter("sql")
    refused = await collect(engine.submit([GenerationRequest(prompt, 4, adapter="sql")])[0])
    rest = await collect(running)

    assert refused.finish is Finish.error and "'sql' was unloaded" in (refused.error or "")
    assert first.token_ids + rest.tokens == expected and rest.finish is Finish.length
    await asyncio.gather(*engine._retirements)  # its rows ended: it leaves the layouts
    assert engine.adapters is not None and sorted(engine.adapters.names) == ["chat", "qv"]
    prefixes = engine._rows.prefixes
    assert prefixes is not None and not any("lora:sql" in e.scope for e in prefixes._entries.values())
    with pytest.raises(KeyError):
        await engine.unload_adapter("sql")
    await engine.load_adapter("sql", folders["sql"])  # and loads again, as new
    assert await alone(engine, prompt, "sql", 48) == expected


async def test_rows_running_while_an_adapter_is_loaded_with_a_new_session_keep_their_tokens(
    tiny_model: Path, folders: dict[str, Path], engines: list[BatchingEngine]
) -> None:
    engine = BatchingEngine(tiny_model, adapters={"qv": folders["qv"]}, step_delay_s=0.005)
    engines.append(engine)
    prompt = engine.tokenizer.encode(PROMPT)
    expected = {name: await alone(engine, prompt, name, 48) for name in ("qv", None)}
    streams = engine.submit([GenerationRequest(prompt, 48, adapter=name) for name in expected])
    firsts = [await stream.updates.get() for stream in streams]
    assert all(first.token_ids for first in firsts)  # both rows run
    session = engine._graph.session

    await engine.load_adapter("sql", folders["sql"])  # every projection: a new session, mid-generation

    assert engine._graph.session is not session
    for name, stream, first in zip(expected, streams, firsts, strict=True):
        rest = await collect(stream)
        assert first.token_ids + rest.tokens == expected[name], name
