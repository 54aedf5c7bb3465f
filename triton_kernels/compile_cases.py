"""What ``compile_check`` compiles: each Triton launcher on meta tensors of the shapes the model
runner uses on a GPU (``cases``), and the deterministic verifier's ops at the shapes it meets
(``verifier_cases``, which must compile to one binary each). Meta tensors hold no memory, so
every case's arguments are built up front, whatever the sizes."""

from __future__ import annotations

import torch

from .launch import MAX_COMPACT_ENTRIES, acceptance_plan, attention_plan, gpu_launch_plans

META = torch.device("meta")


MODELS = {  # hidden, query heads, kv heads, head dim, MLP width, vocabulary, layers
    "smollm2": dict(H=576, Hq=9, Hkv=3, D=64, I=1536, V=49152, L=30),
    "llama3-8b": dict(H=4096, Hq=32, Hkv=8, D=128, I=14336, V=128256, L=32),
    "qwen2-0.5b": dict(H=896, Hq=14, Hkv=2, D=64, I=4864, V=151936, L=24),
    "tiny-mqa": dict(H=64, Hq=4, Hkv=1, D=16, I=96, V=301, L=4),  # the tests' tiny models, one kv head
}
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BATCHES = (1, 8, 32)
NEW_TOKENS = (1, 9, 33)  # decode, verification of 8 drafts, a deterministic replay window of 32
CACHE_KEYS = (512, 4096, 32768)


def _m(*shape, dtype=torch.float32) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=META)


def _heads(B: int, T: int, H: int, D: int, dtype) -> torch.Tensor:
    """[B, H, T, D] as the model makes it: a transposed view of a [B, T, H, D] projection."""
    return _m(B, T, H, D, dtype=dtype).transpose(1, 2)


def cases():
    """(label, launcher, args) triples: one launcher on meta tensors of one shape the model
    runner uses on a GPU (meta tensors hold no memory, so the args are built up front)."""
    from . import KERNELS
    from .bi_matmul import CANDIDATES, bi_matmul, bi_matmul_swiglu, launch
    from .skinny_linear import skinny_linear_group, skinny_silu_linear

    k = {name: fn for name, (fn, _) in KERNELS.items()}
    i64, i32 = torch.int64, torch.int32
    for model, c in MODELS.items():
        H, Hq, Hkv, D, I, V, L = (c[x] for x in ("H", "Hq", "Hkv", "D", "I", "V", "L"))
        for dt in DTYPES:
            tag = f"{model} {str(dt).removeprefix('torch.')}"
            for rows in (1, 32 * 9):
                x = _m(rows, H, dtype=dt)
                yield f"rms_norm {tag} rows={rows}", k["rms_norm"], (x, _m(H, dtype=dt), 1e-5)
                yield f"fused_add_rms_norm {tag} rows={rows}", k["fused_add_rms_norm"], (x, _m(rows, H, dtype=dt),
                                                                                        _m(H, dtype=dt), 1e-5)
                yield f"silu_mul {tag} rows={rows}", k["silu_mul"], (_m(rows, I, dtype=dt), _m(rows, I, dtype=dt))
            for B in BATCHES:
                for T in NEW_TOKENS:
                    yield f"rope_kv_append {tag} B={B} T={T}", k["rope_kv_append"], (
                        _heads(B, T, Hq, D, dt), _heads(B, T, Hkv, D, dt), _heads(B, T, Hkv, D, dt),
                        _m(B, T, D, dtype=dt), _m(B, T, D, dtype=dt), _m(B, Hkv, 4096, D, dtype=dt),
                        _m(B, Hkv, 4096, D, dtype=dt), _m(B, T, dtype=i64))
                    for S in CACHE_KEYS:
                        for name in ("verify_attention", "verify_attention_invariant"):
                            yield f"{name} {tag} B={B} T={T} S={S}", k[name], (
                                _heads(B, T, Hq, D, dt), _m(B, Hkv, S, D, dtype=dt), _m(B, Hkv, S, D, dtype=dt),
                                _m(B, dtype=i64), D ** -0.5)
                for M in (9, 33):
                    yield f"kv_compact {tag} B={B} M={M}", k["kv_compact"], (
                        _m(L, B, Hkv, 4096, D, dtype=dt), _m(L, B, Hkv, 4096, D, dtype=dt),
                        _m(B, M, dtype=i64), _m(B, dtype=i64), _m(B, dtype=i32))
            yield from _attention_plan_cases(k["verify_attention"], tag, Hq, Hkv, D, dt)
            if dt != torch.float16:  # its registers are bf16's
                yield from _compact_plan_cases(k["kv_compact"], tag, Hkv, D, dt)
            if dt == torch.float32:  # the regular path's projections of 2-32 rows (ops.projections.CUDA_SKINNY_ROWS)
                for rows in (2, 9, 32):
                    for n_out, n_in in ((Hq * D, H), (Hkv * D, H), (I, H), (H, I), (V, H)):
                        yield f"skinny_linear {tag} M={rows} N={n_out} K={n_in}", k["skinny_linear"], (
                            _m(rows, n_in, dtype=dt), _m(n_out, n_in, dtype=dt), None)
                    # the regular set's grouped q/k/v and gate/up, and the down projection with its SwiGLU
                    for name, widths in (("qkv", (Hq * D, Hkv * D, Hkv * D)), ("gate_up", (I, I))):
                        yield f"skinny_linear_group:{name} {tag} M={rows}", skinny_linear_group, (
                            _m(rows, H, dtype=dt), [_m(n, H, dtype=dt) for n in widths], [None] * len(widths))
                    gate_up = _m(rows, 2 * I, dtype=dt)
                    yield f"skinny_silu_linear {tag} M={rows} N={H} K={I}", skinny_silu_linear, (
                        gate_up[:, :I], gate_up[:, I:], _m(H, I, dtype=dt), None)
            for rows in (1, 33 * 8):  # one decode token; a replay of 8 windows of 33
                for n_out, n_in in ((Hq * D, H), (I, H), (H, I), (V, H)):
                    # the model multiplies by a [N, K] weight's transposed view
                    yield f"bi_matmul {tag} M={rows} N={n_out} K={n_in}", bi_matmul, (
                        _m(rows, n_in, dtype=dt), _m(n_out, n_in, dtype=dt).t())
                gate_up = _m(rows, 2 * I, dtype=dt)  # the down projection with its SwiGLU, from the grouped halves
                yield f"bi_matmul_swiglu {tag} M={rows} N={H} K={I}", bi_matmul_swiglu, (
                    gate_up[:, :I], gate_up[:, I:], _m(H, I, dtype=dt).t())
        if model == "smollm2":  # the plans the bench sweeps must fit too (float32: where they differ most)
            for plan in CANDIDATES:
                yield f"bi_matmul candidate {plan.name} {model} float32 M=128", launch, (
                    _m(128, H, dtype=torch.float32), _m(I, H, dtype=torch.float32).t(), plan)
        for rows in (1, 9, 16 * 33):  # a decode step's logprob, a verify step's, a replay pass's
            yield f"bi_exp_sum {model} rows={rows}", k["bi_exp_sum"], (_m(rows, V),)
        for B, K in ((1, 4), (8, 8), (32, 8)):
            for dt in (torch.float32, torch.bfloat16):
                yield f"greedy_accept {model} logits {str(dt).removeprefix('torch.')} B={B} K={K}", (
                    k["greedy_accept"]), (_m(B, K, dtype=i64), _m(B, K + 1, V, dtype=dt), _m(B, dtype=i32))
            for has_q in (False, True):
                yield f"rejection_sample {model} B={B} K={K} draft_probs={has_q}", k["rejection_sample"], (
                    _m(B, K, dtype=i64), _m(B, K, V) if has_q else None, _m(B, K + 1, V), _m(B, dtype=i32),
                    _m(B, K), _m(B, K + 1))
        yield from _acceptance_plan_cases(k, model, V)


MAX_SMS = 132  # the most SMs of the GPUs compile_check targets (an H100's): the most key splits a plan wants


def _widths_up_to(widest: int) -> list[int]:
    """The powers of two from 2 up to ``widest`` (a power of two)."""
    return [2 ** e for e in range(1, widest.bit_length())]


def _attention_plan_cases(launcher, tag: str, Hq: int, Hkv: int, D: int, dt: torch.dtype):
    """verify_attention at one shape for each binary its plans can pick that the grid of
    BATCHES x NEW_TOKENS x CACHE_KEYS may miss (those caches are long enough to split every
    batch-1 row's keys): each query tile (16, 32 and 64 rows: the query heads of a kv head x the
    new tokens) without a key split (a short cache) and with one, and each width of the split
    combine (a power of two from 2 up to the most splits ``attention_plan`` wants for one row on
    the most SMs, its cache uncapped; forced through ``num_splits`` on a 32768-key cache)."""
    group = Hq // Hkv
    for rows in (16, 32, 64):
        T = max(1, -(-(rows // 2 + 1) // group)) if rows > 16 else 1  # rows // 2 < group * T <= rows
        for S in (T, 4096):
            yield f"verify_attention {tag} tile B=1 T={T} S={S}", launcher, (
                _heads(1, T, Hq, D, dt), _m(1, Hkv, S, D, dtype=dt), _m(1, Hkv, S, D, dtype=dt),
                _m(1, dtype=torch.int64), D ** -0.5)
    with gpu_launch_plans(MAX_SMS):
        widest = attention_plan(1, Hkv, group, 1, 1 << 20, D, META).block_s
    for splits in _widths_up_to(widest):
        yield f"verify_attention {tag} combine B=1 T=1 S=32768 splits={splits}", launcher, (
            _heads(1, 1, Hq, D, dt), _m(1, Hkv, 32768, D, dtype=dt), _m(1, Hkv, 32768, D, dtype=dt),
            _m(1, dtype=torch.int64), D ** -0.5, splits)


def _compact_plan_cases(launcher, tag: str, Hkv: int, D: int, dt: torch.dtype):
    """kv_compact at each tile ``compact_plan`` picks for the model's head dim: entries a row
    from 1 to ``MAX_COMPACT_ENTRIES`` in powers of two (the op takes a caller's count), the
    head-dim slice narrowing past ``MAX_COMPACT_TILE`` elements; and beyond, the staged path.
    Labelled ``kv_compact plan``, not with the model's name first: few entries, or many in a
    narrow slice, cannot load 16 bytes a thread, and those are not shapes the runner meets
    (compile_check's 16-byte rule)."""
    S = 4 * MAX_COMPACT_ENTRIES
    # past MAX_COMPACT_ENTRIES: the staged path's two launches (one binary each, whatever M)
    for M in [1] + _widths_up_to(MAX_COMPACT_ENTRIES) + [MAX_COMPACT_ENTRIES + 1, S]:
        yield f"kv_compact plan {tag} B=1 M={M}", launcher, (
            _m(2, 1, Hkv, S, D, dtype=dt), _m(2, 1, Hkv, S, D, dtype=dt), _m(1, M, dtype=torch.int64),
            _m(1, dtype=torch.int64), _m(1, dtype=torch.int32))


# verify passes of K drafts: K = 2^n - 1 and 2^n give each pair of rejection_sample's tiles
# (next_pow2(K), next_pow2(K + 1)) and each of greedy_accept's, up to 64 drafts
DRAFT_COUNTS = (0, 1, 2, 3, 4, 7, 8, 15, 16, 31, 32, 63)


def _combine_widths(rows: int, K: int, V: int) -> list[int]:
    """The split combine's widths a launch of ``rows`` reductions or more can pick: each power
    of two from 2 up to the one ``acceptance_plan`` picks for ``rows`` on the most SMs (fewer
    rows never split less, and the split is at most a quarter of the vocabulary's blocks)."""
    with gpu_launch_plans(MAX_SMS):
        widest = acceptance_plan(rows, K, V, META).block_s
    return _widths_up_to(widest)


def _acceptance_plan_cases(k: dict, model: str, V: int):
    """greedy_accept and rejection_sample at one shape for each binary their plans can pick beyond
    the (B, K) grid of ``cases``, forced through ``num_splits``; K runs over ``DRAFT_COUNTS``
    (k_max is the caller's, SWIFT's default 25).
    - greedy_accept: each tile of K + 1 tokens with each width of the split combine that K
      drafts can meet (``_combine_widths`` at one row: its rows are B * (K + 1)). Its combine
      holds a [K + 1, splits] tile, so each combination is its own register budget.
    - rejection_sample: each pair of its drafts' and tokens' tiles at the widest combine (each
      tile is a vector of its own, so the widest is the most registers a pair takes), and at
      K = 7 every width."""
    i64, i32 = torch.int64, torch.int32
    for K in DRAFT_COUNTS:
        for splits in _combine_widths(K + 1, K, V):
            yield f"greedy_accept {model} B=1 K={K} splits={splits}", k["greedy_accept"], (
                _m(1, K, dtype=i64), _m(1, K + 1, V, dtype=torch.bfloat16), _m(1, dtype=i32), splits)
        widths = _combine_widths(1, K, V)
        for splits in widths if K == 7 else widths[-1:]:
            for has_q in (False, True):
                yield f"rejection_sample {model} B=1 K={K} splits={splits} draft_probs={has_q}", k["rejection_sample"], (
                    _m(1, K, dtype=i64), _m(1, K, V) if has_q else None, _m(1, K + 1, V), _m(1, dtype=i32),
                    _m(1, K), _m(1, K + 1), splits)


def _odd_norm_views(rows: int, H: int, dt: torch.dtype) -> dict:
    """{view name: (x [rows, H], weight [H])}: meta tensors one element off a 16-byte boundary,
    or with rows padded by one element (meta tensors carry their offsets into data_ptr, which
    Triton's alignment specialization reads)."""
    return {"offset-x": (_m(rows * H + 1, dtype=dt)[1:].view(rows, H), _m(H, dtype=dt)),
            "offset-weight": (_m(rows, H, dtype=dt), _m(H + 1, dtype=dt)[1:]),
            "padded-rows": (_m(rows, H + 1, dtype=dt)[:, :H], _m(H, dtype=dt))}


VERIFIER_SHAPES = ((1, 2, 4096), (1, 33, 4096), (4, 33, 4096), (16, 33, 4160), (1, 64, 4096), (2, 100, 4160))
VERIFIER_PREFIX = "verifier "


def verifier_cases():
    """The deterministic verifier's ops on a GPU (its fused set: the norms, silu_mul, rope,
    the invariant attention, bi_matmul and its grouped q/k/v launch) at the shapes it meets: verify passes of any batch and
    window, prefill-long rows, caches of two sizes -> (label, launcher, args) triples labelled
    ``verifier <model> <dtype> ...``. ``check`` requires each op to compile to one binary per
    model, dtype and target across them: a row's bits then cannot depend on the batch, the
    window or the prompt length through a specialization on a shape value."""
    from . import KERNELS
    from .bi_matmul import bi_matmul, bi_matmul_group, bi_matmul_swiglu

    k = {name: fn for name, (fn, _) in KERNELS.items()}
    for model in ("smollm2", "llama3-8b", "tiny-mqa"):
        H, Hq, Hkv, D, I, V = (MODELS[model][x] for x in ("H", "Hq", "Hkv", "D", "I", "V"))
        for dt in (torch.float32, torch.bfloat16):
            tag = f"{VERIFIER_PREFIX}{model} {str(dt).removeprefix('torch.')}"
            for B, T, S in VERIFIER_SHAPES:
                shape = f"B={B} T={T} S={S}"
                rows = B * T
                x = _m(rows, H, dtype=dt)
                yield f"{tag} rms_norm {shape}", k["rms_norm"], (x, _m(H, dtype=dt), 1e-5)
                yield f"{tag} fused_add_rms_norm {shape}", k["fused_add_rms_norm"], (x, _m(rows, H, dtype=dt),
                                                                                    _m(H, dtype=dt), 1e-5)
                for view, (xv, wv) in _odd_norm_views(rows, H, dt).items():
                    # the norms' row sums follow their loads' layout, which follows the inputs'
                    # alignment: views must compile to the binary of contiguous inputs
                    yield f"{tag} rms_norm {shape} view={view}", k["rms_norm"], (xv, wv, 1e-5)
                    yield f"{tag} fused_add_rms_norm {shape} view={view}", k["fused_add_rms_norm"], (
                        xv, xv, wv, 1e-5)
                both = _m(rows, 2 * I, dtype=dt)  # the grouped gate/up projection: silu_mul reads its halves
                yield f"{tag} silu_mul {shape}", k["silu_mul"], (both[:, :I], both[:, I:])
                yield f"{tag} rope_kv_append {shape}", k["rope_kv_append"], (
                    _heads(B, T, Hq, D, dt), _heads(B, T, Hkv, D, dt), _heads(B, T, Hkv, D, dt), _m(B, T, D, dtype=dt),
                    _m(B, T, D, dtype=dt), _m(B, Hkv, S, D, dtype=dt), _m(B, Hkv, S, D, dtype=dt),
                    _m(B, T, dtype=torch.int64))
                yield f"{tag} verify_attention_invariant {shape}", k["verify_attention_invariant"], (
                    _heads(B, T, Hq, D, dt), _m(B, Hkv, S, D, dtype=dt), _m(B, Hkv, S, D, dtype=dt),
                    _m(B, dtype=torch.int64), D ** -0.5)
                for n_out, n_in in ((Hq * D, H), (I, H), (H, I)):
                    yield f"{tag} bi_matmul:N={n_out},K={n_in} {shape}", bi_matmul, (
                        _m(rows, n_in, dtype=dt), _m(n_out, n_in, dtype=dt).t())
                # the log-probabilities' softmax denominator (float32 logits, whatever the model's dtype)
                yield f"{tag} bi_exp_sum {shape}", k["bi_exp_sum"], (_m(rows, V),)
                gate_up = _m(rows, 2 * I, dtype=dt)
                yield f"{tag} bi_matmul_swiglu {shape}", bi_matmul_swiglu, (
                    gate_up[:, :I], gate_up[:, I:], _m(H, I, dtype=dt).t())
                yield f"{tag} bi_matmul_group:qkv {shape}", bi_matmul_group, (
                    _m(rows, H, dtype=dt), [_m(n, H, dtype=dt).t() for n in (Hq * D, Hkv * D, Hkv * D)])
            yield from _runner_invariant_cases(k, tag, H, Hq, Hkv, D, I, dt)


# decode steps and draft verifications of the runner's invariant set (``replay="never"``), whose
# tokens must have the verifier's bits: its reductions must be the verifier's binaries. (B, T,
# the cache's capacity, the attention span: whole key blocks, as the set cuts the cache to)
RUNNER_SHAPES = ((1, 1, 1000, 64), (3, 1, 1000, 512), (8, 5, 2500, 1024), (32, 1, 4160, 4160))


def _runner_invariant_cases(k, tag, H, Hq, Hkv, D, I, dt):
    """The invariant set's launches as ``SkipModel.forward_device`` makes them: [B, T, H] norms,
    attention over a layer's cache rows cut to the span (``layer_kernels._bind_invariant_triton``),
    the projections of [B * T, K] rows (q/k/v grouped). Its elementwise ops compile to other
    binaries than the verifier's at some shapes (RoPE writes into the cache, not the verifier's
    buffers; SwiGLU's halves of one decode row are contiguous), whose vector width changes, not
    an element's arithmetic, so they are not held to one; tests/test_invariant_triton.py checks
    the runner's bits against the verifier's."""
    from .bi_matmul import bi_matmul, bi_matmul_group, bi_matmul_swiglu

    for B, T, S, span in RUNNER_SHAPES:
        shape = f"runner B={B} T={T} S={S} span={span}"
        x = _m(B, T, H, dtype=dt)
        yield f"{tag} rms_norm {shape}", k["rms_norm"], (x, _m(H, dtype=dt), 1e-5)
        yield f"{tag} fused_add_rms_norm {shape}", k["fused_add_rms_norm"], (x, _m(B, T, H, dtype=dt),
                                                                            _m(H, dtype=dt), 1e-5)
        k_cache, v_cache = _m(2, B, Hkv, S, D, dtype=dt)  # one layer's rows of the model's cache
        yield f"{tag} verify_attention_invariant {shape}", k["verify_attention_invariant"], (
            _heads(B, T, Hq, D, dt), k_cache[:, :, :span], v_cache[:, :, :span], _m(B, dtype=torch.int64),
            D ** -0.5)
        for n_out, n_in in ((Hq * D, H), (I, H), (H, I)):
            yield f"{tag} bi_matmul:N={n_out},K={n_in} {shape}", bi_matmul, (
                _m(B * T, n_in, dtype=dt), _m(n_out, n_in, dtype=dt).t())
        yield f"{tag} bi_matmul_group:qkv {shape}", bi_matmul_group, (
            _m(B * T, H, dtype=dt), [_m(n, H, dtype=dt).t() for n in (Hq * D, Hkv * D, Hkv * D)])
        gate_up = _m(B * T, 2 * I, dtype=dt)  # the grouped gate/up projection's halves
        yield f"{tag} bi_matmul_swiglu {shape}", bi_matmul_swiglu, (gate_up[:, :I], gate_up[:, I:],
                                                                    _m(H, I, dtype=dt).t())
