"""Which drafter a row uses at each step, and how many drafts, from measured cost and acceptance.

A step of row b drafts k tokens with drafter d, then verifies k+1 positions in one forward.
With a per-draft acceptance probability a (drafts are accepted left to right until the first
miss), the step emits E(k) = 1 + a + ... + a^k = (1 - a^(k+1)) / (1 - a) tokens and costs
k * c_d + c_verify(k+1) seconds (c_d = 0 for prompt lookup). The policy picks the drafter and
k with the most expected tokens per second; "none" (k = 0) emits one token for c_verify(1),
which is plain decoding.

A layer-skip run that confidence stops pays one forward more than it drafts (the draft whose
top-1 probability fell below eps is thrown away), and a run whose first draft is already below
eps drafts nothing yet pays that forward. Both are kept per row (``skip_waste``, ``skip_empty``)
and valued: a share e of empty runs and w wasted forwards per run make a step's tokens
e + (1 - e) E(k) for e (c_d + c_verify(1)) + (1 - e) ((k + w) c_d + c_verify(k+1)) seconds.
Before, an empty run was counted as plain decoding, so a layer set whose drafts were seldom
confident looked free. How common that is: SmolLM2 with the README's 7-sub-layer set and the
layer-skip drafter alone (no policy; `determinism` routine) drafted nothing in 326 of 432 runs,
and 430 of its 644 draft forwards were thrown away.

Costs are measured while generating (``ForwardCosts``); acceptance is the maximum-likelihood
a of a truncated geometric model, accepted / (accepted + misses), counted with a decay so it
follows the text (``Acceptance``). Prompt lookup's acceptance is kept per match length (1, 2,
3, 4+ tokens of context matched): a long match is a far better bet than a one-token one
(on SmolLM2 18 % of 1-token matches predicted the next token, 78-91 % of 4+-token ones).

In a batch the rows share one verify pass, as wide as the longest draft: ``fit_pass`` cuts
the rows' choices to the width with the most expected tokens per second for the batch, and the
costs are kept per batch size (a pass grows with its width differently at each).
"""

from __future__ import annotations

from dataclasses import dataclass

from .acceptance import Acceptance, Agreements, expected_tokens  # noqa: F401  (Acceptance: re-exported)
from .forward_costs import COOLDOWN_STEPS, ForwardCosts  # noqa: F401  (ForwardCosts: re-exported)

DRAFTERS = ("auto", "layer-skip", "lookup", "none")
# prior acceptance of a lookup draft by the length of the context match it came from (1, 2, 3, 4+)
LOOKUP_PRIORS = (0.3, 0.5, 0.6, 0.8)


def lookup_bucket(ngram: int) -> int:
    """The acceptance class of a lookup match of ``ngram`` tokens: 1, 2, 3 or 4 (4 or more)."""
    return max(1, min(ngram, len(LOOKUP_PRIORS)))


def _move_mean(means: dict, row: int, value: float, prior: float | None) -> None:
    """A row's running mean moved a fifth of the way to ``value``, from ``prior`` at first
    (None: the first value is the mean)."""
    old = means.get(row, prior)
    means[row] = float(value) if old is None else 0.8 * old + 0.2 * value


def _class_key(drafter: str, lookup_ngram: int) -> tuple[str, int]:
    return (drafter, lookup_bucket(lookup_ngram) if drafter == "lookup" else 0)


@dataclass
class Choice:
    drafter: str  # "layer-skip" | "lookup" | "none"
    k: int  # drafts to use (for layer-skip: the most; confidence may stop earlier)
    tokens_per_s: float  # the expected rate that won
    acceptance: float = 0.0  # the per-draft acceptance it was valued at
    expected_drafts: int = 0  # the drafts it expects to use (layer-skip: what confidence leaves of k)
    waste: float = 0.0  # layer-skip: forwards a run stopped by confidence pays beyond its drafts


class DrafterPolicy:
    """Chooses per row and step among prompt lookup, the layer-skipped model and no draft.

    ``allowed``: the drafters it may pick ("none" always); ``k_max``: most drafts per step.
    Call ``choose(row, lookup_len, budget, lookup_ngram=n)`` before a step and ``observe(row,
    drafter, num_draft, num_accepted, lookup_ngram=n)`` after it; the generation loop feeds
    ``costs``. Lookup acceptance is per (row, match length class), layer-skip's per row.
    Exploration (``acceptance.Agreements``): a drafter a row has not used for ``explore_every``
    steps is tried once, as soon as it can draft for the row, and the trial's outcome updates
    its estimate, so a low estimate (or a losing prior) is measured again now and then. Costs
    are kept per batch size (``costs``, ``set_batch``).

    ``costs``: a dict of costs per batch size to keep and go on with (a ``Generator`` passes
    the same one to each of its calls: what a pass costs is the machine's and the model's, not
    the text's), else a new one. ``measure=False`` keeps the costs at a fixed model (verify(T)
    = 1 + 0.15 (T - 1), a draft forward 0.5) instead of timing: choices then depend only on the
    drafts' acceptance, which is what seeded sampling needs to give the same tokens on every run
    (timings vary). ``rows_alone=True``: ``fit_pass`` leaves every row's choice as it is, so a
    row's drafts depend on its own tokens alone, whatever else is in the batch: what mode
    deterministic's seeded sampling needs where it runs without a replay (rejection sampling
    draws from the drafts, so a pass width cut by other rows would change a row's tokens).
    """

    def __init__(self, allowed: tuple[str, ...], k_max: int, explore_every: int = 32,
                 lookup_priors: tuple[float, ...] = LOOKUP_PRIORS, skip_prior: float = 0.6, measure: bool = True,
                 costs: dict | None = None, rows_alone: bool = False):
        if len(lookup_priors) != len(LOOKUP_PRIORS):
            raise ValueError(f"lookup_priors: one prior per match length class (1, 2, 3, 4+), got {lookup_priors}")
        self.allowed = tuple(allowed)
        self.k_max = k_max
        self.explore_every = explore_every
        self.priors = {_class_key("lookup", n): p for n, p in enumerate(lookup_priors, start=1)}
        self.priors[_class_key("layer-skip", 0)] = skip_prior
        # per (row, (drafter, class)); class: lookup_bucket of the match for lookup, 0 for layer-skip
        self.agreements = Agreements(self.priors.__getitem__, explore_every)
        self.measure = measure
        self.rows_alone = rows_alone
        self.batch = 1
        # batch size -> its costs (measure=False: one fixed model)
        self._costs: dict[int, ForwardCosts] = costs if costs is not None and measure else {}
        if not measure:
            fixed = self._costs[0] = ForwardCosts()
            fixed.add_verify(1, 1.0)
            fixed.add_draft(0.5)
        self._draft_len: dict = {}  # per row: drafts a confident layer-skip run yields (running mean)
        self._skip_empty: dict = {}  # per row: share of layer-skip runs that drafted nothing (running mean)
        self._skip_waste: dict = {}  # per row: forwards a drafting run paid beyond its drafts (running mean)
        self._prefill_left = 0  # steps after a prefill still not to time

    @property
    def costs(self) -> ForwardCosts:
        """The costs at the current batch size (``set_batch``): a pass over B rows grows with its
        width differently at each B (on a CPU, near flat at batch 1 and near proportional at
        batch 8), so costs measured while the batch was large do not hold for the rows left
        when it shrinks. A batch size not timed yet borrows the shape of the nearest one that is."""
        if not self.measure:
            return self._costs[0]
        costs = self._costs.get(self.batch)
        if costs is None:
            timed = [b for b, c in self._costs.items() if c.has_growth()]
            near = min(timed, key=lambda b: (abs(b - self.batch), b)) if timed else None
            costs = self._costs[self.batch] = ForwardCosts(shape=self._costs[near] if near is not None else None)
        return costs

    def set_batch(self, batch: int) -> None:
        """The rows of the coming steps (the loop calls this each step)."""
        self.batch = batch

    def record_verify(self, T: int, seconds: float) -> None:
        """A verify pass of T tokens a row took ``seconds`` (``ForwardCosts.time_step``); the
        loop calls it once a step, after ``record_draft``."""
        if self._prefill_left:
            self._prefill_left -= 1
        elif self.measure:
            self.costs.time_step(T, seconds)

    def record_draft(self, seconds_per_forward: float) -> None:
        if self.measure and not self._prefill_left:
            self.costs.add_draft(seconds_per_forward)

    def prefilled(self) -> None:
        """A prefill ran: the next COOLDOWN_STEPS steps are not timed (it slows them as a wide
        pass does, ``ForwardCosts.time_step``, but its cost is no drafter's)."""
        self._prefill_left = COOLDOWN_STEPS
        for costs in self._costs.values():
            costs.end_cooldown()

    def acceptance(self, row: int, drafter: str, lookup_ngram: int = 1) -> Acceptance:
        """The running acceptance of ``drafter`` on ``row`` (lookup: for matches of
        ``lookup_ngram`` tokens)."""
        return self.agreements.get(row, _class_key(drafter, lookup_ngram))

    def _rate(self, a: float, k: int, draft_cost: float, verify_cost: float | None = None,
              empty: float = 0.0, waste: float = 0.0, verify_one: float | None = None) -> float:
        """Expected tokens per second of a step with k drafts of acceptance a (verify_cost /
        verify_one: the passes of k + 1 and of 1 token, when the caller has them; else read from
        the costs). Layer-skip: ``empty`` of its runs draft nothing (one forward, then a pass of
        1 token) and a drafting run pays ``waste`` forwards beyond its k drafts."""
        if verify_cost is None:
            verify_cost = self.costs.verify(k + 1)
        tokens = expected_tokens(a, k)
        seconds = (k + waste) * draft_cost + verify_cost
        if empty:
            if verify_one is None:
                verify_one = self.costs.verify(1)
            tokens = empty + (1.0 - empty) * tokens
            seconds = empty * (draft_cost + verify_one) + (1.0 - empty) * seconds
        return tokens / seconds

    def _most_drafts(self) -> int:
        """Most drafts a step is valued at: a verify pass at most twice as wide as the widest
        timed at this batch size (or the one it borrows from), so a choice never rests on a
        cost extrapolated far past what was measured; each wider pass timed widens the range
        (1, 2, 4, 8, ... tokens). Unlimited with the fixed cost model (measure=False)."""
        return 2 * self.costs.widest() - 1 if self.measure else self.k_max

    def _best_k(self, a: float, k_limit: int, draft_cost: float, empty: float = 0.0,
                waste: float = 0.0) -> tuple[int, float]:
        k_limit = min(k_limit, self._most_drafts())
        verify = self.costs.verify_upto(k_limit + 1)  # verify[T - 1]: a pass of T tokens
        best_k, best = 0, 1.0 / verify[0]
        for k in range(1, k_limit + 1):
            rate = self._rate(a, k, draft_cost, verify[k], empty, waste, verify[0])
            if rate > best:
                best_k, best = k, rate
        return best_k, best

    def _trial_k(self, key: tuple[str, int], k_most: int, draft_cost: float) -> int:
        """Drafts for a trial: as many as the drafter's prior would take at its cost (at least
        one). A trial measures acceptance, and one verified draft does. All k_most of them made
        a trial dear: a 1-token lookup match can bring 25 (a 26-token verify pass, several
        decode steps on a CPU; SmolLM2, story prompt: two such trials cost ~7 % of the run), and
        a confident layer-skip run drafted 24 forwards of ~0.8 a decode step each, of which 5
        were accepted (SmolLM2 on the AMD CPU, self-spec + deterministic over five prompts:
        layer-skip draft steps 13 -> 5, decode 1.32 -> 1.18 s in one A/B run)."""
        return max(1, self._best_k(self.priors[key], k_most, draft_cost)[0])

    def choose(self, row: int, lookup_len: int, budget: int, layer_skip: bool = True,
               lookup_ngram: int = 1) -> Choice:
        """The drafter and number of drafts for ``row`` this step. lookup_len: drafts prompt
        lookup has for it (0 = no match), from a context match of lookup_ngram tokens;
        budget: most drafts the row may still use; layer_skip: False while there is no layer
        set to draft with."""
        if budget <= 0 or not self.costs.known():
            # nothing measured yet: the first step is a plain one that measures verify(1)
            return Choice("none", 0, 0.0)
        best = Choice("none", 0, 1.0 / self.costs.verify(1))
        draft_cost = self.costs.draft_cost()
        candidates = []  # (drafter, k, draft cost, lookup_ngram)
        if "lookup" in self.allowed and lookup_len > 0:
            candidates.append(("lookup", min(lookup_len, budget, self.k_max), 0.0, lookup_ngram))
        if "layer-skip" in self.allowed and layer_skip:
            candidates.append(("layer-skip", min(budget, self.k_max), draft_cost, 1))
        for drafter, k_most, cost, ngram in candidates:
            a = self.acceptance(row, drafter, ngram).rate
            limit, empty, waste = k_most, 0.0, 0.0
            if drafter == "layer-skip":  # confidence stops a run early: value the drafts it yields
                limit = min(k_most, max(1, round(self._draft_len.get(row, float(self.k_max)))))
                empty, waste = self._skip_empty.get(row, 0.0), self._skip_waste.get(row, 1.0)
            k, rate = self._best_k(a, limit, cost, empty, waste)
            if k > 0 and rate > best.tokens_per_s:
                best = Choice(drafter, k if drafter == "lookup" else k_most, rate, a, k, waste)
        for drafter, k_most, cost, ngram in candidates:
            key = _class_key(drafter, ngram)
            if drafter != best.drafter and self.agreements.due(row, key):
                self.agreements.trial(row, key)
                a = self.agreements.get(row, key).rate
                k = self._trial_k(key, k_most, cost)
                return Choice(drafter, k, self._rate(a, k, cost), a, k)
        if best.drafter != "none":
            self.agreements.won(row, _class_key(best.drafter, lookup_ngram))
        return best

    def fit_pass(self, choices: list[Choice]) -> list[Choice]:
        """The rows' choices cut to one verify-pass width for the batch. A pass is as wide as
        its longest draft and every row pays for that width, so rows drafting on their own
        account can make the batch slower than plain decoding (each row compares its tokens
        with the whole pass's cost, not the other rows' tokens made dearer). This picks the
        width K (drafts per row at most) with the most expected tokens per second for the
        batch, sum_i E(a_i, min(n_i, K)) / (d(K) c_d + verify(K + 1)) over K = 0 .. max n_i
        (n_i: the drafts row i expects to use, d(K): the layer-skip forwards, max_i min(n_i, K)
        plus the row's wasted forward where confidence, not K, stops it), and cuts every row to
        it (K = 0: plain decoding). One row, or ``rows_alone``: unchanged (``choose``
        already maximized each row's own rate)."""
        if self.rows_alone or len(choices) < 2 or not any(c.k for c in choices):
            return choices
        draft_cost = self.costs.draft_cost()

        def rate(K: int) -> float:
            tokens = sum(expected_tokens(c.acceptance, min(c.expected_drafts, K)) for c in choices)
            forwards = max((min(c.expected_drafts, K) + (c.waste if c.expected_drafts < K else 0.0)
                            for c in choices if c.drafter == "layer-skip"), default=0)
            return tokens / (forwards * draft_cost + self.costs.verify(K + 1))

        width = max(range(max(c.expected_drafts for c in choices) + 1), key=rate)
        if width == 0:
            return [Choice("none", 0, 0.0) for _ in choices]
        return [c if c.k <= width else Choice(c.drafter, width, c.tokens_per_s, c.acceptance,
                                              min(c.expected_drafts, width), c.waste)
                for c in choices]

    def observe(self, row: int, drafter: str, num_draft: int, num_accepted: int, lookup_ngram: int = 1,
                forwards: int | None = None) -> None:
        """Record a verified step of ``row`` that used ``drafter`` (any of them; lookup: drafts
        from a match of ``lookup_ngram`` tokens). Layer-skip: the run is recorded whether it
        drafted or not (``num_draft`` 0: confidence refused its first draft), with the draft
        ``forwards`` it ran for the row when known."""
        self.agreements.tick(row, _class_key(drafter, lookup_ngram), self.agreements.choices(row))
        if drafter in ("lookup", "layer-skip"):
            self.acceptance(row, drafter, lookup_ngram).update(num_draft, num_accepted)
        if drafter != "layer-skip":
            return
        _move_mean(self._skip_empty, row, float(num_draft == 0), 0.0)
        if num_draft > 0:
            _move_mean(self._draft_len, row, num_draft, float(self.k_max))
            if forwards is not None:  # the first run measured replaces choose()'s prior (1: a confidence stop)
                _move_mean(self._skip_waste, row, forwards - num_draft, None)
