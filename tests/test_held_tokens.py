"""When a scheduler sends a request's tokens on (Submit.stream_interval): the
first at once, then every N; all at once when finished (0); or step by step
while a stop string cannot count."""

from __future__ import annotations

from pipeline.messages import Sampling, Submit
from workers.scheduler.loop import Running


def running(interval: int, **sampling) -> Running:
    submit = Submit(request_id="r", reply_to="x", prompt_ids=[1], sampling=Sampling(**sampling),
                    stream_interval=interval)
    return Running(submit, "1-0", [], 0)


def steps(run: Running, finish_at: int) -> list[int]:
    """A token a step for `finish_at` steps: the output lengths at which the held
    ids went out."""
    out = []
    for n in range(1, finish_at + 1):
        run.output_ids.append(n)
        if run.due("length" if n == finish_at else None):
            run.sent = len(run.output_ids)
            out.append(run.sent)
    return out


def test_n_sends_the_first_token_at_once_then_every_n_and_the_rest_at_the_finish():
    assert steps(running(1), 5) == [1, 2, 3, 4, 5]
    assert steps(running(4), 10) == [1, 5, 9, 10]
    assert steps(running(4), 9) == [1, 5, 9]


def test_a_continuation_sends_its_first_new_token_at_once_too():
    submit = Submit(request_id="r", reply_to="x", prompt_ids=[1], sampling=Sampling(),
                    output_ids=[7, 8], attempt=1, stream_interval=4)  # the client has 2
    run = Running(submit, "1-0", [7, 8], 2)
    assert steps(run, 6) == [3, 7, 8]


def test_zero_sends_everything_once_when_finished():
    assert steps(running(0), 7) == [7]


def test_with_stop_strings_tokens_go_out_one_by_one_until_min_tokens():
    assert steps(running(4, stop=["x"], min_tokens=6), 12) == [1, 2, 3, 4, 5, 9, 12]
    assert steps(running(0, stop=["x"], min_tokens=3), 6) == [1, 2, 6]
    assert steps(running(4, min_tokens=6), 12) == [1, 5, 9, 12]  # no stop string: no reason
