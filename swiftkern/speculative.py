"""Speculative decoding: draft with a layer-skipped model (or prompt lookup), verify in one pass.

One step for every row of the batch at once:
  draft   up to k_max tokens with the layer-skipped model, one forward per token, stopping a
          row when the draft's top-1 probability falls below eps (confidence-aware, SWIFT);
  verify  the pending token + the drafts, K+1 positions per row, in ONE full-model forward;
  accept  greedy_accept (greedy) or rejection_sample (sampling) on the verify logits;
  rollback cache lengths to what was accepted; the verify pass's KV is the cache of record.
Words: the *pending* token of a row is its last committed token, whose KV is not yet written.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from . import ops
from .cuda_graphs import unsteady_calls
from .device_reads import read
from .kv_cache import KVCache
from .layer_set import LayerSet
from .model import SkipModel
from .draft_head import DraftHead
from .drafter_policy import Choice, DrafterPolicy
from .drafters import LOOKUP_MIN_NGRAM_UNJUDGED, LookupMatch
from .lookup_index import PromptLookup
from .prefill import admit_arrivals
from .batch_invariant import bi_token_logprob
from .requests import Requests
from .sampling import SamplingParams, keyed_uniforms, probs_from_logits, sample_from_weights, select_tokens

STREAM_TARGET, STREAM_DRAFT, STREAM_ACCEPT, STREAM_RESIDUAL = 0, 1, 2, 3


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
    head_weights = head.head if head is not None else None
    while any(active):
        forwards += 1
        positions = [n + 1 for n in cache.host_lengths]  # position of the token being drafted
        # copied in before the forward: a copy after its launch would wait for it (a GPU sync)
        u = keyed_uniforms(seeds, positions, STREAM_DRAFT, pending.device) if params.do_sample else None  # [B]
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
        probs_t = torch.zeros((B, 0, model.vocab_size), device=pending.device)
    return drafts_t, probs_t, num_draft, forwards


def _chunk_uniforms(seeds: list[int], start: list[int], count: int, stream: int, device) -> torch.Tensor:
    """float32 [B, count]: entry (b, j) keyed on (seeds[b], position start[b] + 1 + j, stream),
    made on the host and copied in once (each copy to a GPU is a sync)."""
    flat_seeds = [seed for seed in seeds for _ in range(count)]
    flat_positions = [s + 1 + j for s in start for j in range(count)]
    return keyed_uniforms(flat_seeds, flat_positions, stream, device).view(len(seeds), count)


QUEUED_LOGPROB_ROWS = 64  # B * (K+1) positions up to which a GPU step queues every logprob


def queue_logprobs(device: torch.device, positions: int) -> bool:
    """Whether a verify step computes every position's logprob before its read (a GPU, at most
    QUEUED_LOGPROB_ROWS positions: it runs while the host waits anyway, and its float32
    [positions, V] temporaries stay small) rather than each row's kept tokens after it (the CPU,
    or a wide step: fewer rows to compute). The same bits either way."""
    return device.type != "cpu" and positions <= QUEUED_LOGPROB_ROWS


@dataclass
class Verified:
    """One verify step's outcome. rows: each row's out tokens on the host (its accepted drafts,
    then the corrected/bonus token, then -1); num_accepted: list[int]; pending: int64 [B] on the
    device, each row's corrected or bonus token; out: int64 [B, K+1] and logits [B, K+1, V] on
    the device; queued: float32 [B, K+1], every out token's ``bi_token_logprob`` launched before
    the read (on a GPU, where it overlaps the forward; entries past a row's tokens are token
    0's), or None."""
    rows: list[list[int]]
    num_accepted: list[int]
    pending: torch.Tensor
    out: torch.Tensor
    logits: torch.Tensor
    queued: torch.Tensor | None

    def logprobs(self, i: int, n: int) -> torch.Tensor:
        """float32 [n]: row i's first n out tokens' log-probabilities (the same bits either way:
        the op is row-invariant; on the CPU computed for those n alone, which costs less)."""
        if self.queued is not None:
            return self.queued[i, :n]
        return bi_token_logprob(self.logits[i, :n], self.out[i, :n])


def verify_and_accept(model: SkipModel, cache: KVCache, pending: torch.Tensor, drafts: torch.Tensor,
                      draft_probs, num_draft: list[int], params: SamplingParams, seeds: list[int],
                      logprobs: bool = False) -> Verified:
    """One full-model forward over [pending, drafts] [B, K+1] and the acceptance rule, read back
    to the host once: everything the step launches is queued before that read, and nothing
    before it waits for the GPU (host values are copied in before the forward; the acceptance
    op's checks take max(num_draft) from the host list), so on a GPU the host's next work
    overlaps the forward. The cache is advanced by K+1 (the caller rolls it back)."""
    B, K = drafts.shape
    device = drafts.device
    start = list(cache.host_lengths)  # position of each row's pending token
    nd = torch.tensor(num_draft, dtype=torch.int32, device=device)  # [B]
    if params.do_sample:
        u_accept = _chunk_uniforms(seeds, start, K, STREAM_ACCEPT, device)  # [B, K]
        u_sample = _chunk_uniforms(seeds, start, K + 1, STREAM_RESIDUAL, device)  # [B, K+1]
    logits = model.forward(torch.cat([pending.unsqueeze(1), drafts], dim=1), cache)  # [B, K+1, V]
    max_draft = max(num_draft, default=0)
    if not params.do_sample:
        out, acc = ops.greedy_accept(drafts, logits, nd, max_draft=max_draft)  # [B, K+1], [B]
    else:
        target = probs_from_logits(logits.reshape(B * (K + 1), -1), params).view(B, K + 1, -1)
        out, acc = ops.rejection_sample(drafts, draft_probs, target, nd, u_accept, u_sample, max_draft=max_draft)
    lps = None
    if logprobs and queue_logprobs(device, B * (K + 1)):  # every position's, queued before the read (Verified.logprobs)
        flat = out.clamp(min=0).view(-1)  # [B*(K+1)]
        lps = bi_token_logprob(logits.reshape(B * (K + 1), -1), flat).view(B, K + 1)
    acc = acc.to(torch.int64)
    next_pending = out.gather(1, acc.unsqueeze(1)).squeeze(1)  # [B] the corrected or bonus token
    host = read(torch.cat([acc.unsqueeze(1), out], dim=1))  # the step's one read: [B, 1 + K+1]
    return Verified([h[1:] for h in host], [h[0] for h in host], next_pending, out, logits, lps)


def _assemble(B: int, choices, lookups, skip, params: SamplingParams, vocab: int, device):
    """Each row's drafts from the drafter it chose. skip: (drafts [B, Ks], probs, num_draft)
    of the layer-skip pass, or None. -> drafts int64 [B, K], draft_probs [B, K, V] or None,
    num_draft list."""
    rows, num_draft = [], []
    skipped = read(skip[0]) if skip is not None else None  # one read of the layer-skip drafts [B][Ks]
    for i, c in enumerate(choices):
        if c.drafter == "lookup":
            row = lookups[i][: c.k]
        elif c.drafter == "layer-skip":
            row = skipped[i][: skip[2][i]]
        else:
            row = []
        rows.append(row)
        num_draft.append(len(row))
    K = max(num_draft)
    drafts = torch.tensor([r + [0] * (K - len(r)) for r in rows], dtype=torch.int64, device=device).view(B, K)
    probs = None
    if params.do_sample and skip is not None:  # mixed rows: one-hot q for the deterministic drafts
        probs = torch.zeros((B, K, vocab), device=device)
        for i, c in enumerate(choices):
            n = num_draft[i]
            if c.drafter == "layer-skip":
                probs[i, :n] = skip[1][i, :n]
            elif n:
                probs[i, torch.arange(n, device=device), drafts[i, :n]] = 1.0
    return drafts, probs, num_draft


def _first_tokens(logits, reqs, cache, params, seeds, requests, logprobs, draft_head) -> torch.Tensor:
    """The first token of requests ``reqs`` (the last rows of the cache) from their prefill
    logits [n, V], committed -> int64 [n]."""
    n = len(reqs)
    positions = list(cache.host_lengths)[cache.batch - n:]
    tokens = select_tokens(logits, params, [seeds[r] for r in reqs], positions)  # [n]
    if logprobs is not None:
        lps = bi_token_logprob(logits, tokens)  # [n]
        for i, r in enumerate(reqs):
            logprobs[r].append(lps[i:i + 1])
    host = read(tokens)
    for r, t in zip(reqs, host):
        requests.commit(r, [t])
    if draft_head is not None:
        draft_head.add(host)
    return tokens


def _fixed_choice(drafter: str, lookup_len: int, budget: int) -> Choice:
    if drafter == "lookup":
        return Choice("lookup", min(lookup_len, budget), 0.0)
    if drafter == "layer-skip":
        return Choice("layer-skip", budget, 0.0)
    return Choice("none", 0, 0.0)


def decode_self_spec(model: SkipModel, cache: KVCache, first_logits: torch.Tensor, params: SamplingParams,
                     seeds: list[int], requests: Requests, layer_set: LayerSet | None, policy: DraftPolicy,
                     drafter: str = "layer-skip", prompts: list[list[int]] | None = None,
                     chooser: DrafterPolicy | None = None, draft_head: DraftHead | None = None,
                     tuner=None, logprobs: list[list[torch.Tensor]] | None = None) -> dict:
    """The speculative loop into ``requests``. first_logits: [B, V] from prefill.

    drafter: "layer-skip" (the model with ``layer_set`` skipped, confidence-aware, logits over
    ``draft_head``'s subset when given), "lookup" (prompt lookup over ``prompts`` + output, no
    model call; q is one-hot when sampling), "none" (verify passes of the pending token only:
    plain decoding through this loop) or "auto": ``chooser`` picks one of those per row and
    step from the costs and acceptance it measures here (given with "lookup", it picks lookup's
    draft length, or no draft, the same way). ``tuner`` (``tuner.OnTheFlyTuner``)
    finds the layer set while generating and replaces ``layer_set`` as it goes.

    The cache needs room for max_new_tokens + min(policy.k_max, max_new_tokens) + 1 positions past the longest
    prompt (a verify pass writes K+1 positions for every row). Finished rows leave the batch;
    requests that arrive later (``Requests.arrive_at``) join it at their step as new rows.
    -> stats: draft_steps and verify_steps (batched forwards), row_verifies (rows verified,
       summed over steps), drafted, accepted (draft tokens, summed over rows), drafter_steps
       ({drafter: row steps}), drafter_trials (with a chooser: row steps that tried a drafter
       it had left out, ``acceptance.Agreements``), per_row: [{verifies, drafted, accepted}] per request
    """
    if drafter == "auto" and chooser is None:
        raise ValueError("drafter 'auto' needs a DrafterPolicy")
    if drafter in ("lookup", "auto") and prompts is None:
        raise ValueError(f"drafter {drafter!r} needs the prompts (prompt lookup matches over them)")
    stats = {"draft_steps": 0, "verify_steps": 0, "row_verifies": 0, "drafted": 0, "accepted": 0,
             "drafter_steps": {"layer-skip": 0, "lookup": 0, "none": 0}}
    per_row = [{"verifies": 0, "drafted": 0, "accepted": 0} for _ in requests.out]
    stats["per_row"] = per_row
    trials_before = chooser.agreements.trials if chooser is not None else 0
    pending = _first_tokens(first_logits, requests.alive, cache, params, seeds, requests, logprobs, draft_head)
    if chooser is not None:
        chooser.prefilled()
    lookup = PromptLookup(prompts, requests.done) if drafter in ("lookup", "auto") else None
    while True:
        pending = requests.drop_finished(cache, pending)
        new = admit_arrivals(model, cache, requests, prompts)  # arrivals, their first tokens committed
        if new is not None:
            if chooser is not None:
                chooser.prefilled()
            due = requests.alive[len(requests.alive) - new.shape[0]:]
            first = _first_tokens(new, due, cache, params, seeds, requests, logprobs, draft_head)
            pending = first if pending is None else torch.cat([pending, first])
            pending = requests.drop_finished(cache, pending)
        if pending is None:
            if not requests.waiting:
                stats["drafter_trials"] = chooser.agreements.trials - trials_before if chooser is not None else 0
                return stats
            continue  # an empty batch: the next arrivals join at once
        requests.step += 1
        step_start, draft_seconds = time.perf_counter(), 0.0
        alive = requests.alive
        B = len(alive)
        row_seeds = [seeds[r] for r in alive]
        base = list(cache.host_lengths)
        budget = [min(policy.k_max, requests.remaining(r)) for r in alive]
        matches = [LookupMatch(0, [])] * B
        if drafter in ("lookup", "auto"):
            min_ngram = 1 if chooser is not None else LOOKUP_MIN_NGRAM_UNJUDGED
            matches = [lookup.match(r, requests.out[r], budget[i], min_ngram=min_ngram) for i, r in enumerate(alive)]
        lookups = [m.tokens for m in matches]
        if chooser is not None:  # auto, or lookup with cost-aware draft lengths
            chooser.set_batch(B)
            choices = [chooser.choose(r, len(lookups[i]), budget[i], layer_skip=layer_set is not None,
                                      lookup_ngram=matches[i].ngram) for i, r in enumerate(alive)]
            choices = chooser.fit_pass(choices)  # one pass width for the batch
        else:
            choices = [_fixed_choice(drafter if layer_set is not None or drafter != "layer-skip" else "none",
                                     len(lookups[i]), budget[i]) for i in range(B)]
        skip = None
        skip_budget = [c.k if c.drafter == "layer-skip" else 0 for c in choices]
        if any(skip_budget):
            t0, mark = time.perf_counter(), unsteady_calls(model)
            d, q, nd, forwards = draft_tokens(model, cache, pending, layer_set, policy, params, row_seeds,
                                              skip_budget, draft_head)
            draft_seconds = time.perf_counter() - t0
            if chooser is not None and forwards and unsteady_calls(model) == mark:
                chooser.record_draft(draft_seconds / forwards)
            cache.rollback(base)
            skip = (d, q, nd)
            stats["draft_steps"] += forwards
        drafts, draft_probs, num_draft = _assemble(B, choices, lookups, skip, params, model.vocab_size,
                                                   pending.device)
        mark = unsteady_calls(model)
        verified = verify_and_accept(model, cache, pending, drafts, draft_probs, num_draft, params, row_seeds,
                                     logprobs=logprobs is not None)
        num_accepted = verified.num_accepted
        steady = unsteady_calls(model) == mark  # no capture's cost in the cost model
        cache.rollback([n + 1 + a for n, a in zip(base, num_accepted)])
        stats["verify_steps"] += 1
        stats["row_verifies"] += B
        for i, row in enumerate(verified.rows):
            r = alive[i]
            used = choices[i].drafter if num_draft[i] else "none"
            stats["drafter_steps"][used] += 1
            per_row[r]["verifies"] += 1
            if used == "layer-skip":
                policy.update(num_accepted[i], num_draft[i])
                if tuner is not None:
                    tuner.observe(num_draft[i], num_accepted[i])
            if chooser is not None:
                chooser.observe(r, used, num_draft[i], num_accepted[i], lookup_ngram=matches[i].ngram)
            committed = row[: num_accepted[i] + 1]
            before = len(requests.out[r])
            requests.commit(r, committed)
            n = len(requests.out[r]) - before  # a stop inside the accepted drafts cuts the rest
            for counts in (stats, per_row[r]):  # the stats count what reached the output
                counts["drafted"] += num_draft[i]
                counts["accepted"] += min(num_accepted[i], n)
            if logprobs is not None:
                logprobs[r].append(verified.logprobs(i, n))
            if draft_head is not None:
                draft_head.add(committed)
        pending = verified.pending
        if chooser is not None and steady:
            # the step's whole cost but its drafts' (lookup, choices, acceptance, commits: ~3 % of
            # a SmolLM2 decode step on the CPU, the same for any width, so a step saved saves it too)
            chooser.record_verify(drafts.shape[1] + 1, time.perf_counter() - step_start - draft_seconds)
        if tuner is not None:
            layer_set = tuner.after_step(model, cache, requests, prompts, draft_head)
