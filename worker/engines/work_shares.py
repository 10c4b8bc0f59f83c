"""Keys' shares of the engine's work: which key's prompt chunk may run next.

Fair share between keys (row_shares.py) divides a worker's rows. A row's cost is not its slot, though: a
key that sends many short requests holds few rows at a time, yet each brings a prompt to prefill, and a
prefill run takes the engine for as long as many decode steps. So the engine also keeps, for each key, the
engine time it spent on that key's rows, divided by the key's weight (`used`), and schedules prompt chunks
as weighted fair queueing schedules packets, by virtual finish time:
- a prefill run's time is charged to its row's key; a decode run's is split evenly between its rows (a
  paged run mixing both splits its time in proportion to each row's tokens);
- decoding rows step at every iteration whatever the counts say (a row once in the batch is never
  starved). A prompt chunk runs only if the key's count once the chunk is done (its finish) is no later
  than every other key's finish of its own next piece of work: one decode step for a key with decoding
  rows, its next chunk for a key that only prefills. So a key whose chunk costs as much as twenty decode
  steps waits until the decoding keys are that far ahead, then runs, and over time each key gets the
  engine time its weight gives it, in pieces no longer than one chunk;
- a key that comes back, or comes for the first time, starts at the least `used` of the keys holding rows:
  idle time banks no credit. A key keeps what it used beyond that while it is away between two requests,
  so sending one short request after another does not wipe its count;
- with one key alone nothing waits.

Costs are wall time of the engine's runs as measured on its thread, so the ledger follows what a prompt
really costs on the device at hand; a chunk's cost before it runs is estimated from the recent runs'
time per token. One owner: the engine's thread.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

RowT = TypeVar("RowT")


@dataclass(frozen=True, slots=True)
class Chunk(Generic[RowT]):
    """A prompt chunk waiting to run, as the ledger sees it: the row's, of `tokens` tokens."""

    row: RowT
    owner: str
    weight: float
    tokens: int
    prompt_left: int


_SMOOTHING = 0.2  # weight of the newest run in the running estimates of a token's and a step's cost


class WorkShares:
    """Engine seconds each key has used, over its weight (see the module's docstring)."""

    def __init__(self) -> None:
        self._used: dict[str, float] = {}
        self._least = 0.0  # the least `used` among the keys holding rows at the last `hold`
        self._prefill_token_s = 0.0  # estimated seconds of one prompt token in a prefill run
        self._decode_row_s = 0.0  # estimated seconds of one row's share of a decode step

    def hold(self, owners: Iterable[str]) -> None:
        """The keys that hold a row in the batch now: a newcomer (or one back below the others) starts at the
        least count among them; a key away with no more than that is forgotten."""
        holding = set(owners)
        if not holding:  # nobody runs: nobody is owed anything
            self._used.clear()
            self._least = 0.0
            return
        counted = [self._used[owner] for owner in holding if owner in self._used]
        least = min(counted) if counted else self._least
        for owner in holding:
            if self._used.get(owner, least) <= least:
                self._used[owner] = least
        self._least = least
        for owner in [o for o, used in self._used.items() if o not in holding and used <= least]:
            del self._used[owner]

    def charge(self, owner: str, weight: float, seconds: float) -> None:
        """`seconds` of engine time spent on a row of `owner`'s."""
        self._used[owner] = self._used.get(owner, self._least) + seconds / max(weight, 1e-9)

    def used(self, owner: str) -> float:
        return self._used.get(owner, self._least)

    def ran_prefill(self, tokens: int, seconds: float) -> None:
        self._prefill_token_s = _smoothed(self._prefill_token_s, seconds / max(tokens, 1))

    def ran_decode(self, rows: int, seconds: float) -> None:
        self._decode_row_s = _smoothed(self._decode_row_s, seconds / max(rows, 1))

    def prefill_cost(self, tokens: int) -> float:
        """The estimated engine seconds of a prompt chunk of `tokens`."""
        return self._prefill_token_s * tokens

    @property
    def decode_cost(self) -> float:
        """The estimated engine seconds of one row's decode step."""
        return self._decode_row_s

    def finish(self, owner: str, weight: float, cost: float) -> float:
        """`owner`'s count once a piece of work of `cost` seconds is done."""
        return self.used(owner) + cost / max(weight, 1e-9)

    def next_chunk(self, pending: Sequence[Chunk[RowT]], decoding: Mapping[str, float]) -> Chunk[RowT] | None:
        """The prompt chunk to run next among `pending`: the one that finishes first (then the one with
        the fewest prompt tokens left), if no other key holding a row finishes its own next piece sooner;
        None when one does. `decoding`: the keys with decoding rows, and their weights."""
        step = self._decode_row_s
        finishes = {owner: self.finish(owner, weight, step) for owner, weight in decoding.items()}
        best: tuple[float, int, Chunk[RowT]] | None = None
        for chunk in pending:
            done = self.finish(chunk.owner, chunk.weight, self.prefill_cost(chunk.tokens))
            if chunk.owner not in decoding:
                finishes[chunk.owner] = min(finishes.get(chunk.owner, done), done)
            if best is None or (done, chunk.prompt_left) < best[:2]:
                best = (done, chunk.prompt_left, chunk)
        if best is None:
            return None
        done, _, chunk = best
        if all(done <= theirs for owner, theirs in finishes.items() if owner != chunk.owner):
            return chunk
        return None

    def chunks(
        self, pending: list[Chunk[RowT]], decoding: Mapping[str, float], budget: int
    ) -> Iterator[Chunk[RowT]]:
        """The prompt chunks of this step, in turn: each one `next_chunk` gives, while whole chunks add up to
        at most `budget` tokens (the first always fits: a chunk is at most the budget). Each is chosen when
        the caller asks for it, so a caller that runs and charges a chunk first has that charge counted."""
        spent = 0
        while pending:
            chunk = self.next_chunk(pending, decoding)
            if chunk is None or (spent and spent + chunk.tokens > budget):
                return  # another key's turn, or no whole chunk left in the budget: the decode rows go first
            pending.remove(chunk)
            spent += chunk.tokens
            yield chunk


def prompt_chunk(
    row: RowT, owner: str, weight: float, done: int, prompt_tokens: int, size: int
) -> Chunk[RowT]:
    """A row's next prompt chunk, `done` of its `prompt_tokens` in: up to the next multiple of `size`, so a
    prompt is computed in the same pieces in every run of it."""
    stop = min(prompt_tokens, (done // size + 1) * size)
    return Chunk(row, owner, weight, stop - done, prompt_tokens - done)


def _smoothed(estimate: float, newest: float) -> float:
    return newest if estimate == 0.0 else estimate + _SMOOTHING * (newest - estimate)
