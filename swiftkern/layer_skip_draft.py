"""The layer-skipped draft (SWIFT, Draft & Verify): the same model with some sub-layers skipped
proposes each row's next tokens, one forward a token, until its top-1 probability falls below
eps (confidence-aware) or the row's budget is spent. ``DraftPolicy`` holds k_max and eps (and
moves eps toward a target acceptance, Self-SD's adaptive threshold)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import ops
from .device_reads import read
from .draft_head import DraftHead
from .kv_cache import KVCache
from .layer_set import LayerSet
from .model import SkipModel
from .sampling import STREAM_DRAFT, SamplingParams, keyed_uniforms, probs_from_logits, sample_from_weights


@dataclass
class DraftPolicy:
    """When a row stops drafting: after k_max drafts, or when the draft's top-1 probability is
    below eps. adaptive=True moves eps toward a target acceptance rate (Self-SD): after every
    verify eps += step if the acceptance rate is below target, else -= step, smoothed with
    momentum, clamped to [eps_min, eps_max]."""

    k_max: int = 25
    eps: float = 0.8
    adaptive: bool = False
    target_acceptance: float = 0.9
    step: float = 0.01
    momentum: float = 0.9
    eps_min: float = 0.0
    eps_max: float = 0.99
    _velocity: float = field(default=0.0, repr=False)

    def update(self, accepted: int, drafted: int) -> None:
        if not self.adaptive or drafted == 0:
            return
        direction = self.step if accepted / drafted < self.target_acceptance else -self.step
        self._velocity = self.momentum * self._velocity + (1 - self.momentum) * direction
        self.eps = min(self.eps_max, max(self.eps_min, self.eps + self._velocity))


def draft_tokens(model: SkipModel, cache: KVCache, pending: torch.Tensor, layer_set: LayerSet,
                 policy: DraftPolicy, params: SamplingParams, seeds: list[int], budget: list[int],
                 head: DraftHead | None = None):
    """Draft with the skipped model from each row's pending token. pending: int64 [B].

    budget[b]: most drafts row b may use (0 = none). Rows draft together until every row has
    stopped; the cache is advanced by the drafts (the caller rolls it back). head: a pruned
    LM head (logits over its subset only; None: the full head).
    -> drafts int64 [B, K], draft_probs float32 [B, K, V] or None (greedy), num_draft [B] list,
       number of draft forwards
    """
    B = cache.batch
    drafts, probs = [], []
    num_draft = [0] * B
    active = [budget[b] > 0 for b in range(B)]
    token, forwards = pending, 0
    # draws keyed on the step too: a position drafted again after a rejection draws afresh
    # (reusing the uniform that steered this step's stop and the drafter policy biased the draft)
    step_starts = list(cache.host_lengths)  # the pending tokens' positions
    head_weights = head.head if head is not None else None
    while any(active):
        forwards += 1
        positions = [n + 1 for n in cache.host_lengths]  # position of the token being drafted
        # copied in before the forward: a copy after its launch would wait for it (a GPU sync)
        u = (keyed_uniforms(seeds, positions, STREAM_DRAFT, pending.device, step_starts)
             if params.do_sample else None)  # [B]
        logits = model.forward(token.unsqueeze(1), cache, layer_set=layer_set, head=head_weights)[:, -1]  # [B, V']
        q = probs_from_logits(logits, params) if params.do_sample else logits.float().softmax(-1)
        if params.do_sample:
            token = sample_from_weights(q, u)
            probs.append(head.to_full(q, 0.0) if head is not None else q)
        else:
            token = ops.greedy_tokens(logits)
        if head is not None:
            token = head.ids[token]
        confidence = read(q.max(-1).values)  # the draft's top-1 probability
        drafts.append(token)
        for b in range(B):
            if not active[b]:
                continue
            if confidence[b] < policy.eps:  # low confidence: this draft is not used
                active[b] = False
                continue
            num_draft[b] += 1
            if num_draft[b] >= budget[b]:
                active[b] = False
    K = max(num_draft)
    drafts_t = torch.stack(drafts[:K], dim=1) if K else pending.new_zeros((B, 0))  # [B, K]
    probs_t = torch.stack(probs[:K], dim=1) if (params.do_sample and K) else None  # [B, K, V]
    if params.do_sample and K == 0:
        probs_t = torch.zeros((B, 0, model.vocab_size), dtype=torch.float32, device=pending.device)
    return drafts_t, probs_t, num_draft, forwards
