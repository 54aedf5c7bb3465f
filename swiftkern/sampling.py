"""Token selection: greedy, and seeded sampling keyed on (seed, absolute position).

A draw at position p of a request with seed s uses a uniform that depends on (s, p, stream)
alone, never on the batch or on how many draws came before. So a replay of the same position
(after a rollback, in a verify pass, in another batch) draws the same token. The layer-skipped
draft's draws depend on the position their step started from too: a position drafted again in a
later step (after a rejection) draws afresh, independent of what the earlier draft steered.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import ops
from .arg_checks import flag, real, whole
from .errors import SwiftkernError
from .top_p import top_p_removed

_MASK64 = (1 << 64) - 1
SEED_RANGE = (-(1 << 63), _MASK64)  # torch's seeds: s < 0 is the same seed as 2**64 + s


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


# the streams of keyed uniforms: a token's own draw (``token_uniforms``), the layer-skipped
# draft's draws, rejection sampling's acceptance tests and its draws from the residual
STREAM_TARGET, STREAM_DRAFT, STREAM_ACCEPT, STREAM_RESIDUAL = 0, 1, 2, 3


def keyed_uniform(seed: int, position: int, stream: int = STREAM_TARGET, step: int = 0) -> float:
    """A uniform in [0, 1) that is a pure function of (seed, position, stream, step). step: the
    position the draw's decoding step started from, for a stream whose position a later step
    may draw again (the layer-skipped draft's, after a rejection); 0 for the others."""
    h = _splitmix64(_splitmix64(_splitmix64(_splitmix64(seed & _MASK64) ^ position) ^ stream) ^ step)
    return (h >> 40) / float(1 << 24)  # 24 bits: exactly representable in float32


def keyed_uniforms(seeds: list[int], positions: list[int], stream: int = STREAM_TARGET,
                   device: torch.device | str = "cpu", steps: list[int] | None = None) -> torch.Tensor:
    """float32 [B] uniforms for row b at absolute position positions[b] (in the step that
    started at steps[b]: see ``keyed_uniform``)."""
    steps = steps if steps is not None else [0] * len(seeds)
    vals = [keyed_uniform(s, p, stream, t) for s, p, t in zip(seeds, positions, steps)]
    return torch.tensor(vals, dtype=torch.float32, device=device)


# below it, logits / temperature overflow float32 for ordinary logits (1e-40: every one, so
# the softmax is NaN and nothing valid is drawn); the distribution is greedy's long before
MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How to pick a token. do_sample=False is greedy (argmax); otherwise temperature,
    then top-k, then top-p filtering (HF's order), then an inverse-CDF draw."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        flag("do_sample", self.do_sample)
        real("temperature", self.temperature)  # a wrong kind is refused before the comparisons below
        real("top_p", self.top_p)
        whole("top_k", self.top_k)
        if self.do_sample and not self.temperature >= MIN_TEMPERATURE:
            raise SwiftkernError(f"temperature must be >= {MIN_TEMPERATURE} when sampling, got {self.temperature}; "
                                 "for the limit of temperature -> 0 decode greedily (do_sample=False)")
        if self.top_k < 0:
            raise SwiftkernError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise SwiftkernError(f"top_p must be in (0, 1], got {self.top_p}")


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, top-k and top-p as HF's warpers: removed entries become -inf.

    logits: [N, V] -> float32 [N, V]
    """
    out = logits.to(torch.float32) / params.temperature  # a new tensor: filled in place below
    if params.top_k and params.top_k < out.shape[-1]:
        kth = torch.topk(out, params.top_k, dim=-1).values[..., -1:]
        out.masked_fill_(out < kth, float("-inf"))
    if params.top_p < 1.0:
        out.masked_fill_(top_p_removed(out, params.top_p), float("-inf"))
    return out


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a token is drawn from: softmax(filter_logits). [N, V] -> float32 [N, V]"""
    return filter_logits(logits, params).softmax(dim=-1)


def sample_from_weights(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: the smallest i with cumsum(w)[i] > u * sum(w).

    weights: float [N, V] (non-negative, unnormalized allowed); u: float32 [N] in [0, 1)
    -> int64 [N]
    """
    cdf = weights.to(torch.float32).cumsum(dim=-1)  # [N, V]
    threshold = (u.to(torch.float32) * cdf[:, -1]).unsqueeze(-1)
    idx = torch.searchsorted(cdf, threshold, right=True).squeeze(-1)
    return idx.clamp_(max=weights.shape[-1] - 1)


def select_tokens(logits: torch.Tensor, params: SamplingParams, seeds: list[int],
                  positions: list[int]) -> torch.Tensor:
    """The next token of each row. logits: [N, V]; positions: absolute position of the token
    being chosen, per row. -> int64 [N]"""
    return select_with_uniforms(logits, params, token_uniforms(params, seeds, positions, logits.device))


def token_uniforms(params: SamplingParams, seeds: list[int], positions: list[int], device) -> torch.Tensor | None:
    """float32 [N]: the uniforms ``select_tokens`` draws N tokens with (row n keyed on (seeds[n],
    positions[n])), or None when greedy. Made apart so a caller can copy them in before the
    forward whose logits they sample (on a GPU a copy after its launch waits for it)."""
    return keyed_uniforms(seeds, positions, device=device) if params.do_sample else None


def select_with_uniforms(logits: torch.Tensor, params: SamplingParams, u: torch.Tensor | None) -> torch.Tensor:
    """``select_tokens`` with its uniforms made beforehand (``token_uniforms``). logits [N, V] ->
    int64 [N]"""
    if u is None:
        return ops.greedy_tokens(logits)
    return sample_from_weights(probs_from_logits(logits, params), u)
