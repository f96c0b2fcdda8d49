"""torch.distributed.pipelining's own schedules as text: what its ``_dump_csv`` writes, built at test
time from torch's classes (stand-in stages, no processes), for schedule texts to be run against."""

from __future__ import annotations

import os
import tempfile
from typing import Any

#: torch's schedule classes (torch 2.13), each with the stages per rank it runs (None: any, default 2)
TORCH_SCHEDULES: dict[str, int | None] = {
    "ScheduleGPipe": 1,
    "Schedule1F1B": 1,
    "ScheduleInterleaved1F1B": None,
    "ScheduleLoopedBFS": None,
    "ScheduleInterleavedZeroBubble": None,
    "ScheduleZBVZeroBubble": 2,
    "ScheduleDualPipeV": 2,
}


class _Stage:
    """What torch's schedule constructors read of a stage (its index, the stage count, the group)."""

    def __init__(self, index: int, num_stages: int, ranks: int) -> None:
        self.stage_index, self.num_stages, self.group_size, self.group_rank = index, num_stages, ranks, 0
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.stage_index_to_group_rank: dict[int, int] = {}
        self.submod = None


def torch_text(
    schedule: str, ranks: int, microbatches: int, virtual_stages: int | None = None, communication: bool = False
) -> str:
    """torch's text of its schedule class ``schedule`` (a key of :data:`TORCH_SCHEDULES`) for ``ranks``
    processes, ``virtual_stages`` stages each and ``microbatches``: its ``_dump_csv`` output, compute only,
    or with ``communication`` as torch lowers it (sends, receives, and its UNSHARD, RESHARD and REDUCE_GRAD).
    torch's single-stage schedules (GPipe, 1F1B) have no ``_dump_csv``: their ``pipeline_order`` is written
    as the others' are, and lowered by torch's runtime loading that text. torch's ``Schedule1F1B`` order
    starts its last rank's forwards at micro-batch 1 (``1F1 .. 1F4`` for 4 micro-batches on 2 ranks), a
    text torch's runtime refuses to lower and lightning-pipe refuses to run."""
    from torch.distributed.pipelining import schedules

    fixed = TORCH_SCHEDULES[schedule]
    v = fixed if fixed is not None else (virtual_stages or 2)
    if virtual_stages is not None and virtual_stages != v:
        raise ValueError(f"{schedule} runs {v} stage(s) per rank, not {virtual_stages}")
    cls = getattr(schedules, schedule)
    num_stages = ranks * v
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "schedule.csv")
        if issubclass(cls, schedules.PipelineScheduleSingle):
            single: Any = cls(_Stage(0, num_stages, ranks), microbatches)
            runtime: Any = schedules._PipelineScheduleRuntime([_Stage(0, num_stages, ranks)], microbatches)
            runtime.pipeline_order = single.pipeline_order
            if communication:  # torch's lowering takes compute only; it adds its REDUCE_GRAD again
                runtime.pipeline_order = {
                    rank: [a for a in actions if a is None or a.computation_type != schedules.REDUCE_GRAD]
                    for rank, actions in single.pipeline_order.items()
                }
            schedules.PipelineScheduleMulti._dump_csv(runtime, path)  # as the multi-stage schedules write theirs
            if communication:
                runtime._load_csv(path, format="compute_only")
                runtime._dump_csv(path, format="compute_comms")
        else:
            stages = [_Stage(s, num_stages, ranks) for s in range(num_stages) if s % ranks == 0]
            torch_schedule: Any = cls(stages, microbatches)
            torch_schedule._dump_csv(path, format="compute_comms" if communication else "compute_only")
        with open(path) as text:
            return text.read()
