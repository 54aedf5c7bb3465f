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

import torch

from .batch_invariant import bi_token_logprob
from .deterministic_steps import DeterministicRun
from .errors import SwiftkernError
from .fast_path import FastPath
from .kv_cache import KVCache
from .model import SkipModel
from .replay_policy import FastPathPolicy
from .requests import Requests
from .sampling import SamplingParams
from .verifier import Verifier

__all__ = ["FastPath", "decode_deterministic", "invariant_token_logprobs"]


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
    run = DeterministicRun(model, cache, prompts, params, seeds, requests, verifier, fast_path, policy, verified)

    start = list(requests.alive)
    t0 = time.perf_counter()
    rows = run.prefill(start, list(range(len(start))), batched=True)
    run.stats["prefill_s"] = time.perf_counter() - t0  # the first tokens' draw has waited for the device
    rows = run.drop_finished(rows)
    while True:
        due, new_rows = requests.admit(cache)  # arrivals: new rows after the alive ones
        if due:
            rows = run.drop_finished(rows + run.prefill(due, new_rows, batched=False))
        if not rows:
            if not requests.waiting:
                break
            continue  # an empty batch: the next arrivals join at once
        while rows:  # verify passes: a full group of due rows, or every verified row due
            due = [i for i, row in enumerate(rows) if row.stopped or len(row.unverified) >= window]
            if not due or (len(due) < verify_batch and len(due) < sum(row.verified for row in rows)):
                break
            due.sort(key=lambda i: -len(rows[i].unverified))
            run.verify(rows, due[:verify_batch])
            rows = run.drop_finished(rows)
        if rows:
            run.fast_step(rows)
            rows = run.drop_finished(rows)  # unverified requests finish here
        requests.step += 1
    return run.final_stats()


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


