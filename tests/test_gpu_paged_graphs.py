"""The paged model's pure-decode runs replayed as CUDA graphs on a card (worker/engines/paged/model.py,
decode_graphs.py): rows across rows buckets (3, 5 and 17 rows: padded to 4, 8 and 32) and a row whose
context crosses from the 8-block width bucket to the 16-block one get the eager runs' logits, and so their
greedy tokens, step after step. Skipped where onnxruntime-genai cannot use CUDA; `scripts/gpu-report`
runs it on a GPU host. The buckets' padding itself is checked on the CPU (test_paged_decode_graphs.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ortfleet.bench.backends import PROMPTS
from ortfleet.bench.paged_model import eager
from tests.gpu_marks import ON_A_GPU
from worker.engines.genai_config import read_genai
from worker.engines.paged.decode_graphs import Bucket
from worker.engines.paged.model import PackedRow, PagedModel
from worker.engines.row_sizing import kv_geometry

pytestmark = ON_A_GPU

NEAR = 0.25  # fp16 logits of another batch shape (padded rows, other GEMM algorithms) differ this little
STEPS = 5


@pytest.fixture(scope="module")
def cuda_model() -> Path:
    from common.settings import FleetSettings
    from ortfleet.modelbuild.default import ensure_default_model

    return ensure_default_model(FleetSettings().model_cache, device="cuda")


def text_ids(model_dir: Path, tokens: int) -> list[int]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids: list[int] = []
    while len(ids) < tokens:
        ids += tokenizer.encode(" ".join(PROMPTS)).ids
    return ids[:tokens]


def test_decode_runs_replayed_as_cuda_graphs_give_the_eager_runs_logits_across_buckets(
    cuda_model: Path,
) -> None:
    block = kv_geometry(read_genai(cuda_model)).block_size
    per_row = -(-(8 * block + STEPS + 1) // block)  # a row past eight blocks by the last step
    counts = (3, 5, 17)
    model = PagedModel(cuda_model, sum(counts) * per_row, block, cuda_graph=True)
    graphs = model.graphs
    assert graphs is not None, "the session refused CUDA graphs (see the log's warning)"
    text = text_ids(cuda_model, 8 * block)
    next_block = 0
    for count in counts:
        # The first row at 8 blocks less two tokens: its third decode needs a ninth block (width 16).
        lengths = [8 * block - 2, *(37 + 53 * index for index in range(count - 1))]
        prompts = [text[index : index + length] for index, length in enumerate(lengths)]
        tables = [list(range(next_block + per_row * r, next_block + per_row * (r + 1))) for r in range(count)]
        next_block += count * per_row
        with eager(model):
            first = model.returned_logits([PackedRow(p, 0, t) for p, t in zip(prompts, tables, strict=True)])
        generated = [[int(token)] for token in first.argmax(axis=1)]
        for _ in range(STEPS):
            rows = [
                PackedRow([ids[-1]], len(prompt) + len(ids) - 1, table)
                for prompt, ids, table in zip(prompts, generated, tables, strict=True)
            ]
            with eager(model):
                theirs = model.returned_logits(rows)  # writes this step's keys and values
            ours = model.returned_logits(rows)  # the same, through the bucket's graph
            assert ours.shape == theirs.shape == (count, model.vocab)
            gap = np.abs(ours - theirs).max()
            assert gap < NEAR, (count, gap)  # another row's logits, or a wrong past, would be far off
            top_two = np.sort(theirs, axis=1)[:, -2:]
            clear = top_two[:, 1] - top_two[:, 0] > 2 * NEAR  # no near-tie a fp16 difference could split
            np.testing.assert_array_equal(ours.argmax(axis=1)[clear], theirs.argmax(axis=1)[clear])
            for ids, token in zip(generated, theirs.argmax(axis=1), strict=True):
                ids.append(int(token))
    rows_buckets = {bucket.rows for bucket in graphs.buckets}
    assert rows_buckets == {4, 8, 32}
    assert {Bucket(32, 8), Bucket(32, 16)} <= set(graphs.buckets)  # the long row crossed a width bucket
    assert graphs.runs == len(counts) * STEPS  # every decode run went through a graph
