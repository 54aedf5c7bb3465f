"""The deterministic replay's fast path with a layer set (LLM-42 with self-speculation): which
forward proposes the next tokens, and when a prompt-lookup match is worth a verify pass, from
measured costs and agreement.

A row's unverified tokens come from fast forwards (one batched forward a token, of the full
model or of the layer-skipped draft) until a fixed-shape verify pass commits the matching prefix
plus the verifier's own token. With agreement a per proposed token (compared left to right
until the first miss), E(a, n) = 1 + a + ... + a^n tokens are committed from n proposed. A
cycle of n fast tokens of kind k (``full`` or ``draft``) then costs n c_k + c_V and commits
E(a_k, n): its rate is

    R_k = E(a_k, n_k) / (n_k c_k + c_V),

with c_k a row's share of a forward of kind k, c_V its share of a verify pass (seconds over the
rows in it) and n_k the fast tokens a cycle of kind k holds (measured; at first W - 1). Each
fast step runs the kind with the larger sum of R_k over the rows drafting. A draft's skipped
attention layers write no KV, so rows holding draft tokens are verified before a full step.

A lookup match of m tokens (no model cost) sends its row to a verify pass: with u fast tokens
of kind k already unverified it commits E(a_k, u) + a_k^u (E(a_L, m) - 1) for (u + w) c_k + c_V,
w the fast steps the row sits out until its pass has a full group of rows, and is taken when
that rate beats R_k by LOOKUP_MARGIN.

Exploration (``acceptance.Agreements``): a kind the rows have left out ``explore_every`` fast
steps is tried for one short cycle (from a step where no row holds unverified tokens, for
TRIAL_TOKENS fast tokens a row, then its verify pass; the first cycle, before anything is
timed, is such a trial of the draft), and a lookup class declined that often is taken once when its row would not
wait for its verify pass, so an estimate that fell, or a prior that loses on this machine's
costs, is measured again.

The output does not depend on these choices (the verifier commits its own tokens; they decide
only what it is shown), so choosing by timings keeps it deterministic.
"""

from __future__ import annotations

from .acceptance import Agreements, expected_tokens
from .drafter_policy import LOOKUP_PRIORS, lookup_bucket

KINDS = ("full", "draft")
PRIORS = {"full": 0.95, "draft": 0.6}  # agreement of a fast token with the verifier, before measuring
PRIOR_DRAFT_COST = 0.5  # a draft forward's cost in full forwards, before one is timed
PRIOR_VERIFY_SLOPE = 0.15  # before a verify pass is timed: c_V = c_full (1 + slope (tokens - 1)) / rows
# a lookup match must promise this much more than the fast path: near break-even the estimates'
# error is larger than the gain (SmolLM2 on the CPU, replay forced: matches taken at break-even
# cut the fast tokens by a third and doubled the verify passes for no gain in time)
LOOKUP_MARGIN = 1.15
# a trial of a kind ends after this many fast tokens a row (then its verify pass): enough to
# measure agreement; a whole window of a losing kind was mostly rolled back (SmolLM2 on the CPU,
# window 32, the draft tried first: 17 % of the fast tokens rolled back over five prompts)
TRIAL_TOKENS = 4


class FastPathPolicy:
    """Picks each fast step's forward (``kind``) and each lookup match (``take``) for the rows of
    a deterministic replay; fed the costs (``record_fast``, ``record_verify``) and agreements
    (``observe``) measured while decoding.

    window, verify_batch: the verifier's fixed shape. explore_every: a choice left out this many
    times on a row (a kind, or a lookup class) is tried again (see the module's docstring).
    measure False: a fixed cost model instead of timings (a full forward 1, a
    draft PRIOR_DRAFT_COST, a verify pass from PRIOR_VERIFY_SLOPE), so the choices follow the
    agreement alone (tests on a loaded machine).
    """

    def __init__(self, window: int, verify_batch: int, explore_every: int = 32, decay: float = 0.8,
                 measure: bool = True):
        self.window, self.verify_batch = window, verify_batch
        self.explore_every, self.decay, self.measure = explore_every, decay, measure
        # kind -> seconds of a forward per row in it
        self.fast_cost: dict[str, float] = {} if measure else {"full": 1.0, "draft": PRIOR_DRAFT_COST}
        self.verify_cost: float | None = None  # seconds of a verify pass per real row in it
        # per (request, kind | ("lookup", bucket))
        self.agreements = Agreements(
            lambda what: PRIORS[what] if isinstance(what, str) else LOOKUP_PRIORS[what[1] - 1], explore_every)
        self._trial: dict[int, str] = {}  # request -> the kind it tries until its next verify pass
        self._run: dict[tuple[int, str], float] = {}  # (request, kind) -> fast tokens a cycle (mean)
        self.taken = self.declined = 0

    # --- measurements ------------------------------------------------------------------
    def _mix(self, old: float | None, new: float) -> float:
        return new if old is None else self.decay * old + (1 - self.decay) * new

    def record_fast(self, kind: str, seconds: float, rows: int) -> None:
        if self.measure:
            self.fast_cost[kind] = self._mix(self.fast_cost.get(kind), seconds / rows)

    def record_verify(self, seconds: float, rows: int) -> None:
        if self.measure:
            self.verify_cost = self._mix(self.verify_cost, seconds / rows)

    def observe(self, request: int, kind: str | None, fast: int, lookup: int, matched: int, ngram: int) -> None:
        """A verify pass compared ``fast`` fast tokens of ``kind`` then ``lookup`` lookup tokens
        (from a match of ``ngram`` tokens) of request's row, and the first ``matched`` agreed."""
        trial = self._trial.pop(request, None) is not None
        if fast and kind is not None:
            self.agreements.get(request, kind).update(fast, min(matched, fast))
            if not lookup and not trial:  # a trial's cycle is cut at TRIAL_TOKENS
                self._run[(request, kind)] = self._mix(self._run.get((request, kind)), float(fast))
        if lookup and matched >= fast:
            self.agreements.get(request, ("lookup", lookup_bucket(ngram))).update(lookup, matched - fast)

    # --- choices -----------------------------------------------------------------------
    def _cost(self, kind: str) -> float:
        if kind in self.fast_cost:
            return self.fast_cost[kind]
        other = self.fast_cost["draft" if kind == "full" else "full"]
        return other * PRIOR_DRAFT_COST if kind == "draft" else other / PRIOR_DRAFT_COST

    def _verify_share(self) -> float:
        if self.verify_cost is not None:
            return self.verify_cost
        tokens = self.verify_batch * self.window
        return self._cost("full") * (1 + PRIOR_VERIFY_SLOPE * (tokens - 1)) / self.verify_batch

    def _rate(self, request: int, kind: str) -> float:
        a = self.agreements.get(request, kind).rate
        n = max(1, round(self._run.get((request, kind), self.window - 1)))
        return expected_tokens(a, n) / (n * self._cost(kind) + self._verify_share())

    def kind(self, requests: list[int], fresh: bool = True) -> str:
        """The forward for this fast step of the drafting rows ``requests`` ("full" | "draft").
        fresh: none of them holds unverified tokens; a trial starts only then, so that its rows
        reach their windows together instead of being sent to early verify passes."""
        trying = [self._trial[r] for r in requests if r in self._trial]
        if not self.fast_cost:  # nothing timed yet: try the draft first, as the user asked
            choice = "draft"
            for r in requests:
                self._trial[r] = choice
        elif trying:  # a trial lasts until its rows' verify passes
            choice = trying[0]
        else:
            choice = max(KINDS, key=lambda k: sum(self._rate(r, k) for r in requests))
            for r in requests:
                self.agreements.won(r, choice)
            other = KINDS[1 - KINDS.index(choice)]
            if fresh and requests and all(self.agreements.due(r, other) for r in requests):
                for r in requests:
                    self.agreements.trial(r, other)
                    self._trial[r] = other
                choice = other
        for r in requests:
            self.agreements.tick(r, choice, KINDS)
        return choice

    def trial_tokens(self, request: int) -> int | None:
        """The fast tokens after which request's row goes to its verify pass because it is trying
        a kind (TRIAL_TOKENS), or None when it is not."""
        return TRIAL_TOKENS if request in self._trial else None

    def take(self, request: int, kind: str, unverified: int, match_len: int, ngram: int, wait: int = 0) -> bool:
        """Whether request's row, holding ``unverified`` fast tokens of ``kind`` (the kind its
        next step would run), takes a lookup match of ``match_len`` tokens from a context match
        of ``ngram`` tokens, and is verified next, after ``wait`` fast steps of the batch that
        it sits out (its verify pass waits for a full group of rows)."""
        lookup = ("lookup", lookup_bucket(ngram))
        take = False
        if self.fast_cost and wait == 0 and self.agreements.due(request, lookup):  # a trial, when it costs no wait
            self.agreements.trial(request, lookup)
            take = True
        elif self.fast_cost:
            a_k, a_l = self.agreements.get(request, kind).rate, self.agreements.get(request, lookup).rate
            tokens = expected_tokens(a_k, unverified) + a_k ** unverified * (expected_tokens(a_l, match_len) - 1)
            rate = tokens / ((unverified + wait) * self._cost(kind) + self._verify_share())
            take = rate > LOOKUP_MARGIN * self._rate(request, kind)
            if take:
                self.agreements.won(request, lookup)
        self.agreements.tick(request, lookup if take else None, [lookup])
        self.taken += take
        self.declined += not take
        return take
