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

import torch

from .batch_invariant import bi_token_logprob
from .cuda_graphs import unsteady_calls
from .device_reads import read
from .draft_head import DraftHead
from .drafter_policy import Choice, DrafterPolicy
from .drafters import LOOKUP_MIN_NGRAM_UNJUDGED, LookupMatch
from .kv_cache import KVCache
from .layer_set import LayerSet
from .layer_skip_draft import DraftPolicy, draft_tokens
from .lookup_index import PromptLookup
from .model import SkipModel
from .prefill import admit_arrivals
from .requests import Requests
from .sampling import SamplingParams, select_tokens
from .verify_step import Verified, verify_and_accept

__all__ = ["DraftPolicy", "decode_self_spec", "draft_tokens", "verify_and_accept"]


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
    run = _SelfSpecRun(model, cache, params, seeds, requests, policy, drafter, prompts, chooser, draft_head, tuner,
                       logprobs)
    trials_before = chooser.agreements.trials if chooser is not None else 0
    pending = run.first_tokens(first_logits, requests.alive)
    if chooser is not None:
        chooser.prefilled()
    while True:
        pending = requests.drop_finished(cache, pending)
        new = admit_arrivals(model, cache, requests, prompts)  # arrivals, their first tokens committed
        if new is not None:
            if chooser is not None:
                chooser.prefilled()
            first = run.first_tokens(new, requests.alive[len(requests.alive) - new.shape[0]:])
            pending = first if pending is None else torch.cat([pending, first])
            pending = requests.drop_finished(cache, pending)
        if pending is None:
            if not requests.waiting:
                run.stats["drafter_trials"] = chooser.agreements.trials - trials_before if chooser is not None else 0
                return run.stats
            continue  # an empty batch: the next arrivals join at once
        requests.step += 1
        pending, layer_set = run.step(pending, layer_set)


class _SelfSpecRun:
    """One ``decode_self_spec`` call's state (its arguments, the prompt-lookup index, the stats)
    and its step: choose each row's drafter, draft, verify, commit."""

    def __init__(self, model: SkipModel, cache: KVCache, params: SamplingParams, seeds: list[int],
                 requests: Requests, policy: DraftPolicy, drafter: str, prompts, chooser, draft_head, tuner,
                 logprobs):
        self.model, self.cache, self.params, self.seeds, self.requests = model, cache, params, seeds, requests
        self.policy, self.drafter, self.prompts, self.chooser = policy, drafter, prompts, chooser
        self.draft_head, self.tuner, self.logprobs = draft_head, tuner, logprobs
        self.lookup = PromptLookup(prompts, requests.done) if drafter in ("lookup", "auto") else None
        self.per_row = [{"verifies": 0, "drafted": 0, "accepted": 0} for _ in requests.out]
        self.stats = {"draft_steps": 0, "verify_steps": 0, "row_verifies": 0, "drafted": 0, "accepted": 0,
                      "drafter_steps": {"layer-skip": 0, "lookup": 0, "none": 0}, "per_row": self.per_row}

    def first_tokens(self, logits: torch.Tensor, reqs: list[int]) -> torch.Tensor:
        """The first token of requests ``reqs`` (the last rows of the cache) from their prefill
        logits [n, V], committed -> int64 [n]."""
        n, cache, requests = len(reqs), self.cache, self.requests
        positions = list(cache.host_lengths)[cache.batch - n:]
        tokens = select_tokens(logits, self.params, [self.seeds[r] for r in reqs], positions)  # [n]
        if self.logprobs is not None:
            lps = bi_token_logprob(logits, tokens)  # [n]
            for i, r in enumerate(reqs):
                self.logprobs[r].append(lps[i:i + 1])
        host = read(tokens)
        for r, t in zip(reqs, host):
            requests.commit(r, [t])
        if self.draft_head is not None:
            self.draft_head.add(host)
        return tokens

    def _choices(self, layer_set: LayerSet | None) -> tuple[list[Choice], list[LookupMatch]]:
        """Each row's drafter and draft length this step, and its prompt-lookup match."""
        requests, chooser, drafter = self.requests, self.chooser, self.drafter
        alive = requests.alive
        budget = [min(self.policy.k_max, requests.remaining(r)) for r in alive]
        matches = [LookupMatch(0, [])] * len(alive)
        if drafter in ("lookup", "auto"):
            min_ngram = 1 if chooser is not None else LOOKUP_MIN_NGRAM_UNJUDGED
            matches = [self.lookup.match(r, requests.out[r], budget[i], min_ngram=min_ngram)
                       for i, r in enumerate(alive)]
        if chooser is None:
            fixed = drafter if layer_set is not None or drafter != "layer-skip" else "none"
            return [_fixed_choice(fixed, len(m.tokens), b) for m, b in zip(matches, budget)], matches
        # auto, or lookup with cost-aware draft lengths
        chooser.set_batch(len(alive))
        choices = [chooser.choose(r, len(matches[i].tokens), budget[i], layer_skip=layer_set is not None,
                                  lookup_ngram=matches[i].ngram) for i, r in enumerate(alive)]
        return chooser.fit_pass(choices), matches  # one pass width for the batch

    def step(self, pending: torch.Tensor, layer_set: LayerSet | None) -> tuple[torch.Tensor, LayerSet | None]:
        """One draft-verify-commit step of every row from its pending token (int64 [B]). -> each
        row's next pending token (int64 [B]), the layer set to draft with next (the tuner's,
        when it searches)."""
        model, cache, requests, chooser, stats = self.model, self.cache, self.requests, self.chooser, self.stats
        step_start, draft_seconds = time.perf_counter(), 0.0
        alive = requests.alive
        B = len(alive)
        row_seeds = [self.seeds[r] for r in alive]
        base = list(cache.host_lengths)
        choices, matches = self._choices(layer_set)
        skip = None
        skip_budget = [c.k if c.drafter == "layer-skip" else 0 for c in choices]
        if any(skip_budget):
            t0, mark = time.perf_counter(), unsteady_calls(model)
            d, q, nd, forwards = draft_tokens(model, cache, pending, layer_set, self.policy, self.params, row_seeds,
                                              skip_budget, self.draft_head)
            draft_seconds = time.perf_counter() - t0
            if chooser is not None and forwards and unsteady_calls(model) == mark:
                chooser.record_draft(draft_seconds / forwards)
            cache.rollback(base)
            skip = (d, q, nd)
            stats["draft_steps"] += forwards
        drafts, draft_probs = _assemble(choices, [m.tokens for m in matches], skip, self.params, model.vocab_size,
                                        pending.device)
        num_draft = [len(row) for row in drafts]
        mark = unsteady_calls(model)
        verified = verify_and_accept(model, cache, pending, drafts, draft_probs, self.params, row_seeds,
                                     logprobs=self.logprobs is not None)
        steady = unsteady_calls(model) == mark  # no capture's cost in the cost model
        cache.rollback([n + 1 + a for n, a in zip(base, verified.num_accepted)])
        stats["verify_steps"] += 1
        stats["row_verifies"] += B
        self._commit(verified, choices, num_draft, matches)
        if chooser is not None and steady:
            # the step's whole cost but its drafts' (lookup, choices, acceptance, commits: ~3 % of
            # a SmolLM2 decode step on the CPU, the same for any width, so a step saved saves it too)
            chooser.record_verify(max(num_draft) + 1, time.perf_counter() - step_start - draft_seconds)
        if self.tuner is not None:
            layer_set = self.tuner.after_step(model, cache, requests, self.prompts, self.draft_head)
        return verified.pending, layer_set

    def _commit(self, verified: Verified, choices: list[Choice], num_draft: list[int],
                matches: list[LookupMatch]) -> None:
        """Each row's accepted drafts and its corrected or bonus token into the output; the
        policies and the tuner told how far each row's drafts were accepted."""
        requests, chooser, stats = self.requests, self.chooser, self.stats
        alive, num_accepted = requests.alive, verified.num_accepted
        for i, row in enumerate(verified.rows):
            r = alive[i]
            used = choices[i].drafter if num_draft[i] else "none"
            stats["drafter_steps"][used] += 1
            self.per_row[r]["verifies"] += 1
            if used == "layer-skip":
                self.policy.update(num_accepted[i], num_draft[i])
                if self.tuner is not None:
                    self.tuner.observe(num_draft[i], num_accepted[i])
            if chooser is not None:
                if choices[i].drafter == "layer-skip":  # drafted or not, its forwards were paid
                    budget = choices[i].k  # confidence stopped a run short of it one forward later
                    forwards = num_draft[i] if num_draft[i] >= budget else num_draft[i] + 1
                    chooser.observe(r, "layer-skip", num_draft[i], num_accepted[i], forwards=forwards)
                else:
                    chooser.observe(r, used, num_draft[i], num_accepted[i], lookup_ngram=matches[i].ngram)
            committed = row[: num_accepted[i] + 1]
            before = len(requests.out[r])
            requests.commit(r, committed)
            n = len(requests.out[r]) - before  # a stop inside the accepted drafts cuts the rest
            for counts in (stats, self.per_row[r]):  # the stats count what reached the output
                counts["drafted"] += num_draft[i]
                counts["accepted"] += min(num_accepted[i], n)
            if self.logprobs is not None:
                self.logprobs[r].append(verified.logprobs(i, n))
            if self.draft_head is not None:
                self.draft_head.add(committed)


def _assemble(choices, lookups, skip, params: SamplingParams, vocab: int, device):
    """Each row's drafts from the drafter it chose. skip: (drafts [B, Ks], probs, num_draft)
    of the layer-skip pass, or None. -> drafts (host lists, one a row), draft_probs [B, K, V]
    (sampling with layer-skipped drafts: the skipped model's rows, one-hot at a lookup row's
    drafts) or None."""
    rows = []
    skipped = read(skip[0]) if skip is not None else None  # one read of the layer-skip drafts [B][Ks]
    for i, c in enumerate(choices):
        if c.drafter == "lookup":
            rows.append(list(lookups[i][: c.k]))
        elif c.drafter == "layer-skip":
            rows.append(skipped[i][: skip[2][i]])
        else:
            rows.append([])
    if not (params.do_sample and skip is not None):
        return rows, None
    # mixed rows: one-hot q for the deterministic drafts, their indices copied in at once
    one_hot = [(i, j, t) for i, c in enumerate(choices) if c.drafter != "layer-skip" for j, t in enumerate(rows[i])]
    at = torch.tensor(one_hot, dtype=torch.int64, device=device).view(-1, 3).T  # [3, M]: rows, positions, tokens
    probs = torch.zeros((len(rows), max(map(len, rows)), vocab), dtype=torch.float32, device=device)  # [B, K, V]
    for i, c in enumerate(choices):
        if c.drafter == "layer-skip":
            probs[i, :len(rows[i])] = skip[1][i, :len(rows[i])]
    probs[at[0], at[1], at[2]] = 1.0
    return rows, probs


def _fixed_choice(drafter: str, lookup_len: int, budget: int) -> Choice:
    if drafter == "lookup":
        return Choice("lookup", min(lookup_len, budget), 0.0)
    if drafter == "layer-skip":
        return Choice("layer-skip", budget, 0.0)
    return Choice("none", 0, 0.0)
