"""Deterministic decoding (LLM-42): batch-variant fast decoding, fixed-shape batch-invariant replay.

A request's output is a function of (prompt, seed, sampling settings) alone, bit for bit,
whatever else is in the batch:
  prefill  every prompt through the verifier (``verifier.Verifier.prefill``): the prompt's KV
           is the cache of record, and the first token is the verifier's;
  fast     all rows decode together with the regular model runner (any kernels, batch-variant
           allowed), or, with a layer set, with the layer-skipped draft or the full model and
           prompt-lookup matches as ``replay_policy.FastPathPolicy`` picks them per step from
           measured costs and agreement (a full step checks a row's lookup drafts in its own
           forward and keeps those the model agrees with, so one step can add several
           tokens); their tokens are *unverified*;
  verify   when a row has ``window`` unverified tokens or its fast path stopped (stop token,
           length, stop string, or a low-confidence draft), replay its last verified token +
           up to window-1 unverified tokens in a fixed-shape ``verify_batch x window`` pass;
  commit   the matching prefix, then the verifier's token at the first mismatch (or, after a
           short window that matched, the verifier's next token); the verifier's KV is the
           cache of record and everything after the commit is rolled back.
Sampling draws each token with a uniform keyed on (seed, absolute position), so the fast path
and the replay draw the same token unless their distributions differ at that point.
Words: the *pending* token of a row is its last verified token, whose KV is not yet written.

Where every kernel of the regular path is itself batch- and length-invariant (the CPU with the
C++ kernels, float32, bfloat16 or float16: ``SkipModel.batch_invariant``), the replay would
reproduce the fast path bit for bit: ``Generator(replay="auto")`` then decodes without it, and
``invariant_token_logprobs`` re-scores an output. ``Generator(replay="never")`` decodes that way
wherever an invariant set runs, on CUDA too (the verifier's Triton kernels, ``bi_matmul`` for
cuBLAS's matmul at every step), which ``replay="auto"`` takes on CUDA unless the self-spec
drafter runs (measured cheaper than the replay there: ``Generator.replay_elided``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .device_reads import read
from .errors import SwiftkernError
from .kv_cache import KVCache
from .layer_set import LayerSet
from .model import SkipModel
from .prefill import prefill
from .requests import Requests
from .sampling import SamplingParams, select_with_uniforms, token_uniforms
from .batch_invariant import bi_log_softmax, bi_token_logprob
from .cuda_graphs import unsteady_calls
from .draft_head import DraftHead
from .drafters import LOOKUP_MIN_NGRAM_UNJUDGED
from .lookup_index import PromptLookup
from .replay_policy import FastPathPolicy
from .verifier import Slot, Verifier

# most prompt-lookup drafts a full fast forward checks per row: a forward of 4 tokens costs about
# one of 1 (SmolLM2 on the AMD CPU, `--routine verify_cost`: 4 tokens 1.11x, 8 tokens 1.80x)
RIDE_ALONG_MAX = 3


# Host reads. On a GPU, reading a device tensor on the host (``tolist``) and a blocking copy of
# host values in (``torch.tensor(..., device=...)``) both wait for every kernel queued so far. So
# a fast step and a verify pass copy their host values in before they launch anything (the GPU
# is then idle: the copy waits for nothing), queue all of their work, and read it back once
# (tests/test_host_reads.py counts them).


@dataclass
class _Row:
    pending: int
    verified: bool = True  # False: a request that does not need determinism keeps fast tokens at once
    unverified: list[int] = field(default_factory=list)
    stopped: bool = False  # the fast path stopped; the row waits for its verify pass
    kind: str | None = None  # the forward ("full" | "draft") that made its unverified fast tokens
    lookup_from: int | None = None  # unverified[lookup_from:] came from a prompt-lookup match
    lookup_ngram: int = 0  # the length of the context match it came from


class FastPath:
    """Proposes every row's next token with one batched forward (batch-variant allowed).

    layer_set None: the full model (regular decoding). A layer set: the layer-skipped draft,
    which also stops a row when its top-1 probability is below ``eps``, and may score only the
    vocabulary of a pruned ``head`` (``draft_head.DraftHead``, grown with every committed token).
    ``lookup`` (with a layer set): before a draft forward, a row whose context ends in an n-gram
    seen earlier may take that n-gram's continuation as its unverified tokens at no model cost
    and is verified next; the verifier commits what matches, as it does for the draft's tokens.
    Before a full forward, the continuation rides along in that forward instead (``check``):
    the tokens the full model agrees with join the row's unverified ones at once, so the
    verifier's replay, not a verify pass of its own, judges them (the verifier's passes are dear
    where the replay runs: a GPU).
    ``adaptive`` (with a layer set; default True): a ``replay_policy.FastPathPolicy`` picks each
    step's forward (the full model or the draft) and which lookup matches to take from the
    costs and agreement measured while decoding; False: always the draft, and every lookup
    match of at least LOOKUP_MIN_NGRAM_UNJUDGED tokens.
    """

    def __init__(self, layer_set: LayerSet | None = None, eps: float = 0.0, head: DraftHead | None = None,
                 lookup: bool = False, adaptive: bool = True):
        self.layer_set = layer_set
        self.eps = eps if layer_set is not None else 0.0
        self.head = head if layer_set is not None else None
        self.lookup = lookup and layer_set is not None
        self.adaptive = adaptive and layer_set is not None

    def committed(self, tokens: list[int]) -> None:
        """Tokens that became part of the output (the pruned head keeps them proposable)."""
        if self.head is not None:
            self.head.add(tokens)

    def propose(self, model: SkipModel, cache: KVCache, last: torch.Tensor, params: SamplingParams,
                seeds: list[int], draft: bool = True) -> tuple[list[int], list[bool], torch.Tensor]:
        """last: int64 [B], each row's newest token (appended to the cache). draft False: the full
        model proposes (where there is a layer set). -> next token per row, whether the draft
        was confident enough to keep it, logits [B, V]. One read of the device: the pruned
        head's ids and the uniforms are copied in before the forward, the confidence is read
        with the tokens."""
        positions = [n + 1 for n in cache.host_lengths]  # position of the token chosen now
        draft = draft and self.layer_set is not None
        head = self.head.head if self.head is not None and draft else None
        ids = self.head.ids if head is not None else None  # int64 [V']: made anew after the head grew
        u = token_uniforms(params, seeds, positions, model.device)
        logits = model.forward(last.unsqueeze(1), cache, layer_set=self.layer_set if draft else None,
                               head=head)[:, -1]  # [B, V']
        chosen = select_with_uniforms(logits, params, u)  # [B]
        tokens = ids[chosen] if ids is not None else chosen  # [B] token ids
        if self.eps <= 0.0 or not draft:
            return read(tokens), [True] * tokens.shape[0], logits
        confident = logits.float().softmax(-1).max(-1).values >= self.eps  # [B]
        host = read(torch.stack([tokens, confident.to(torch.int64)]))  # the step's one read: [2, B]
        return host[0], [bool(c) for c in host[1]], logits

    def check(self, model: SkipModel, cache: KVCache, newest: list[int], drafts: list[list[int]],
              params: SamplingParams, seeds: list[int]) -> list[list[int]]:
        """The full model on each row's newest token followed by its prompt-lookup drafts, in one
        forward of 1 + the longest draft tokens a row (shorter rows padded with their newest
        token: the caller rolls back what the padding wrote). newest: the B rows' newest tokens
        (host ids: nothing is read back from the device but the choices, once); drafts: per row
        (may be empty). -> per row, the drafts the model's own choice (``select_tokens`` at
        each position, the rule the verifier replays) agrees with, left to right, then that
        choice at the first disagreement or after the last draft."""
        T = 1 + max(len(d) for d in drafts)
        inputs = torch.tensor([[t] + d + [t] * (T - 1 - len(d)) for t, d in zip(newest, drafts)],
                              dtype=torch.int64, device=model.device)  # [B, T]
        start = [n + 1 for n in cache.host_lengths]  # position of the token chosen after the newest
        u = token_uniforms(params, [s for s in seeds for _ in range(T)], [p + j for p in start for j in range(T)],
                      model.device)  # [B*T] or None
        logits = model.forward(inputs, cache)  # [B, T, V]
        B, V = logits.shape[0], logits.shape[-1]
        chosen = read(select_with_uniforms(logits.reshape(B * T, V), params, u).view(B, T))  # the step's one read
        out = []
        for d, c in zip(drafts, chosen):
            n = 0
            while n < len(d) and d[n] == c[n]:
                n += 1
            out.append(d[:n] + [c[n]])
        return out


@torch.inference_mode()
def decode_deterministic(model: SkipModel, cache: KVCache, prompts: list[list[int]], params: SamplingParams,
                         seeds: list[int], requests: Requests, window: int = 32, verify_batch: int = 4,
                         fast_path: FastPath | None = None, verified: list[bool] | None = None,
                         verifier_kernels: str = "auto") -> dict:
    """Prefill, then fast-decode / verify / commit into ``requests`` until every request stops.

    cache: a fresh cache with one row per request alive at the start (``requests.alive``, in
    order) and room for the longest prompt + max_new_tokens + window positions. Finished rows
    leave the batch; requests that arrive later (``Requests.arrive_at``) join it at their step
    (a fast step, or a step of verify passes alone), prefilled through the verifier on their
    own, as a server's dynamic batching adds requests while others decode. verified[r] False: request
    r does not need determinism and keeps its fast-path tokens unverified (regular decoding at
    regular cost; its logprobs are the fast path's); only with the regular fast path.
    verifier_kernels: the verifier's per-row ops ("auto" | "portable" | "fused", see
    ``verifier_kernels``).
    -> stats: prefill_passes and verify_passes (fixed-shape passes), dummy_rows (filler slots),
       fast_steps (batched fast forwards), fast_tokens (unverified tokens proposed), rolled_back
       (of those, discarded after a mismatch), rollback_fraction, corrected (mismatches),
       verify_batch (the pass's rows: verify_batch, or fewer when fewer requests are verified),
       verifier_kernels (the set's name), lookup_tokens (fast tokens from prompt lookup sent to
       the verifier), lookup_checked (lookup drafts a full fast forward agreed with),
       with an adaptive fast path: fast_kinds ({"full", "draft": fast steps}), lookup_taken /
       lookup_declined (matches taken or declined), trials (a kind or lookup class tried again
       after the policy left it out, per row: ``acceptance.Agreements``),
       logprobs (per request, float32 [new tokens]: the verifier's log-probability of each
       returned token), per_row [{verifies, fast_tokens, rolled_back}] per request
    """
    fast_path = fast_path or FastPath()
    verified = [True] * len(prompts) if verified is None else [bool(v) for v in verified]
    if len(verified) != len(prompts):
        raise SwiftkernError(f"got {len(verified)} verified flags for {len(prompts)} prompts")
    if fast_path.layer_set is not None and not all(verified):
        raise SwiftkernError("every request must be verified with the layer-skipped fast path (its unverified "
                             "tokens are the draft's, not the model's)")
    # the pass's rows: never more than the requests to verify (a row's bits do not depend on the
    # pass's shape, which stays fixed for the whole call; a single request would otherwise carry
    # verify_batch - 1 dummy rows through every pass)
    verify_batch = max(1, min(verify_batch, sum(verified)))
    verifier = Verifier(model, window, verify_batch, kernels=verifier_kernels)
    policy = FastPathPolicy(window, verify_batch) if fast_path.adaptive else None
    stats = {"fast_steps": 0, "fast_tokens": 0, "lookup_tokens": 0, "lookup_checked": 0, "rolled_back": 0,
             "corrected": 0}
    if policy is not None:
        stats["fast_kinds"] = {"full": 0, "draft": 0}
    per_row = [{"verifies": 0, "fast_tokens": 0, "rolled_back": 0} for _ in prompts]
    logprobs: list[list[torch.Tensor]] = [[] for _ in prompts]
    lookup = PromptLookup(prompts, requests.done)

    stats["prefill_passes"] = 0
    start = list(requests.alive)
    t0 = time.perf_counter()
    rows = _prefill_rows(model, verifier, cache, start, list(range(len(start))), prompts, params, seeds, verified,
                         requests, logprobs, fast_path, stats, batched=True)
    stats["prefill_s"] = time.perf_counter() - t0  # the first tokens' draw has waited for the device
    rows = _drop_finished(requests, cache, rows)
    while True:
        due, new_rows = requests.admit(cache)  # arrivals: new rows after the alive ones
        if due:
            rows = rows + _prefill_rows(model, verifier, cache, due, new_rows, prompts, params, seeds, verified,
                                        requests, logprobs, fast_path, stats, batched=False)
            rows = _drop_finished(requests, cache, rows)
        if not rows:
            if not requests.waiting:
                break
            continue  # an empty batch: the next arrivals join at once
        while rows:  # verify passes: a full group of due rows, or every verified row due
            due = [i for i, row in enumerate(rows) if row.stopped or len(row.unverified) >= window]
            if not due or (len(due) < verify_batch and len(due) < sum(row.verified for row in rows)):
                break
            due.sort(key=lambda i: -len(rows[i].unverified))
            _verify(verifier, cache, rows, due[:verify_batch], prompts, params, seeds, requests, stats,
                    per_row, logprobs, fast_path, policy)
            rows = _drop_finished(requests, cache, rows)
        if rows:
            _fast_step(model, cache, rows, fast_path, prompts, params, seeds, requests, window, stats, per_row,
                       logprobs, policy, lookup)
            rows = _drop_finished(requests, cache, rows)  # unverified requests finish here
        requests.step += 1

    stats["verify_passes"] = verifier.passes - stats["prefill_passes"]
    stats["verifier_kernels"] = verifier.kernels.name
    stats["verify_batch"] = verify_batch
    stats["dummy_rows"] = verifier.dummy_rows
    stats["rollback_fraction"] = stats["rolled_back"] / stats["fast_tokens"] if stats["fast_tokens"] else 0.0
    if policy is not None:
        stats.update(lookup_taken=policy.taken, lookup_declined=policy.declined,
                     trials=policy.agreements.trials)
    stats["logprobs"] = [torch.cat(lp) for lp in logprobs]
    stats["per_row"] = per_row
    return stats


@torch.inference_mode()
def invariant_token_logprobs(model: SkipModel, tokens: list[int], prompt_len: int) -> torch.Tensor:
    """Score ``tokens`` from scratch with the batch-invariant kernel set (one forward over all of
    them): -> float32 [len(tokens) - prompt_len], each token's log-probability after the prompt
    given everything before it. Equal bit for bit to the logprobs mode deterministic returns
    without replay (``Generator(replay="auto")`` where those kernels run), whatever the batch
    and however the tokens were decoded (tested)."""
    if not 1 <= prompt_len <= len(tokens):
        raise SwiftkernError(f"prompt_len must be in [1, {len(tokens)}], got {prompt_len}")
    with model.batch_invariant():
        cache = model.new_cache(1, len(tokens))
        logits = model.forward(torch.tensor([tokens], device=model.device), cache)[0]  # [L, V]
        targets = torch.tensor(tokens[prompt_len:], device=model.device)
        return bi_token_logprob(logits[prompt_len - 1:-1], targets)


def _prefill_rows(model, verifier, cache, reqs, cache_rows, prompts, params, seeds, verified, requests, logprobs,
                  fast_path, stats, batched: bool) -> list[_Row]:
    """Prefill requests ``reqs`` into cache rows ``cache_rows``: through the verifier where
    verified (its KV is the cache of record), else with the regular runner (``batched``: one
    padded forward over the whole cache, which holds exactly ``reqs``; else one forward a
    prompt); draw and commit each one's first token (the indices and uniforms copied in
    before the passes, one read after them). -> their rows."""
    n, before = len(reqs), verifier.passes
    replayed = [i for i, r in enumerate(reqs) if verified[r]]
    regular = [i for i, r in enumerate(reqs) if not verified[r]]
    index = torch.tensor(replayed, dtype=torch.int64, device=model.device) if replayed else None  # [len(replayed)]
    u = token_uniforms(params, [seeds[r] for r in reqs], [len(prompts[r]) for r in reqs], model.device)  # [n] or None
    logits = torch.empty((n, model.vocab_size), device=model.device)  # [n, V]
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
    stats["prefill_passes"] += verifier.passes - before
    first = select_with_uniforms(logits, params, u)  # [n]
    first_lp = first_lp.gather(1, first.unsqueeze(1)).squeeze(1)
    rows = []
    for i, (r, t) in enumerate(zip(reqs, read(first))):  # the one read
        requests.commit(r, [t])
        fast_path.committed([t])
        logprobs[r].append(first_lp[i:i + 1])
        rows.append(_Row(pending=t, verified=verified[r]))
    return rows


def _vlen(prompts, requests, r: int) -> int:
    """Verified length of request r: prompt + committed tokens (the pending one included)."""
    return len(prompts[r]) + len(requests.out[r])


def _lookup_drafts(rows, lookup: PromptLookup, requests, window, stats, per_row, policy: FastPathPolicy | None,
                   kind: str) -> None:
    """Prompt-lookup tokens as unverified tokens for every row that is still drafting and has a
    match (up to the window and the request's remaining tokens) that the policy takes (with no
    policy: of at least LOOKUP_MIN_NGRAM_UNJUDGED tokens); such a row is verified next. kind: the
    forward the step would run."""
    for row, r in zip(rows, requests.alive):
        if not row.verified or row.stopped:
            continue
        room = min(window - 1, requests.remaining(r)) - len(row.unverified)
        match = lookup.match(r, requests.out[r], room, min_ngram=1 if policy is not None else LOOKUP_MIN_NGRAM_UNJUDGED,
                             pending=row.unverified)
        tokens = _through_stop(match.tokens, requests.stop_ids)
        if tokens and (policy is None or policy.take(
                r, row.kind or kind, len(row.unverified), len(tokens), match.ngram,
                wait=_steps_to_verify(rows, row, window, policy.verify_batch))):
            row.lookup_from, row.lookup_ngram = len(row.unverified), match.ngram
            row.unverified.extend(tokens)
            row.stopped = True
            stats["fast_tokens"] += len(tokens)
            stats["lookup_tokens"] += len(tokens)
            per_row[r]["fast_tokens"] += len(tokens)


def _through_stop(tokens: list[int], stop_ids) -> list[int]:
    """tokens up to and including the first stop id: a match runs on past it, and what follows
    a stop is never committed (the fast path's own tokens stop there too)."""
    for i, t in enumerate(tokens):
        if t in stop_ids:
            return tokens[:i + 1]
    return tokens


def _checked_lookups(rows, lookup: PromptLookup, requests, window) -> list[list[int]]:
    """Prompt-lookup drafts that ride along in a full fast forward (``FastPath.check``), per row:
    up to RIDE_ALONG_MAX tokens of a match of at least LOOKUP_MIN_NGRAM_UNJUDGED tokens, leaving
    room in the window and the request for the model's own token after them; none for a row
    that is not drafting."""
    drafts = []
    for row, r in zip(rows, requests.alive):
        room = min(window - len(row.unverified), requests.remaining(r) - len(row.unverified)) - 1
        if not row.verified or row.stopped or room <= 0:
            drafts.append([])
            continue
        match = lookup.match(r, requests.out[r], min(room, RIDE_ALONG_MAX), min_ngram=LOOKUP_MIN_NGRAM_UNJUDGED,
                             pending=row.unverified)
        drafts.append(_through_stop(match.tokens, requests.stop_ids))
    return drafts


def _steps_to_verify(rows: list[_Row], me: _Row, window: int, verify_batch: int) -> int:
    """Fast steps a row that stops now waits for its verify pass, which runs once verify_batch
    rows (or every verified row) are due; the others counted as due at their window."""
    verified = [row for row in rows if row.verified and row is not me]
    due = [row.stopped or len(row.unverified) >= window for row in verified]
    need = min(verify_batch, len(verified) + 1) - 1 - sum(due)
    if need <= 0:
        return 0
    return sorted(window - len(row.unverified) for row, d in zip(verified, due) if not d)[need - 1]


def _fast_step(model, cache, rows, fast_path, prompts, params, seeds, requests, window, stats, per_row,
               logprobs, policy: FastPathPolicy | None, lookup: PromptLookup):
    """One batched fast forward for every row; rows that are waiting discard theirs. With a
    policy, it picks the forward (full or draft) first; before a full one, rows holding draft
    tokens are sent to their verify pass (the draft wrote no KV in its skipped layers). With
    lookup, rows with a match take its tokens, and when every row is then waiting for its
    verify pass no forward runs."""
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
        checked = _checked_lookups(rows, lookup, requests, window)
        checked = checked if any(checked) else None
    elif fast_path.lookup:
        _lookup_drafts(rows, lookup, requests, window, stats, per_row, policy, kind)
    if all(row.stopped for row in rows):
        return
    newest = [row.unverified[-1] if row.unverified else row.pending for row in rows]
    last = None if checked is not None else torch.tensor(newest, dtype=torch.int64, device=model.device)  # [B]
    row_seeds = [seeds[r] for r in alive]
    t0, mark = time.perf_counter(), unsteady_calls(model)
    if checked is not None:  # every row is verified here (lookup needs a layer set)
        proposals, logits = fast_path.check(model, cache, newest, checked, params, row_seeds), None
    else:
        tokens, confident, logits = fast_path.propose(model, cache, last, params, row_seeds, draft=kind == "draft")
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
            logprobs[r].append(torch.log_softmax(logits[i].float(), -1)[token].view(1))
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
            if (token in requests.stop_ids or len(seen) >= requests.max_new_tokens
                    or (fast_path.layer_set is not None and len(row.unverified) >= most)
                    or (requests.stop_check is not None and requests.stop_check(r, seen))):
                row.stopped = True
                break
    # each row keeps KV for its pending token and every unverified token but the newest (a row
    # with lookup tokens has no KV for them: it keeps what it has, its verify pass writes the rest)
    cache.rollback([min(_vlen(prompts, requests, r) - 1 + len(row.unverified), n)
                    for r, row, n in zip(alive, rows, cache.host_lengths)])


def _verify(verifier, cache, rows, picked, prompts, params, seeds, requests, stats, per_row, logprobs, fast_path,
            policy: FastPathPolicy | None = None):
    """One fixed-shape pass over the rows ``picked``; commit, correct and roll back each (and
    tell the policy how far each row's fast and lookup tokens agreed). The pass's uniforms are
    copied in before it, its choices' logprobs queued before its one read."""
    T = verifier.window
    alive = requests.alive
    slots = []
    for i in picked:
        row, r = rows[i], alive[i]
        fed = row.unverified[:T - 1]  # the replay: pending + up to window-1 unverified tokens
        slots.append(Slot(i, _vlen(prompts, requests, r) - 1, [row.pending] + fed, list(range(len(fed) + 1))))
    row_seeds = [seeds[alive[s.row]] for s in slots for _ in s.want]
    positions = [s.start + 1 + j for s in slots for j in s.want]  # position of each predicted token
    t0, mark = time.perf_counter(), unsteady_calls(verifier.model)
    u = token_uniforms(params, row_seeds, positions, verifier.model.device)  # [N] or None
    logits = verifier.forward(cache, slots)  # [N, V]
    chosen = select_with_uniforms(logits, params, u)  # [N]
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
            per_row[r]["rolled_back"] += len(row.unverified) - match
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
        fast_path.committed(commit)
        logprobs[r].append(lps[:len(requests.out[r]) - before])
        per_row[r]["verifies"] += 1
        row.pending, row.unverified = commit[-1], rest
        row.lookup_from = max(0, row.lookup_from - T) if rest and row.lookup_from is not None else None
        row.kind = row.kind if rest else None
    lengths = list(cache.host_lengths)
    for s in slots:
        r = alive[s.row]
        lengths[s.row] = _vlen(prompts, requests, r) - 1 + len(rows[s.row].unverified)
    cache.set_lengths(lengths)


def _drop_finished(requests: Requests, cache: KVCache, rows: list[_Row]) -> list[_Row]:
    kept = requests.drop_finished(cache, torch.arange(len(rows)))
    return [] if kept is None else [rows[i] for i in kept.tolist()]
