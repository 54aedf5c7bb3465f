"""LayerKernels.forward (csrc/decoder_forward_cpu.cpp), a forward up to the LM head in one C++
call, against the same forward with its ops called one by one from Python (the embedding, the
RoPE rows, ``LayerKernels.stack``, the cache advance, the final norm): the same logits, cache
and lengths, bit for bit; and a bad token id refused before anything is written."""

import contextlib

import pytest
import torch

from conftest import tiny_model
from swiftkern import SkipModel, SwiftkernError, layer_kernels
from swiftkern.layer_kernels import LayerKernels
from swiftkern.layer_set import LayerSet

pytestmark = pytest.mark.usefixtures("uninitialized_is_poison")  # conftest: unwritten outputs fail

needs_forward = pytest.mark.skipif(LayerKernels.for_device("cpu").forward is None,
                                   reason="the C++ CPU kernels (decoder_forward) were not built")


def _run(model, chunks, layer_set, ragged):
    """Logits of every chunk fed in turn (rows rolled back to different lengths after the first
    when ``ragged``), and the cache at the end."""
    cache = model.new_cache(chunks[0].shape[0], 64)
    logits = []
    for i, c in enumerate(chunks):
        logits.append(model.forward(c, cache, layer_set=layer_set).clone())
        if i == 0 and ragged:
            cache.rollback([n - 3 * b for b, n in enumerate(cache.host_lengths)])
    return logits, cache.k.clone(), cache.v.clone(), list(cache.host_lengths), cache.lengths.clone()


def _same(a, b):
    for x, y in zip(a[0], b[0]):
        assert torch.equal(x, y)
    assert torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])
    assert a[3] == b[3] and torch.equal(a[4], b[4]) and a[4].tolist() == a[3]


@needs_forward
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])  # qwen2: q/k/v biases; qwen3: q/k norms
@pytest.mark.parametrize("skip", [None, "attn:1|mlp:0,2"])
@pytest.mark.parametrize("invariant", [False, True], ids=["rotary", "rope-table"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_call_equals_the_ops_one_by_one(arch, skip, invariant, dtype, launch_names):
    """Rows at different lengths (positions per row, RoPE rows from HF's rotary or the table);
    a prefill of 23 tokens, a verify chunk of 4, a decode step; 3 rows. Both runs go through
    the same stack; only the ops around it move into C++."""
    model = SkipModel.from_hf(tiny_model(arch, num_hidden_layers=3).to(dtype))
    layer_set = LayerSet.parse(skip, 3) if skip else None
    g = torch.Generator().manual_seed(11)
    chunks = [torch.randint(3, 301, (3, T), generator=g) for T in (23, 4, 1)]
    calls = launch_names

    def go():
        with model.batch_invariant() if invariant else contextlib.nullcontext():
            return _run(model, chunks, layer_set, ragged=True)
    one_call = go()
    assert calls == ["decoder_forward"] * len(chunks)
    with layer_kernels.op_by_op_forward():  # the twin: the stack called from Python
        op_by_op = go()
    assert calls[len(chunks):] == ["decoder_stack"] * len(chunks)
    _same(one_call, op_by_op)
    assert LayerKernels.for_device("cpu", invariant).forward is not None  # the switch is undone on leaving


@needs_forward
@pytest.mark.parametrize("bad", [301, -1])
def test_a_bad_token_id_is_refused_before_anything_is_written(bad):
    """The C++ call checks every id before it writes; the runner names the bad one as its
    Python check did (tests/test_model.py has the same message for the op-by-op path)."""
    model = SkipModel.from_hf(tiny_model("llama", num_hidden_layers=2))
    cache = model.new_cache(2, 16)
    model.forward(torch.tensor([[5, 6, 7], [8, 9, 10]]), cache)
    k, v, lengths = cache.k.clone(), cache.v.clone(), cache.lengths.clone()
    with pytest.raises(SwiftkernError, match=r"tokens must be in \[0, 301\)"):
        model.forward(torch.tensor([[4, 5], [6, bad]]), cache)
    assert torch.equal(cache.k, k) and torch.equal(cache.v, v)
    assert torch.equal(cache.lengths, lengths) and cache.host_lengths == [3, 3]


@needs_forward
def test_int32_ids_give_the_int64_bits():
    model = SkipModel.from_hf(tiny_model("qwen3", num_hidden_layers=2))
    ids = torch.randint(0, 301, (2, 7), generator=torch.Generator().manual_seed(2))
    runs = []
    for dtype in (torch.int64, torch.int32):
        cache = model.new_cache(2, 16)
        runs.append((model.forward(ids.to(dtype), cache), cache.k.clone()))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])


@needs_forward
def test_a_position_past_the_rope_table_is_refused_before_anything_is_written():
    """The op itself: table rows are read at checked positions (the runner grows the table first)."""
    model = SkipModel.from_hf(tiny_model("llama", num_hidden_layers=2))
    kern = LayerKernels.for_device("cpu", invariant=False)
    cache = model.new_cache(1, 16)
    cache.set_lengths([9])
    cos = torch.zeros(8, model.head_dim)  # rows for positions 0-7 only
    k = cache.k.clone()
    skip = [0] * model.num_layers
    with pytest.raises(RuntimeError, match=r"position 9 at 0 is outside \[0, 8\)"):
        kern.forward(torch.tensor([[3]]), model.embed, cos, cos, True, None, cache.lengths, model.final_norm,
                     model._stack_weights, skip, cache.k, cache.v, 10, model.num_heads, model.num_kv_heads,
                     model.head_dim, model.eps, model.scale, [], (model.lm_head, None, None))
    assert torch.equal(cache.k, k) and cache.lengths.tolist() == [9]


@needs_forward
def test_a_strided_embedding_table_takes_the_ops_one_by_one(launch_names):
    """The C++ call reads the table as contiguous rows: a strided one (a view of a wider weight)
    goes op by op, with the same logits as a contiguous copy through the one call."""
    model = SkipModel.from_hf(tiny_model("llama", num_hidden_layers=2))
    ids = torch.randint(0, 301, (1, 5), generator=torch.Generator().manual_seed(4))
    contiguous = model.forward(ids, model.new_cache(1, 8))
    wide = torch.cat([model.embed, model.embed], dim=1)  # [V, 2H]
    model.embed = wide[:, :model.embed.shape[1]]  # the same values, row stride 2H
    assert not model.embed.is_contiguous()
    assert torch.equal(model.forward(ids, model.new_cache(1, 8)), contiguous)
    assert launch_names == ["decoder_forward", "decoder_stack"]


@needs_forward
@pytest.mark.parametrize("invariant", [False, True], ids=["regular", "invariant"])
def test_the_lm_head_in_the_call_takes_the_kernel_ops_linear_takes(invariant, monkeypatch, launch_names):
    """The LM head inside the call, the model's own and a pruned draft head (``DraftHead``), on
    packed weights: at 4 rows the packed codes; at 70, past PACKED_MAX_ROWS, the regular set's
    head runs torch's matmul on the float32 weight and the invariant set's still the codes. The
    op-by-op path's logits (``head_logits``) bit for bit, one launch a forward; a spoiled packed
    head row shows the call read the codes."""
    from conftest import bitwise_equal, gguf_like
    from swiftkern.draft_head import DraftHead
    from swiftkern.ops import projections
    from swiftkern.packed_weights import PackedSet

    monkeypatch.setattr(projections, "mkl_lags_here", lambda: False)  # PACKED_MAX_ROWS holds on any CPU
    model = SkipModel(gguf_like(tiny_model("llama", num_hidden_layers=2)), pack_weights=False)
    model.packed = PackedSet(model._stack_weights + [model.lm_head])
    draft = DraftHead.for_model(model, 40, [200, 250, 7])
    tokens = torch.randint(0, 301, (1, 70), generator=torch.Generator().manual_seed(3))
    with model.batch_invariant() if invariant else contextlib.nullcontext():
        logits = {}
        for T in (4, 70):
            for head in (None, draft.head):
                launch_names.clear()
                logits[T, head is None] = model.forward(tokens[:, :T], model.new_cache(1, 80), head=head)
                assert launch_names == ["decoder_forward"]
                with layer_kernels.op_by_op_forward():
                    op_by_op = model.forward(tokens[:, :T], model.new_cache(1, 80), head=head)
                assert bitwise_equal(logits[T, head is None], op_by_op), (T, head is None)
        model.packed.slots()[-1][7].zero_()  # the LM head's row 7 in codes: its logit moves
        spoiled = model.forward(tokens[:, :4], model.new_cache(1, 80))
        assert not torch.equal(spoiled[..., 7], logits[4, True][..., 7])
        assert torch.equal(spoiled[..., 8:], logits[4, True][..., 8:])
