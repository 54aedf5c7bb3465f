"""acceptance.Agreements: when a policy tries a choice it left out, against the schedule its
docstring states (explore_every, doubling per trial up to MAX_BACKOFF, reset by a win)."""

from swiftkern.acceptance import MAX_BACKOFF, Agreements


def decisions_until_due(agreements: Agreements, row, choice) -> int:
    n = 0
    while not agreements.due(row, choice):
        agreements.tick(row, "other", [choice])
        n += 1
    return n


def test_trials_back_off_until_the_choice_wins_again():
    ag = Agreements(lambda c: 0.5, explore_every=4)
    waits = []
    for _ in range(6):
        waits.append(decisions_until_due(ag, 0, "x"))
        ag.trial(0, "x")
    assert waits == [4, 8, 16, 32, 4 * MAX_BACKOFF, 4 * MAX_BACKOFF]
    ag.won(0, "x")
    assert decisions_until_due(ag, 0, "x") == 4
    assert ag.trials == 6


def test_a_trial_keeps_the_estimate_for_its_outcome_and_rows_are_separate():
    ag = Agreements(lambda c: 0.3, explore_every=2)
    for _ in range(20):
        ag.get(0, "x").update(5, 0)
    low = ag.get(0, "x").rate
    ag.trial(0, "x")
    assert ag.get(0, "x").rate == low < 0.05
    ag.get(0, "x").update(7, 7)  # the trial: every draft accepted
    assert 0.45 < ag.get(0, "x").rate < 0.5  # 7 accepted against the ~9 decayed misses
    assert decisions_until_due(ag, 1, "x") == 2  # row 1's schedule is its own
    ag.tick(0, "x", ["x", "y"])  # using x: it is no longer idle, and y is one decision idle
    assert not ag.due(0, "x") and decisions_until_due(ag, 0, "y") == 1


def test_using_a_choice_restarts_its_wait():
    """A decision that uses a choice sets its idle count to 0 (the others' go up by one): after two
    decisions without x and one with it, x is due explore_every = 3 decisions later, y (idle 1) after 2."""
    ag = Agreements(lambda c: 0.5, explore_every=3)
    ag.tick(0, "y", ["x", "y"])
    ag.tick(0, "y", ["x", "y"])
    ag.tick(0, "x", ["x", "y"])
    assert not ag.due(0, "x") and decisions_until_due(ag, 0, "x") == 3
    assert decisions_until_due(ag, 0, "y") == 2
