"""Packed weights: GGUF-quantized float32 weights stored as their codes (packed_weights.pack)
and read by the C++ packed_linear. Checked against gguf's own quantizer and dequantizer, against
skinny_linear on the float32 weight (bit for bit, every instruction set), against the reference
twin, and through the model runner (the same logits bit for bit, SmolLM2's weights all packed)."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import bitwise_equal, gguf_like, gguf_weight, hf_greedy, tiny_model
from swiftkern import Generator, ops, reference
from swiftkern.draft_head import DraftHead
from swiftkern.errors import SwiftkernError
from swiftkern.layer_kernels import LayerKernels
from swiftkern.layer_set import LayerSet
from swiftkern.model import SkipModel
from swiftkern.packed_weights import PackedSet, bits_of, pack, unpack

pytestmark = pytest.mark.usefixtures("uninitialized_is_poison")  # conftest: unwritten outputs fail

BITS = {Q.Q4_1: 4, Q.Q8_0: 8}
needs_cpp = pytest.mark.skipif(ops.backend_info()["ops"]["packed_linear"]["cpu"] != "cpp",
                               reason="the C++ packed_linear kernel was not built")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 70), st.sampled_from([32, 64, 96, 576]), st.sampled_from([Q.Q4_1, Q.Q8_0]),
       st.integers(0, 2**31 - 1))
def test_pack_finds_gguf_codes_exactly(N, K, qtype, seed):
    w = gguf_weight(N, K, qtype, seed)
    packed = pack(w)
    assert packed is not None and packed.dtype == torch.uint8
    assert bits_of(packed) == BITS[qtype] and packed.shape[:2] == (N, K // 32)
    assert bitwise_equal(unpack(packed), w)


def test_pack_refuses_what_it_cannot_hold_exactly():
    w = gguf_weight(8, 64, Q.Q4_1, 0)
    assert pack(torch.randn(8, 64)) is None  # plain float32 weights
    assert pack(gguf_weight(8, 96, Q.Q4_1, 1)[:, :33].contiguous()) is None  # K not a multiple of 32
    assert pack(w.double()) is None and pack(w[0]) is None and pack(w[:0]) is None
    nudged = w.clone()
    nudged[3, 17] = torch.nextafter(nudged[3, 17], torch.tensor(1.0))  # one weight one ulp off
    assert pack(nudged) is None


def make(lead, K, N, bits, bias, seed):
    g = torch.Generator().manual_seed(seed)
    w = gguf_weight(N, K, Q.Q4_1 if bits == 4 else Q.Q8_0, seed)
    x = torch.randn(*lead, K, generator=g)
    return x, w, pack(w), (torch.randn(N, generator=g) if bias else None)


def packed_kernels() -> list:
    """The kernels packed_linear_isa runs here: every instruction set of skinny_linear's, and with
    AVX-512 both ways of widening a 4-bit block's float16 heads (per block, gathered)."""
    names = ops.registry.extension.packed_linear_isas()
    isas = ops.registry.extension.skinny_linear_isas()
    assert [n for n in names if n != "avx512-gather"] == isas and ("avx512-gather" in names) == ("avx512" in isas)
    return names


@needs_cpp
def test_packed_kernels_here_names_the_cpus_choice():
    """`swiftkern info`'s packed kernel: the widest instruction set this CPU has, with AVX-512
    gathering the 4-bit heads on Intel alone (gather_heads_pays), and packed_linear's bits are
    the named kernel's."""
    here, names = ops.packed_kernels_here(), packed_kernels()
    isas = ops.registry.extension.skinny_linear_isas()
    intel = ops.projections.cpu_vendor() == "GenuineIntel"
    assert here == ("avx512-gather" if isas[0] == "avx512" and intel else isas[0]) and here in names
    x, w, packed, _ = make((3,), 96, 9, 4, False, 7)
    assert bitwise_equal(torch.ops.swiftkern.packed_linear(x, packed, None),
                         ops.registry.extension.packed_linear_isa(x, packed, here))


@needs_cpp
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from([(0,), (1,), (2,), (3,), (5,), (7,), (8,), (9,), (13,), (33,), (2, 3), (2, 5)]), st.sampled_from([32, 96, 512, 576, 1536]),
       st.sampled_from([1, 3, 4, 5, 9, 577]), st.sampled_from([4, 8]), st.booleans(), st.integers(0, 2**31 - 1))
def test_packed_linear_has_skinny_linears_bits(lead, K, N, bits, bias, seed):
    x, w, packed, b = make(lead, K, N, bits, bias, seed)
    want = torch.ops.swiftkern.skinny_linear(x, w, b)
    assert bitwise_equal(torch.ops.swiftkern.packed_linear(x, packed, b), want)
    assert bitwise_equal(ops.packed_linear(x, packed, b), want)
    for isa in packed_kernels():  # every instruction set the kernel has: the same bits
        assert bitwise_equal(ops.registry.extension.packed_linear_isa(x, packed, isa), torch.ops.swiftkern.skinny_linear(x, w, None))


@needs_cpp
@pytest.mark.parametrize("bits", [4, 8])
def test_every_register_tile_shape_has_skinny_linears_bits(bits):
    """Every row count up to the unpack path and past it, against weight-row counts that leave
    every remainder of a 2-, 3- and 4-row weight tile, with every instruction set this CPU has
    (AVX-512: register tiles up to 11 rows; AVX2: up to 6 rows a tile, in near-equal groups up
    to 16 rows, so 7-13 rows are two groups of unequal size, then lane panels of 16 weight rows
    packed from the codes (lane_panel_gemm.h), in x tiles of 1-6 rows: 16 / 17 the edge, 17 rows
    tiles of 5 + 6 + 6, 26 rows 5 + 5 + 5 + 5 + 6, 1101 weight rows 68 panels and 13 rows)."""
    isas = packed_kernels()
    for M in (*range(1, 14), 16, 17, 20, 21, 23, 26, 64, 65):
        for N in (1, 2, 3, 4, 5, 6, 7, 11, 1101):  # 1101: 276 tiles, over two threads
            x, w, packed, b = make((M,), 64, N, bits, N % 2 == 1, M * 1000 + N)
            assert bitwise_equal(torch.ops.swiftkern.packed_linear(x, packed, b),
                                 torch.ops.swiftkern.skinny_linear(x, w, b)), (M, N)
            want = torch.ops.swiftkern.skinny_linear(x, w, None)
            for isa in isas:
                assert bitwise_equal(ops.registry.extension.packed_linear_isa(x, packed, isa), want), (M, N, isa)


@needs_cpp
@pytest.mark.parametrize("bits", [4, 8])
def test_many_rows_in_several_l2_blocks_have_skinny_linears_bits(bits):
    """A prefill-sized call: at K = 1536 the x rows go in blocks of 42, so 100 rows are two whole
    blocks and a partial one, each with its own pass over the unpacked weight tiles."""
    for M, N in ((100, 7), (43, 1101)):
        x, w, packed, b = make((M,), 1536, N, bits, True, M + N)
        assert bitwise_equal(torch.ops.swiftkern.packed_linear(x, packed, b),
                             torch.ops.swiftkern.skinny_linear(x, w, b)), (M, N)


@pytest.mark.parametrize("bits", [4, 8])
def test_matches_the_reference_twin(bits):
    x, w, packed, b = make((5,), 96, 37, bits, True, bits)
    want = torch.nn.functional.linear(x.double(), w.double(), b.double())
    for y in (ops.packed_linear(x, packed, b), reference.packed_linear(x, packed, b)):
        assert torch.allclose(y.double(), want, rtol=1e-5, atol=1e-5)


def test_bad_input_is_refused_with_a_reason():
    x, w, packed, b = make((2,), 64, 8, 4, True, 0)
    for args, words in [((x.double(), packed, b), "float32"), ((x, w, b), "uint8"),
                        ((x[:, :32], packed, b), "K = 32 * packed.shape[1] = 64"),
                        ((x, packed, b[:3]), "bias must be float32 [N = 8]"),
                        ((x, packed, b.bfloat16()), "bias must be float32 [N = 8]"),
                        ((x, packed[..., :18], b), "20 or 34")]:
        with pytest.raises(SwiftkernError, match=words.replace("[", r"\[").replace("*", r"\*")):
            ops.packed_linear(*args)


@needs_cpp
@pytest.mark.parametrize("bits", [4, 8])
def test_opcheck(bits):
    x, _, packed, b = make((3,), 64, 9, bits, True, 1)
    torch.library.opcheck(torch.ops.swiftkern.packed_linear, (x, packed, b))


def python_watch(packed: PackedSet, python: bool) -> PackedSet:
    """packed, checking its weights with the Python tuples instead of the C++ VersionWatch."""
    if python:
        packed._watch = None
    return packed


@pytest.mark.parametrize("python", [False, True])
def test_packed_set_repacks_a_weight_changed_in_place(python):
    if not python and ops.registry.extension is None:
        pytest.skip("swiftkern._C is not built: no VersionWatch")
    a, b = gguf_weight(6, 64, Q.Q4_1, 0), gguf_weight(6, 64, Q.Q4_1, 1)
    weights = [a.clone(), None, torch.ones(64)]
    packed = python_watch(PackedSet(weights), python)
    assert (packed._watch is None) == python
    assert packed.count == 1 and packed.slots()[1] is None and packed.slots()[2] is None  # 1-D: never packed
    weights[0].copy_(b)
    assert bitwise_equal(unpack(packed.slots()[0]), b)
    weights[0].add_(torch.randn(6, 64))  # no longer codes times a scale: not read packed
    assert packed.slots()[0] is None
    weights[0].copy_(a)
    weights[0][2:4].mul_(1.0)  # a write through a view moves the shared version: repacked, the same codes
    assert bitwise_equal(unpack(packed.slots()[0]), a)
    param = torch.nn.Parameter(a.clone(), requires_grad=False)
    packed = python_watch(PackedSet([param]), python)
    param.data = b.clone()  # new storage, the same _version: the old codes were read on
    assert bitwise_equal(unpack(packed.slots()[0]), b)


@pytest.mark.parametrize("edit", ["whole", "row", "column"])
def test_refresh_finds_a_write_through_data(edit):
    """A write through ``w.data`` (PEFT's merge of an adapter) moves neither the weight's version
    nor its address: the stale codes were read on. ``refresh`` samples every row and column."""
    a, b = gguf_weight(6, 64, Q.Q4_1, 0), gguf_weight(6, 64, Q.Q4_1, 1)
    param = torch.nn.Parameter(a.clone(), requires_grad=False)
    packed = PackedSet([param])
    if edit == "whole":
        param.data.copy_(b)  # another Q4_1 weight
    elif edit == "row":
        param.data[4] = b[4]  # row 4 of another Q4_1 weight: codes again
    else:
        param.data[:, 37] = b[:, 37]  # one column: that block is no longer codes times a scale
    assert bitwise_equal(unpack(packed.slots()[0]), a)  # the version watch does not see it
    assert packed.refresh() == 1 and packed.refresh() == 0
    got = packed.slots()[0]
    if edit == "column":
        assert got is None  # not read packed: the runner reads the float32 weight
    else:
        assert bitwise_equal(unpack(got), param.detach())


@needs_cpp
def test_generate_after_a_write_through_data_matches_hf():
    """SmolLM2-like packed weights, every down projection negated through ``.data``: the next
    ``generate`` of the same Generator, and a new one, gave the old model's tokens."""
    if not ops.packed_linear_fast():
        pytest.skip("packed weights run on a CPU with AVX2 or AVX-512")
    hf = gguf_like(tiny_model("llama"))
    gen = Generator(SkipModel(hf))
    assert gen.model.packed is not None and gen.model.packed.count == 4 * 7 + 1
    prompt = [5, 9, 11, 3]
    before = gen.generate([prompt], max_new_tokens=12, eos_token_id=[]).tokens[0]
    assert before == hf_greedy(hf, prompt, 12, eos_token_id=[])
    for layer in hf.model.layers:
        layer.mlp.down_proj.weight.data.mul_(-1.0)
    want = hf_greedy(hf, prompt, 12, eos_token_id=[])
    assert want != before  # the edit changes the model's tokens
    assert gen.generate([prompt], max_new_tokens=12, eos_token_id=[]).tokens[0] == want
    assert Generator(SkipModel(hf)).generate([prompt], max_new_tokens=12, eos_token_id=[]).tokens[0] == want


@needs_cpp
def test_version_watch_sees_writes_views_and_new_storage():
    w = torch.randn(4, 8)
    p = torch.nn.Parameter(torch.randn(3, 8), requires_grad=False)
    watch = ops.registry.extension.VersionWatch([w, p])
    assert not watch.changed()
    w[1].add_(0.0)  # through a view
    assert watch.changed()
    watch.look()
    assert not watch.changed()
    p.data = torch.randn(3, 8)  # new storage
    assert watch.changed()
    watch.look()
    w.clone().add_(1.0)  # a copy's write is not w's
    assert not watch.changed()


@needs_cpp
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_runner_logits_with_packed_weights_are_bit_equal(arch):
    """Prefill, decode, a 5-token verify pass and a layer-skipped draft, two rows of unequal
    lengths: the runner reading packed weights gives the float32 runner's logits bit for bit
    (the packed set is attached by hand, so this runs on any CPU; without AVX-512 the portable
    kernel reads it)."""
    hf = gguf_like(tiny_model(arch))
    plain, packed = SkipModel(hf, pack_weights=False), SkipModel(hf, pack_weights=False)
    packed.packed = PackedSet(packed._stack_weights + [packed.lm_head])
    assert packed.packed.count == 4 * 7 + 1  # every projection and the head
    skip = LayerSet.parse("attn:1|mlp:2", 4)
    outs = []
    for model in (plain, packed):
        g = torch.Generator().manual_seed(0)
        cache = model.new_cache(2, 64)
        logits = [model.forward(torch.randint(0, 301, (2, 7), generator=g), cache)]
        cache.set_lengths(torch.tensor([7, 4], dtype=torch.int32))
        for T, ls in [(1, None), (5, None), (1, skip), (3, skip)]:
            logits.append(model.forward(torch.randint(0, 301, (2, T), generator=g), cache, ls))
        outs.append(logits)
    for a, b in zip(*outs):
        assert bitwise_equal(a, b)
    next(w for w in packed.packed.slots() if w is not None).zero_()  # negative control: the codes were read
    g = torch.Generator().manual_seed(0)
    assert not torch.allclose(packed.forward(torch.randint(0, 301, (2, 7), generator=g), packed.new_cache(2, 64)),
                              outs[0][0])


def test_pack_weights_true_where_it_cannot_run_is_refused(monkeypatch):
    monkeypatch.setattr(ops, "packed_linear_fast", lambda: False)
    with pytest.raises(SwiftkernError, match="AVX2 or AVX-512"):
        SkipModel(tiny_model("llama"), pack_weights=True)
    assert SkipModel(tiny_model("llama")).packed is None  # auto: not here, silently the same bits


@pytest.mark.slow
def test_smollm2_packs_every_projection_and_keeps_its_logits(smollm2):
    model, tok = smollm2
    if not ops.packed_linear_fast():
        pytest.skip("packed weights are read on CPUs with AVX2 or AVX-512 (this one has neither)")
    assert model.packed is not None and model.packed.count == 30 * 7 + 1  # Q4_1 layers, Q8_0 head
    ids = torch.tensor([tok("The capital of France is")["input_ids"]])
    packed, outs = model.packed, []
    try:
        for model.packed in (packed, None):
            cache = model.new_cache(1, 64)
            logits = [model.forward(ids, cache)]
            for _ in range(3):
                logits.append(model.forward(logits[-1][:, -1:].argmax(-1), cache))
            outs.append(logits)
    finally:
        model.packed = packed
    for a, b in zip(*outs):
        assert bitwise_equal(a, b)


def test_pruned_draft_head_keeps_packed_rows_through_regrowth():
    w = gguf_weight(3000, 64, Q.Q8_0, 2)
    head = DraftHead(w, None, num_frequent=5, context_ids=[2999], packed_head=pack(w))
    head.add(range(100, 2900))  # forces a regrow of the row buffers
    weight, _, packed = head.head
    assert torch.equal(weight, w[head.ids]) and bitwise_equal(unpack(packed), weight)


@needs_cpp
def test_pruned_draft_head_logits_from_packed_rows_are_bit_equal():
    hf = gguf_like(tiny_model("llama"))
    plain, packed = SkipModel(hf, pack_weights=False), SkipModel(hf, pack_weights=False)
    packed.packed = PackedSet(packed._stack_weights + [packed.lm_head])
    heads = [DraftHead.for_model(m, 40, [200, 250, 7]) for m in (plain, packed)]
    assert heads[0].head[2] is None and heads[1].head[2] is not None
    tokens = torch.tensor([[3, 200, 17, 250, 9]])
    skip = LayerSet.parse("attn:1|mlp:2", 4)
    a, b = (m.forward(tokens, m.new_cache(1, 8), skip, head=h.head) for m, h in zip((plain, packed), heads))
    assert bitwise_equal(a, b)
    heads[1].head[2].zero_()  # negative control: the packed rows were read, so spoiling them shows
    assert not torch.allclose(packed.forward(tokens, packed.new_cache(1, 8), skip, head=heads[1].head), a)


@needs_cpp
def test_invariant_set_reads_packed_weights_at_any_size():
    """In the batch-invariant set the matmul is skinny_linear's order at any number of rows, so
    packed weights are read past 32 rows too (a 2 x 20-token prefill) with the same bits."""
    hf = gguf_like(tiny_model("llama"))
    plain, packed = SkipModel(hf, pack_weights=False), SkipModel(hf, pack_weights=False)
    packed.packed = PackedSet(packed._stack_weights + [packed.lm_head])
    tokens = torch.randint(0, 301, (2, 20), generator=torch.Generator().manual_seed(1))
    outs = []
    for model in (plain, packed):
        with model.batch_invariant():
            assert model._reads_packed(LayerKernels.for_device("cpu", True), 40) == (model is packed)
            outs.append(model.forward(tokens, model.new_cache(2, 24)))
    assert bitwise_equal(*outs)
