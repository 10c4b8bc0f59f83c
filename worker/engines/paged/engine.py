"""worker.engine.Engine on the paged model, scheduled by ortfleet (scheduler.py) rather than og.Engine.

Each step is one run of the model (model.py on a card; cpu_model.py, its contract on the CPU graph) with
the scheduler's rows: every decoding row's last token and the step's prompt chunks. Each row whose logits
give its next token then goes through the batcher's own per-token path (BatchingEngine._next: RowSampler's
pick with penalties, logit_bias, min_tokens, a grammar; log-probabilities; replay of an earlier attempt's
tokens; the end of sequence, max_tokens and the context), so a request asks here what it asks of the CPU
batcher. With `sampler` (ORTFLEET_SAMPLING=graph) the sampler graph (device_sampling/) picks every row it
can serve in one run and RowSampler the rest (grammars, and the rows it flags). Where the runner gives the
run's logits where they lie (`DeviceRunner.run`: on the card for model.py, an OrtValue of its float32 rows
for cpu_model.py), the graph reads them there, and only the rows the host reads come back, in one gather
after the graph's run (device_logits.py): rows the graph left to RowSampler (grammars, the rows it flags) and
the prompt chunks that ask for their log-probabilities. Without a graph, or with a runner that only returns
host logits, every row's logits come to the host (`returned_logits`). A plain row the graph picked for (no
grammar, replay or first update, a token that ends nothing) skips the per-token path: its bookkeeping and
update, those `_next` gives such a token, are done in the step's loop (`_hand_on`).

Prompt log-probabilities (`prompt_logprobs`) are the batcher's too: a row that asks for them gets the
logits of every position of its prompt chunks from each run (PackedRow.all_logits; the others their last
token's only), and the batcher's own code (BatchingEngine._add_prompt_logprobs) turns them into
log-probabilities, chunk after chunk, handed on with the first token. Reused tokens have no logits, so
such a row reuses no cached block: it gets a cache scope no other row shares, as every row does with the
prefix cache off.

A run that fails leaves no row's KV to trust: every request goes back to the queue as `lost` and the
worker restarts the engine with a fresh pool (BatchingEngine._fail, PagedRows.clear).

LoRA adapters are the batcher's (`adapters`, an AdapterLibrary the runner is made with too): each row runs
with its request's adapter, rows of different adapters and of the base model in one run (the runner applies
them, model.py, cpu_model.py), and its prompt blocks are cached in its adapter's scope (Row.cache_scope).
Loads and unloads at run time are the batcher's (load_adapter, unload_adapter), swapped into the runner
between steps. An unloaded adapter's cached blocks are not dropped (the block manager evicts them in
time): an adapter loaded again under its name gets scopes of its own instead.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, cast, runtime_checkable

import numpy as np

from worker.engine import EngineUpdate, TokenLogprobs
from worker.engines.batcher.adapter_library import AdapterChange, AdapterLibrary
from worker.engines.batcher.engine import BatchingEngine, Picked
from worker.engines.batcher.graph import Layout
from worker.engines.batcher.lora import AdapterSet
from worker.engines.batcher.rows import Row
from worker.engines.device_sampling.runner import SampledStep, SamplerGraph
from worker.engines.engine_thread import EngineThread, Updates
from worker.engines.paged.blocks import BlockManager
from worker.engines.paged.device_logits import DeviceLogits, DeviceRunner
from worker.engines.paged.model import PackedRow
from worker.engines.paged.scheduler import PagedRow, Plan, Planned, Scheduler

if TYPE_CHECKING:
    import onnxruntime as ort

logger = logging.getLogger(__name__)


class PagedRunner(Protocol):
    blocks: int
    block_size: int
    vocab: int

    def returned_logits(self, rows: Sequence[PackedRow]) -> np.ndarray:
        """One run of `rows`: each row's last token's logits, each of its tokens' for a row with
        all_logits, float32 [taken, vocab] (model.py)."""
        ...


_UNREAD = np.empty(0, np.float32)  # the logits handed to `_next` with a row the graph picked (not read)


@runtime_checkable
class AdapterRunner(Protocol):
    def use_adapters(
        self, session: tuple[ort.InferenceSession, Layout] | None, adapters: AdapterSet | None
    ) -> None:
        """These adapters' layouts from the next run on, and `session` where the graph gained projections."""
        ...


class PagedRows:
    """The batcher's rows (Row: a request's stream, sampler and progress) over the scheduler's: which
    Row each PagedRow is, and what the batcher's per-token path asks of its rows (end, running, every)."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self._row: dict[PagedRow, Row] = {}
        self._paged: dict[Row, PagedRow] = {}
        self._decoding_of: list[PagedRow] | None = None  # the scheduler's list _decoding_rows follows
        self._decoding_rows: list[Row] = []

    @property
    def capacity(self) -> int:
        return self.scheduler.capacity

    @capacity.setter
    def capacity(self, rows: int) -> None:
        self.scheduler.capacity = rows

    def add(self, row: Row, paged: PagedRow) -> None:
        self.scheduler.submit(paged)
        self._row[paged], self._paged[row] = row, paged

    def row_of(self, paged: PagedRow) -> Row:
        return self._row[paged]

    def rows_of(self, planned: Sequence[Planned]) -> list[Row]:
        row = self._row
        return [row[plan.row] for plan in planned]

    def decoding_rows(self) -> list[Row]:
        """The scheduler's decoding rows' Rows, in order (kept while its list is the same)."""
        decoding = self.scheduler.decoding
        if decoding is not self._decoding_of:
            row = self._row
            self._decoding_rows, self._decoding_of = [row[paged] for paged in decoding], decoding
        return self._decoding_rows

    def __contains__(self, row: Row) -> bool:
        return row in self._paged

    def end(self, row: Row) -> None:
        paged = self._paged.pop(row)
        del self._row[paged]
        self.scheduler.end(paged)

    @property
    def waiting(self) -> Sequence[PagedRow]:
        return self.scheduler.waiting

    def running(self) -> int:
        return len(self.scheduler.running)

    def every(self) -> list[Row]:
        return [self._row[paged] for paged in self.scheduler.rows()]

    def counts(self) -> tuple[int, int, int]:
        """Rows waiting, prefilling, decoding."""
        running = self.scheduler.running
        decoding = sum(1 for row in running if row.decoding)
        return len(self.scheduler.waiting), len(running) - decoding, decoding

    def clear(self) -> list[Row]:
        """Takes every row out, with a fresh pool of the same size (its KV can no longer be trusted)."""
        rows = self.every()
        blocks = self.scheduler.blocks
        self.scheduler.clear(BlockManager(blocks.blocks, blocks.block_size))
        self._row.clear()
        self._paged.clear()
        return rows


class PagedEngine(BatchingEngine):
    """See the module's docstring. `runner` makes the model's runner (and a fresh one after a failure),
    with `adapters`' graph and layouts where there is a library."""

    kv_budget_source = "the paged KV pool"
    fast_plain_rows = True  # False: every row through `_next`, plain ones too (tests compare the two)

    def __init__(
        self,
        model_dir: Path,
        runner: Callable[[], PagedRunner],
        capacity: int,
        prefill_chunk: int,
        step_delay_s: float = 0.0,
        prefix_cache: bool = True,
        sampler: Callable[[frozenset[int], int], SamplerGraph] | None = None,
        adapters: AdapterLibrary | None = None,
    ) -> None:
        EngineThread.__init__(self, "paged")
        self._take_model(model_dir, prefill_chunk, step_delay_s, adapters or AdapterLibrary(model_dir, {}))
        self._reloaded: Counter[str] = Counter()  # loads at run time by name: a cache scope each
        self._make_runner = runner
        self._runner = runner()
        self.vocab_size = self._runner.vocab
        self._prefix_cache = prefix_cache
        self._unshared = itertools.count()  # cache scopes of rows that share no block with another
        self.prefix_block_tokens = self._runner.block_size if prefix_cache else 0
        blocks = BlockManager(self._runner.blocks, self._runner.block_size)
        self._paged_rows = PagedRows(Scheduler(blocks, capacity, prefill_chunk))
        self._rows = self._paged_rows  # type: ignore[assignment]  # what BatchingEngine's own methods use
        # ORTFLEET_SAMPLING=graph: the sampler graph picks the rows it can serve, the others go to RowSampler
        self._sampler = sampler(self.eos_token_ids, self.vocab_size) if sampler is not None else None
        self._on_device = self._sampler is not None and isinstance(self._runner, DeviceRunner)
        if self._sampler is not None and self._on_device:  # its sessions now, rather than at the first steps
            on_card = self._sampler.providers[0] == "CUDAExecutionProvider"
            self._sampler.prepare("float16" if on_card else "float32")  # model.py's logits, cpu_model.py's
        self._thread.start()

    # The event loop's side.

    @property
    def kv_budget_tokens(self) -> int:
        return self._runner.blocks * self._runner.block_size

    @property
    def kv_tokens_reserved(self) -> int:
        blocks = self._paged_rows.scheduler.blocks
        return (blocks.blocks - blocks.available) * blocks.block_size

    @property
    def prefix_cache_tokens(self) -> int:
        blocks = self._paged_rows.scheduler.blocks
        return blocks.cached_blocks * blocks.block_size

    def rows(self) -> tuple[int, int, int]:
        return self._paged_rows.counts()

    # The engine's thread.

    def _queue(self, row: Row) -> None:
        request = row.request
        prompt = request.prompt_ids
        all_logits = request.prompt_logprobs is not None  # every prompt position's logits: none reused
        shares = self._prefix_cache and not all_logits
        adapter = request.adapter
        if not shares:
            scope = f"\0{next(self._unshared)}"  # a scope of its own
        elif adapter is not None and self._reloaded[adapter]:
            scope = f"{row.cache_scope}\0{self._reloaded[adapter]}"  # not the blocks of the one unloaded
        else:
            scope = row.cache_scope  # the request's, and its adapter's
        paged = PagedRow(
            prompt, row.reserved - len(prompt), scope, request.owner, request.weight, all_logits, adapter
        )
        self._paged_rows.add(row, paged)

    # Adapters at run time: the batcher's load_adapter and unload_adapter, swapped into the runner.

    def _swap(self, change: AdapterChange, loaded: str | None) -> None:
        runner = self._runner
        if not isinstance(runner, AdapterRunner):
            raise ValueError(f"this paged engine's runner ({type(runner).__name__}) serves no adapters")
        runner.use_adapters(change.session, change.layouts)
        self.adapters = change.layouts
        self._unloaded -= {loaded}

    def _forget_prompts(self, adapter: str) -> None:
        self._reloaded[adapter] += 1  # its blocks stay cached, out of reach of a later load of its name

    def _step(self, updates: Updates) -> None:
        rows = self._paged_rows
        planned = rows.scheduler.plan()
        if not planned:
            return
        decodes = planned.decodes  # the first rows: one token each, all sampling
        chunks = planned[decodes:]
        packed = [plan.packed for plan in planned]
        every_position = any(plan.packed.all_logits for plan in chunks)  # a chunk asks for each position's
        began = time.perf_counter()
        returned: np.ndarray | DeviceLogits
        try:
            if self._on_device:  # the sampler graph reads them where they are; the host, rows it needs
                runner = cast(DeviceRunner, self._runner)  # checked at start: no isinstance a step
                returned = DeviceLogits(cast(SamplerGraph, self._sampler), *runner.run(packed))
            else:
                returned = self._runner.returned_logits(packed)  # [taken, vocab]: each row's, in order
            ends: Sequence[int] = (
                list(itertools.accumulate(row.returned for row in packed))
                if every_position
                else range(1, len(packed) + 1)  # one row of logits each
            )
            if ends[-1] != len(returned):
                raise ValueError(f"{len(returned)} rows of logits for rows that take {ends[-1]}")
        except Exception as e:  # no row's KV can be trusted after a run that broke
            logger.exception("a paged run failed")
            self._fail(f"a paged run failed: {e}")
            return
        rows.scheduler.advance(planned)
        self._count(planned)
        self._charge(planned, time.perf_counter() - began)
        if not chunks:  # a step of decodes: every row samples, from its own row of logits
            self._hand_on(planned, range(decodes), rows.decoding_rows(), returned, updates)
            return
        # each sampling row, and its logits' index in `returned` (its last token's give its next token)
        sampling = [plan for plan in planned if plan.samples]
        at = [end - 1 for plan, end in zip(planned, ends, strict=True) if plan.samples]
        # prompt chunks of rows that ask for prompt log-probabilities: their rows of `returned`
        prompts = (
            [(plan, end) for plan, end in zip(planned, ends, strict=True) if plan.packed.all_logits]
            if every_position
            else []
        )
        self._hand_on(sampling, at, rows.rows_of(sampling), returned, updates, prompts)

    def _hand_on(
        self,
        sampling: Sequence[Planned],
        at: Sequence[int],
        batch: list[Row],
        returned: np.ndarray | DeviceLogits,
        updates: Updates,
        prompts: Sequence[tuple[Planned, int]] = (),
    ) -> None:
        """Each sampling row's next token: a plain row the sampler graph picked for is done here, every
        other row goes through the batcher's per-token path (`_next`), in the rows' order.

        A plain row is one whose update `_next` would make a bare token of: not its first update (no
        cached tokens, replay or prompt log-probabilities to report), no replay under way, no grammar (no
        mask, closer or key check to feed), and a token that ends nothing (not end of sequence, short of
        max_tokens and of the context). Its bookkeeping is `_next`'s for such a token, and so is its
        update, its log-probabilities (the graph's) included; `batch_rows` is the count `_next` reads.

        `prompts`: the prompt chunks (and where their rows of `returned` end) whose log-probabilities are
        added first. Logits left on the device come to the host once, after the graph's run: the rows it
        leaves to the host and the prompt chunks' rows."""
        rows = self._paged_rows
        graph = self._picks(at, batch, returned)
        host: list[bool] = graph.host.tolist() if graph is not None else [True] * len(batch)
        tokens: list[int] = graph.tokens.tolist() if graph is not None else []
        if isinstance(returned, DeviceLogits):
            wanted = [at[index] for index, hosted in enumerate(host) if hosted]
            for plan, end in prompts:
                wanted.extend(range(end - plan.packed.returned, end))
            returned.fetch(wanted)
        for plan, end in prompts:  # a prompt chunk of a row that asks for prompt log-probabilities
            start = end - plan.packed.returned
            chunk = returned.rows(start, end) if isinstance(returned, DeviceLogits) else returned[start:end]
            self._add_prompt_logprobs(rows.row_of(plan.row), plan.packed.past, chunk)
        fast, eos, context = self.fast_plain_rows, self.eos_token_ids, self.context_length
        append = updates.append
        running = rows.running()
        for index, (plan, row) in enumerate(zip(sampling, batch, strict=True)):
            paged = plan.row
            row.length = length = paged.computed
            picked = None
            if not host[index]:
                assert graph is not None
                stream, token = row.stream, tokens[index]
                request = stream.request
                asked = request.logprobs
                if (
                    fast
                    and not row.first_update
                    and token not in eos
                    and row.produced + 1 < request.max_new_tokens
                    and length + 1 < context
                    and request.guidance is None
                    and row.replayed >= len(request.replay_ids)
                ):
                    row.sampler.accept(token)
                    row.produced += 1
                    row.next_token = token
                    logprobs = None if asked is None else (_graph_logprobs(graph, index, asked),)
                    append((stream, EngineUpdate([token], None, None, running, None, None, logprobs)))
                    paged.generated.append(token)
                    continue
                picked = Picked(token, None if asked is None else _graph_logprobs(graph, index, asked))
            if row.first_update:
                row.cached = paged.reused
            if not isinstance(returned, DeviceLogits):
                logits = returned[at[index]]
            else:  # `_next` reads no logits for a row the graph picked
                logits = returned.row(at[index]) if picked is None else _UNREAD
            self._next(row, logits, updates, picked)
            if row in rows:  # it goes on: its next token is fed at the next step
                paged.generated.append(row.next_token)
            running = rows.running()

    def _picks(
        self, at: Sequence[int], rows: list[Row], returned: np.ndarray | DeviceLogits
    ) -> SampledStep | None:
        """The sampler graph's step over the rows of the run's logits `returned` that sample, `at` (None
        without the graph): all of them, as they are, when every row samples (a step of decodes), else just
        those rows; on the device, its tokens `taken` there. Its `host` flags the rows RowSampler picks on
        the host."""
        if self._sampler is None or not at:
            return None
        samplers, produced = [row.sampler for row in rows], [row.produced for row in rows]
        every = len(at) == len(returned)
        if isinstance(returned, DeviceLogits):
            taken = returned.taken if every else returned.taken[np.asarray(at)]
            return self._sampler.run(returned.logits, samplers, produced, taken)
        return self._sampler.run(returned if every else returned[at], samplers, produced)

    def _charge(self, planned: Plan, seconds: float) -> None:
        """A run's time to its rows' keys, in proportion to the tokens each row brought (work_shares.py)."""
        scheduler = self._paged_rows.scheduler
        shares = scheduler.shares
        brought = dict(scheduler.decoding_owners)  # tokens by key (and weight): one charge a key
        for plan in planned[planned.decodes :]:
            key = (plan.row.owner, plan.row.weight)
            brought[key] = brought.get(key, 0) + len(plan.packed.tokens)
        tokens = sum(brought.values())
        per_token = seconds / tokens
        shares.ran_prefill(tokens, seconds)  # the run's rows share its time by tokens, chunks or decodes
        shares.ran_decode(tokens, seconds)
        for (owner, weight), count in brought.items():
            shares.charge(owner, weight, per_token * count)

    def _count(self, planned: Plan) -> None:
        counters = self.counters
        counters.decode_tokens += planned.decodes
        for plan in planned[planned.decodes :]:  # prompt chunks
            row, tokens = plan.row, len(plan.packed.tokens)
            counters.prefill_tokens += tokens
            counters.prefill_runs += 1
            if plan.packed.past == row.reused:  # its first chunk: the prompt was just admitted
                counters.prefix_tokens_queried += len(row.prompt)
                counters.prefix_hits += row.reused > 0
                counters.prefix_tokens_reused += row.reused
        counters.decode_steps += 1

    def _renew(self) -> None:
        self._runner = self._make_runner()  # its pool is new; _fail gave the scheduler fresh books
        self._on_device = self._sampler is not None and isinstance(self._runner, DeviceRunner)
        logger.info("the paged engine starts again with a fresh KV pool")


def _graph_logprobs(step: SampledStep, index: int, asked: int) -> TokenLogprobs:
    """Row `index`'s log-probabilities from the sampler graph: its token's and the `asked` likeliest."""
    top = zip(step.top_ids[index][:asked], step.top_logprobs[index][:asked], strict=True)
    return TokenLogprobs(float(step.logprobs[index]), tuple((int(t), float(v)) for t, v in top))
