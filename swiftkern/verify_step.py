"""One verify step of self-speculative decoding: the pending token and every row's drafts through
the full model in one forward, the acceptance rule on its logits (``ops.greedy_accept`` greedy,
``ops.rejection_sample`` sampled), and one read of the outcome to the host."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from . import device_reads, ops
from .batch_invariant import bi_token_logprob
from .cuda_graphs import padded_width
from .device_reads import read, read_host
from .kv_cache import KVCache
from .model import SkipModel
from .sampling import STREAM_ACCEPT, STREAM_RESIDUAL, SamplingParams, keyed_uniforms, probs_from_logits


def _chunk_uniforms(seeds: list[int], start: list[int], count: int, stream: int, device) -> torch.Tensor:
    """float32 [B, count]: entry (b, j) keyed on (seeds[b], position start[b] + 1 + j, stream),
    made on the host and copied in once (each copy to a GPU is a sync)."""
    flat_seeds = [seed for seed in seeds for _ in range(count)]
    flat_positions = [s + 1 + j for s in start for j in range(count)]
    return keyed_uniforms(flat_seeds, flat_positions, stream, device).view(len(seeds), count)


def verify_tokens(pending: torch.Tensor, rows: list[list[int]], width: int | None = None) -> torch.Tensor:
    """A verify pass's tokens, int64 [B, K+1] (K: ``width``, or the longest row; shorter rows zero-padded):
    row b's pending token (pending: int64 [B]), then its drafts rows[b]. Where host values are
    written through NumPy (``device_reads.writes_through_numpy``: the CPU) one array made into
    a tensor (a ``torch.tensor`` of the drafts and a ``torch.cat`` ran cold after each forward:
    ~100 us a step against ~54 us in SmolLM2's lookup loop on a 2-core AMD EPYC); elsewhere the
    drafts copied in once and joined to pending on the device."""
    B, K = len(rows), max(map(len, rows), default=0) if width is None else width
    padded = [row + [0] * (K - len(row)) for row in rows]  # [B][K]
    if device_reads.writes_through_numpy(pending.device):
        first = pending.numpy().tolist()
        host = np.array([[first[b]] + row for b, row in enumerate(padded)], dtype=np.int64)
        return torch.from_numpy(host.reshape(B, K + 1))
    drafts = torch.tensor(padded, dtype=torch.int64, device=pending.device).view(B, K)
    return torch.cat([pending.unsqueeze(1), drafts], dim=1)


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
    0's), or computed with the acceptance (the CPU's ``greedy_verify``: each row's out tokens up
    to its num_accepted + 1, NaN past them), or None."""
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


def verify_and_accept(model: SkipModel, cache: KVCache, pending: torch.Tensor, drafts: list[list[int]],
                      draft_probs, params: SamplingParams, seeds: list[int], logprobs: bool = False) -> Verified:
    """One full-model forward over each row's pending token (int64 [B]) and its drafts (host
    lists, up to K tokens a row: [B, K+1] positions, ``verify_tokens``) and the acceptance rule,
    read back to the host once: everything the step launches is queued before that read, and
    nothing before it waits for the GPU (host values, the drafts among them, are copied in
    before anything is launched; the acceptance op's checks take max(num_draft) from the host),
    so on a GPU the host's next work overlaps the forward. draft_probs: [B, K, V] (sampling with
    layer-skipped drafts) or None. Through CUDA graphs (``model.graphs``) the pass is padded to
    ``GraphRunner.padded_tokens`` positions a row (drafts of token 0 past every row's own, never
    accepted): a few widths, a few graphs. The cache is advanced by the pass's positions (the
    caller rolls it back)."""
    device = pending.device
    num_draft = [len(row) for row in drafts]
    B, K = len(drafts), max(num_draft, default=0)
    start = list(cache.host_lengths)  # position of each row's pending token
    if K:  # through CUDA graphs a width of few graph keys: padded drafts, never accepted
        K = padded_width(model, cache, B, K + 1) - 1
        if draft_probs is not None and draft_probs.shape[1] < K:
            draft_probs = torch.nn.functional.pad(draft_probs, (0, 0, 0, K - draft_probs.shape[1]))  # [B, K, V]
    queued = logprobs and queue_logprobs(device, B * (K + 1))  # every position's logprob before the read
    host_verify = None if params.do_sample or queued else ops.greedy_verify_here(device.type)
    if K == 0 and not params.do_sample and host_verify is None:
        return _decode_step(model, cache, pending, queued)
    nd = None if host_verify is not None else torch.tensor(num_draft, dtype=torch.int32, device=device)  # [B]
    if params.do_sample:
        u_accept = _chunk_uniforms(seeds, start, K, STREAM_ACCEPT, device)  # [B, K]
        u_sample = _chunk_uniforms(seeds, start, K + 1, STREAM_RESIDUAL, device)  # [B, K+1]
    tokens = verify_tokens(pending, drafts, K)  # [B, K+1]
    draft_tokens = tokens[:, 1:]  # [B, K]
    logits = model.forward(tokens, cache)  # [B, K+1, V]
    if host_verify is not None:  # the CPU: acceptance, next pending tokens and host rows in one C++ call
        out, next_pending, rows, num_accepted, lps = read_host(host_verify, draft_tokens, logits, num_draft, logprobs)
        return Verified(rows, num_accepted, next_pending, out, logits, lps)
    if not params.do_sample:
        out, acc = ops.greedy_accept(draft_tokens, logits, nd, max_draft=K)  # [B, K+1], [B]
    else:
        target = probs_from_logits(logits.reshape(B * (K + 1), -1), params).view(B, K + 1, -1)
        out, acc = ops.rejection_sample(draft_tokens, draft_probs, target, nd, u_accept, u_sample, max_draft=K)
    lps = None
    if queued:  # Verified.logprobs
        flat = out.clamp(min=0).view(-1)  # [B*(K+1)]
        lps = bi_token_logprob(logits.reshape(B * (K + 1), -1), flat).view(B, K + 1)
    acc = acc.to(torch.int64)
    next_pending = out.gather(1, acc.unsqueeze(1)).squeeze(1)  # [B] the corrected or bonus token
    host = read(torch.cat([acc.unsqueeze(1), out], dim=1))  # the step's one read: [B, 1 + K+1]
    return Verified([h[1:] for h in host], [h[0] for h in host], next_pending, out, logits, lps)


def _decode_step(model: SkipModel, cache: KVCache, pending: torch.Tensor, queued: bool) -> Verified:
    """A greedy verify step in which no row drafts, taken as ``decode_ar`` takes a step: the
    forward of each row's pending token (int64 [B]), ``ops.greedy_tokens`` and one read. The
    acceptance at K = 0 is its one position's argmax (ties to the lowest index, as
    ``greedy_tokens``): the same tokens, without the copies of num_draft and the drafts, the
    acceptance's launches and the gather and join after them (a GPU's eager launches from Python;
    most steps of prompt lookup at batch 1 draft nothing). queued: the logprobs computed before
    the read, as ``verify_and_accept`` queues them."""
    logits = model.forward(pending.unsqueeze(1), cache)  # [B, 1, V]
    next_pending = ops.greedy_tokens(logits[:, 0])  # [B]
    lps = bi_token_logprob(logits[:, 0], next_pending).unsqueeze(1) if queued else None  # [B, 1]
    host = read(next_pending)
    return Verified([[t] for t in host], [0] * len(host), next_pending, next_pending.unsqueeze(1), logits, lps)
