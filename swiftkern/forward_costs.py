"""What the speculative loop's steps cost, as it times them: a step that verifies T tokens per
row, and a layer-skipped draft forward, for ``drafter_policy``'s choices.
"""

from __future__ import annotations

from dataclasses import dataclass, field

COOLDOWN_STEPS = 4  # plain steps after a wider pass (or a prefill) that it slows (ForwardCosts.time_step)


@dataclass
class ForwardCosts:
    """Seconds of a step that verifies T tokens per row (its full-model forward and the step's
    own work around it: lookups, choices, acceptance, commits), and of one layer-skipped draft
    forward, as running means (decay ``decay`` per new sample).

    verify(T) interpolates linearly between measured T, read as never falling with T (a wider
    pass measured cheaper is noise: taken at face value, the line through verify(1) and a
    cheaper verify(2) made every wider pass look free); outside them it extends the line
    through the last two. With one point it follows ``shape`` (the costs at another
    batch size: their growth with T relative to their own point), or without one grows by
    ``prior_slope`` of verify(1) per extra token, which is what a compute-light decode step
    looks like. ``draft_cost()``: the measured draft forward, else ``shape``'s relative to
    its verify(1), else half a verify(1).

    ``time_step`` feeds it the loop's passes in order and charges a pass for the plain steps
    it slows down after it: on the CPU machine a decode step takes 5.4 ms in a row of decode
    steps, and the four after a pass of 8 tokens take 6.4-6.8, 6.2-6.5, 6.0-6.3 and 5.8-5.9
    ms (after 32 tokens 8.3-8.7 at first). Timed alone, a wide pass looked cheaper than it is
    and the plain steps dearer, which made drafting look better than it was. (A prefill slows
    the steps after it too, to 9 ms at first: ``DrafterPolicy.prefilled`` leaves them untimed.)

    A sample counts as at most ``spike`` times the running mean it joins (a plain step's charge
    to a wide pass too): the loop's plain steps took p50 9.7, p90 12.0, p99 29.8, max 46 ms on
    the CPU machine, and a step of 46 ms lifted verify(1) by 7 ms, the running max lifted the
    wider passes with it and drafts looked free. In the lookup replay told step times with that
    spread (``python -m bench --routine lookup_replay``, provider ``noisy``) the policy lost
    1.2-4.2 % of its noise-free speed, and with the clip at 1.5 it lost -0.3 to 1.2 %."""

    decay: float = 0.8
    prior_slope: float = 0.15
    spike: float = 1.5  # a sample joins a running mean as at most this times the mean
    _verify: dict = field(default_factory=dict)  # T -> running mean seconds
    draft: float | None = None
    shape: "ForwardCosts | None" = None
    # the last pass wider than one token, its seconds so far, and the plain steps after it
    # still to charge to it
    _cooling: tuple[int, float, int] | None = None
    _version: int = field(default=0, repr=False, compare=False)  # add_verify calls so far
    # _verify's points sorted by T with costs as a running max, and the _version they hold for
    _points: dict = field(default_factory=dict, repr=False, compare=False)
    _points_version: int = field(default=-1, repr=False, compare=False)
    # verify(1), verify(2), ... as last computed, and the versions (own, shape's) they hold for
    _table: list = field(default_factory=list, repr=False, compare=False)
    _table_stamp: tuple | None = field(default=None, repr=False, compare=False)

    def _clip(self, sample: float, mean: float) -> float:
        return min(sample, self.spike * mean)

    def _mix(self, old: float | None, new: float) -> float:
        return new if old is None else self.decay * old + (1 - self.decay) * self._clip(new, old)

    def add_verify(self, T: int, seconds: float) -> None:
        self._verify[T] = self._mix(self._verify.get(T), seconds)
        self._version += 1

    def time_step(self, T: int, seconds: float) -> None:
        """A pass of T tokens a row took ``seconds``, in the order the loop ran them. A plain
        step (T = 1) within COOLDOWN_STEPS of a wider pass also adds its time over verify(1) to
        that pass's, which is recorded once those steps are done or another wide pass starts.
        (Every plain step still updates verify(1): kept to the steps out of any cool-down, it
        went stale where most steps follow a lookup draft, and the charges with it.)"""
        if self._cooling is not None and T == 1 and 1 in self._verify:
            wide, spent, left = self._cooling
            plain = self._verify[1]
            self._cooling = (wide, spent + self._clip(seconds, plain) - plain, left - 1)
            if left == 1:
                self.end_cooldown()
        elif T > 1:
            self.end_cooldown()
            self._cooling = (T, seconds, COOLDOWN_STEPS)
        if T == 1:
            self.add_verify(1, seconds)

    def end_cooldown(self) -> None:
        """Records the wide pass still cooling down, if any, with the excess so far."""
        if self._cooling is not None:
            self.add_verify(self._cooling[0], max(self._cooling[1], 1e-9))
        self._cooling = None

    def add_draft(self, seconds_per_forward: float) -> None:
        self.draft = self._mix(self.draft, seconds_per_forward)

    def known(self) -> bool:
        return bool(self._verify)

    def has_growth(self) -> bool:
        """Whether verify passes of two or more widths are timed (how cost grows with T is known)."""
        return len(self._verify) >= 2

    def widest(self) -> int:
        """The widest pass timed, here or in ``shape`` (0: none)."""
        own = max(self._verify, default=0)
        return max(own, self.shape.widest()) if self.shape is not None else own

    def _monotone(self) -> dict:
        """{T: cost} in increasing T, each cost the running max (a wider pass costs no less)."""
        if self._points_version != self._version:
            self._points, self._points_version, floor = {}, self._version, 0.0
            for t, c in sorted(self._verify.items()):
                floor = max(floor, c)
                self._points[t] = floor
        return self._points

    def _stamp(self) -> tuple:
        """What verify() depends on, as versions: its own points and its shape's."""
        return (self._version, self.shape._stamp() if self.shape is not None else None)

    def verify_upto(self, n: int) -> list[float]:
        """[verify(1), ..., verify(n)] (at least those: a longer list may come back). The drafter
        policy values every draft count of every row each step, ~20 verify() calls a row; this
        computes each once until a pass is timed (on the CPU machine the choice took ~0.1 ms a
        step, as much as the rest of the step's host work; on a GPU it delays the next launch)."""
        stamp = self._stamp()
        if stamp != self._table_stamp:
            self._table, self._table_stamp = [], stamp
        table = self._table
        for T in range(len(table) + 1, n + 1):
            table.append(self.verify(T))
        return table

    def verify(self, T: int) -> float:
        points = self._monotone()
        if not points:
            raise ValueError("no verify cost measured yet")
        if T in points:
            return points[T]
        pts = list(points.items())
        if len(pts) == 1:
            t0, c0 = pts[0]
            if self.shape is not None and self.shape.has_growth():
                return c0 * self.shape.verify(T) / self.shape.verify(t0)
            base = c0 / (1 + self.prior_slope * (t0 - 1))
            return base * (1 + self.prior_slope * (T - 1))
        lo = [p for p in pts if p[0] < T]
        hi = [p for p in pts if p[0] > T]
        if not lo:  # narrower than any timed pass: no cheaper a token than the narrowest
            (t0, c0), (t1, c1) = pts[0], pts[1]
            return max(c0 + (c1 - c0) * (T - t0) / (t1 - t0), c0 * T / t0)
        (t0, c0), (t1, c1) = (lo[-1], hi[0]) if hi else (pts[-2], pts[-1])
        return c0 + (c1 - c0) * (T - t0) / (t1 - t0)

    def wide_pass_floor(self, T: int) -> float:
        """What a pass of T tokens costs at least, read from the widest pass timed here: its cost
        grown by ``prior_slope`` of verify(1) per extra token (0 when nothing is timed, or T is
        no wider). Past the timed passes ``verify`` extends the line through the last two, and
        under load those are often equal (the running max of a noisy verify(1) lifts them
        all): 128 tokens then read as the price of 16, 0.10 s, where a search phase of
        4 x 32 tokens took 0.86 s (the 2-core Xeon, 2026-11-28).

        ``verify`` itself is not floored so: a flat line is also what a pass costs where it is
        launch-bound (the invariant set on an H100, CUDA graphs: 8 tokens 1.72 ms, 1 token 1.70),
        and there the floor would read 32 tokens as 1.7 x 16's, so the drafter policy would never
        try them. The policy trusts the line only up to twice the widest timed pass
        (``DrafterPolicy._most_drafts``), so a flat line costs it one wider pass, which is then timed."""
        points = self._monotone()
        if not points:
            return 0.0
        t, c = next(reversed(points.items()))
        if T <= t:
            return 0.0
        return c * (1 + self.prior_slope * (T - 1)) / (1 + self.prior_slope * (t - 1))

    def draft_cost(self) -> float:
        if self.draft is not None:
            return self.draft
        if self.shape is not None and self.shape.draft is not None and self.shape.known():
            return self.shape.draft * self.verify(1) / self.shape.verify(1)
        return 0.5 * self.verify(1)
