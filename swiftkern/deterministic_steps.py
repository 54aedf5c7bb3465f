"""The steps of one deterministic decoding call: prefill rows, a fast step, a verify pass.

``decode_deterministic`` (``deterministic.py``) runs the loop; a ``DeterministicRun`` holds the
call's state (its requests' rows, stats, logprobs, policy and prompt-lookup index) and does each
step. Host reads: on a GPU, reading a device tensor on the host (``tolist``) and a blocking copy
of host values in (``torch.tensor(..., device=...)``) both wait for every kernel queued so far.
So a fast step and a verify pass copy their host values in before they launch anything (the GPU
is then idle: the copy waits for nothing), queue all of their work, and read it back once
(tests/test_host_reads.py counts them).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .batch_invariant import bi_log_softmax, bi_token_logprob
from .cuda_graphs import unsteady_calls
from .device_reads import read
from .drafters import LOOKUP_MIN_NGRAM_UNJUDGED
from .fast_path import FastPath
from .kv_cache import KVCache
from .lookup_index import PromptLookup
from .model import SkipModel
from .prefill import prefill
from .replay_policy import FastPathPolicy
from .requests import Requests
from .sampling import SamplingParams, select_with_uniforms, token_uniforms
from .verifier import Slot, Verifier

# most prompt-lookup drafts a full fast forward checks per row: a forward of 4 tokens costs about
# one of 1 (SmolLM2 on the AMD CPU, `--routine verify_cost`: 4 tokens 1.11x, 8 tokens 1.80x)
RIDE_ALONG_MAX = 3


@dataclass
class Row:
    """A request's place in the loop while it is in the batch."""
    pending: int  # its last verified token, whose KV is not yet written
    verified: bool = True  # False: a request that does not need determinism keeps fast tokens at once
    unverified: list[int] = field(default_factory=list)
    stopped: bool = False  # the fast path stopped; the row waits for its verify pass
    kind: str | None = None  # the forward ("full" | "draft") that made its unverified fast tokens
    lookup_from: int | None = None  # unverified[lookup_from:] came from a prompt-lookup match
    lookup_ngram: int = 0  # the length of the context match it came from


class DeterministicRun:
    """One ``decode_deterministic`` call's state and steps. ``rows`` arguments: the batch's
    ``Row``s, row i holding request ``requests.alive[i]``; ``verified[r]``: request r is replayed
    (else it keeps its fast tokens). ``stats``, ``per_row`` and ``logprobs`` fill as it runs."""

    def __init__(self, model: SkipModel, cache: KVCache, prompts: list[list[int]], params: SamplingParams,
                 seeds: list[int], requests: Requests, verifier: Verifier, fast_path: FastPath,
                 policy: FastPathPolicy | None, verified: list[bool]):
        self.model, self.cache, self.verifier = model, cache, verifier
        self.prompts, self.params, self.seeds, self.requests = prompts, params, seeds, requests
        self.fast_path, self.policy, self.verified = fast_path, policy, verified
        self.window = verifier.window
        self.lookup = PromptLookup(prompts, requests.done)
        self.stats = {"fast_steps": 0, "fast_tokens": 0, "lookup_tokens": 0, "lookup_checked": 0, "rolled_back": 0,
                      "corrected": 0, "prefill_passes": 0}
        if policy is not None:
            self.stats["fast_kinds"] = {"full": 0, "draft": 0}
        self.per_row = [{"verifies": 0, "fast_tokens": 0, "rolled_back": 0} for _ in prompts]
        self.logprobs: list[list[torch.Tensor]] = [[] for _ in prompts]

    def final_stats(self) -> dict:
        """The stats ``decode_deterministic`` returns, once every request stopped."""
        stats, verifier = self.stats, self.verifier
        stats["verify_passes"] = verifier.passes - stats["prefill_passes"]
        stats["verifier_kernels"] = verifier.kernels.name
        stats["verify_batch"], stats["window"] = verifier.verify_batch, verifier.window
        stats["dummy_rows"] = verifier.dummy_rows
        stats["rollback_fraction"] = stats["rolled_back"] / stats["fast_tokens"] if stats["fast_tokens"] else 0.0
        if self.policy is not None:
            stats.update(lookup_taken=self.policy.taken, lookup_declined=self.policy.declined,
                         trials=self.policy.agreements.trials)
        stats["logprobs"] = [torch.cat(lp) for lp in self.logprobs]
        stats["per_row"] = self.per_row
        return stats

    def vlen(self, r: int) -> int:
        """Verified length of request r: prompt + committed tokens (the pending one included)."""
        return len(self.prompts[r]) + len(self.requests.out[r])

    def drop_finished(self, rows: list[Row]) -> list[Row]:
        kept = self.requests.drop_finished(self.cache, torch.arange(len(rows)))
        return [] if kept is None else [rows[i] for i in kept.tolist()]

    def prefill(self, reqs: list[int], cache_rows: list[int], batched: bool) -> list[Row]:
        """Prefill requests ``reqs`` into cache rows ``cache_rows``: through the verifier where
        verified (its KV is the cache of record), else with the regular runner (``batched``: one
        padded forward over the whole cache, which holds exactly ``reqs``; else one forward a
        prompt); draw and commit each one's first token (the indices and uniforms copied in
        before the passes, one read after them). -> their rows."""
        model, cache, prompts, verifier = self.model, self.cache, self.prompts, self.verifier
        n, before = len(reqs), verifier.passes
        replayed = [i for i, r in enumerate(reqs) if self.verified[r]]
        regular = [i for i, r in enumerate(reqs) if not self.verified[r]]
        index = torch.tensor(replayed, dtype=torch.int64, device=model.device) if replayed else None  # [len(replayed)]
        u = token_uniforms(self.params, [self.seeds[r] for r in reqs], [len(prompts[r]) for r in reqs],
                           model.device)  # [n] or None
        logits = torch.empty((n, model.vocab_size), dtype=torch.float32, device=model.device)  # [n, V]
        if regular and batched:  # then overwritten for the replayed rows
            logits = prefill(model, cache, [prompts[r] for r in reqs]).float()
        elif regular:
            logits[regular] = prefill(model, cache, [prompts[reqs[i]] for i in regular], per_row=True,
                                      rows=[cache_rows[i] for i in regular]).float()
        first_lp = torch.log_softmax(logits, -1) if regular else torch.empty_like(logits)  # the fast path's
        if replayed:
            by_row: list = [None] * cache.batch  # the verifier reads prompt b for cache row b
            for i in replayed:
                by_row[cache_rows[i]] = prompts[reqs[i]]
            mine = verifier.prefill(cache, by_row, [cache_rows[i] for i in replayed]).float()  # [len(replayed), V]
            logits[index] = mine
            first_lp[index] = bi_log_softmax(mine)
        self.stats["prefill_passes"] += verifier.passes - before
        first = select_with_uniforms(logits, self.params, u)  # [n]
        first_lp = first_lp.gather(1, first.unsqueeze(1)).squeeze(1)
        rows = []
        for i, (r, t) in enumerate(zip(reqs, read(first))):  # the one read
            self.requests.commit(r, [t])
            self.fast_path.committed([t])
            self.logprobs[r].append(first_lp[i:i + 1])
            rows.append(Row(pending=t, verified=self.verified[r]))
        return rows

    def lookup_drafts(self, rows: list[Row], kind: str) -> None:
        """Prompt-lookup tokens as unverified tokens for every row that is still drafting and has a
        match (up to the window and the request's remaining tokens) that the policy takes (with no
        policy: of at least LOOKUP_MIN_NGRAM_UNJUDGED tokens); such a row is verified next. kind:
        the forward the step would run."""
        requests, policy, window = self.requests, self.policy, self.window
        for row, r in zip(rows, requests.alive):
            if not row.verified or row.stopped:
                continue
            room = min(window - 1, requests.remaining(r)) - len(row.unverified)
            match = self.lookup.match(r, requests.out[r], room,
                                      min_ngram=1 if policy is not None else LOOKUP_MIN_NGRAM_UNJUDGED,
                                      pending=row.unverified)
            tokens = _through_stop(match.tokens, requests, r, row.unverified)
            if tokens and (policy is None or policy.take(
                    r, row.kind or kind, len(row.unverified), len(tokens), match.ngram,
                    wait=_steps_to_verify(rows, row, window, policy.verify_batch))):
                row.lookup_from, row.lookup_ngram = len(row.unverified), match.ngram
                row.unverified.extend(tokens)
                row.stopped = True
                self.stats["fast_tokens"] += len(tokens)
                self.stats["lookup_tokens"] += len(tokens)
                self.per_row[r]["fast_tokens"] += len(tokens)

    def checked_lookups(self, rows: list[Row]) -> list[list[int]]:
        """Prompt-lookup drafts that ride along in a full fast forward (``FastPath.check``), per
        row: up to RIDE_ALONG_MAX tokens of a match of at least LOOKUP_MIN_NGRAM_UNJUDGED tokens,
        leaving room in the window and the request for the model's own token after them; none
        for a row that is not drafting."""
        requests, drafts = self.requests, []
        for row, r in zip(rows, requests.alive):
            room = min(self.window - len(row.unverified), requests.remaining(r) - len(row.unverified)) - 1
            if not row.verified or row.stopped or room <= 0:
                drafts.append([])
                continue
            match = self.lookup.match(r, requests.out[r], min(room, RIDE_ALONG_MAX),
                                      min_ngram=LOOKUP_MIN_NGRAM_UNJUDGED, pending=row.unverified)
            drafts.append(_through_stop(match.tokens, requests, r, row.unverified))
        return drafts

    def fast_step(self, rows: list[Row]) -> None:
        """One batched fast forward for every row; rows that are waiting discard theirs. With a
        policy, it picks the forward (full or draft) first; before a full one, rows holding draft
        tokens are sent to their verify pass (the draft wrote no KV in its skipped layers). With
        lookup, rows with a match take its tokens, and when every row is then waiting for its
        verify pass no forward runs."""
        model, cache, requests, policy, fast_path = self.model, self.cache, self.requests, self.policy, self.fast_path
        stats, per_row, window = self.stats, self.per_row, self.window
        alive = requests.alive
        kind = "draft"
        if policy is not None:
            drafting = [(r, row) for row, r in zip(rows, alive) if row.verified and not row.stopped]
            fresh = not any(row.unverified for _, row in drafting)
            kind = policy.kind([r for r, _ in drafting], fresh) if drafting else "draft"
            if kind == "full":
                for row in rows:
                    if row.kind == "draft" and row.unverified and not row.stopped:
                        row.stopped = True
        checked = None  # lookup drafts the full forward checks (a draft step sends matches to the verifier)
        if fast_path.lookup and kind == "full":
            checked = self.checked_lookups(rows)
            checked = checked if any(checked) else None
        elif fast_path.lookup:
            self.lookup_drafts(rows, kind)
        if all(row.stopped for row in rows):
            return
        newest = [row.unverified[-1] if row.unverified else row.pending for row in rows]
        last = None if checked is not None else torch.tensor(newest, dtype=torch.int64, device=model.device)  # [B]
        row_seeds = [self.seeds[r] for r in alive]
        t0, mark = time.perf_counter(), unsteady_calls(model)
        if checked is not None:  # every row is verified here (lookup needs a layer set)
            proposals, logits = fast_path.check(model, cache, newest, checked, self.params, row_seeds), None
        else:
            tokens, confident, logits = fast_path.propose(model, cache, last, self.params, row_seeds,
                                                          draft=kind == "draft")
            proposals = [[t] if ok else [] for t, ok in zip(tokens, confident)]  # [] a low-confidence draft
        if policy is not None and unsteady_calls(model) == mark:  # a replayed (or eager) forward, no capture
            policy.record_fast(kind, time.perf_counter() - t0, len(rows))
        stats["fast_steps"] += 1
        if policy is not None:
            stats["fast_kinds"][kind] += 1
        for i, row in enumerate(rows):
            r = alive[i]
            if not row.verified:  # kept at once: its KV is the fast path's
                token = proposals[i][0]
                requests.commit(r, [token])
                self.logprobs[r].append(torch.log_softmax(logits[i].float(), -1)[token].view(1))
                row.pending = token
                continue
            if row.stopped:
                continue
            if not proposals[i]:  # a low-confidence draft is dropped and the row is verified now
                row.stopped = True
                continue
            if checked is not None:
                stats["lookup_checked"] += len(proposals[i]) - 1
            trial = policy.trial_tokens(r) if policy is not None else None  # a kind's trial is short
            most = min(window, trial or window)  # unverified tokens before the row's verify pass
            for token in proposals[i]:
                row.unverified.append(token)
                # "draft" once any token is a draft's: its skipped layers wrote no KV, so a full step
                # must not follow before the row's verify pass (mixed tokens are judged as the draft's)
                row.kind = "draft" if kind == "draft" else row.kind or kind
                stats["fast_tokens"] += 1
                per_row[r]["fast_tokens"] += 1
                seen = requests.out[r] + row.unverified
                if (requests.stops(r, seen) or len(seen) >= requests.max_new_tokens
                        or (fast_path.layer_set is not None and len(row.unverified) >= most)):
                    row.stopped = True
                    break
        # each row keeps KV for its pending token and every unverified token but the newest (a row
        # with lookup tokens has no KV for them: it keeps what it has, its verify pass writes the rest)
        cache.rollback([min(self.vlen(r) - 1 + len(row.unverified), n)
                        for r, row, n in zip(alive, rows, cache.host_lengths)])

    def verify(self, rows: list[Row], picked: list[int]) -> None:
        """One fixed-shape pass over the rows ``picked``; commit, correct and roll back each (and
        tell the policy how far each row's fast and lookup tokens agreed). The pass's uniforms
        are copied in before it, its choices' logprobs queued before its one read."""
        verifier, requests, policy, stats = self.verifier, self.requests, self.policy, self.stats
        T = verifier.window
        alive = requests.alive
        slots = []
        for i in picked:
            row, r = rows[i], alive[i]
            fed = row.unverified[:T - 1]  # the replay: pending + up to window-1 unverified tokens
            slots.append(Slot(i, self.vlen(r) - 1, [row.pending] + fed, list(range(len(fed) + 1))))
        row_seeds = [self.seeds[alive[s.row]] for s in slots for _ in s.want]
        positions = [s.start + 1 + j for s in slots for j in s.want]  # position of each predicted token
        t0, mark = time.perf_counter(), unsteady_calls(verifier.model)
        u = token_uniforms(self.params, row_seeds, positions, verifier.model.device)  # [N] or None
        logits = verifier.forward(self.cache, slots)  # [N, V]
        chosen = select_with_uniforms(logits, self.params, u)  # [N]
        chosen_lp = bi_token_logprob(logits, chosen)  # [N], queued before the read
        chosen_host = read(chosen)  # the pass's one read
        if policy is not None and unsteady_calls(verifier.model) == mark:
            policy.record_verify(time.perf_counter() - t0, len(slots))
        n = 0
        for s in slots:
            row, r = rows[s.row], alive[s.row]
            preds = chosen_host[n:n + len(s.want)]
            lps = chosen_lp[n:n + len(s.want)]
            n += len(s.want)
            compared = min(len(row.unverified), T)
            match = 0
            while match < compared and row.unverified[match] == preds[match]:
                match += 1
            fast = compared if row.lookup_from is None else min(row.lookup_from, compared)
            if policy is not None:
                policy.observe(r, row.kind, fast, compared - fast, match, row.lookup_ngram)
            if match < compared:  # mismatch: the verifier's token replaces the rest
                commit, rest = row.unverified[:match] + [preds[match]], []
                stats["rolled_back"] += len(row.unverified) - match
                self.per_row[r]["rolled_back"] += len(row.unverified) - match
                stats["corrected"] += 1
                row.stopped = False
            elif compared < len(preds):  # a short window matched: the verifier's next token too
                commit, rest = row.unverified + [preds[compared]], []
                row.stopped = False
            else:  # a full window matched; tokens past it stay unverified
                commit, rest = row.unverified[:T], row.unverified[T:]
                row.stopped = row.stopped and bool(rest)  # a stop among the rest still holds
            before = len(requests.out[r])
            requests.commit(r, commit)
            self.fast_path.committed(commit)
            self.logprobs[r].append(lps[:len(requests.out[r]) - before])
            self.per_row[r]["verifies"] += 1
            row.pending, row.unverified = commit[-1], rest
            row.lookup_from = max(0, row.lookup_from - T) if rest and row.lookup_from is not None else None
            row.kind = row.kind if rest else None
        lengths = list(self.cache.host_lengths)
        for s in slots:
            lengths[s.row] = self.vlen(alive[s.row]) - 1 + len(rows[s.row].unverified)
        self.cache.set_lengths(lengths)


def _through_stop(tokens: list[int], requests, r: int, pending: list[int]) -> list[int]:
    """tokens up to and including the first that stops request r after its output and its
    ``pending`` unverified tokens (``Requests.stops``: a stop id, or a stop string its text then
    holds). A match runs on past a stop, and what follows one is never committed (the fast
    path's own tokens stop there too); uncut, it was verified, dropped by the commit and
    counted nowhere."""
    seen = requests.out[r] + pending
    for i, t in enumerate(tokens):
        seen.append(t)
        if requests.stops(r, seen):
            return tokens[:i + 1]
    return tokens


def _steps_to_verify(rows: list[Row], me: Row, window: int, verify_batch: int) -> int:
    """Fast steps a row that stops now waits for its verify pass, which runs once verify_batch
    rows (or every verified row) are due; the others counted as due at their window."""
    verified = [row for row in rows if row.verified and row is not me]
    due = [row.stopped or len(row.unverified) >= window for row in verified]
    need = min(verify_batch, len(verified) + 1) - 1 - sum(due)
    if need <= 0:
        return 0
    return sorted(window - len(row.unverified) for row, d in zip(verified, due) if not d)[need - 1]
