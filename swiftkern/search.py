"""Layer-set search (SWIFT): matchness of candidate layer sets, and the optimizer that proposes them.

Words: the *search space* is the 2(L-2) sub-layers of layers 1..L-2 (the first and last layer
are never skipped); a *candidate* skips k = round(r * 2L) of them at skip ratio r; its
*matchness* on a window of context is the fraction of positions where the skipped model's top-1
(one teacher-forced forward over the window, on top of the full model's KV of everything
before it, exactly as a draft sees it) equals the token the full model generated there.

``LayerSetSearch`` proposes candidates (random k-subsets; every ``bo_every``-th candidate a
Bayesian-optimization proposal from a GP over the scored bitmasks, mapped to a layer set by its
top-k coordinates) and keeps the best; it stops at a matchness target, after ``patience``
candidates without improvement, or after ``max_steps`` (SWIFT's rules and defaults).
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass, field

import torch

from .errors import SwiftkernError
from .gp import GaussianProcess, expected_improvement, upper_confidence_bound
from .kv_cache import KVCache
from .layer_set import LayerSet
from .model import SkipModel


SMALL_SPACE = 20000  # a search space of at most this many sets is listed when random draws miss its last ones


def window_start(context: list[int], window: int) -> int:
    """The first input position of ``matchness``'s window over ``context``: the full model's KV
    of the positions before it is what matchness reads from the cache."""
    return len(context) - 1 - min(window, len(context) - 1)


def matchness(model: SkipModel, cache: KVCache, rows: list[int], contexts: list[list[int]],
              candidates: list[LayerSet], window: int = 32, head=None) -> list[float]:
    """Matchness of each candidate on the last ``window`` positions of each row's context.

    contexts[i]: prompt + generated tokens of cache row rows[i]; the cache must hold the full
    model's KV for at least its first len(context) - 1 - window positions. All candidates and
    rows are scored in ONE forward (batch = candidates x rows) over a scratch copy of the
    prefixes' KV; the cache itself is not touched. head: the draft's pruned head
    (``draft_head.DraftHead``), so the top-1 is the one the draft would propose (None: the full
    head). -> one score per candidate, the mean over rows weighted by their window lengths.
    """
    if not candidates or not rows or len(rows) != len(contexts):
        raise SwiftkernError("matchness needs candidates and one context per row")
    spans = []
    for r, ctx in zip(rows, contexts):
        start = window_start(ctx, window)
        n = len(ctx) - 1 - start
        if n < 1:
            raise SwiftkernError("matchness needs a context of at least 2 tokens")
        if cache.host_lengths[r] < start:
            raise SwiftkernError(f"matchness: row {r} has KV for {cache.host_lengths[r]} positions, needs {start}")
        spans.append((r, ctx, start, n))
    width = max(n for *_, n in spans)
    C, R = len(candidates), len(spans)
    scratch = KVCache(model.num_layers, C * R, model.num_kv_heads, max(s + width for _, _, s, _ in spans),
                      model.head_dim, model.dtype, model.device)
    inputs, targets, valid = [], [], []
    for _ in candidates:
        for j, (r, ctx, start, n) in enumerate(spans):
            pad = width - n
            inputs.append(ctx[start:start + n] + [ctx[-1]] * pad)
            targets.append(ctx[start + 1:] + [-1] * pad)
            valid.append([1] * n + [0] * pad)
    lengths = []
    for c in range(C):
        for j, (r, _, start, _) in enumerate(spans):
            b = c * R + j
            scratch.k[:, b, :, :start] = cache.k[:, r, :, :start]
            scratch.v[:, b, :, :start] = cache.v[:, r, :, :start]
            lengths.append(start)
    scratch.set_lengths(lengths)
    sets = [ls for ls in candidates for _ in spans]
    logits = model.forward(torch.tensor(inputs, device=model.device), scratch, layer_set=sets,
                           head=head.head if head is not None else None)  # [C*R, W, V or V']
    top1 = logits.argmax(-1) if head is None else head.ids[logits.argmax(-1)]
    hits = (top1 == torch.tensor(targets, device=model.device)).to(torch.float64)
    mask = torch.tensor(valid, dtype=torch.float64, device=model.device)
    per = (hits * mask).view(C, R, width).sum((1, 2)) / mask.view(C, R, width).sum((1, 2))
    return per.tolist()


def skip_count(num_layers: int, ratio: float) -> int:
    """Sub-layers skipped at ratio r: round(r * 2L), at most the 2(L-2) searchable ones."""
    return min(max(0, 2 * (num_layers - 2)), round(ratio * 2 * num_layers))


def check_searchable(num_layers: int, skip_ratio: float) -> None:
    """Refuse a search with nothing to search: fewer than 3 layers, or a ratio that skips no sub-layer."""
    if num_layers < 3:
        raise SwiftkernError(f"layer-set search needs >= 3 layers (first and last are kept), the model has "
                             f"{num_layers}: give a layer set yourself (layer_set / --layer-set, e.g. 'none'), or "
                             "draft by prompt lookup (drafter lookup)")
    if skip_count(num_layers, skip_ratio) < 1:
        raise SwiftkernError(f"skip ratio {skip_ratio} skips no sub-layer of a {num_layers}-layer model: "
                             f"raise it above {1 / (4 * num_layers):.3g}, or leave it 'auto'")


@dataclass
class SearchConfig:
    """Knobs of the search, SWIFT's values as defaults where they fit.

    skip_ratio: fraction r of the 2L sub-layers a candidate skips (SWIFT: 0.45);
    bo_every: every bo_every-th candidate is a BO proposal (SWIFT: 25), the rest random;
    acquisition: "ucb" (kappa, SWIFT: 2.5) or "ei"; target: stop once the best matchness
    reaches it (SWIFT: 0.93-0.95); patience: stop after this many candidates without
    improvement (SWIFT: 300); max_steps: stop after this many candidates (SWIFT: 1000);
    pool: candidate bitmasks the acquisition is maximized over per BO proposal."""

    skip_ratio: float = 0.45
    bo_every: int = 25
    acquisition: str = "ucb"
    kappa: float = 2.5
    target: float = 0.95
    patience: int = 300
    max_steps: int = 1000
    pool: int = 512
    seed: int = 0

    def __post_init__(self):
        if not 0.0 < self.skip_ratio < 1.0:
            raise SwiftkernError(f"skip ratio must be in (0, 1), got {self.skip_ratio}")
        if self.acquisition not in ("ucb", "ei"):
            raise SwiftkernError(f"acquisition must be 'ucb' or 'ei', got {self.acquisition!r}")
        if self.bo_every < 1 or self.max_steps < 1 or self.patience < 1:
            raise SwiftkernError("bo_every, max_steps and patience must be >= 1")


@dataclass
class LayerSetSearch:
    """Proposes layer sets and keeps the best scored one (see module doc).

    ``propose(n)`` -> n new candidates (fewer, at least one, once a small space has fewer
    sets left unscored); ``observe(candidate, score)``; ``best`` / ``best_score``;
    ``done()`` -> the stop rule that fired, or None. ``rescore(score)`` replaces the best's
    score with one measured on new context (scores of old windows are not trusted)."""

    num_layers: int
    config: SearchConfig = field(default_factory=SearchConfig)
    initial: LayerSet | None = None

    def __post_init__(self):
        L = self.num_layers
        check_searchable(L, self.config.skip_ratio)
        self.coords = [i for i in range(1, L - 1)] + [L + i for i in range(1, L - 1)]  # bit positions
        self.k = skip_count(L, self.config.skip_ratio)
        self.space = math.comb(len(self.coords), self.k)  # the sets of k sub-layers there are
        self.rng = random.Random(self.config.seed)
        self.x: list[list[int]] = []
        self.y: list[float] = []
        self.seen: set[tuple[int, ...]] = set()
        self.steps = 0
        self.since_improvement = 0
        self.best: LayerSet | None = None
        self.best_score = float("-inf")
        self._queued: list[LayerSet] = []
        self._hyper, self._hyper_n = None, 0
        if self.initial is None:  # SWIFT starts from the odd layers, cut (or filled up) to k sub-layers
            odd = [c for c in self.coords if (c % L) % 2 == 1]
            even = [c for c in self.coords if (c % L) % 2 == 0]
            self.initial = LayerSet.from_bits(self._bits((odd + even)[: self.k]))
        self._queued.append(self.initial)

    # --- proposals -------------------------------------------------------------------
    def _bits(self, chosen) -> list[int]:
        """The bitmask of a layer set skipping the sub-layers at bit positions ``chosen``."""
        bits = [0] * (2 * self.num_layers)
        for c in chosen:
            bits[c] = 1
        return bits

    def _random_bits(self) -> list[int]:
        return self._bits(self.rng.sample(self.coords, self.k))

    def _top_k_bits(self, scores: list[float]) -> list[int]:
        """Layer set of the k highest coordinates of a continuous point over the search space."""
        order = sorted(range(len(self.coords)), key=lambda i: -scores[i])[: self.k]
        return self._bits(self.coords[i] for i in order)

    def _bo_bits(self) -> list[int]:
        """Maximize the acquisition over a pool: top-k maps of random continuous points, and
        one-swap neighbours of the best scored sets; never a set scored before."""
        x = torch.tensor(self.x, dtype=torch.float64)
        y = torch.tensor(self.y, dtype=torch.float64)
        regrid = self._hyper is None or len(self.y) >= 1.5 * self._hyper_n  # hyper-parameters: refit now and then
        gp = GaussianProcess().fit(x, y, None if regrid else self._hyper)
        if regrid:
            self._hyper, self._hyper_n = gp.hyper, len(self.y)
        pool = [self._top_k_bits([self.rng.random() for _ in self.coords]) for _ in range(self.config.pool // 2)]
        for i in sorted(range(len(self.y)), key=lambda i: -self.y[i])[:4]:
            on = [c for c in self.coords if self.x[i][c]]
            off = [c for c in self.coords if not self.x[i][c]]
            if not on or not off:  # k = 0 or every searchable sub-layer: a set has no neighbours
                continue
            for _ in range(self.config.pool // 8):
                bits = list(self.x[i])
                bits[self.rng.choice(on)] = 0
                bits[self.rng.choice(off)] = 1
                pool.append(bits)
        pool = [b for b in {tuple(b): b for b in pool}.values() if tuple(b) not in self.seen]
        if not pool:
            return self._random_bits()
        mean, std = gp.predict(torch.tensor(pool, dtype=torch.float64))
        if self.config.acquisition == "ucb":
            acq = upper_confidence_bound(mean, std, self.config.kappa)
        else:
            acq = expected_improvement(mean, std, max(self.y))
        return pool[int(acq.argmax())]

    def propose(self, n: int = 1) -> list[LayerSet]:
        out = []
        while len(out) < n:
            if self._queued:
                out.append(self._queued.pop(0))
                continue
            position = self.steps + len(out) + 1
            use_bo = position % self.config.bo_every == 0 and len(self.y) >= 2
            bits = self._bo_bits() if use_bo else self._random_bits()
            taken = self.seen | {tuple(o.to_bits()) for o in out}
            for _ in range(20):  # a fresh random set where we can
                if tuple(bits) not in taken:
                    break
                bits = self._random_bits()
            else:  # a small space nearly all scored: draw among the sets left
                left = self._sets_left(taken)  # None: too many sets to list
                if left:
                    bits = list(self.rng.choice(left))
                elif left is not None and out:
                    break  # none left: fewer than n
            out.append(LayerSet.from_bits(bits))
        return out

    def _sets_left(self, taken: set) -> list[tuple[int, ...]] | None:
        """The k-subsets not in ``taken``, or None where the space is too large to list."""
        if self.space > SMALL_SPACE:
            return None
        every = (tuple(self._bits(chosen)) for chosen in itertools.combinations(self.coords, self.k))
        return [bits for bits in every if bits not in taken]

    # --- results ---------------------------------------------------------------------
    def observe(self, candidate: LayerSet, score: float) -> None:
        bits = candidate.to_bits()
        self.x.append(bits)
        self.y.append(float(score))
        self.seen.add(tuple(bits))
        self.steps += 1
        if score > self.best_score:
            self.best, self.best_score = candidate, float(score)
            self.since_improvement = 0
        else:
            self.since_improvement += 1

    def rescore(self, score: float) -> None:
        """The best set scored again on newer context: its score is now this one."""
        self.best_score = float(score)
        if self.best is not None:
            self.x.append(self.best.to_bits())
            self.y.append(float(score))

    def done(self) -> str | None:
        if self.best_score >= self.config.target:
            return "target"
        if len(self.seen) >= self.space:  # every set of k sub-layers scored
            return "exhausted"
        if self.since_improvement >= self.config.patience:
            return "patience"
        if self.steps >= self.config.max_steps:
            return "max_steps"
        return None
