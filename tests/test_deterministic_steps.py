"""The deterministic loop's pure helpers (swiftkern/deterministic_steps.py) against a step-by-step
simulation of the loop's rule for when a verify pass runs."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from swiftkern.deterministic_steps import Row, _steps_to_verify, _through_stop


def _simulated_wait(rows: list[Row], me: Row, window: int, verify_batch: int) -> int:
    """Fast steps until ``decode_deterministic`` runs a verify pass with ``me`` stopped now: each
    step every verified row that is neither stopped nor at its window adds one unverified token;
    a pass runs once the due rows (stopped, or at the window) number verify_batch, or every
    verified row (``me`` included)."""
    verified = [r for r in rows if r.verified]
    counts = {id(r): len(r.unverified) for r in verified}
    steps = 0
    while True:
        due = sum(r is me or r.stopped or counts[id(r)] >= window for r in verified)
        if due >= min(verify_batch, len(verified)):
            return steps
        for r in verified:
            if not (r is me or r.stopped or counts[id(r)] >= window):
                counts[id(r)] += 1
        steps += 1


@settings(max_examples=300, deadline=None)
@given(window=st.integers(1, 9), verify_batch=st.integers(1, 6),
       others=st.lists(st.tuples(st.integers(0, 10), st.booleans(), st.booleans()), max_size=7),
       mine=st.integers(0, 9))
def test_steps_to_verify_matches_the_loops_rule(window, verify_batch, others, mine):
    rows = [Row(pending=0, verified=v, unverified=[1] * n, stopped=s) for n, s, v in others]
    me = Row(pending=0, unverified=[1] * min(mine, window))
    rows.insert(len(rows) // 2, me)
    assert _steps_to_verify(rows, me, window, verify_batch) == _simulated_wait(rows, me, window, verify_batch)


def test_through_stop_keeps_the_first_stop_and_drops_what_follows():
    stops = frozenset({2, 9})
    assert _through_stop([5, 6, 2, 7, 9], stops) == [5, 6, 2]
    assert _through_stop([9, 1], stops) == [9]
    assert _through_stop([5, 6], stops) == [5, 6]
    assert _through_stop([], stops) == []
