"""Skip-aware decoder runner over the weights of an HF LLaMA-family causal LM."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

from . import cuda_device, ops, reference
from .layer_kernels import LayerKernels, invariant_backend
from .arg_checks import flag, whole
from .errors import SwiftkernError
from .kv_cache import KVCache
from .layer_set import LayerSet
from .modules_read import Snapshot, check_plain_modules
from .packed_weights import PackedSet
from .longrope import longrope_limit, rotate
from .rope_table import RopeTable, rope_follows_the_batch
from .transient import transient
from .weight_checks import check_weights_placed

SUPPORTED_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


@dataclass
class _Layer:
    """References (not copies) to one decoder layer's weights."""

    ln_attn: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_bias: torch.Tensor | None
    k_bias: torch.Tensor | None
    v_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    ln_mlp: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    gate_bias: torch.Tensor | None
    up_bias: torch.Tensor | None
    down_bias: torch.Tensor | None
    q_norm: torch.Tensor | None  # [D]: Qwen3's RMSNorm of each query head before RoPE, else None
    k_norm: torch.Tensor | None  # [D]: the same for each key head


def _norm_weight(attn, name: str) -> torch.Tensor | None:
    norm = getattr(attn, name, None)
    return None if norm is None else norm.weight


def _check_ids(name: str, ids: torch.Tensor, hi: int) -> None:
    """Refuse a CPU index tensor with a value outside [0, hi)."""
    if ids.numel():
        lo, top = (int(v) for v in torch.aminmax(ids))
        if lo < 0 or top >= hi:
            raise SwiftkernError(f"forward: {name} must be in [0, {hi}), got min {lo}, max {top}")


def head_norm(kern, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Qwen3's per-head RMSNorm: x [..., heads, D] normed over D with weight [D] (HF applies it
    to the projection's view before RoPE); x itself where the model has none (weight None)."""
    return x if weight is None else kern.rms_norm(x, weight, eps)


def _check_supported(hf_model) -> None:
    model_type = getattr(getattr(hf_model, "config", None), "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES or not hasattr(hf_model, "lm_head"):
        names = ", ".join(SUPPORTED_MODEL_TYPES.values())
        raise SwiftkernError(
            f"unsupported model {type(hf_model).__name__} (model_type={model_type!r}); "
            f"swiftkern runs LLaMA-family causal LMs: {names}"
        )
    act = getattr(hf_model.config, "hidden_act", "silu")
    if act != "silu":
        raise SwiftkernError(f"unsupported hidden_act {act!r}: swiftkern's MLP is SwiGLU (silu)")
    check_plain_modules(hf_model)
    check_weights_placed(hf_model)
    _check_counts(hf_model)


def _check_counts(hf_model) -> None:
    """Refuse a config whose layer count is not the model's (HF's forward runs the first
    ``num_hidden_layers`` layers, the runner would run them all) and an embedding with fewer rows
    than the LM head (a token the head can choose could not be fed back)."""
    cfg, inner = hf_model.config, hf_model.model
    if cfg.num_hidden_layers != len(inner.layers):
        raise SwiftkernError(f"config.num_hidden_layers is {cfg.num_hidden_layers}, the model has {len(inner.layers)} "
                             f"layers (HF runs the first {cfg.num_hidden_layers}): make them agree first")
    head, embed = hf_model.lm_head.weight.shape[0], inner.embed_tokens.weight.shape[0]
    if embed < head:
        raise SwiftkernError(f"the LM head has {head} rows, the embedding {embed}: a token the head chooses could not "
                             f"be fed back; resize them together (model.resize_token_embeddings)")


class SkipModel:
    """A LLaMA-family decoder that can skip any attention or MLP sub-layer.

    Shares the HF model's parameters (no copies) and reproduces its arithmetic, so with no
    layer skipped the logits match HF's to float rounding and greedy tokens are identical.
    One ``forward`` serves prefill, decode (T = 1) and multi-token verification (T = k + 1).
    """

    def __init__(self, hf_model, pack_weights: bool | None = None):
        _check_supported(hf_model)
        cfg = hf_model.config
        self.hf_model = hf_model  # its mode left as it is: the runner has no dropout, HF's generate leaves it too
        self.config = cfg
        self.num_layers = cfg.num_hidden_layers
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        # the LM head's rows, as HF's logits (config.vocab_size may say otherwise after surgery on the model)
        self.vocab_size = hf_model.lm_head.weight.shape[0]
        self.eps = cfg.rms_norm_eps
        self.scale = self.head_dim ** -0.5
        self.sliding_window = self._sliding_window(cfg)
        inner = hf_model.model
        self.embed = inner.embed_tokens.weight  # [V, H]
        self.final_norm = inner.norm.weight  # [H]
        self.lm_head = hf_model.lm_head.weight  # [V, H]
        self.lm_head_bias = getattr(hf_model.lm_head, "bias", None)
        self.rotary = inner.rotary_emb
        self.longrope_limit = longrope_limit(self.rotary)  # None unless rope_type longrope
        self.layers = [self._layer(layer) for layer in inner.layers]
        # the same weights flat, 18 per layer in _Layer's field order, for LayerKernels.stack
        self._stack_weights = [getattr(w, f.name) for w in self.layers for f in fields(_Layer)]
        self.packed = self._pack(pack_weights)
        self.invariant = False  # True inside batch_invariant(): the invariant kernel set
        self._rope_table: RopeTable | None = None
        self.graphs = None  # a cuda_graphs.GraphRunner inside cuda_graphs(), else None
        self._plans: dict = {}  # LayerSet or None -> _skip_plan's (attn, mlp) plan (lists of bools)
        # held by a Generator's whole generate call: the contexts above and a graph runner's cache
        # are this model's, so calls from several threads run one at a time
        self.lock = threading.RLock()
        self._snapshot = Snapshot(hf_model)  # what was read, for check_unchanged

    def __getstate__(self) -> dict:
        """A copy (``copy.deepcopy``, ``pickle``: a ``spawn`` / ``forkserver`` worker's argument)
        carries the HF model and the options, not what is made from them: a lock of its own, the
        packed weights made again from the copy's own weights (a tensor's version does not travel,
        so a carried copy could not tell a stale one), the RoPE table and skip plans on first use."""
        if self.graphs is not None:
            raise SwiftkernError("a SkipModel cannot be copied inside its cuda_graphs() context (a call is running)")
        change = self.change_since_wrap()  # a copy's snapshot is made from its own HF model: it would hide it
        if change is not None:
            raise SwiftkernError(f"a SkipModel cannot be copied after its HF model changed since the wrap: {change}; "
                                 f"wrap the model again (SkipModel.from_hf(model)) and copy that")
        state = dict(self.__dict__)
        for name in ("lock", "_rope_table", "_plans", "packed", "_snapshot"):
            del state[name]
        state["_was_packed"] = self.packed is not None
        return state

    def __setstate__(self, state: dict) -> None:
        was_packed = state.pop("_was_packed")
        self.__dict__.update(state)
        self.lock = threading.RLock()
        self._snapshot = Snapshot(self.hf_model)
        self._rope_table, self._plans = None, {}
        self.packed = self._pack(None if was_packed else False)

    def change_since_wrap(self) -> str | None:
        """What changed in the HF model since it was wrapped (``check_unchanged``), in words, or None."""
        return self._snapshot.change(self.hf_model)

    def check_unchanged(self) -> None:
        """Refuse (SwiftkernError, naming the first difference) an HF model whose modules or weight
        tensors the runner reads were replaced, or changed dtype, device or shape, since it was
        wrapped: ``model.to(dtype)``, a new ``nn.Parameter`` or module, ``resize_token_embeddings``,
        an adapter injected. In-place updates are read as they are. ``Generator.generate`` calls
        this at every call (~0.5 ms for SmolLM2's 30 layers on a 2-core AMD EPYC); a caller of
        ``forward`` can too."""
        change = self.change_since_wrap()
        if change is not None:
            raise SwiftkernError(
                f"the HF model changed since this SkipModel wrapped it: {change}. swiftkern holds the tensors it "
                f"read then and would run the old ones; wrap the model again (SkipModel.from_hf(model), and a "
                f"new Generator on it)")

    @classmethod
    def from_hf(cls, hf_model, pack_weights: bool | None = None) -> "SkipModel":
        """Wrap an HF LlamaForCausalLM / MistralForCausalLM / Qwen2ForCausalLM / Qwen3ForCausalLM.

        ``pack_weights``: keep a packed copy of the projection and LM head weights that are
        exactly integer codes times a scale (a GGUF model dequantized to float32;
        ``packed_weights``), which the CPU decode, draft and verify passes read at a sixth of the
        bytes with the same bits. None (default): where it runs (float32 on a CPU with the
        AVX2 or AVX-512 kernel); False: never. ``packed`` is then the ``PackedSet`` or None."""
        return cls(hf_model, pack_weights)

    def _pack(self, pack_weights: bool | None) -> PackedSet | None:
        if pack_weights is not None:
            flag("pack_weights (None: where it pays)", pack_weights)
        if pack_weights is False:
            return None
        runs = self.device.type == "cpu" and self.dtype == torch.float32 and ops.packed_linear_fast()
        if not runs:
            if pack_weights:
                raise SwiftkernError("pack_weights=True: packed weights run on a CPU with AVX2 or AVX-512, in float32, "
                                     "with the C++ extension built (SWIFTKERN_BACKEND auto or cpp)")
            return None
        weights = self._stack_weights + [self.lm_head]
        state = transient(self.hf_model)
        shared = state.get("packed")  # packed once per HF model
        if shared is None or len(shared.weights) != len(weights) or any(
                a is not b for a, b in zip(shared.weights, weights)):
            shared = state["packed"] = PackedSet(weights)
        return shared if shared.count else None

    def _reads_packed(self, kern: LayerKernels, rows: int) -> bool:
        """Whether a pass of ``rows`` rows reads packed weights: a packed set, the C++ kernels,
        and at most ops.packed_max_rows() rows (past them the regular set runs torch's matmul) or
        any number in the invariant set (whose matmul is skinny_linear's order at any size)."""
        limit = ops.packed_max_rows()
        return (self.packed is not None and kern.stack is not None
                and (limit < 0 or rows <= limit or self.invariant))

    def _packed_slots(self, kern: LayerKernels, rows: int) -> list:
        """The packed weights for ``kern.stack`` ([] when none are read); the LM head's last."""
        return self.packed.slots() if self._reads_packed(kern, rows) else []

    @property
    def packed_head(self) -> torch.Tensor | None:
        """The LM head packed (uint8 [V, H/32, bytes]) where this model reads packed weights."""
        return self.packed.slot(-1) if self.packed is not None else None

    @staticmethod
    def _sliding_window(cfg) -> int | None:
        window = getattr(cfg, "sliding_window", None)
        layer_types = getattr(cfg, "layer_types", None)
        if layer_types is not None and "sliding_attention" not in layer_types:
            return None
        if getattr(cfg, "model_type", "") == "qwen2" and not getattr(cfg, "use_sliding_window", False):
            return None
        return window

    @staticmethod
    def _layer(layer) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp
        return _Layer(
            ln_attn=layer.input_layernorm.weight,
            q=attn.q_proj.weight, k=attn.k_proj.weight, v=attn.v_proj.weight,
            q_bias=attn.q_proj.bias, k_bias=attn.k_proj.bias, v_bias=attn.v_proj.bias,
            o=attn.o_proj.weight, o_bias=attn.o_proj.bias,
            ln_mlp=layer.post_attention_layernorm.weight,
            gate=mlp.gate_proj.weight, up=mlp.up_proj.weight, down=mlp.down_proj.weight,
            gate_bias=mlp.gate_proj.bias, up_bias=mlp.up_proj.bias, down_bias=mlp.down_proj.bias,
            q_norm=_norm_weight(attn, "q_norm"), k_norm=_norm_weight(attn, "k_norm"),
        )

    @contextmanager
    def batch_invariant(self, on: bool = True):
        """Within this context every forward runs the batch- and length-invariant kernel set
        (``layer_kernels.invariant_backend``; RoPE from a ``RopeTable``): a row's logits depend
        on its own tokens alone, bit for bit, whatever the other rows, and decoding token by
        token, verifying drafts and prefilling give a token the same bits. The set is the C++
        kernels on the CPU (float32, bfloat16 or float16) and the deterministic verifier's Triton
        kernels on CUDA. Raises SwiftkernError where neither runs. ``on=False``: the regular
        kernel set within (e.g. a prompt's prefill inside invariant decoding), which runs
        everywhere."""
        if on and invariant_backend(self.device.type, self.dtype) is None:
            raise SwiftkernError(
                f"the batch-invariant kernels run on the CPU in float32, bfloat16 or float16 with the C++ "
                f"extension built, or on CUDA with the Triton kernels (SWIFTKERN_BACKEND auto or triton); here: "
                f"{self.device.type}, {self.dtype}, SWIFTKERN_BACKEND={ops.backends.current_backend()}. Use the "
                f"deterministic mode's replay (replay='always')")
        if on and rope_follows_the_batch(self.rotary):
            raise SwiftkernError(f"rope_type {self.rotary.rope_type!r} rescales its frequencies by the longest "
                                 "position of a forward: no batch-invariant decoding (run the regular kernels)")
        if on and self._rope_table is None:
            self._rope_table = RopeTable(self.rotary, self.dtype, self.device)
        before = self.invariant
        self.invariant = bool(on)
        try:
            yield self
        finally:
            self.invariant = before

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, T, D] at ``positions`` (int64 [B, T]) from the model's rotary module (``x``
        gives the dtype and device), a longrope model's set chosen per token (``longrope.rotate``)."""
        return rotate(self.rotary, x, positions, self.longrope_limit)

    def rope_table_address(self) -> int | None:
        """Where the invariant set's RoPE table lives now (None: not made yet). A CUDA graph of an
        invariant forward reads it, so the graph runner keys its graphs on it: a table that grew
        (and freed the old one) is never read through an older graph."""
        table = self._rope_table
        return None if table is None or table.cos is None else table.cos.data_ptr()

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    def new_cache(self, batch: int, max_len: int, used: int | None = None) -> KVCache:
        """A KV cache for ``batch`` rows of up to ``max_len`` positions each. ``used``: how many
        leading positions hold tokens whose outputs are kept (default ``max_len``); the rest only
        padded passes write (a verify pass wider than a row's drafts, a replay window), and their
        outputs are discarded. A sliding-window model needs ``used`` within its window."""
        max_len = whole("KV cache max_len", max_len, 1)
        self.check_positions(max_len if used is None else whole("KV cache used", used, 0, max_len))
        return KVCache(self.num_layers, batch, self.num_kv_heads, max_len, self.head_dim,
                       self.dtype, self.device)

    def check_positions(self, used: int) -> None:
        """Refuse ``used`` positions (prompt + new tokens) past a sliding window: swiftkern's
        attention reads every key, which equals the model's only while no query is that far on."""
        if self.sliding_window is not None and used > self.sliding_window:
            raise SwiftkernError(
                f"this model uses sliding-window attention ({self.sliding_window} tokens), which "
                f"swiftkern does not implement; keep prompt + max_new_tokens <= {self.sliding_window}"
            )

    def _skip_plan(self, layer_set, batch: int, device) -> tuple[list, list]:
        """Per layer, for attention and MLP: True (every row skips it), False (no row does), or
        a float mask [B, 1, 1] (1 = the row keeps it) when ``layer_set`` is a list with one
        LayerSet per row."""
        per_row = isinstance(layer_set, (list, tuple))
        if not per_row and layer_set in self._plans:  # one set for all rows: plain bools, kept
            return self._plans[layer_set]
        sets = layer_set if per_row else [layer_set]
        for ls in sets:
            if ls is not None and ls.num_layers != self.num_layers:
                raise SwiftkernError(f"layer set is for {ls.num_layers} layers, the model has {self.num_layers}")
        if per_row and len(layer_set) != batch:
            raise SwiftkernError(f"forward: got {len(layer_set)} layer sets for a batch of {batch} rows")
        plans = []
        for masks in ([ls.attn_mask() if ls is not None else [False] * self.num_layers for ls in sets],
                      [ls.mlp_mask() if ls is not None else [False] * self.num_layers for ls in sets]):
            plan = []
            for i in range(self.num_layers):
                column = [m[i] for m in masks]
                if all(column) or not any(column):
                    plan.append(column[0])
                else:
                    keep = torch.tensor([0.0 if s else 1.0 for s in column], dtype=self.dtype, device=device)
                    plan.append(keep.view(batch, 1, 1))
            plans.append(plan)
        if not per_row:
            if len(self._plans) >= 1024:  # a long search drafts with many sets: keep the memo small
                self._plans.clear()
            self._plans[layer_set] = (plans[0], plans[1])
        return plans[0], plans[1]

    def _add_norm(self, kern: LayerKernels, hidden: torch.Tensor, pending: torch.Tensor | None,
                  weight: torch.Tensor, fuse: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden, pending: [B, T, H] (pending None: nothing to add) -> (rms_norm(hidden +
        pending, weight), hidden + pending); one fused pass when ``fuse``."""
        if pending is None:
            return kern.rms_norm(hidden, weight, self.eps), hidden
        if fuse:
            return kern.fused_add_rms_norm(pending, hidden, weight, self.eps)
        hidden = hidden + pending
        return kern.rms_norm(hidden, weight, self.eps), hidden

    def _layer_loop(self, kern: LayerKernels, cache: KVCache, hidden, cos, sin, positions, new_lengths, max_len,
                    uniform_start, mask, fuse: bool, skip_attn: list, skip_mlp: list):
        """The decoder layers op by op (what ``LayerKernels.stack`` does in one C++ call where it
        can; this path also takes per-row skip masks and every backend). -> (hidden, pending):
        the residual stream and the last kept sub-layer's output not yet added to it (or None)."""
        B, T = hidden.shape[:2]
        pending = None  # the last kept sub-layer's output, added to hidden by the next norm
        linear = kern.linear
        linears = kern.linears or (lambda x, weights, biases: [linear(x, w, b) for w, b in zip(weights, biases)])
        for i, w in enumerate(self.layers):
            if skip_attn[i] is not True:
                x, hidden = self._add_norm(kern, hidden, pending, w.ln_attn, fuse)
                q, k, v = linears(x, (w.q, w.k, w.v), (w.q_bias, w.k_bias, w.v_bias))
                q = head_norm(kern, q.view(B, T, self.num_heads, self.head_dim), w.q_norm, self.eps).transpose(1, 2)
                k = head_norm(kern, k.view(B, T, self.num_kv_heads, self.head_dim), w.k_norm, self.eps).transpose(1, 2)
                v = v.view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
                q = kern.rope_kv_append(q, k, v, cos, sin, cache.k[i], cache.v[i], positions, uniform_start, max_len)
                attn = kern.verify_attention(q, cache.k[i], cache.v[i], new_lengths, self.scale, max_len, mask)
                attn = attn.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim)
                out = linear(attn, w.o, w.o_bias)
                pending = out if skip_attn[i] is False else out * skip_attn[i]
            if skip_mlp[i] is not True:
                x, hidden = self._add_norm(kern, hidden, pending, w.ln_mlp, fuse)
                gate, up = linears(x, (w.gate, w.up), (w.gate_bias, w.up_bias))
                if kern.silu_linear is not None:  # one launch, the same bits
                    out = kern.silu_linear(gate, up, w.down, w.down_bias)
                else:
                    out = linear(kern.silu_mul(gate, up), w.down, w.down_bias)
                pending = out if skip_mlp[i] is False else out * skip_mlp[i]
        return hidden, pending

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,
        cache: KVCache,
        layer_set: LayerSet | None = None,
        logits_positions: torch.Tensor | None = None,
        head: tuple[torch.Tensor, torch.Tensor | None] | None = None,
    ) -> torch.Tensor:
        """Append T tokens to every row of the cache and return their logits.

        tokens: int64 [B, T], row b continuing at position cache.host_lengths[b];
        layer_set: sub-layers to skip (None: the full model), or a list of one LayerSet per row
        (rows scored together, e.g. candidate layer sets: a sub-layer some rows keep runs for
        all and is masked out of the others' residual); skipped attention writes no KV;
        logits_positions: int64 [B, P] chunk-relative positions whose logits are wanted
        (None: all T); head: (weight [V', H], bias [V'] or None[, the weight packed]) replacing
        the LM head, e.g. the rows of a vocabulary subset (``draft_head.DraftHead``). -> logits [B, T or P, V or
        V'] in the model dtype. Advances the cache by T. Inside ``cuda_graphs(runner)`` the
        runner replays captured CUDA graphs where it can (``cuda_graphs.GraphRunner``). Reads the
        tensors the HF model held when it was wrapped (in-place writes show): after replacing its
        weights or modules, wrap it again (``check_unchanged`` refuses a changed model;
        ``Generator.generate`` calls it at every call, this per-step call does not).
        """
        self._check_forward_args(tokens, cache, layer_set, logits_positions)
        B, T = tokens.shape
        cache.check_room(T)
        skip_attn, skip_mlp = self._skip_plan(layer_set, B, tokens.device)
        starts = cache.host_lengths
        kern = self._one_call_kernels(tokens, skip_attn, skip_mlp, logits_positions)
        if kern is not None:  # the CPU's common case: one C++ call through the LM head
            logits = self._forward_in_one_call(kern, tokens, cache, skip_attn, skip_mlp, max(starts) + T, head)
            cache.advance_host(T)
            return logits
        self._check_token_ids(tokens)
        with cuda_device.current(self.device):  # Triton launches on torch's current device
            if self.graphs is not None:
                logits = self.graphs.forward(tokens, cache, skip_attn, skip_mlp, logits_positions, head)
                if logits is not None:
                    return logits
            uniform_start = starts[0] if min(starts) == max(starts) else None
            hidden = self.forward_device(tokens, cache, skip_attn, skip_mlp, max(starts) + T, uniform_start,
                                         logits_positions)
            cache.advance_host(T)
            return self.head_logits(hidden, head)

    def _check_forward_args(self, tokens, cache, layer_set, logits_positions) -> None:
        """``forward``'s inputs: kinds, shapes, dtypes and devices on the host (no device sync);
        logits positions also by value where they sit on the CPU (token ids: ``forward`` next, by
        ``_check_token_ids`` or inside the C++ one-call forward). On CUDA that
        would cost a sync a step: there the Generator has checked the prompt's ids (and every
        id it generates is in range), and an id out of range is a device-side assert."""
        if not isinstance(cache, KVCache):
            raise SwiftkernError(f"forward: cache must be a KVCache (model.new_cache(batch, max_len)), "
                                 f"got {type(cache).__name__}")
        L, _, H_kv, _, D = cache.k.shape
        if (L, H_kv, D) != (self.num_layers, self.num_kv_heads, self.head_dim) or cache.k.dtype != self.dtype \
                or cache.k.device != self.device:
            raise SwiftkernError(f"forward: the cache holds [L={L}, B, H_kv={H_kv}, S, D={D}] {cache.k.dtype} on "
                                 f"{cache.k.device}, this model needs [L={self.num_layers}, B, H_kv={self.num_kv_heads}, "
                                 f"S, D={self.head_dim}] {self.dtype} on {self.device}: make it with "
                                 f"model.new_cache(batch, max_len)")
        if not torch.is_tensor(tokens) or tokens.dim() != 2 or tokens.shape[0] != cache.batch:
            raise SwiftkernError(f"forward: tokens must be a tensor [B, T] with B = cache batch {cache.batch}, got "
                                 f"{tuple(tokens.shape) if torch.is_tensor(tokens) else type(tokens).__name__}")
        if tokens.dtype not in (torch.int64, torch.int32) or tokens.device != self.device:
            raise SwiftkernError(f"forward: tokens must be int64 (or int32) ids on the model's device {self.device}, got "
                                 f"{tokens.dtype} on {tokens.device}")
        sets = layer_set if isinstance(layer_set, (list, tuple)) else [layer_set]
        if not all(ls is None or isinstance(ls, LayerSet) for ls in sets):
            raise SwiftkernError(f"forward: layer_set must be None, a LayerSet (LayerSet.parse makes one from its "
                                 f"string form) or a list of one per row, got {layer_set!r}")
        B, T = tokens.shape
        if logits_positions is not None and (not torch.is_tensor(logits_positions) or logits_positions.dim() != 2
                                             or logits_positions.shape[0] != B
                                             or logits_positions.dtype != torch.int64
                                             or logits_positions.device != self.device):
            raise SwiftkernError(f"forward: logits_positions must be int64 [B, P] with B = {B} on {self.device}, got "
                                 f"{logits_positions!r}"[:300])
        if self.device.type == "cpu" and logits_positions is not None:
            _check_ids("logits_positions", logits_positions, T)

    def _check_token_ids(self, tokens: torch.Tensor) -> None:
        """Token ids in [0, vocab) where they sit on the CPU (before ``forward_device``; the C++
        one-call forward checks them itself, and this runs after it refused one, to name it)."""
        if tokens.device.type == "cpu":
            _check_ids("tokens", tokens, self.vocab_size)

    def forward_device(self, tokens: torch.Tensor, cache: KVCache, skip_attn: list, skip_mlp: list, max_len: int,
                       uniform_start: int | None, logits_positions: torch.Tensor | None) -> torch.Tensor:
        """``forward`` up to the final norm, reading no host-side cache state (what a CUDA graph
        captures): tokens int64 [B, T]; skip_attn, skip_mlp from ``_skip_plan``; ``max_len``
        >= every row's length + T (the keys attention is planned for; past a row's length they
        are masked); ``uniform_start``: every row's length when all are equal (a hint, None
        always works). Advances ``cache.lengths`` (the device side) by T.
        -> normed hidden [B, T or P, H]."""
        B, T = tokens.shape
        positions = cache.lengths.unsqueeze(1) + torch.arange(T, device=cache.lengths.device)  # [B, T]
        new_lengths = cache.lengths + T  # [B]
        kern = LayerKernels.for_device(tokens.device.type, self.invariant)  # the layer ops, bound once, unchecked
        if kern.backends["verify_attention"] != "reference":
            mask = None  # the kernels mask by cache length themselves
        elif T == 1 and uniform_start is not None and uniform_start + T == max_len:
            mask = False  # every query sees the whole prefix
        else:
            mask = reference.grouped_attention_bias(  # [B, 1, group * T, max_len], shared by all layers
                ops.attention_mask(new_lengths, T, max_len), self.num_heads // self.num_kv_heads, self.dtype)
        # fuse each kept sub-layer's residual add into the next kept norm where a kernel does it
        # (C++ on the CPU: one pass instead of seven torch ops per norm, 24 vs 26 ms a SmolLM2
        # decode step; its sum of squares runs in another order than torch's mean, so logits
        # agree with HF's to float rounding, as the skinny matmul's do); the reference path keeps
        # HF's arithmetic (add, then norm) operation for operation
        fuse = kern.backends["fused_add_rms_norm"] != "reference"
        hidden = F.embedding(tokens, self.embed)  # [B, T, H]
        if self.invariant:  # the table covers the whole cache: it grows with a larger cache only
            cos, sin = self._rope_table.lookup(positions, max(max_len, cache.max_len))  # [B, T, D] each
        else:
            cos, sin = self.rope(hidden, positions)  # [B, T, D] each
        plain = all(s is True or s is False for s in skip_attn + skip_mlp)  # no per-row masks
        if kern.stack is not None and plain:  # _layer_loop in one C++ call
            skip, packed, _ = self._stack_args(kern, skip_attn, skip_mlp, B * T)
            hidden, pending = kern.stack(hidden, self._stack_weights, skip, cache.k, cache.v, cos, sin, positions,
                                         new_lengths, max_len, self.num_heads, self.num_kv_heads, self.head_dim,
                                         self.eps, self.scale, packed)
        else:
            hidden, pending = self._layer_loop(kern, cache, hidden, cos, sin, positions, new_lengths, max_len,
                                               uniform_start, mask, fuse, skip_attn, skip_mlp)
        cache.advance_device(T)
        if logits_positions is not None:  # every op below is per row: pick the rows first
            idx = logits_positions.unsqueeze(-1).expand(-1, -1, hidden.shape[-1])
            hidden = hidden.gather(1, idx)  # [B, P, H]
            pending = None if pending is None else pending.gather(1, idx)
        # the last add through the kernel of every other (the verifier's too): its rounding of
        # the sum, not torch's (the Triton interpreter rounds bf16 toward zero, a GPU to nearest)
        return self._add_norm(kern, hidden, pending, self.final_norm, fuse)[0]

    def _stack_args(self, kern: LayerKernels, skip_attn: list, skip_mlp: list,
                    rows: int) -> tuple[list, list, torch.Tensor | None]:
        """``kern.stack``'s skip code per layer (1: attention skipped, 2: MLP skipped) for a plan of
        plain bools, its packed weight slots for a pass of ``rows`` rows ([] when none are read),
        and the LM head's packed weight then (None when none are read)."""
        skip = [int(a) | 2 * int(m) for a, m in zip(skip_attn, skip_mlp)]
        slots = self._packed_slots(kern, rows)  # the stack's, then the LM head's
        return skip, slots[:len(self._stack_weights)], slots[-1] if slots else None

    def _one_call_kernels(self, tokens: torch.Tensor, skip_attn: list, skip_mlp: list,
                          logits_positions: torch.Tensor | None) -> LayerKernels | None:
        """The layer kernels where ``_forward_in_one_call`` takes this pass (their ``forward`` and
        ``stack`` built, no per-row masks, every position's logits, no CUDA graph runner, the
        embedding table contiguous, as the C++ call reads it), else None."""
        if self.graphs is not None or logits_positions is not None or not self.embed.is_contiguous():
            return None
        kern = LayerKernels.for_device(tokens.device.type, self.invariant)
        if kern.forward is None or kern.stack is None:
            return None
        return kern if all(s is True or s is False for s in skip_attn + skip_mlp) else None

    def _forward_in_one_call(self, kern: LayerKernels, tokens: torch.Tensor, cache: KVCache, skip_attn: list,
                             skip_mlp: list, max_len: int, head: tuple | None) -> torch.Tensor:
        """``forward_device``'s ops and ``head_logits``' in one C++ call (``kern.forward``: the
        embedding, the RoPE rows, ``kern.stack``, the final norm and the LM head or ``head``, the same
        kernels in the same order): the same bits, without the small ops that each ran with a cold
        cache after the stack. -> logits [B, T, V or V']."""
        B, T = tokens.shape
        if self.invariant:  # the table's rows, read in C++ at the positions it computes
            cos, sin = self._rope_table.tables(max(max_len, cache.max_len))  # [P, D] each
            positions = None
        else:  # HF's rotary at this chunk's positions, as forward_device computes them (its bits)
            positions = cache.lengths.unsqueeze(1) + torch.arange(T, device=cache.lengths.device)  # [B, T]
            cos, sin = self.rope(self.embed, positions)  # [B, T, D] each (the first argument gives the dtype)
        skip, packed, packed_head = self._stack_args(kern, skip_attn, skip_mlp, B * T)
        head = self._head_parts(head, packed_head)
        try:
            return kern.forward(tokens, self.embed, cos, sin, self.invariant, positions, cache.lengths, self.final_norm,
                                self._stack_weights, skip, cache.k, cache.v, max_len, self.num_heads,
                                self.num_kv_heads, self.head_dim, self.eps, self.scale, packed, head)
        except RuntimeError:
            self._check_token_ids(tokens)  # a bad id (checked before anything was written) as a SwiftkernError
            raise

    def head_logits(self, hidden: torch.Tensor,
                    head: tuple[torch.Tensor, torch.Tensor | None] | None = None) -> torch.Tensor:
        """normed hidden [B, P, H] -> logits [B, P, V] through the LM head, or [B, P, V'] through
        ``head`` = (weight [V', H], bias [V'] or None[, the weight packed or None]), e.g. a pruned
        draft head (``DraftHead.head``)."""
        kern = LayerKernels.for_device(hidden.device.type, self.invariant)
        reads_packed = self._reads_packed(kern, hidden.numel() // hidden.shape[-1])
        weight, bias, packed = self._head_parts(head, self.packed_head if reads_packed else None)
        if packed is not None:  # the same bits, fewer bytes
            return torch.ops.swiftkern.packed_linear(hidden, packed, bias)
        return kern.linear(hidden, weight, bias)

    def _head_parts(self, head: tuple | None, packed_head: torch.Tensor | None) -> tuple:
        """(weight, bias, the weight packed or None) of the LM head, or of ``head`` (a pruned one:
        logits over a vocabulary subset only), read packed where the model reads packed weights:
        ``packed_head``, the LM head's packed weight then, else None."""
        if head is None:
            return self.lm_head, self.lm_head_bias, packed_head
        weight, bias, *rest = head
        return weight, bias, rest[0] if rest and packed_head is not None else None

    @contextmanager
    def cuda_graphs(self, runner):
        """Within this context ``forward`` goes through ``runner`` (a ``cuda_graphs.GraphRunner``
        for this model), which replays captured CUDA graphs for the shapes it has seen before."""
        if runner is not None and runner.model is not self:
            raise SwiftkernError("cuda_graphs: the runner belongs to another model")
        if runner is not None:
            runner.follow_weights(self._snapshot.addresses())
        before = self.graphs
        self.graphs = runner
        try:
            yield self
        finally:
            self.graphs = before

    __call__ = forward
