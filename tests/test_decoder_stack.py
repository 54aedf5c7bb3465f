"""LayerKernels.stack (csrc/decoder_stack_cpu.cpp), the layer loop in one C++ call, against the
runner's Python loop over the same kernels: the same logits and cache, bit for bit."""

import contextlib
import dataclasses
from dataclasses import fields

import pytest
import torch

from conftest import gguf_like, tiny_model
from swiftkern import SkipModel, layer_kernels, ops
from swiftkern.layer_kernels import LayerKernels
from swiftkern.layer_set import LayerSet
from swiftkern.model import _Layer
from swiftkern.packed_weights import PackedSet

pytestmark = pytest.mark.usefixtures("uninitialized_is_poison")  # conftest: unwritten outputs fail

needs_stack = pytest.mark.skipif(LayerKernels.for_device("cpu").stack is None,
                                 reason="the C++ CPU kernels (decoder_stack) were not built")

# the order csrc/decoder_stack.h reads a layer's 18 weights in (its enum Field)
CPP_FIELDS = ["ln_attn", "q", "k", "v", "q_bias", "k_bias", "v_bias", "o", "o_bias", "ln_mlp", "gate", "up", "down",
              "gate_bias", "up_bias", "down_bias", "q_norm", "k_norm"]


def test_layer_fields_are_in_the_order_the_cpp_stack_reads():
    assert [f.name for f in fields(_Layer)] == CPP_FIELDS


def _without_stack(monkeypatch):
    """LayerKernels.for_device as it is, minus the C++ stack: the Python loop."""
    original = LayerKernels.for_device

    def python_loop(device_type, invariant=False):
        return dataclasses.replace(original(device_type, invariant), stack=None)
    monkeypatch.setattr(LayerKernels, "for_device", staticmethod(python_loop))


def _run(model, chunks, layer_set=None):
    """Logits of every chunk (int64 [B, T] each) fed in turn, and the caches at the end."""
    cache = model.new_cache(chunks[0].shape[0], 64)
    logits = [model.forward(c, cache, layer_set=layer_set).clone() for c in chunks]
    return logits, cache.k.clone(), cache.v.clone(), list(cache.host_lengths)


@needs_stack
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])  # qwen2: q/k/v biases; qwen3: q/k norms
@pytest.mark.parametrize("skip", [None, "attn:1|mlp:0,2", "attn:0,1,2,3|mlp:3"])
@pytest.mark.parametrize("invariant", [False, True])
@pytest.mark.parametrize("mkl_lags", [False, True], ids=["torch-past-32-rows", "cpp-at-any-size"])
def test_stack_equals_the_python_loop(arch, skip, invariant, mkl_lags, monkeypatch):
    from swiftkern.ops import projections

    # both rules of ops.skinny_max_rows, whichever this CPU takes (an AMD one: the C++ kernels
    # at any size, torch's matmul never reached in the stack)
    monkeypatch.setattr(projections, "mkl_lags_here", lambda: mkl_lags)
    model = SkipModel.from_hf(tiny_model(arch, num_hidden_layers=4))
    layer_set = LayerSet.parse(skip, 4) if skip else None
    g = torch.Generator().manual_seed(3)
    # prefill of 40 tokens per row (past SKINNY_MAX_ROWS rows: torch's matmul outside the
    # invariant set where MKL does not lag), a verify chunk of 4, a decode step; 3 rows
    chunks = [torch.randint(3, 301, (3, T), generator=g) for T in (40, 4, 1)]

    def go():
        with model.batch_invariant() if invariant else contextlib.nullcontext():
            return _run(model, chunks, layer_set)
    with_stack = go()
    _without_stack(monkeypatch)
    layer_kernels._CACHE.clear()
    without = go()
    for a, b in zip(with_stack[0], without[0]):
        assert torch.equal(a, b)
    assert torch.equal(with_stack[1], without[1]) and torch.equal(with_stack[2], without[2])
    assert with_stack[3] == without[3]


@needs_stack
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_stack_runs_bf16_and_fp16_with_the_python_loops_bits(arch, dtype, monkeypatch, launch_names):
    """A model in bf16 / fp16 takes the stack too (its projections torch's matmul, as ops.linear
    gives them; before, such a model ran the Python loop, ~15 op calls a layer): one C++ call
    per forward, and the loop's logits and cache bit for bit."""
    model = SkipModel.from_hf(tiny_model(arch, num_hidden_layers=3).to(dtype))
    g = torch.Generator().manual_seed(7)
    chunks = [torch.randint(3, 301, (2, T), generator=g) for T in (40, 4, 1)]
    calls = launch_names
    layer_kernels._CACHE.clear()
    with_stack = _run(model, chunks, LayerSet.parse("attn:1|mlp:0", 3))
    # the stack inside the one-call forward (csrc/decoder_forward_cpu.cpp), once per chunk
    assert calls == ["decoder_forward"] * len(chunks) and with_stack[0][0].dtype == dtype
    _without_stack(monkeypatch)
    layer_kernels._CACHE.clear()
    without = _run(model, chunks, LayerSet.parse("attn:1|mlp:0", 3))
    assert calls == ["decoder_forward"] * len(chunks)
    for a, b in zip(with_stack[0], without[0]):
        assert torch.equal(a, b)
    assert torch.equal(with_stack[1], without[1]) and torch.equal(with_stack[2], without[2])
    layer_kernels._CACHE.clear()


@needs_stack
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
@pytest.mark.parametrize("skip", [None, "attn:0,2|mlp:1"])
def test_stack_equals_the_reference_ops_on_odd_shapes(skip, arch):
    """Against SWIFTKERN_BACKEND=reference (torch's own ops, none of the C++ kernels the stack
    shares with the Python loop): heads 9 / 3, hidden 72, head size 8 (qwen3: 20, its per-head
    norms over 20), intermediate 100, qwen2's biases, rows of a 37-token prefill, a verify chunk
    of 5 and a decode step."""
    heads = dict(head_dim=20) if arch == "qwen3" else {}
    hf = tiny_model(arch, num_hidden_layers=3, hidden_size=72, num_attention_heads=9, num_key_value_heads=3,
                    intermediate_size=100, **heads)
    model = SkipModel.from_hf(hf)
    layer_set = LayerSet.parse(skip, 3) if skip else None
    g = torch.Generator().manual_seed(5)
    chunks = [torch.randint(3, 301, (2, T), generator=g) for T in (37, 5, 1)]
    assert LayerKernels.for_device("cpu").stack is not None
    with_stack = _run(model, chunks, layer_set)
    ops.set_backend("reference")
    try:
        layer_kernels._CACHE.clear()
        assert LayerKernels.for_device("cpu").stack is None
        reference_run = _run(model, chunks, layer_set)
    finally:
        ops.set_backend("auto")
        layer_kernels._CACHE.clear()
    for a, b in zip(with_stack[0], reference_run[0]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(with_stack[1], reference_run[1], rtol=1e-4, atol=1e-4)


@needs_stack
def test_rows_of_unequal_lengths(monkeypatch):
    """Rows at different cache lengths (a batch after acceptance), as the loop sees them."""
    model = SkipModel.from_hf(tiny_model("llama", num_hidden_layers=3))
    g = torch.Generator().manual_seed(5)

    def go():
        cache = model.new_cache(2, 64)
        model.forward(torch.randint(3, 301, (2, 9), generator=g.manual_seed(5)), cache)
        cache.rollback([4, 9])
        out = model.forward(torch.randint(3, 301, (2, 3), generator=g), cache)
        return out, cache.k.clone()
    a = go()
    _without_stack(monkeypatch)
    layer_kernels._CACHE.clear()
    b = go()
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])



_FOR_DEVICE = LayerKernels.for_device  # as the package defines it, before any test patches it


def _stack_rows(monkeypatch, rows: bool, shared: list):
    """LayerKernels.for_device as it is, its C++ stack called with rows=rows; shared gets, per call
    that returns a pending output, whether hidden and pending lie in one buffer (the float32 row
    path's mark: the op-by-op path returns tensors of their own)."""
    original = _FOR_DEVICE

    def with_rows(device_type, invariant=False):
        kern = original(device_type, invariant)

        def stack(*args):
            hidden, pending = kern.stack(*args, row_path=rows)
            if pending is not None:
                shared.append(hidden.untyped_storage().data_ptr() == pending.untyped_storage().data_ptr())
            return hidden, pending
        return dataclasses.replace(kern, stack=stack, forward=None)  # the stack called from Python, as patched
    monkeypatch.setattr(LayerKernels, "for_device", staticmethod(with_rows))
    layer_kernels._CACHE.clear()


@needs_stack
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])  # qwen2: q/k/v biases; qwen3: q/k norms
@pytest.mark.parametrize("weights", ["float32", "packed", "bfloat16", "float16"])
@pytest.mark.parametrize("invariant", [False, True])
def test_row_path_has_the_op_by_op_bits(arch, weights, invariant, monkeypatch):
    """decoder_stack's path on raw rows (csrc/decoder_stack_rows.cpp) against its op-by-op path:
    logits and caches bit for bit, with float32, packed, bf16 or fp16 weights (bf16 / fp16: the
    projections' fp32 scratch rounded once into the model's dtype, as each op rounds its output),
    a prefill of 40 tokens, a verify chunk of 5, decode steps with and without skipped sub-layers,
    three rows of unequal lengths; and the row path ran (one buffer holds both outputs) wherever
    no projection went to torch's matmul."""
    packed = weights == "packed"
    heads = dict(head_dim=32) if arch == "qwen3" else {}  # 6 x 32: GGUF quantizes rows of 32s
    hf = tiny_model(arch, num_hidden_layers=4, num_attention_heads=6, num_key_value_heads=2, hidden_size=96,
                    intermediate_size=160, **heads)
    if weights in ("bfloat16", "float16"):
        hf = hf.to(getattr(torch, weights))
    model = SkipModel.from_hf(gguf_like(hf) if packed else hf, pack_weights=False)
    if packed:
        model.packed = PackedSet(model._stack_weights + [model.lm_head])
        assert model.packed.count == 4 * 7 + 1
    skip = LayerSet.parse("attn:1,3|mlp:0", 4)

    def run(rows):
        shared = []
        _stack_rows(monkeypatch, rows, shared)
        g = torch.Generator().manual_seed(11)
        with model.batch_invariant() if invariant else contextlib.nullcontext():
            cache = model.new_cache(3, 64)
            logits = [model.forward(torch.randint(3, 301, (3, 40), generator=g), cache).clone()]
            cache.rollback([40, 23, 31])
            for T, ls in [(5, None), (1, None), (1, skip), (2, skip)]:
                logits.append(model.forward(torch.randint(3, 301, (3, T), generator=g), cache, ls).clone())
        return logits, cache.k.clone(), cache.v.clone(), shared
    fast, slow = run(True), run(False)
    assert fast[0][0].dtype == model.dtype
    for a, b in zip(fast[0], slow[0]):
        assert torch.equal(a, b)
    assert torch.equal(fast[1], slow[1]) and torch.equal(fast[2], slow[2])
    assert not any(slow[3]) and len(fast[3]) == 5
    # the prefill's 120 rows go to torch's matmul where MKL does not lag (ops.skinny_max_rows),
    # outside the invariant set: there the op-by-op path runs; the later chunks take the row path
    assert all(fast[3][1:])
