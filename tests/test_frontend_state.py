"""A frontend shows each token range once, in order, whatever Redis redelivers."""

from __future__ import annotations

from api.frontend import RequestState
from pipeline.messages import Delta, Sampling, Submit


def state(attempt: int = 0) -> RequestState:
    return RequestState(Submit(request_id="r", reply_to="x", prompt_ids=[1],
                               sampling=Sampling(), attempt=attempt))


def test_redelivered_deltas_are_dropped():
    s = state()
    first = Delta("r", 0, [5, 6], "ab", None)
    assert s.accept(first) == [first]
    assert s.accept(first) == []
    assert s.output_ids == [5, 6]


def test_deltas_arriving_out_of_order_are_released_in_order():
    s = state()
    second, first = Delta("r", 1, [6], "b", None), Delta("r", 0, [5], "a", None)
    assert s.accept(second) == []
    assert s.accept(first) == [first, second]


def test_deltas_of_an_abandoned_attempt_are_ignored():
    s = state(attempt=1)
    assert s.accept(Delta("r", 0, [5], "a", None, None, 0)) == []
    assert s.accept(Delta("r", 0, [5], "a", "stop", None, 1))[0].finish == "stop"
    assert s.finished
