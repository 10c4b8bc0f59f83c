"""Which rows run in each step of the paged model (model.py), and with which tokens.

A step is one run of the model, and its rows may mix decodes and prompt chunks (the paged operator takes
both in one run):

1. **Decode first.** Every row whose prompt is in brings its last sampled token: a decoding row gets a
   token every step, whatever prefills are under way.
2. **Then prefill**, whole chunks of up to `prefill_chunk` prompt tokens a step in all, in the order and
   as far as the keys' shares of the engine's time allow (work_shares.py; the engine charges each run's
   time to its rows' keys), the rows with the fewest prompt tokens left first among equals (a short chat
   behind long prompts gets its first token soon), each in chunks at fixed
   offsets of its prompt (0, chunk, 2 chunk, ...; a row that reused cached blocks starts at their end and
   goes on to the next multiple), so that a prompt's KV is computed in the same pieces in every run of it.
   A row that asks for its prompt's logits (`all_logits`, for prompt log-probabilities) gets each
   position's logits of its chunks (PackedRow.all_logits), and its last token's only once it decodes.
3. **Admission**: waiting rows join first come first served while a row is free (`capacity`) and the pool
   can reserve the row's whole length (blocks.py): a running row never runs out of KV, so no row is ever
   preempted for memory. A row whose prompt starts with cached blocks of its scope reuses them and
   prefills the rest.

The scheduler owns the rows and the block manager's books; what a row's next token is (sampling, end of
sequence, stop strings) is its caller's: after `advance`, the caller appends each sampling row's next token
to its `generated`, and `end`s a row that is done or cancelled.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import count, islice
from typing import NamedTuple

from worker.engines.paged.blocks import BlockManager, OutOfBlocks
from worker.engines.paged.model import PackedRow
from worker.engines.work_shares import WorkShares, prompt_chunk


@dataclass(eq=False)
class PagedRow:
    prompt: Sequence[int]
    max_new_tokens: int
    scope: str = ""  # whose cached prompt blocks it may reuse, and who may reuse its own
    owner: str = ""  # whose work it is (work_shares.py), and that key's weight
    weight: float = 1.0
    all_logits: bool = False  # its prompt chunks bring back every position's logits, not only the last's
    adapter: str | None = None  # the LoRA adapter it runs with (None: the base model)
    key: int = field(default_factory=count().__next__)  # its name in the block manager
    computed: int = 0  # tokens whose KV is in the pool (prompt, then generated)
    reused: int = 0  # prompt tokens whose KV came from the cache
    generated: list[int] = field(default_factory=list)  # sampled; the last one is not in the pool yet

    @property
    def decoding(self) -> bool:
        return self.computed >= len(self.prompt)

    @property
    def length(self) -> int:
        """Tokens the row's KV will hold at most: its prompt and max_new_tokens."""
        return len(self.prompt) + self.max_new_tokens


class Planned(NamedTuple):  # a tuple: one is made for each row of each step
    row: PagedRow
    packed: PackedRow
    samples: bool  # its logits give the row's next token (a decode, or its prompt's last chunk)


class Plan(list[Planned]):
    """A step's rows (`plan`): its `decodes` first, the scheduler's `decoding` rows in order, each bringing
    one token and sampling; then the prompt chunks."""

    decodes = 0


class Scheduler:
    def __init__(self, blocks: BlockManager, capacity: int, prefill_chunk: int) -> None:
        if capacity < 1 or prefill_chunk < 1:
            raise ValueError(f"a batch needs rows and a chunk: capacity {capacity}, chunk {prefill_chunk}")
        self.blocks = blocks
        self.capacity = capacity
        self.prefill_chunk = prefill_chunk
        self.waiting: deque[PagedRow] = deque()
        self.running: list[PagedRow] = []
        self.shares = WorkShares()  # the engine charges each run's time to its rows' keys
        # What plan() reads of the running rows, kept while no row joins, ends or finishes its prompt (in
        # a step of decodes only, it changes at a row's start and end, not at each token): the decoding
        # rows in running order, their ids in the pool and their count by key and weight, the prefilling
        # rows, and the keys holding rows.
        self._stale = True  # to be worked out again at the next plan
        self.decoding: list[PagedRow] = []
        self._decoding_ids: list[int] = []
        self._prefilling: list[PagedRow] = []
        self._owners: set[str] = set()
        self.decoding_owners: dict[tuple[str, float], int] = {}  # decoding rows by key and weight

    def submit(self, row: PagedRow) -> None:
        """Queues the row; a row that could never fit the pool is refused here, by name."""
        size = self.blocks.block_size
        needed = -(-row.length // size)
        if not row.prompt:
            raise ValueError("a row needs at least one prompt token")
        if needed > self.blocks.blocks:
            raise ValueError(
                f"the row needs {needed} blocks of {size} tokens ({len(row.prompt)} prompt tokens and "
                f"{row.max_new_tokens} to generate); the pool holds {self.blocks.blocks}"
            )
        self.waiting.append(row)

    def plan(self) -> Plan:
        """The next step's rows: admissions first, then every decoding row, then prompt chunks. Each row's
        blocks grow to hold what it brings."""
        self._admit()
        if self._stale:
            self._split()
        decoding_rows = self.decoding
        tables = self.blocks.grow_each_by_one(self._decoding_ids)
        planned = Plan(
            [  # each brings its last sampled token
                Planned(row, PackedRow([row.generated[-1]], row.computed, table, False, row.adapter), True)
                for row, table in zip(decoding_rows, tables, strict=True)
            ]
        )
        planned.decodes = len(planned)
        self.shares.hold(self._owners)
        if not self._prefilling:
            return planned
        decoding = {row.owner: row.weight for row in decoding_rows}
        pending = [
            prompt_chunk(row, row.owner, row.weight, row.computed, len(row.prompt), self.prefill_chunk)
            for row in self._prefilling
        ]
        for chunk in self.shares.chunks(pending, decoding, self.prefill_chunk):
            row = chunk.row
            start = row.computed
            stop = start + chunk.tokens
            table = self.blocks.grow(row.key, stop - start)
            last = stop == len(row.prompt)
            packed = PackedRow(row.prompt[start:stop], start, table, row.all_logits, row.adapter)
            planned.append(Planned(row, packed, last))
        return planned

    def advance(self, planned: Sequence[Planned]) -> None:
        """The step ran: each planned row's tokens are in the pool (its whole prompt blocks offered to the
        cache). The caller then gives each row that samples its next token (`PagedRow.generated`)."""
        decodes = planned.decodes if isinstance(planned, Plan) else 0
        for plan in islice(planned, decodes):  # one token each; their prompt blocks were offered already
            plan.row.computed += 1
        computed = self.blocks.computed
        for row, packed, _ in planned[decodes:]:
            prefilled = row.computed < len(row.prompt)  # a decode's prompt blocks were offered already
            row.computed += len(packed.tokens)
            if prefilled:
                computed(row.key, row.computed)
                if row.computed >= len(row.prompt):
                    self._stale = True  # it decodes from the next step on

    def end(self, row: PagedRow) -> None:
        """The row is done (its last token, end of sequence, a stop) or cancelled: out of the batch, its
        blocks back to the pool (its whole prompt blocks kept for reuse)."""
        if row in self.waiting:
            self.waiting.remove(row)
            return
        self.running.remove(row)
        self._stale = True
        self.blocks.release(row.key)

    def clear(self, blocks: BlockManager) -> None:
        """Takes every row out, with `blocks` as the pool (the engine's, after a run that failed)."""
        self.waiting.clear()
        self.running.clear()
        self._stale = True
        self.blocks = blocks

    def rows(self) -> Iterator[PagedRow]:
        yield from self.waiting
        yield from self.running

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.capacity:
            row = self.waiting[0]
            try:  # admit checks the pool before it takes anything, and hashes the prompt once
                row.reused = row.computed = self.blocks.admit(
                    row.key, row.prompt, row.max_new_tokens, row.scope
                )
            except OutOfBlocks:
                return  # first come, first served: no later row jumps ahead of one waiting for blocks
            self.waiting.popleft()
            self.running.append(row)
            self._stale = True

    def _split(self) -> None:
        running = self.running
        self.decoding = [row for row in running if row.computed >= len(row.prompt)]
        self._decoding_ids = [row.key for row in self.decoding]
        self._prefilling = [row for row in running if row.computed < len(row.prompt)]
        self._owners = {row.owner for row in running}
        self.decoding_owners = Counter((row.owner, row.weight) for row in self.decoding)
        self._stale = False
