"""On-the-fly layer-set optimization (SWIFT's schedule) inside the speculative loop.

Generation runs in windows of N tokens. While optimizing, every N new tokens of the tracked
row (context accumulation) are followed by a layer-set optimization phase: the best set so far
is re-scored on the new window, then ``steps_per_window`` candidates are scored, several per
batched forward. Once a stop rule fires (matchness target, patience, max steps), or the search
time reaches ``time_fraction`` of the time spent generating, drafting runs with the best set
(confidence-aware acceleration); if the measured acceptance of its drafts falls well below its
matchness, the search restarts from it.

Beyond SWIFT: ``skip_ratio="auto"`` searches a ladder of ratios side by side and keeps the one
whose best set promises the most tokens per second, from the draft forward time measured for
that set and the verify costs the drafter policy measures; when no ratio beats plain decoding,
layer skipping is switched off (small models: a draft step costs nearly a full step).
The search pays only for what can pay, since on a small model it is pure overhead:
- before the first phase, a ratio whose draft forward is so slow that even a set of the
  target matchness would not beat plain decoding is dropped (the draft's cost predicted from
  the bytes it reads and the measured plain step: nothing is run);
- phases grow (``candidates_per_forward`` candidates in the first, doubling up to
  ``steps_per_window``), and after each one the search stops when not even a set
  ``optimism[phase]`` better in matchness than the best found would beat plain decoding
  (generous after one phase, tighter as the scores accumulate);
- all of it is capped at ``time_fraction`` of the time spent generating, counting the phase
  about to run (predicted from the last phase, or from the measured verify costs): a phase
  waits until the generation so far has earned it, so a short generation pays no search
  (on SmolLM2/CPU the first phase, 0.14-0.17 s, was 5 % of a 128-token generation);
- no phase starts with fewer than two windows of tokens left to use its result.
"""

from __future__ import annotations

import math
import time

from .arg_checks import real, whole
from .drafter_policy import DrafterPolicy, expected_tokens
from .errors import SwiftkernError
from .kv_cache import KVCache
from .layer_set import LayerSet
from .model import SkipModel
from .search import LayerSetSearch, SearchConfig, matchness, skip_count

AUTO_RATIOS = (0.1, 0.2, 0.3, 0.45)


def tuner_options(options) -> dict:
    """``Generator(search_options=)`` checked: None or a dict of ``OnTheFlyTuner`` keyword
    arguments (window, steps_per_window, candidates_per_forward: int >= 1; time_fraction > 0;
    restart_ratio >= 0; config: a SearchConfig; optimism: numbers) -> a dict."""
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise SwiftkernError(f"search_options must be a dict of tuner options, got {type(options).__name__}")
    counts = ("window", "steps_per_window", "candidates_per_forward")
    for key, value in options.items():
        name = f"search_options[{key!r}]"
        if key in counts:
            whole(name, value, 1)
        elif key == "time_fraction":  # 1e9: no cap
            if not real(name, value) > 0:
                raise SwiftkernError(f"{name} must be > 0, got {value}")
        elif key == "restart_ratio":
            if not real(name, value) >= 0:
                raise SwiftkernError(f"{name} must be >= 0, got {value}")
        elif key == "config":
            if not isinstance(value, SearchConfig):
                raise SwiftkernError(f"search_options['config'] must be a swiftkern.search.SearchConfig, got {value!r}")
        elif key == "optimism":
            entries = value if isinstance(value, (tuple, list)) else (value,)
            if not entries:  # the first search phase indexed it
                raise SwiftkernError("search_options['optimism'] must be a number or a non-empty list of numbers")
            for v in entries:
                if not math.isfinite(real("search_options['optimism'] entry", v)):
                    raise SwiftkernError(f"search_options['optimism'] entries must be finite, got {v}")
        else:
            hint = " (give skip_ratio= to the Generator)" if key == "skip_ratio" else ""
            raise SwiftkernError(f"search_options has no option {key!r}{hint}; it takes "
                                 f"{', '.join(counts + ('time_fraction', 'restart_ratio', 'config', 'optimism'))}")
    return dict(options)


class OnTheFlyTuner:
    """Finds the draft's layer set while generating; see the module doc. One tuner may serve
    several generate calls (``new_generation``): SWIFT optimizes on the first inputs and drafts
    with what it found on the rest. ``search_s`` counts the current call's search time.

    ``after_step(model, cache, requests, prompts, head)`` is called by the loop after
    every verify step and returns the layer set drafts should use now (None: no layer skip);
    ``observe(num_draft, num_accepted)`` records a verified layer-skip draft.
    """

    def __init__(self, num_layers: int, chooser: DrafterPolicy | None, skip_ratio="auto", window: int = 32,
                 steps_per_window: int = 32, candidates_per_forward: int = 4, time_fraction: float = 0.1,
                 initial: LayerSet | None = None, restart_ratio: float = 0.5, config: SearchConfig | None = None,
                 optimism: tuple = (0.45, 0.3, 0.15)):
        ratios = list(AUTO_RATIOS if skip_ratio == "auto" else (float(skip_ratio),))
        base = config or SearchConfig()
        start = {}
        if initial is not None and not initial.is_empty:  # a stored set: its ratio's search starts from it
            match = [r for r in ratios if skip_count(num_layers, r) == initial.num_skipped]
            if not match and skip_ratio == "auto":  # an asked ratio is kept: a stored set of another one is left out
                ratios.append(initial.num_skipped / (2 * num_layers))
                match = ratios[-1:]
            if match:
                start[match[0]] = initial
        self.searches = {r: LayerSetSearch(num_layers, SearchConfig(**{**base.__dict__, "skip_ratio": r}),
                                           start.get(r)) for r in ratios}
        self.chooser = chooser
        self.window, self.steps_per_window = window, steps_per_window
        self.per_forward = candidates_per_forward
        self.time_fraction = time_fraction
        self.restart_ratio = restart_ratio
        self.optimism = tuple(optimism) if isinstance(optimism, (tuple, list)) else (float(optimism),)
        self.target = base.target  # the matchness a search aims at: the ceiling of the ratio check
        self.ratio_ceiling: dict = {}  # ratio -> rate vs plain of a set of target matchness
        self.optimizing = True
        self.current: LayerSet | None = None
        self.current_score = 0.0
        self.enabled = True  # False once no ratio can beat plain decoding
        self.search_s = 0.0  # this generate call's
        self.calls = 1
        self.cut_short = False  # the last stop was for one call's clock or length, not a verdict
        self.start = time.perf_counter()
        self.last_optimized_at = None
        self.phases = 0
        self.last_phase_s: float | None = None
        self.scored = 0
        self.restarts = 0
        self._acc, self._miss = 0.0, 0.0

    def new_generation(self, chooser: DrafterPolicy | None) -> None:
        """Go on in a new generate call (its own drafter policy and clock): what was found stays,
        a search cut short resumes after a window of the new output, and the time cap counts
        this call's time alone."""
        self.chooser = chooser
        if self.cut_short:
            self.optimizing, self.enabled, self.cut_short = True, True, False
        self.search_s = 0.0
        self.start = time.perf_counter()
        self.last_optimized_at = None
        self.calls += 1

    # --- the schedule ----------------------------------------------------------------
    def after_step(self, model: SkipModel, cache: KVCache, requests, prompts, head=None) -> LayerSet | None:
        if not self.optimizing or not self.enabled:
            return self.current
        rows = [i for i, r in enumerate(requests.alive) if not requests.done[r]]
        if not rows:
            return self.current
        i = rows[0]
        r = requests.alive[i]
        produced = len(requests.out[r])
        if self.last_optimized_at is None:
            self.last_optimized_at = 0
        if produced - self.last_optimized_at < self.window:
            return self.current  # still accumulating context
        elapsed = time.perf_counter() - self.start
        budget = self.time_fraction * max(elapsed - self.search_s, 1e-9)
        if self.search_s > budget:
            return self._finish("time budget", cut_short=True)
        if requests.remaining(r) < 2 * self.window:
            return self._finish("too few tokens left for a found set to pay", cut_short=True)
        if self.search_s + self._phase_estimate() > budget:
            return self.current  # this phase is not affordable yet: keep generating, ask again
        self.last_optimized_at = produced
        t0 = time.perf_counter()
        if self.phases == 0 and self.chooser is not None and self.chooser.costs.known():
            self._drop_slow_ratios(model, head)
            if not self.searches:
                self.search_s += time.perf_counter() - t0
                self.best_rate_vs_plain = 0.0
                return self._finish("no skip ratio drafts fast enough to pay")
        self._optimize(model, cache, i, prompts[r] + requests.out[r], head)
        self._pick(model, head)
        self.last_phase_s = time.perf_counter() - t0
        self.search_s += self.last_phase_s
        self.phases += 1
        if all(s.done() for s in self.searches.values()):
            return self._finish("stop rule")
        if getattr(self, "hopeless", False):
            return self._finish("no set within reach can pay")
        return self.current

    def _phase_estimate(self) -> float:
        """Seconds the next phase should take: twice the last one (phases double their
        candidates), or before any, one forward of candidates_per_forward x window tokens from
        the verify costs the drafter policy measured (extrapolated linearly from the short
        verify passes it has timed, and no less than the widest of them grown by the prior
        slope: ``ForwardCosts.wide_pass_floor``); 0 when nothing is measured."""
        if self.last_phase_s is not None:
            return 2 * self.last_phase_s
        if self.chooser is None or not self.chooser.costs.known():
            return 0.0
        costs, tokens = self.chooser.costs, self.per_forward * self.window
        return max(costs.verify(tokens), costs.wide_pass_floor(tokens))

    def _drop_slow_ratios(self, model, head) -> None:
        """Drop the ratios whose draft forward (predicted for a random set of that ratio) is too
        slow for even a set of the target matchness to beat plain decoding."""
        plain = 1.0 / self.chooser.costs.verify(1)
        for ratio in list(self.searches):
            probe = LayerSet.random(model.num_layers, ratio, seed=0)
            self.ratio_ceiling[ratio] = self._rate(self.target, self._draft_cost(model, probe, head)) / plain
            if self.ratio_ceiling[ratio] <= 1.0:
                del self.searches[ratio]

    def _optimize(self, model, cache, row, context, head) -> None:
        todo = []
        steps = min(self.steps_per_window, self.per_forward * 2 ** self.phases)  # phases grow
        for ratio, search in self.searches.items():
            if search.done():
                continue
            if search.best is not None:
                todo.append((search, search.best, True))  # re-score the kept best on new context
            n = max(1, steps // len(self.searches))
            todo += [(search, c, False) for c in search.propose(n)]
        for j in range(0, len(todo), self.per_forward):
            chunk = todo[j:j + self.per_forward]
            scores = matchness(model, cache, [row], [context], [c for _, c, _ in chunk], self.window, head)
            for (search, cand, is_rescore), score in zip(chunk, scores):
                if is_rescore:
                    search.rescore(score)
                else:
                    search.observe(cand, score)
                self.scored += 1

    def _draft_cost(self, model, layer_set, head) -> float:
        """Seconds of one draft forward with this set, predicted without running it: the
        measured plain step verify(1) times the share of the weight bytes the draft reads
        (kept sub-layers + its LM head rows; a decode step is memory-bound, and its per-layer
        overheads go with the layers). Measured on SmolLM2/CPU: predicted 0.47, timed 0.52 of
        a full step at ratio 0.45 with the pruned head (``python -m bench --routine draft_step``)."""
        attn = [sum(t.numel() for t in (w.q, w.k, w.v, w.o)) for w in model.layers]
        mlp = [sum(t.numel() for t in (w.gate, w.up, w.down)) for w in model.layers]
        hidden = model.lm_head.shape[1]
        full = sum(attn) + sum(mlp) + model.lm_head.numel()
        kept = sum(a for a, skip in zip(attn, layer_set.attn_mask()) if not skip)
        kept += sum(m for m, skip in zip(mlp, layer_set.mlp_mask()) if not skip)
        kept += (len(head) if head is not None else model.vocab_size) * hidden
        return self.chooser.costs.verify(1) * kept / full

    def _rate(self, alpha: float, draft_cost: float) -> float:
        costs = self.chooser.costs
        return max(expected_tokens(alpha, k) / (k * draft_cost + costs.verify(k + 1)) for k in range(1, 26))

    def _pick(self, model, head) -> None:
        """The set to draft with: the best of the ratio whose best set promises the highest rate."""
        best = [(s.best_score, s.best) for s in self.searches.values() if s.best is not None]
        if not best:
            return
        if self.chooser is None or not self.chooser.costs.known():
            self.current_score, self.current = max(best, key=lambda b: b[0])
            return
        plain = 1.0 / self.chooser.costs.verify(1)
        rated = []
        optimism = self.optimism[min(self.phases, len(self.optimism) - 1)]
        for score, ls in best:
            cost = self._draft_cost(model, ls, head)
            rated.append((self._rate(max(score, 0.0), cost), score, ls, self._rate(min(1.0, score + optimism), cost)))
        rate, score, ls, _ = max(rated, key=lambda t: t[0])
        self.current, self.current_score = ls, score
        self.best_rate_vs_plain = rate / plain
        self.hopeless = max(t[3] for t in rated) < plain  # not even a better-scoring set would pay

    def _finish(self, why: str, cut_short: bool = False) -> LayerSet | None:
        """Stop optimizing; ``cut_short``: for this call only (its time cap or its length)."""
        self.optimizing = False
        self.cut_short = cut_short
        self.stop_reason = why
        if self.chooser is not None and getattr(self, "best_rate_vs_plain", 1.0) < 1.0:
            self.enabled = False  # no searched set can beat plain decoding at the measured costs
            self.stop_reason = why + "; layer skip cannot beat plain decoding"
            self.current = None  # nothing drafts with it: report no set
            return None
        return self.current

    # --- acceleration ----------------------------------------------------------------
    def observe(self, num_draft: int, num_accepted: int) -> None:
        """A verified layer-skip draft; restarts the search when acceptance falls far below
        the matchness its set scored."""
        if num_draft == 0:
            return
        self._acc = 0.9 * self._acc + num_accepted
        self._miss = 0.9 * self._miss + (1.0 if num_accepted < num_draft else 0.0)
        observed = self._acc + self._miss
        if (not self.optimizing and self.enabled and observed >= 5
                and self._acc / observed < self.restart_ratio * self.current_score):
            self.optimizing = True
            self.restarts += 1
            self._acc = self._miss = 0.0
            for s in self.searches.values():
                s.since_improvement = 0
                s.steps = 0
                s.best_score = float("-inf") if s.best is None else 0.0  # re-scored on the next window

    def stats(self) -> dict:
        return {"search_phases": self.phases, "candidates_scored": self.scored, "search_s": self.search_s,
                "search_calls": self.calls,
                "search_restarts": self.restarts, "layer_skip_enabled": self.enabled,
                "ratio_ceiling": {r: round(v, 3) for r, v in self.ratio_ceiling.items()},
                "search_stop": getattr(self, "stop_reason", "")}
