# How fast an engine has stepped lately, for its scheduler's liveness record
# (`pipeline status`): the steps that ended within the last `window_s` seconds.
# Torch-free; the engine records each step it runs.

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

WINDOW_S = 30.0
MAX_STEPS = 8192  # 30 s of 3.7 ms steps; a faster engine keeps its last 8192


@dataclass(frozen=True)
class StepRecord:
    started: float  # time.perf_counter()
    ended: float
    rows: int  # tokens run: one per decode, a chunk's per prefill
    sampled: int  # tokens it produced


@dataclass
class Pace:
    window_s: float = WINDOW_S
    steps: deque[StepRecord] = field(default_factory=lambda: deque(maxlen=MAX_STEPS))

    def record(self, step: StepRecord) -> None:
        self.steps.append(step)

    def summary(self, now: float) -> dict[str, float | int | None]:
        """`recent_steps` in the window; their median time, mean rows, the
        tokens they produced a second of the span from the first one's start to
        the last one's end, and `busy`: the share of that span spent in steps
        (under 1 by the engine's idle time: waiting for work, or for its
        scheduler between steps). None for each where there are none."""
        while self.steps and self.steps[0].ended < now - self.window_s:
            self.steps.popleft()
        steps = list(self.steps)
        if not steps:
            return {"recent_steps": 0, "step_ms_p50": None, "rows_per_step": None,
                    "output_tokens_per_s": None, "busy": None}
        span = steps[-1].ended - steps[0].started
        rate = sum(s.sampled for s in steps) / span if span > 0 else None
        busy = sum(s.ended - s.started for s in steps) / span if span > 0 else None
        return {  # to 0.01 (busy, a share, to 0.0001): they are read by people (`pipeline status`)
            "recent_steps": len(steps),
            "step_ms_p50": round(statistics.median(s.ended - s.started for s in steps) * 1000, 2),
            "rows_per_step": round(statistics.fmean(s.rows for s in steps), 2),
            "output_tokens_per_s": None if rate is None else round(rate, 2),
            "busy": None if busy is None else round(busy, 4),
        }
