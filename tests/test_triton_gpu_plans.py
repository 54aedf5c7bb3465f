"""The launch plans a GPU gets, run by the interpreter against the reference.

The interpreter plans its own small launches (``launch.interpreting()``: wider vocabulary
blocks, 32-key attention blocks, 2 SMs), so its tests alone never run the GPU branches of
``launch.py``: 1024-wide elementwise and vocabulary blocks, 64-key attention blocks, the float32
attention tile, and the key and vocabulary splits that 132 SMs ask for. Inside
``gpu_launch_plans(132)`` the launchers plan as on an H100 while the interpreter runs the
kernels, so a plan that drops or repeats work fails here, not first on a GPU.
"""

import contextlib
import itertools

import pytest
import torch

from swiftkern import reference
from swiftkern.triton_kernels import launch
from swiftkern.triton_kernels.greedy_accept import greedy_accept
from swiftkern.triton_kernels.rejection_sample import rejection_sample
from swiftkern.triton_kernels.silu_mul import silu_mul
from swiftkern.triton_kernels.verify_attention import verify_attention, verify_attention_invariant
from test_triton_verify_attention import case, want
from triton_cases import DEVICE, H100_SMS, NATIVE, assert_close, poisoned

pytestmark = pytest.mark.skipif(NATIVE, reason="on a GPU the native tests run its own plans")


@pytest.fixture
def h100_plans():
    with launch.gpu_launch_plans(H100_SMS), poisoned():
        yield


def test_the_plans_are_a_gpus_inside_and_the_interpreters_outside():
    cpu = torch.device("cpu")
    outside = launch.vocab_plan(9, 49152, cpu), launch.attention_plan(1, 3, 3, 1, 4096, 64, cpu)
    with launch.gpu_launch_plans(H100_SMS):
        inside = launch.vocab_plan(9, 49152, cpu), launch.attention_plan(1, 3, 3, 1, 4096, 64, cpu)
        fp32 = launch.attention_plan(1, 3, 3, 9, 4096, 64, cpu, fp32=True)
    assert (outside[0].block, outside[1].block_n) == (8192, 32)
    # closed forms: 1024-wide blocks, 48 of them, splits = min(ceil(2 * 132 / 9), 48 // 4)
    assert (inside[0].block, inside[0].splits, inside[0].chunk) == (1024, 12, 4096)
    # 64-key blocks for head dim 64; splits = min(ceil(2 * 132 / 3), 64 // 2) = 32 of 128 keys
    assert (inside[1].block_n, inside[1].splits, inside[1].chunk, inside[1].block_s) == (64, 32, 128, 32)
    assert (fp32.block_m, fp32.block_n, fp32.num_warps) == (16, 32, 8)
    assert launch.GPU_PLANS["sms"] is None


def test_the_acceptance_tiles_closed_form():
    """acceptance_plan: powers of two over the K drafts (at least 2), the K + 1 tokens and the
    vocabulary splits (at least 2), over vocab_plan's split of the rows' reductions."""
    cpu = torch.device("cpu")
    with launch.gpu_launch_plans(H100_SMS):
        nine = launch.acceptance_plan(9, 8, 49152, cpu)  # 12 splits, as vocab_plan's closed form above
        one = launch.acceptance_plan(1, 0, 301, cpu)  # one 512-wide block: one split
        odd = launch.acceptance_plan(3, 5, 49152, cpu, splits=5)
    assert (nine.vocab.splits, nine.block_k, nine.block_k1, nine.block_s) == (12, 8, 16, 16)
    assert (one.vocab.splits, one.block_k, one.block_k1, one.block_s) == (1, 2, 1, 2)
    assert (odd.vocab.splits, odd.block_k, odd.block_k1, odd.block_s) == (5, 8, 8, 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# (decode over 2304 keys: 18 key splits, more than 16 for the combine; verification; MQA)
@pytest.mark.parametrize("heads,T,lens,S", [((9, 3), 1, [2200, 1], 2304), ((9, 3), 9, [9, 520], 704),
                                            ((4, 1), 5, [300], 704)])
def test_verify_attention_in_gpu_plans_matches_reference(h100_plans, dtype, heads, T, lens, S):
    D = 64
    q, k, v, cache_lens, stale = case(lens, *heads, T, D, S, dtype, seed=T)
    plan = launch.attention_plan(len(lens), heads[1], heads[0] // heads[1], T, S, D, q.device,
                                 fp32=dtype == torch.float32)
    assert plan.splits > 1 and plan.block_n == (32 if dtype == torch.float32 else 64)
    assert_close("verify_attention", verify_attention(q, k, v, cache_lens, D ** -0.5),
                 want(q, k, v, cache_lens, stale, D ** -0.5))
    # the invariant plan: one split, the GPU's 64-key blocks
    assert_close("verify_attention", verify_attention_invariant(q, k, v, cache_lens, D ** -0.5),
                 want(q, k, v, cache_lens, stale, D ** -0.5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_accept_in_gpu_plans_matches_reference(h100_plans, dtype):
    # 49 vocabulary blocks of 1024; min(ceil(264 / 15), 49 // 4) = 12 splits asked, in chunks of
    # ceil(49 / 12) = 5 blocks: 10 chunks of 5120, the last one short
    B, K, V = 3, 4, 50000
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(B, K + 1, V, generator=g).to(dtype)
    logits[1, 2, V - 1] = 50.0  # the argmax in the last, partial block
    logits[2, 0, 5120] = 50.0  # ... at a chunk's first element
    draft = logits[:, :K].float().argmax(-1)
    draft[0, 1] = (draft[0, 1] + 1) % V
    nd = torch.tensor([4, 4, 2], dtype=torch.int32)
    assert launch.vocab_plan(B * (K + 1), V, torch.device(DEVICE)).splits == 10
    out, acc = greedy_accept(draft, logits, nd)
    want_out, want_acc = reference.greedy_accept(draft, logits, nd)
    assert torch.equal(out, want_out) and torch.equal(acc, want_acc)


@pytest.mark.parametrize("with_q", [True, False])
def test_rejection_sample_in_gpu_plans_matches_reference(h100_plans, with_q):
    B, K, V = 4, 3, 50000
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(B, K + 1, V, generator=g) * 3
    p = torch.softmax(logits, -1)
    q = torch.softmax(logits[:, :K] + torch.randn(B, K, V, generator=g), -1) if with_q else None
    draft = torch.multinomial(p[:, :K].reshape(-1, V), 1, generator=g).view(B, K)
    nd = torch.tensor([3, 0, 2, 3], dtype=torch.int32)
    u_acc, u_smp = torch.rand(B, K, generator=g), torch.rand(B, K + 1, generator=g)
    assert launch.vocab_plan(B, V, torch.device(DEVICE)).splits == 10  # as greedy's: 12 asked, 10 chunks of 5120
    out, acc = rejection_sample(draft, q, p, nd, u_acc, u_smp)
    want_out, want_acc = reference.rejection_sample(draft, q, p, nd, u_acc, u_smp)
    assert torch.equal(out, want_out) and torch.equal(acc, want_acc)


def test_silu_mul_in_gpu_plans_matches_reference(h100_plans):
    gate, up = torch.randn(3, 4099), torch.randn(3, 4099)  # 13 blocks of 1024, the last partial
    assert launch.elementwise_plan(gate.numel()).block == 1024
    assert_close("silu_mul", silu_mul(gate, up), reference.silu_mul(gate, up))


@pytest.mark.parametrize("sms", [None, 108, 132])
@pytest.mark.parametrize("head_dim", [16, 40, 64, 128])
def test_the_invariant_attention_plan_is_one_plan_whatever_the_shapes(sms, head_dim):
    """What shapes the invariant kernel (tiles, splits, warps) does not move with the batch, the
    GQA group, the new tokens, the keys or the dtype, on the interpreter's plans (sms None) and on
    a GPU's: the verifier's bits rest on it (compile_check adds: one binary)."""
    cpu = torch.device("cpu")
    shaping = ("block_m", "block_n", "block_d", "splits", "num_warps", "num_stages")

    def plan(*args, **kw):
        p = launch.attention_plan(*args, device=cpu, invariant=True, **kw)
        return tuple(getattr(p, f) for f in shaping)

    with launch.gpu_launch_plans(sms) if sms else contextlib.nullcontext():
        first = plan(1, 1, 1, 1, 1, head_dim)
        for batch, kv_heads, group, q_len, keys, fp32 in itertools.product(
                (1, 7, 64), (1, 8), (1, 3, 7), (1, 2, 33, 100), (1, 100, 4096, 32768), (False, True)):
            assert plan(batch, kv_heads, group, q_len, keys, head_dim, fp32=fp32) == first
    assert first[0] == launch.INVARIANT_BLOCK_M and first[3] == 1


@pytest.mark.parametrize("sms", [None, 108, 132])
def test_every_split_of_a_plan_holds_keys_or_tokens(sms):
    """A split past the end launches programs that reduce nothing: each plan's splits cover the
    keys (the vocabulary) and its last split starts inside them, chunks whole key blocks."""
    cpu = torch.device("cpu")
    with launch.gpu_launch_plans(sms) if sms else contextlib.nullcontext():
        for batch, kv_heads, group, q_len, keys, forced in itertools.product(
                (1, 7), (1, 8), (1, 7), (1, 33), (1, 63, 64, 100, 4096, 4097), (None, 3, 1000)):
            p = launch.attention_plan(batch, kv_heads, group, q_len, keys, 64, device=cpu, splits=forced)
            assert p.chunk % p.block_n == 0 and (p.splits - 1) * p.chunk < keys <= p.splits * p.chunk, p
        for rows, vocab, forced in itertools.product((1, 3, 64), (1, 100, 1024, 49152, 128256), (None, 7, 10**6)):
            p = launch.vocab_plan(rows, vocab, cpu, splits=forced)
            assert p.chunk % p.block == 0 and (p.splits - 1) * p.chunk < vocab <= p.splits * p.chunk, p


def _attention_binaries(plan: launch.AttentionPlan, fp32: bool) -> set:
    """What decides verify_attention's compiled kernels: the main kernel's tile, warps and
    whether it splits the keys; the combine's width, where it runs."""
    main = ("main", plan.block_m, plan.block_n, plan.block_d, plan.splits > 1, fp32, plan.num_warps, plan.num_stages)
    return {main} | ({("combine", plan.block_s, plan.block_d, plan.combine_warps)} if plan.splits > 1 else set())


def _cache_lengths(T: int) -> list[int]:
    """Key counts from T to 32768: m * 2^k and m * 2^k + 1 for m = 1, 3, 5, 7."""
    return sorted({T} | {x for k in range(16) for m in (1, 3, 5, 7) for x in (m << k, (m << k) + 1) if T <= x <= 32768})


@pytest.mark.parametrize("sms", [108, 132])
def test_compile_cases_compile_every_attention_binary_a_gpu_run_can_pick(sms):
    """compile_check compiles ``compile_cases.cases()``: each verify_attention binary the plans pick
    for batches of 1-32, 1-33 new tokens and caches of up to 32768 keys (sampled at m * 2^k and
    m * 2^k + 1 keys, m = 1, 3, 5, 7) must be among those the cases' launches get, on an A100's
    and an H100's SM counts. (Found missing before: the unsplit tiles of a short cache, the 32- and
    64-row tiles, and most of the combine's widths.)"""
    from swiftkern.triton_kernels.compile_cases import MODELS, cases

    meta = torch.device("meta")
    launches = [(label, args) for label, _, args in cases() if label.startswith("verify_attention ")]
    with launch.gpu_launch_plans(sms):
        for model, c in MODELS.items():
            group = c["Hq"] // c["Hkv"]
            for dtype in ("float32", "bfloat16"):
                fp32 = dtype == "float32"
                compiled = set()
                for label, args in launches:
                    if label.split()[1:3] == [model, dtype]:
                        B, _, T, _ = args[0].shape
                        compiled |= _attention_binaries(launch.attention_plan(
                            B, c["Hkv"], group, T, args[1].shape[2], c["D"], meta, args[5] if len(args) > 5 else None,
                            fp32=fp32), fp32)
                picked = {}
                for B in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32):
                    for T in range(1, 34):
                        for S in _cache_lengths(T):
                            for binary in _attention_binaries(launch.attention_plan(
                                    B, c["Hkv"], group, T, S, c["D"], meta, fp32=fp32), fp32):
                                picked.setdefault(binary, (B, T, S))
                missing = {b: shape for b, shape in picked.items() if b not in compiled}
                assert not missing, f"{model} {dtype}: no case compiles {missing} (first picked at B, T, S)"


def _acceptance_tiles(op: str, B: int, K: int, V: int, splits: int | None) -> set:
    """The acceptance kernels' compile-time tiles at one launch: the vocabulary block and warps;
    greedy_accept's combine tile [K + 1 tokens, splits] as one pair (a 2-D tile: each pair is
    its own register budget); rejection_sample's drafts' and tokens' tiles as one pair and its
    combine's width alone (vectors of their own)."""
    rows = B * (K + 1) if op == "greedy_accept" else B
    plan = launch.acceptance_plan(rows, K, V, torch.device("meta"), splits)
    tiles = {("block", plan.vocab.block, plan.vocab.num_warps)}
    if op == "greedy_accept":
        return tiles | {("tokens x combine", plan.block_k1, plan.block_s)}
    return tiles | {("drafts, tokens", plan.block_k, plan.block_k1), ("combine", plan.block_s)}


@pytest.mark.parametrize("sms", [108, 132])
def test_compile_cases_compile_every_acceptance_tile_a_gpu_run_can_pick(sms):
    """Each of greedy_accept's and rejection_sample's compile-time tiles that batches of 1-32
    rows with 0-63 drafts pick (``_acceptance_tiles``: the vocabulary block; greedy_accept's
    tokens x combine pairs; rejection_sample's drafts and tokens pairs and combine widths) is
    among those ``compile_cases.cases()`` launch, per model."""
    from swiftkern.triton_kernels.compile_cases import MODELS, cases

    launches = [(label.split()[0], args) for label, _, args in cases()
                if label.startswith(("greedy_accept ", "rejection_sample "))]
    with launch.gpu_launch_plans(sms):
        for model, c in MODELS.items():
            V = c["V"]
            for op in ("greedy_accept", "rejection_sample"):
                compiled = set()
                for name, args in launches:
                    logits = args[1] if name == "greedy_accept" else args[2]
                    if name == op and logits.shape[2] == V:
                        B, K = args[0].shape
                        forced = args[-1] if (name == "greedy_accept" and len(args) == 4) or len(args) == 7 else None
                        compiled |= _acceptance_tiles(op, B, K, V, forced)
                picked = {}
                for B in range(1, 33):
                    for K in range(64):
                        for tile in _acceptance_tiles(op, B, K, V, None):
                            picked.setdefault(tile, (B, K))
                missing = {t: shape for t, shape in picked.items() if t not in compiled}
                assert not missing, f"{model} {op}: no case compiles {missing} (first picked at B, K)"


def test_compile_cases_compile_every_kv_compact_tile_its_plan_can_pick():
    """Each (entries, head-dim slice, warps) tile compact_plan picks for 1 to MAX_COMPACT_ENTRIES
    entries a row, and the staged path's past it, at each model's head dim, is among those
    ``compile_cases.cases()`` launch in float32 and bfloat16; and the warps hold a thread to
    COMPACT_TILE_PER_THREAD elements of each tile (4 warps at least, no more than that needs)."""
    from swiftkern.triton_kernels.compile_cases import MODELS, cases

    def tile(M, D):
        p = launch.compact_plan("kv_compact", M, D)
        per_thread = p.block_m * p.block_d / (32 * p.num_warps)  # of the keys' tile, and of the values'
        assert per_thread <= launch.COMPACT_TILE_PER_THREAD and (p.num_warps == 4 or per_thread == launch.COMPACT_TILE_PER_THREAD)
        return p.block_m, p.block_d, p.num_warps, p.staged

    compiled = {}
    for label, _, args in cases():
        if label.startswith("kv_compact "):
            D, dtype = args[0].shape[-1], args[0].dtype
            compiled.setdefault((D, dtype), set()).add(tile(args[2].shape[1], D))
    for model, c in MODELS.items():
        picked = {tile(M, c["D"]) for M in range(1, launch.MAX_COMPACT_ENTRIES + 2)}
        for dtype in (torch.float32, torch.bfloat16):
            missing = picked - compiled.get((c["D"], dtype), set())
            assert not missing, f"{model} {dtype}: no case compiles kv_compact's (entries, slice, warps) {sorted(missing)}"
