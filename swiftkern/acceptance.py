"""Running estimates of how often proposed tokens are accepted, and when a policy tries an
unused choice again.

A policy that only compares estimates never measures a choice again once it loses: a drafter
that missed on a hard passage, or whose prior loses on this machine's costs, stays unused even
after the text turns easy. ``Agreements`` counts, per (row, choice), the decisions since the
row last used the choice; one left out ``explore_every`` times is *due*, and the policy runs it
once as a trial whose outcome updates the stale estimate (after a long run of misses, a trial
whose 7 drafts are all accepted lifts it from ~0 to ~0.47; going back to the prior instead
made the policy follow an optimistic prior for several decisions before the outcome came in).
Each trial doubles the wait before the next one (up to MAX_BACKOFF x explore_every) until the
choice wins on its estimate again (``won``), so a choice that keeps losing costs O(log steps)
trials rather than one every explore_every steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Hashable, Iterable

MAX_BACKOFF = 8  # the longest wait between trials of a choice: this many times explore_every


def expected_tokens(a: float, k: int) -> float:
    """E[tokens emitted] by a step with k drafts of acceptance a: sum_{i=0..k} a^i."""
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


@dataclass
class Acceptance:
    """Per-draft acceptance a of one drafter on one row: accepted / (accepted + misses),
    both counts decayed by ``decay`` per verify, starting from ``prior`` worth ``prior_weight``
    observations. A verify of n drafts with m accepted adds m accepted and a miss if m < n."""

    prior: float = 0.5
    prior_weight: float = 2.0
    decay: float = 0.9
    accepted: float = field(default=0.0)
    misses: float = field(default=0.0)

    def __post_init__(self):
        self.accepted = self.prior * self.prior_weight
        self.misses = (1 - self.prior) * self.prior_weight

    def update(self, num_draft: int, num_accepted: int) -> None:
        if num_draft == 0:
            return
        self.accepted = self.decay * self.accepted + num_accepted
        self.misses = self.decay * self.misses + (1.0 if num_accepted < num_draft else 0.0)

    @property
    def rate(self) -> float:
        return self.accepted / (self.accepted + self.misses)


class Agreements:
    """Per (row, choice): an ``Acceptance`` from ``prior_of(choice)``, how many decisions of the
    row have left the choice out since it was last used (``tick``), and the wait for a trial:
    ``due`` once those decisions reach it (explore_every at first, doubled by each ``trial``,
    back to explore_every when the choice ``won``)."""

    def __init__(self, prior_of: Callable[[Hashable], float], explore_every: int):
        if explore_every < 1:
            raise ValueError(f"explore_every must be >= 1, got {explore_every}")
        self.prior_of = prior_of
        self.explore_every = explore_every
        self._rows: dict = {}  # row -> {choice: [Acceptance, decisions since last used, wait for a trial]}
        self.trials = 0

    def _entry(self, row: Hashable, choice: Hashable) -> list:
        entries = self._rows.setdefault(row, {})
        if choice not in entries:
            entries[choice] = [Acceptance(prior=self.prior_of(choice)), 0, self.explore_every]
        return entries[choice]

    def get(self, row: Hashable, choice: Hashable) -> Acceptance:
        return self._entry(row, choice)[0]

    def choices(self, row: Hashable) -> list:
        """The choices row has an estimate for."""
        return list(self._rows.get(row, {}))

    def due(self, row: Hashable, choice: Hashable) -> bool:
        """Whether row has left ``choice`` out for as many decisions as its trial waits for."""
        entry = self._entry(row, choice)
        return entry[1] >= entry[2]

    def trial(self, row: Hashable, choice: Hashable) -> None:
        """Row tries ``choice`` now (its estimate is kept, for the trial's outcome to update); the
        next trial waits twice as long (up to MAX_BACKOFF x explore_every)."""
        entry = self._entry(row, choice)
        entry[1], entry[2] = 0, min(2 * entry[2], MAX_BACKOFF * self.explore_every)
        self.trials += 1

    def won(self, row: Hashable, choice: Hashable) -> None:
        """``choice`` won a decision of row on its estimate: its next trial waits explore_every."""
        self._entry(row, choice)[2] = self.explore_every

    def tick(self, row: Hashable, used: Hashable | None, among: Iterable) -> None:
        """A decision of row used ``used`` (None: none of them) and left out the rest of ``among``."""
        for choice in among:
            entry = self._entry(row, choice)
            entry[1] = 0 if choice == used else entry[1] + 1
