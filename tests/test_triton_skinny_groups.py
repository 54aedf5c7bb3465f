"""The regular set's grouped Triton projections (triton_kernels/skinny_linear.py):
skinny_linear_group (a layer's q/k/v or gate/up in one launch) and skinny_silu_linear (the down
projection with its SwiGLU in the A tile's load) against the launches they replace, bit for bit
(interpreted on the CPU, native on a GPU), against their torch twins on odd shapes, and the model
runner's regular set taking them (the CUDA rule turned on for the CPU's tensors) with the same
logits, bit for bit, in fewer launches."""

import contextlib

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conftest import tiny_model
from swiftkern import SkipModel, layer_kernels, reference
from swiftkern.errors import SwiftkernError
from test_triton_skinny_linear import cuda_rule_on_cpu  # noqa: F401  (a fixture)
from triton_cases import DEVICE, FEW, TOLERANCES, backend, opcheck, poisoned, triton_op


def _tensor(g, *shape, dtype, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)


def group_operands(lead, K, widths, biased, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = _tensor(g, *lead, K, dtype=dtype)
    weights = [_tensor(g, n, K, dtype=dtype, scale=K ** -0.5) for n in widths]
    biases = [_tensor(g, n, dtype=dtype) if b else None for n, b in zip(widths, biased)]
    return x, weights, biases


def swiglu_operands(lead, I, N, bias, dtype, seed):
    """gate and up as the halves of one [..., 2I] buffer (skinny_linear_group's gate/up output)."""
    g = torch.Generator().manual_seed(seed)
    both = _tensor(g, *lead, 2 * I, dtype=dtype, scale=3.0)
    weight = _tensor(g, N, I, dtype=dtype, scale=I ** -0.5)
    return both[..., :I], both[..., I:], weight, _tensor(g, N, dtype=dtype) if bias else None


LEADS = st.sampled_from([(1,), (2,), (9,), (3, 5), (32,), (33,), (0,)])


@FEW
@given(lead=LEADS, K=st.sampled_from([1, 31, 130, 300]),
       widths=st.lists(st.sampled_from([1, 63, 65, 96]), min_size=1, max_size=3),
       biased=st.lists(st.booleans(), min_size=3, max_size=3),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**16))
def test_group_is_each_weights_skinny_linear_bit_for_bit(lead, K, widths, biased, dtype, seed):
    x, weights, biases = group_operands(lead, K, widths, biased[:len(widths)], dtype, seed)
    with poisoned():
        got = triton_op("skinny_linear_group")(x, weights, biases)
    single = triton_op("skinny_linear")
    assert got.shape == (*lead, sum(widths)) and got.dtype == dtype
    assert torch.equal(got, torch.cat([single(x, w, b) for w, b in zip(weights, biases)], dim=-1))
    atol, rtol = TOLERANCES["skinny_linear"][dtype]
    want = reference.skinny_linear_group(x.double(), [w.double() for w in weights],
                                         [None if b is None else b.double() for b in biases]).to(dtype)
    torch.testing.assert_close(got, want, atol=atol * K ** 0.5, rtol=rtol)


@FEW
@given(lead=LEADS, I=st.sampled_from([1, 37, 130, 300]), N=st.sampled_from([1, 63, 65]), bias=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**16))
def test_silu_linear_is_silu_mul_then_skinny_linear_bit_for_bit(lead, I, N, bias, dtype, seed):
    gate, up, weight, b = swiglu_operands(lead, I, N, bias, dtype, seed)
    with poisoned():
        got = triton_op("skinny_silu_linear")(gate, up, weight, b)
    assert got.shape == (*lead, N) and got.dtype == dtype
    assert torch.equal(got, triton_op("skinny_linear")(triton_op("silu_mul")(gate, up), weight, b))
    atol, rtol = TOLERANCES["skinny_linear"][dtype]
    want = reference.skinny_silu_linear(gate.float(), up.float(), weight.float(),
                                        None if b is None else b.float()).to(dtype)
    torch.testing.assert_close(got, want, atol=atol * I ** 0.5 + TOLERANCES["silu_mul"][dtype][0] * I, rtol=rtol)


def test_bad_input_says_what_is_wrong():
    x, (w0, w1), (b0, b1) = group_operands((4,), 16, (8, 6), (True, True), torch.float32, 1)
    group = triton_op("skinny_linear_group")
    for args, match in (((x, [], []), "takes 1 to 3 weights and one bias"),
                        ((x, [w0, w1, w0, w1], [None] * 4), "takes 1 to 3 weights"),
                        ((x, [w0, w1], [b0]), "takes 1 to 3 weights and one bias .or None. each, got 2 and 1"),
                        ((x, [w0, w1[:, :15]], [b0, b1]), r"x must be \[..., K\] and weight1 \[N, K\]"),
                        ((x, [w0, w1.bfloat16()], [b0, None]), "x and weight1 must have one dtype"),
                        ((x, [w0, w1], [b0, b1[:5]]), r"bias1 must be \[N\] = \[6\]"),
                        ((x, [w0.double()], [None]), "weight0 must be float32, bfloat16 or float16")):
        with pytest.raises(SwiftkernError, match=f"skinny_linear_group: {match}"):
            group(*args)
    gate, up, weight, b = swiglu_operands((3,), 12, 5, True, torch.float32, 2)
    swiglu = triton_op("skinny_silu_linear")
    for args, match in (((gate, up[:, :11], weight, b), "gate and up must have one shape and dtype"),
                        ((gate, up, weight[:, :11], b), r"x must be \[..., K\] and weight \[N, K\]"),
                        ((gate, up, weight, b[:4]), r"bias must be \[N\] = \[5\]")):
        with pytest.raises(SwiftkernError, match=f"skinny_silu_linear: {match}"):
            swiglu(*args)


def test_opcheck():
    x, weights, biases = group_operands((5,), 40, (24, 8, 8), (True, False, True), torch.float32, 3)
    opcheck(torch.ops.swiftkern_triton.skinny_linear_group, (x, weights, biases))
    gate, up, weight, b = swiglu_operands((5,), 40, 24, True, torch.float32, 4)
    opcheck(torch.ops.swiftkern_triton.skinny_silu_linear, (gate.contiguous(), up.contiguous(), weight, b))


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])  # qwen2: q, k and v biases
def test_the_regular_runner_groups_its_projections_with_the_same_logits(cuda_rule_on_cpu, monkeypatch, model_type):
    """A tiny model's decode of 3 rows and verify pass of 3 x 4 tokens through the regular set
    (SWIFTKERN_BACKEND=triton: its silu_mul the Triton kernel whose bits skinny_silu_linear
    makes) with the grouped launches and without them (``ungrouped_projections``): the same
    logits bit for bit, and a layer's projections in 4 matmul launches instead of 7."""
    import swiftkern.triton_kernels.skinny_linear as skinny

    launches = []
    real_launch = skinny.launch
    monkeypatch.setattr(skinny, "launch", lambda *a, **k: launches.append(1) or real_launch(*a, **k))
    layers = 2
    model = SkipModel(tiny_model(model_type, num_hidden_layers=layers).to(DEVICE))
    tokens = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12], [20, 21, 22, 23]], device=DEVICE)  # [3, 4]

    def logits_and_launches(grouped: bool):
        with contextlib.nullcontext() if grouped else layer_kernels.ungrouped_projections():
            kern = layer_kernels.LayerKernels.for_device(torch.device(DEVICE).type)
            assert (kern.linears is not None, kern.silu_linear is not None) == (grouped, grouped)
            return forwards()

    def forwards():
        cache, out = model.new_cache(3, 16), []
        for chunk in (tokens[:, :1], tokens):  # a decode step of 3 rows, then a verify pass of 3 x 4
            launches.clear()
            out.append((model.forward(chunk, cache), len(launches)))
        return out

    with backend("triton"):
        grouped = logits_and_launches(True)
        separate = logits_and_launches(False)
    for (got, n_grouped), (want, n_separate) in zip(grouped, separate):
        assert torch.equal(got, want)
        assert (n_grouped, n_separate) == (4 * layers + 1, 7 * layers + 1)  # + the LM head


def test_the_swiglu_joins_the_down_projection_only_with_the_triton_silu_mul(cuda_rule_on_cpu, monkeypatch):
    """skinny_silu_linear makes the Triton silu_mul's bits: the regular set takes it where silu_mul
    is that kernel, and with another silu_mul (here the reference) keeps the two ops, whose bits
    are that kernel's; q/k/v stay grouped either way."""
    import swiftkern.triton_kernels.skinny_linear as skinny

    fused = []
    real = skinny.skinny_silu_linear
    monkeypatch.setattr(skinny, "skinny_silu_linear", lambda *a: fused.append(1) or real(*a))
    gate, up, weight, _ = swiglu_operands((3,), 40, 24, False, torch.float32, 7)
    for name, takes in (("triton", True), ("reference", False)):
        fused.clear()
        with backend(name):
            kern = layer_kernels.LayerKernels.for_device(torch.device(DEVICE).type)
            got = kern.silu_linear(gate, up, weight, None)
            want = kern.linear(kern.silu_mul(gate, up), weight, None)
        assert kern.backends["silu_mul"] == name and bool(fused) is takes and kern.linears is not None
        assert torch.equal(got, want)
