"""The scheduler alone (plain Python, no model): bounds, cache-aware order, starvation window, slots."""

from __future__ import annotations

import pytest

from kvrag import EngineConfig, InvalidRequestError, OverloadedError
from kvrag.engine.serving.scheduler import Scheduler, Ticket


def make(**overrides) -> Scheduler:
    limits = dict(max_running=2, max_queued=8, max_queued_tokens=1000, starvation_window=100)
    limits.update(overrides)
    return Scheduler(**limits)


def drain(s: Scheduler) -> list[str]:
    order = []
    while (t := s.next()) is not None:
        order.append(t.payload)
    return order


def test_highest_cached_to_compute_ratio_goes_first_ties_in_arrival_order():
    s = make()
    s.submit(Ticket(tokens=100, cached=0, compute=100, payload="cold"))
    s.submit(Ticket(tokens=100, cached=90, compute=10, payload="hot"))
    s.submit(Ticket(tokens=100, cached=50, compute=50, payload="warm"))
    s.submit(Ticket(tokens=10, cached=0, compute=10, payload="cold-2"))
    assert drain(s) == ["hot", "warm", "cold", "cold-2"]


def test_a_ticket_passed_over_window_times_goes_next():
    s = make(starvation_window=2)
    s.submit(Ticket(tokens=100, cached=0, compute=100, payload="cold"))
    for i in range(4):
        s.submit(Ticket(tokens=100, cached=90, compute=10, payload=f"hot{i}"))
    # two hot ones pass it, then it has waited long enough
    assert drain(s) == ["hot0", "hot1", "cold", "hot2", "hot3"]
    fifo = make(starvation_window=0)
    fifo.submit(Ticket(tokens=1, payload="first"))
    fifo.submit(Ticket(tokens=1, cached=9, payload="second"))
    assert drain(fifo) == ["first", "second"]


def test_a_full_queue_refuses_clearly_and_keeps_nothing():
    s = make(max_queued=2, max_queued_tokens=150)
    s.submit(Ticket(tokens=100))
    with pytest.raises(OverloadedError, match="max_queued_tokens=150"):
        s.submit(Ticket(tokens=60))
    s.submit(Ticket(tokens=50))
    with pytest.raises(OverloadedError, match="max_queued=2"):
        s.submit(Ticket(tokens=1))
    assert len(s.waiting) == 2
    s.submit(Ticket(tokens=500, bounded=False))  # internal work is not refused
    assert len(s.waiting) == 3
    alone = make(max_queued_tokens=10)
    alone.submit(Ticket(tokens=500))  # one request alone is always taken, however long
    assert [t.tokens for t in alone.waiting] == [500]


def test_decoding_tickets_wait_for_a_slot_others_go_ahead():
    s = make(max_running=1)
    a, b = Ticket(tokens=10, decodes=True, payload="a"), Ticket(tokens=10, decodes=True, payload="b")
    score = Ticket(tokens=10, payload="score")
    for t in (a, b, score):
        s.submit(t)
    assert s.next() is a and s.running == 1
    assert s.next() is score  # b has no slot; a call that does not decode starts
    assert s.next() is None
    s.finish(a)
    assert s.next() is b and s.running == 1


def test_a_cancelled_ticket_leaves_the_queue():
    s = make()
    a, b = Ticket(tokens=10, payload="a"), Ticket(tokens=10, payload="b")
    s.submit(a)
    s.submit(b)
    assert s.cancel(a) and a.cancelled
    assert not s.cancel(a)
    assert drain(s) == ["b"]


@pytest.mark.parametrize(
    "field, value",
    [("max_running", 0), ("max_queued", 0), ("max_queued_tokens", -1), ("starvation_window", -1), ("decode_group", 0)]
    + [("max_running", 2.5), ("decode_group", True), ("prefill_slice_s", -0.1), ("prefill_slice_s", float("inf"))],
)
def test_serving_bounds_are_validated(field, value):
    with pytest.raises(InvalidRequestError, match=field):
        EngineConfig(**{field: value})


def test_background_work_starts_only_when_nothing_else_waits_or_decodes():
    s = make(starvation_window=1)
    refresh = Ticket(tokens=500, bounded=False, background=True, payload="refresh")
    request = Ticket(tokens=10, decodes=True, payload="request")
    s.submit(refresh)
    s.submit(request)
    assert s.has_foreground()
    assert s.next() is request and s.running == 1
    assert s.next() is None  # a request decodes: the engine is not idle
    s.submit(Ticket(tokens=1, payload="score"))
    assert s.next().payload == "score" and refresh.passed == 0  # never counted as passed over
    s.finish(request)
    assert not s.has_foreground() and s.next() is refresh


# -- speculative tickets (RAGCache's speculative prefill, issue 37) ------------------------------------


def test_speculative_work_starts_only_when_no_foreground_ticket_waits_and_before_background():
    s = make()
    s.submit(Ticket(tokens=10, background=True, bounded=False, payload="refresh"))
    s.submit(Ticket(tokens=10, speculative=True, bounded=False, payload="spec-1"))
    s.submit(Ticket(tokens=10, payload="request"))
    s.submit(Ticket(tokens=10, speculative=True, bounded=False, payload="spec-2"))
    assert not s.waiting[1].foreground and s.has_foreground()
    assert drain(s) == ["request", "spec-1", "spec-2", "refresh"]


def test_speculative_work_may_start_while_requests_decode_background_may_not():
    s = make(max_running=1)
    s.submit(Ticket(tokens=10, decodes=True, payload="decoding"))
    assert s.next().payload == "decoding" and s.running == 1
    s.submit(Ticket(tokens=10, background=True, bounded=False, payload="refresh"))
    s.submit(Ticket(tokens=10, speculative=True, bounded=False, payload="spec"))
    assert s.next().payload == "spec"
    assert s.next() is None  # the refresh waits for an idle engine
    # a foreground ticket waiting for a slot holds speculation back too
    s.submit(Ticket(tokens=10, decodes=True, payload="blocked"))
    s.submit(Ticket(tokens=10, speculative=True, bounded=False, payload="spec-2"))
    assert s.next() is None


def test_speculative_tickets_never_count_in_the_starvation_window():
    s = make(starvation_window=1)
    s.submit(Ticket(tokens=10, speculative=True, bounded=False, payload="spec"))
    s.submit(Ticket(tokens=100, cached=0, compute=100, payload="cold"))
    s.submit(Ticket(tokens=100, cached=90, compute=10, payload="hot"))
    assert drain(s) == ["hot", "cold", "spec"]  # the speculation was passed twice and never jumps ahead
    s.submit(Ticket(tokens=100, cached=0, compute=100, payload="cold"))
    s.submit(Ticket(tokens=10, speculative=True, bounded=False, payload="spec"))
    s.submit(Ticket(tokens=100, cached=90, compute=10, payload="hot"))
    first = s.next()
    assert first.payload == "hot" and [t.passed for t in s.waiting] == [1, 0]


def test_speculative_tickets_take_no_queue_bound():
    s = make(max_queued=1)
    s.submit(Ticket(tokens=10, payload="request"))
    s.submit(Ticket(tokens=10, speculative=True, bounded=False, payload="spec"))
    assert len(s.waiting) == 2
