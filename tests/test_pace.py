"""The engine's pace (workers/scheduler/pace.py) on steps of known times."""

from __future__ import annotations

from workers.scheduler.pace import MAX_STEPS, Pace, StepRecord


def test_the_summary_is_the_windows_median_step_mean_rows_and_rate():
    pace = Pace(window_s=30.0)
    # three back-to-back steps of 10, 30 and 20 ms: 64, 64 and 512 rows, 64 tokens each
    pace.record(StepRecord(100.00, 100.01, 64, 64))
    pace.record(StepRecord(100.01, 100.04, 64, 64))
    pace.record(StepRecord(100.04, 100.06, 512, 64))
    summary = pace.summary(now=101.0)
    assert summary["recent_steps"] == 3
    assert summary["step_ms_p50"] == 20.0
    assert summary["rows_per_step"] == round(640 / 3, 2)
    assert summary["output_tokens_per_s"] == round(192 / 0.06, 2)
    assert summary["busy"] == 1.0


def test_busy_is_the_share_of_the_span_spent_in_steps():
    pace = Pace(window_s=30.0)
    # 10 ms steps with 2.5 ms gaps between them, then an idle second
    for i in range(4):
        pace.record(StepRecord(50.0 + i * 0.0125, 50.0 + i * 0.0125 + 0.01, 8, 8))
    assert pace.summary(now=51.0)["busy"] == round(0.04 / 0.0475, 4)
    pace.record(StepRecord(51.0475, 51.0575, 8, 8))
    assert pace.summary(now=52.0)["busy"] == round(0.05 / 1.0575, 4)


def test_steps_older_than_the_window_are_forgotten_and_the_count_is_capped():
    pace = Pace(window_s=10.0)
    pace.record(StepRecord(0.0, 1.0, 1, 1))
    pace.record(StepRecord(5.0, 6.0, 1, 1))
    assert pace.summary(now=10.5)["recent_steps"] == 2  # the first ended 9.5 s before
    assert pace.summary(now=11.5)["recent_steps"] == 1  # and now 10.5
    assert pace.summary(now=100.0) == {"recent_steps": 0, "step_ms_p50": None,
                                       "rows_per_step": None, "output_tokens_per_s": None,
                                       "busy": None}
    for i in range(MAX_STEPS + 10):
        pace.record(StepRecord(200.0 + i * 1e-4, 200.0 + (i + 1) * 1e-4, 1, 1))
    assert pace.summary(now=201.0)["recent_steps"] == MAX_STEPS
