"""The paged CUDA model run by ortfleet (worker/engines/paged/model.py) on a card: whether its tokens are
og.Engine's, and what one run costs.

`python -m ortfleet.bench.paged_model [--model DIR] [--tokens N] [--block-size B] [--blocks K]
[--cuda-graphs both|on|off] --json FILE` runs, on cuda:0, each stage in turn and writes FILE after each (a
stage that fails records its error and the next one runs):

1. **alone**: each of the prompts greedily on its own (its prompt in one run, then one run a token), end of
   sequence masked, N tokens;
2. **together**: the same prompts in one batch whose runs mix a chunked prefill (the first prompt in two
   chunks), whole prefills and decoding rows, rows starting at different runs: the tokens of each row
   against its tokens alone;
3. **decode runs**: ms a pure-decode run of 1, 2, 16, 64, 128 and 256 rows at 128 tokens of context,
   with the logits left on the card, median of 20 after 3 unmeasured;
4. **CUDA graphs** (`--cuda-graphs`, both by default: the model's session captures graphs, and stages 1
   to 3 run eagerly, then again with each pure-decode run replaying its bucket's graph, paged/model.py):
   the tokens alone and together with graphs against the eager ones, the decode runs with graphs
   (`_graphs`), whether the run of 256 rows took under 2 ms, and the buckets captured;
5. **og.Engine**: the same prompt ids, greedy, N tokens (`min_new_tokens` = N), through the engine a GPU
   worker runs today, in a child process once the pool above is freed, with eager steps: its tokens
   against ours alone; then with CUDA graphs (ORTFLEET_CUDA_GRAPH=on): its tokens against its eager ones.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import time
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from ortfleet.bench.backends import PROMPTS
from ortfleet.bench.machine import describe
from worker.engines.paged.model import PackedRow, PagedModel

DECODE_ROWS = (1, 2, 16, 64, 128, 256)
GRAPH_TARGET_MS = 2.0  # issue 67: a decode run of 256 rows, replayed


def prompt_ids(model_dir: Path, count: int = 4) -> list[list[int]]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return [tokenizer.encode(PROMPTS[i % len(PROMPTS)] * (1 + i)).ids for i in range(count)]


class Greedy:
    """Rows of one batch: each its blocks, its tokens so far and its greedy picks, end of sequence masked."""

    def __init__(self, model: PagedModel) -> None:
        self.model = model
        self.eos = sorted(model.shape.eos)
        self.next_block = 0

    def blocks(self, tokens: int) -> list[int]:
        count = -(-tokens // self.model.block_size)
        first, self.next_block = self.next_block, self.next_block + count
        if self.next_block > self.model.blocks:
            raise RuntimeError(f"the pool of {self.model.blocks} blocks is too small for this stage")
        return list(range(first, first + count))

    def pick(self, logits: np.ndarray) -> list[int]:
        logits = logits.copy()
        logits[:, self.eos] = -np.inf
        return [int(t) for t in logits.argmax(axis=1)]


def alone(model: PagedModel, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    out = []
    greedy = Greedy(model)
    for ids in prompts:
        table = greedy.blocks(len(ids) + tokens)
        [token] = greedy.pick(model.returned_logits([PackedRow(ids, 0, table)]))
        generated = [token]
        while len(generated) < tokens:
            past = len(ids) + len(generated) - 1
            [token] = greedy.pick(model.returned_logits([PackedRow([generated[-1]], past, table)]))
            generated.append(token)
        out.append(generated)
    return out


def together(model: PagedModel, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """Run 1: the first prompt's first half. Run 2: its second half, and the second prompt whole. Run 3:
    the two decode, the other prompts prefill whole. Then every row decodes together."""
    greedy = Greedy(model)
    tables = [greedy.blocks(len(ids) + tokens) for ids in prompts]
    generated: list[list[int]] = [[] for _ in prompts]
    half = len(prompts[0]) // 2

    def step(rows: list[tuple[int, PackedRow]]) -> None:
        picks = greedy.pick(model.returned_logits([row for _, row in rows]))
        for (index, row), token in zip(rows, picks, strict=True):
            if row.past + len(row.tokens) >= len(prompts[index]):  # a whole prompt is in: its pick counts
                generated[index].append(token)

    def decoding(index: int) -> tuple[int, PackedRow]:
        past = len(prompts[index]) + len(generated[index]) - 1
        return index, PackedRow([generated[index][-1]], past, tables[index])

    step([(0, PackedRow(prompts[0][:half], 0, tables[0]))])
    step([(0, PackedRow(prompts[0][half:], half, tables[0])), (1, PackedRow(prompts[1], 0, tables[1]))])
    prefills = [(i, PackedRow(prompts[i], 0, tables[i])) for i in range(2, len(prompts))]
    step([decoding(0), *prefills, decoding(1)])
    while any(len(g) < tokens for g in generated):
        step([decoding(i) for i in range(len(prompts)) if len(generated[i]) < tokens])
    return generated


def og_engine_tokens(
    model_dir: Path, prompts: list[list[int]], tokens: int, cuda_graph: str
) -> list[list[int]]:
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as child:
        return child.submit(_og_engine_tokens, model_dir, prompts, tokens, cuda_graph).result()


def _og_engine_tokens(
    model_dir: Path, prompts: list[list[int]], tokens: int, cuda_graph: str
) -> list[list[int]]:
    os.environ["ORTFLEET_CUDA_GRAPH"] = cuda_graph
    from common import aio
    from ortfleet.bench.backends import open_worker_engine
    from worker.engine import GenerationRequest

    engine = open_worker_engine(model_dir, "cuda")

    async def generate() -> list[list[int]]:
        streams = engine.submit([GenerationRequest(ids, tokens, min_new_tokens=tokens) for ids in prompts])
        out = []
        for stream in streams:
            ids: list[int] = []
            while True:
                update = await stream.updates.get()
                ids += update.token_ids
                if update.finish is not None:
                    if update.error:
                        raise RuntimeError(update.error)
                    break
            out.append(ids)
        return out

    try:
        return aio.run(generate())
    finally:
        engine.close()


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict[str, Any]:
    """Rows equal, and where each row first differs (None: never)."""
    first = [
        next(
            (i for i, (a, b) in enumerate(zip(x, y, strict=False)) if a != b),
            None if len(x) == len(y) else min(len(x), len(y)),
        )
        for x, y in zip(ours, theirs, strict=True)
    ]
    return {"rows_equal": sum(f is None for f in first), "rows": len(ours), "first_difference": first}


@contextmanager
def eager(model: PagedModel) -> Iterator[PagedModel]:
    """The model with every run eager, its CUDA graphs kept for afterwards."""
    graphs, model.graphs = model.graphs, None
    try:
        yield model
    finally:
        model.graphs = graphs


def decode_runs(model: PagedModel, rows: int, context: int = 128, repeat: int = 20) -> float:
    per_row = -(-(context + 1) // model.block_size)
    if rows * per_row > model.blocks:
        raise RuntimeError(f"{rows} rows of {context} tokens need {rows * per_row} blocks")
    batch = [PackedRow([7], context, list(range(r * per_row, (r + 1) * per_row))) for r in range(rows)]
    times = []
    for attempt in range(repeat + 3):
        start = time.perf_counter()
        model.run(batch)
        if attempt >= 3:
            times.append((time.perf_counter() - start) * 1000)
    return round(statistics.median(times), 3)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ortfleet.bench.paged_model", description=__doc__)
    parser.add_argument("--model", type=Path, help="a paged CUDA model folder (default: the default model's)")
    parser.add_argument("--tokens", type=int, default=32, help="tokens of each greedy row (default 32)")
    parser.add_argument("--block-size", type=int, default=256, help="tokens of a KV block (default 256)")
    parser.add_argument("--blocks", type=int, default=512, help="blocks of the pool (default 512)")
    parser.add_argument(
        "--cuda-graphs",
        choices=("both", "on", "off"),
        default="both",
        help="eager runs, then runs replaying CUDA graphs (both, the default), or one of them",
    )
    parser.add_argument("--json", type=Path, required=True, metavar="FILE")
    args = parser.parse_args(argv)
    model_dir = args.model
    if model_dir is None:
        from common.model_folder import default_model_dir
        from common.settings import FleetSettings

        model_dir = default_model_dir(FleetSettings().model_cache, "cuda")
    result: dict[str, Any] = {
        "model": str(model_dir),
        "tokens": args.tokens,
        "block_size": args.block_size,
        "blocks": args.blocks,
        "cuda_graphs": args.cuda_graphs,
        "machine": describe(),
        "stages": {},
    }

    def stage(name: str, work: Callable[[], Any]) -> Any:
        started = time.perf_counter()
        try:
            value = work()
            seconds = round(time.perf_counter() - started, 2)
            result["stages"][name] = {"ok": True, "seconds": seconds, "value": value}
        except Exception as error:  # recorded, and the next stage runs
            value = None
            result["stages"][name] = {"ok": False, "error": f"{type(error).__name__}: {error}",
                                      "trace": traceback.format_exc()[-3000:]}  # fmt: skip
        print(f"{name}: {json.dumps(result['stages'][name])[:600]}", flush=True)
        args.json.write_text(json.dumps(result, indent=2))
        return value

    prompts = prompt_ids(model_dir)
    result["prompt_tokens"] = [len(p) for p in prompts]
    opened: list[PagedModel] = []

    def open_model() -> dict[str, Any]:
        model = PagedModel(model_dir, args.blocks, args.block_size, cuda_graph=args.cuda_graphs != "off")
        opened.append(model)
        return {"providers": model.session.get_providers(), "cuda_graphs": model.graphs is not None}

    stage("open", open_model)
    if not opened:
        return

    def stages(model: PagedModel, suffix: str) -> tuple[list[list[int]] | None, list[list[int]] | None]:
        ours: list[list[int]] | None = stage(f"alone{suffix}", lambda: alone(model, prompts, args.tokens))
        mixed = stage(f"together{suffix}", lambda: together(model, prompts, args.tokens))
        if ours is not None and mixed is not None:
            stage(f"together_against_alone{suffix}", lambda: agreement(mixed, ours))
        for rows in DECODE_ROWS:

            def timed(rows: int = rows) -> float:
                return decode_runs(model, rows)

            stage(f"decode_run_ms_{rows}_rows{suffix}", timed)
        return ours, mixed

    def on_the_model(model: PagedModel) -> list[list[int]] | None:
        ours: list[list[int]] | None = None
        mixed: list[list[int]] | None = None
        if args.cuda_graphs != "on" or model.graphs is None:
            with eager(model):
                ours, mixed = stages(model, "")
        graphs = model.graphs
        if graphs is None:
            return ours
        ours_graphs, mixed_graphs = stages(model, "_graphs")
        if ours is not None and ours_graphs is not None:
            stage("alone_graphs_against_eager", lambda: agreement(ours_graphs, ours))
        if mixed is not None and mixed_graphs is not None:
            stage("together_graphs_against_eager", lambda: agreement(mixed_graphs, mixed))
        timing = result["stages"].get(f"decode_run_ms_{DECODE_ROWS[-1]}_rows_graphs", {})
        if timing.get("ok"):
            stage("decode_run_256_rows_graphs_under_2_ms", lambda: timing["value"] < GRAPH_TARGET_MS)
        stage("graphs", lambda: {"buckets": [list(b) for b in graphs.buckets], "runs": graphs.runs})
        return ours if ours is not None else ours_graphs

    ours = on_the_model(opened.pop())  # the pool goes back before og.Engine sizes its cache
    theirs = stage("og_engine", lambda: og_engine_tokens(model_dir, prompts, args.tokens, "off"))
    if ours is not None and theirs is not None:
        stage("alone_against_og_engine", lambda: agreement(ours, theirs))
    graphs = stage("og_engine_cuda_graphs", lambda: og_engine_tokens(model_dir, prompts, args.tokens, "on"))
    if graphs is not None and theirs is not None:
        stage("og_engine_cuda_graphs_against_eager", lambda: agreement(graphs, theirs))


if __name__ == "__main__":
    main()
