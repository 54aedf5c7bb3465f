"""The deterministic mode's fast path: every row's next token from one batched forward.

Its tokens are *unverified*: batch-variant kernels may make them, and ``deterministic``'s
fixed-shape verifier replays them before any is committed.
"""

from __future__ import annotations

import torch

from .cuda_graphs import padded_width
from .device_reads import read
from .draft_head import DraftHead
from .kv_cache import KVCache
from .layer_set import LayerSet
from .model import SkipModel
from .sampling import SamplingParams, select_with_uniforms, token_uniforms


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
        forward of 1 + the longest draft tokens a row (through CUDA graphs padded to
        ``cuda_graphs.padded_width``; shorter rows padded with their newest token: the caller
        rolls back what the padding wrote). newest: the B rows' newest tokens
        (host ids: nothing is read back from the device but the choices, once); drafts: per row
        (may be empty). -> per row, the drafts the model's own choice (``select_tokens`` at
        each position, the rule the verifier replays) agrees with, left to right, then that
        choice at the first disagreement or after the last draft."""
        T = padded_width(model, cache, len(drafts), 1 + max(len(d) for d in drafts))  # few graph keys
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
