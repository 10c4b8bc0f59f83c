"""The paged scheduler for an engine that serves LoRA adapters: each planned row's PackedRow names its
row's adapter (PagedRow.adapter), which the runner applies to that row alone (model.py, cpu_model.py).

A step whose rows all run the base model is the scheduler's plan as it is: the rows of adapters are
counted as they come and go, and only a plan while some hold rows is gone over.
"""

from __future__ import annotations

from worker.engines.paged.blocks import BlockManager
from worker.engines.paged.scheduler import PagedRow, Plan, Scheduler


class AdapterScheduler(Scheduler):
    _adapter_rows = 0  # rows waiting or running with an adapter

    def submit(self, row: PagedRow) -> None:
        super().submit(row)
        self._adapter_rows += row.adapter is not None

    def plan(self) -> Plan:
        planned = super().plan()
        if self._adapter_rows:
            for index, plan in enumerate(planned):
                adapter = plan.row.adapter
                if adapter is not None:
                    planned[index] = plan._replace(packed=plan.packed._replace(adapter=adapter))
        return planned

    def end(self, row: PagedRow) -> None:
        super().end(row)
        self._adapter_rows -= row.adapter is not None

    def clear(self, blocks: BlockManager) -> None:
        super().clear(blocks)
        self._adapter_rows = 0
