"""The batcher's LoRA adapters as they change at run time: what a load or an unload makes of them, worked
out off the engine's thread, for the engine to swap in between two steps (engine.py's load_adapter).

The library holds the adapters the engine's AdapterSet lays out (unloaded ones stay until their rows end)
and the projections its session's graph is rewritten for. A load reads and checks the adapter against the
base model's graph; where it targets a projection the graph was not rewritten for, the change carries a
new session whose graph is rewritten for every targeted projection so far (a graph never loses a
projection: an unload keeps the session). Rewriting only the targeted projections keeps a base-model run
of a worker without adapters free of LoRA work.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import onnxruntime as ort

from worker.engines.batcher.graph import Layout, open_session
from worker.engines.batcher.lora import Adapter, AdapterSet, read_adapter
from worker.engines.batcher.lora_graph import LoraGraph, Projection


@dataclass(frozen=True)
class AdapterChange:
    """The engine's adapters after a load or an unload, ready to swap in."""

    adapters: dict[str, Adapter]
    projections: tuple[Projection, ...]  # those the session's graph is rewritten for
    layouts: AdapterSet
    session: tuple[ort.InferenceSession, Layout] | None  # a new one, where the graph gains projections


class AdapterLibrary:
    """The engine's adapters (name: Adapter) and its graph's rewritten projections. `with_adapter` and
    `without` only compute a change; `commit` records one once the engine has swapped it in. The paged
    engine's card opens a new graph its own way (`open_graph`) and keeps the layouts on it (`device`)."""

    def __init__(
        self,
        model_dir: Path,
        folders: Mapping[str, Path],
        open_graph: Callable[[bytes], tuple[ort.InferenceSession, Layout]] | None = None,
        device: tuple[str, int] = ("cpu", 0),
    ) -> None:
        self.model_dir = model_dir
        self.device = device
        self._open_graph = open_graph or self._open_on_cpu
        self._graph = LoraGraph(model_dir) if folders else None
        self.adapters: dict[str, Adapter] = {
            name: read_adapter(name, Path(folder), self.graph) for name, folder in folders.items()
        }
        self.projections: tuple[Projection, ...] = self._targeted(self.adapters.values())

    @property
    def graph(self) -> LoraGraph:
        """The base model's graph and its projections, read once: adapters are checked against it and every
        rewrite is made from it."""
        if self._graph is None:
            self._graph = LoraGraph(self.model_dir)
        return self._graph

    def rewritten(self) -> bytes | None:
        """The decoder rewritten for the library's projections (None: no adapter, the folder's graph)."""
        return self.graph.rewritten(list(self.projections)) if self.projections else None

    def layouts(self) -> AdapterSet | None:
        adapters = list(self.adapters.values())
        return AdapterSet(self.projections, adapters, self.device) if adapters else None

    def with_adapter(self, name: str, folder: Path) -> AdapterChange:
        """The change that adds the adapter in `folder` (AdapterMismatch, AdapterUnreadable, as at start);
        a new session when it targets projections the graph lacks."""
        adapter = read_adapter(name, folder, self.graph)
        adapters = {**self.adapters, name: adapter}
        projections = self._targeted([adapter], also=self.projections)
        session = None
        if projections != self.projections:
            graph = self.graph.rewritten(list(projections))
            session = self._open_graph(graph)
        layouts = AdapterSet(projections, list(adapters.values()), self.device)
        return AdapterChange(adapters, projections, layouts, session)

    def without(self, name: str) -> AdapterChange:
        """The change that takes the adapter out (its rows have ended); the session stays."""
        adapters = {other: a for other, a in self.adapters.items() if other != name}
        layouts = AdapterSet(self.projections, list(adapters.values()), self.device)
        return AdapterChange(adapters, self.projections, layouts, None)

    def _open_on_cpu(self, graph: bytes) -> tuple[ort.InferenceSession, Layout]:
        return open_session(self.model_dir, graph=graph)

    def commit(self, change: AdapterChange) -> None:
        self.adapters, self.projections = change.adapters, change.projections

    def _targeted(
        self, adapters: Iterable[Adapter], also: tuple[Projection, ...] = ()
    ) -> tuple[Projection, ...]:
        """The graph's projections some of `adapters` target, and those of `also`, in the graph's order."""
        targeted = {key for adapter in adapters for key in adapter.modules}
        if not targeted and not also:
            return ()
        return tuple(
            p
            for p in self.graph.projections
            if p in also or any((p.layer, part.module) in targeted for part in p.parts)
        )
