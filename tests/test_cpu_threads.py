"""The C++ CPU kernels give the same bits at 1, 2 and 4 threads, at shapes past each kernel's
grain (so the work is split): a race, or a reduction whose split follows the thread count, fails.

`make test` runs its workers at one thread each (OMP_NUM_THREADS=1: two workers on two cores
without OpenMP's spinning threads taking each other's cores), so this file is where the kernels'
parallel paths run."""

import pytest
import torch

from conftest import bitwise_equal, gguf_like, tiny_model, torch_threads
from swiftkern import SkipModel, ops

pytestmark = [pytest.mark.usefixtures("uninitialized_is_poison"),
              pytest.mark.skipif(ops.backend_info()["ops"]["skinny_linear"]["cpu"] != "cpp",
                                 reason="the C++ CPU kernels were not built")]

OPS = torch.ops.swiftkern
THREADS = [1, 2, 4]


def at_threads(fn):
    """fn() run at each of THREADS threads -> its outputs (tensors, or tuples/lists of them)."""
    runs = []
    for n in THREADS:
        with torch_threads(n):
            runs.append(fn())
    return runs


def flat(out):
    return [t for t in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(t, torch.Tensor)]


def assert_same_bits(runs):
    first = flat(runs[0])
    for n, run in zip(THREADS[1:], runs[1:]):
        for a, b in zip(first, flat(run), strict=True):
            assert bitwise_equal(a, b), f"{n} threads differ"


def randn(g, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_row_and_elementwise_kernels(dtype):
    g = torch.Generator().manual_seed(0)
    x, res, w = randn(g, 96, 576, dtype=dtype), randn(g, 96, 576, dtype=dtype), randn(g, 576, dtype=dtype)
    gate, up = randn(g, 40, 1536, dtype=dtype), randn(g, 40, 1536, dtype=dtype)  # 61440 > silu_mul's grain
    assert_same_bits(at_threads(lambda: OPS.rms_norm(x, w, 1e-5)))
    assert_same_bits(at_threads(lambda: OPS.fused_add_rms_norm(x, res, w, 1e-5)))
    assert_same_bits(at_threads(lambda: OPS.silu_mul(gate, up)))


def test_linear_kernels():
    g = torch.Generator().manual_seed(1)
    x, w, b = randn(g, 7, 576), randn(g, 1537, 576) / 24, randn(g, 1537)  # 1537 columns: many tiles and a rest
    assert_same_bits(at_threads(lambda: OPS.skinny_linear(x, w, b)))
    from test_packed_weights import make  # a GGUF-quantized weight and its packed codes

    x, _, packed, b = make((5,), 576, 577, 4, True, 2)
    assert_same_bits(at_threads(lambda: OPS.packed_linear(x, packed, b)))


def test_log_softmax_parts():
    g = torch.Generator().manual_seed(2)
    x = randn(g, 6, 49152) * 4  # 294912 elements: bi_exp's grain is 32768
    assert_same_bits(at_threads(lambda: OPS.bi_exp(x)))
    assert_same_bits(at_threads(lambda: OPS.bi_exp_sum(x)))
    # a row a thread (rows >= threads) or each row's exps in chunks over every thread (fewer
    # rows); 40001 columns: five chunks and a padded end
    y = randn(g, 6, 40001) * 4
    for rows in (1, 3, 6):
        assert_same_bits(at_threads(lambda: OPS.bi_max_exp_sum(y[:rows])))


def test_acceptance_kernels():
    g = torch.Generator().manual_seed(3)
    B, K, V = 6, 5, 49152
    logits = randn(g, B, K + 1, V)
    draft = logits.argmax(-1)[:, :K].clone()
    draft[:, 2] = (draft[:, 2] + 1) % V  # every row rejects at its third draft
    num_draft = torch.tensor([5, 4, 3, 2, 1, 0], dtype=torch.int32)
    assert_same_bits(at_threads(lambda: OPS.greedy_accept(draft, logits, num_draft)))
    probs = torch.softmax(logits, -1)
    draft_probs = torch.softmax(randn(g, B, K, V), -1)
    u_accept, u_sample = torch.rand(B, K, generator=g), torch.rand(B, K + 1, generator=g)
    assert_same_bits(at_threads(lambda: OPS.rejection_sample(draft, draft_probs, probs, num_draft, u_accept,
                                                             u_sample)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_and_attention_kernels(dtype):
    g = torch.Generator().manual_seed(4)
    B, Hq, Hkv, T, D, S = 5, 9, 3, 9, 64, 300
    q, k, v = randn(g, B, Hq, T, D, dtype=dtype), randn(g, B, Hkv, T, D, dtype=dtype), randn(g, B, Hkv, T, D,
                                                                                             dtype=dtype)
    angles = torch.rand(B, T, D // 2, generator=g).repeat(1, 1, 2) * 6
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    cache_k, cache_v = randn(g, B, Hkv, S, D, dtype=dtype), randn(g, B, Hkv, S, D, dtype=dtype)
    lens = torch.tensor([9, 40, 130, 277, 300])
    positions = lens[:, None] - T + torch.arange(T)  # each row's T newest positions

    def append():
        kc, vc = cache_k.clone(), cache_v.clone()
        return OPS.rope_kv_append(q, k, v, cos, sin, kc, vc, positions), kc, vc

    assert_same_bits(at_threads(append))
    assert_same_bits(at_threads(lambda: OPS.verify_attention(q, cache_k, cache_v, lens, D ** -0.5)))
    assert_same_bits(at_threads(lambda: OPS.verify_attention_invariant(q, cache_k, cache_v, lens, D ** -0.5)))

    src = torch.stack([torch.randperm(S, generator=g)[:T] for _ in range(B)])  # [B, T] entries to keep
    dst = torch.tensor([0, 7, 100, 200, 291])
    counts = torch.tensor([9, 3, 0, 9, 5], dtype=torch.int32)

    def compact():
        kc, vc = cache_k[None].clone(), cache_v[None].clone()  # [1, B, Hkv, S, D]: one layer
        OPS.kv_compact(kc, vc, src, dst, counts)
        return kc, vc

    assert_same_bits(at_threads(compact))


@pytest.mark.parametrize("packed", [False, True], ids=["float32-weights", "packed-weights"])
@pytest.mark.parametrize("invariant", [False, True], ids=["regular", "invariant"])
def test_a_forward_through_the_cpp_stack(invariant, packed):
    """A prefill and a decode step of a 2-layer model of SmolLM2's widths (so the kernels split
    their work, and a layer's q, k and v, or gate and up, share one parallel region's tasks):
    the regular kernel set, its projections on the C++ kernels (torch's matmul past
    skinny_linear's 32 rows is not asked to be thread-invariant: 24 rows here), and the batch-
    and length-invariant set; float32 weights or their 4/8-bit codes (packed_linear)."""
    hf = tiny_model("qwen2", num_hidden_layers=2, hidden_size=576, intermediate_size=1536,
                    num_attention_heads=9, num_key_value_heads=3, vocab_size=4099)
    model = SkipModel.from_hf(gguf_like(hf) if packed else hf, pack_weights=packed)
    if packed:
        assert model.packed.count == 2 * 7 + 1  # every projection and the LM head
    tokens = torch.randint(0, 4099, (2, 12), generator=torch.Generator().manual_seed(5))

    def forward():
        cache = model.new_cache(2, 32)
        with model.batch_invariant() if invariant else torch.no_grad():
            first = model.forward(tokens, cache).clone()
            step = model.forward(tokens[:, :1], cache).clone()
        return first, step, cache.k.clone(), cache.v.clone()

    assert_same_bits(at_threads(forward))


def test_the_thread_counts_take_effect():
    """A negative control: torch's own float sum splits its reduction by thread, so its bits
    follow the thread count here; were set_num_threads ignored (OMP_NUM_THREADS=1 in a worker),
    every check above would compare one thread with itself."""
    x = torch.randn(4_000_000, generator=torch.Generator().manual_seed(6))
    with pytest.raises(AssertionError, match="threads differ"):
        assert_same_bits(at_threads(lambda: x.sum()))
