"""greedy_accept: the registered op and the public wrapper against reference.greedy_accept.

Tier 1: exact hand-computed cases. Tier 2: hypothesis-drawn odd shapes, dtypes, ties and
acceptance lengths. Tier 3: opcheck, torch.compile, bad input, backend reporting, reloads.
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import torch_threads
from swiftkern import ops, reference
from swiftkern.errors import SwiftkernError

pytestmark = pytest.mark.usefixtures("uninitialized_is_poison")  # conftest: unwritten outputs fail

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
OP = torch.ops.swiftkern.greedy_accept


def one_hot_logits(targets, V, dtype=torch.float32):
    """targets: nested list [B][K+1] of token ids -> logits [B, K+1, V] with those argmaxes."""
    t = torch.tensor(targets, dtype=torch.int64)
    logits = torch.zeros(*t.shape, V)
    logits.scatter_(2, t.unsqueeze(-1), 1.0)
    return logits.to(dtype)


def run_both(draft, logits, num_draft):
    """ops.greedy_accept == torch.ops op == reference; returns (out_tokens, num_accepted)."""
    out, acc = ops.greedy_accept(draft, logits, num_draft)
    ref_out, ref_acc = reference.greedy_accept(draft, logits, num_draft.to(torch.int32))
    op_out, op_acc = OP(draft, logits, num_draft.to(torch.int32))
    assert out.dtype == torch.int64 and acc.dtype == torch.int32
    assert torch.equal(out, ref_out) and torch.equal(acc, ref_acc)
    assert torch.equal(op_out, ref_out) and torch.equal(op_acc, ref_acc)
    return out, acc


@pytest.fixture(autouse=True)
def _auto_backend():
    yield
    ops.set_backend("auto")


# ---------------------------------------------------------------- tier 1: exact tiny cases

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "draft, num_draft, want_out, want_acc",
    [
        ([2, 4, 1], 3, [2, 4, 1, 3], 3),     # all accepted + bonus token
        ([2, 0, 1], 3, [2, 4, -1, -1], 1),   # first mismatch at 1: corrected token 4
        ([0, 4, 1], 3, [2, -1, -1, -1], 0),  # mismatch at 0
        ([2, 4, 1], 0, [2, -1, -1, -1], 0),  # num_draft 0: only the target's token
        ([2, 4, 1], 2, [2, 4, 1, -1], 2),    # drafts past num_draft are ignored
    ],
)
def test_exact_single_row(dtype, draft, num_draft, want_out, want_acc):
    logits = one_hot_logits([[2, 4, 1, 3]], V=5, dtype=dtype)
    out, acc = run_both(torch.tensor([draft]), logits, torch.tensor([num_draft], dtype=torch.int32))
    assert out.tolist() == [want_out] and acc.tolist() == [want_acc]


def test_exact_batch_vocab1_k0_b0():
    # a batch mixing all of the above
    logits = one_hot_logits([[2, 4, 1, 3], [0, 0, 0, 0], [1, 2, 3, 4]], V=5)
    draft = torch.tensor([[2, 4, 1], [0, 1, 0], [1, 2, 3]])
    out, acc = run_both(draft, logits, torch.tensor([3, 3, 1]))
    assert out.tolist() == [[2, 4, 1, 3], [0, 0, -1, -1], [1, 2, -1, -1]] and acc.tolist() == [3, 1, 1]
    # vocab 1: every target token is 0
    out, acc = run_both(torch.tensor([[0, 0], [0, 5]]), torch.randn(2, 3, 1), torch.tensor([2, 2]))
    assert out.tolist() == [[0, 0, 0], [0, 0, -1]] and acc.tolist() == [2, 1]
    # K = 0: just the target's token at position 0
    out, acc = run_both(torch.empty(2, 0, dtype=torch.int64), one_hot_logits([[3], [1]], V=4),
                        torch.zeros(2, dtype=torch.int32))
    assert out.tolist() == [[3], [1]] and acc.tolist() == [0, 0]
    # B = 0
    out, acc = run_both(torch.empty(0, 3, dtype=torch.int64), torch.randn(0, 4, 7), torch.zeros(0, dtype=torch.int32))
    assert out.shape == (0, 4) and acc.shape == (0,)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("V", [3, 16, 37, 100])
def test_ties_nan_inf_zero(dtype, V):
    """Argmax rules as torch.argmax: ties -> lowest index, first NaN wins, all -inf -> 0."""
    inf, nan = float("inf"), float("nan")
    h = V // 2
    cases = [  # (fill, {index: value}, expected argmax)
        (-1.0, {1: 5.0, V - 1: 5.0}, 1),
        (-1.0, {V - 1: nan, 0: nan, 1: inf}, 0),
        (-inf, {}, 0),
        (-1.0, {h: inf, V - 1: inf}, h),
        (-2.0, {0: -0.0, V - 1: 0.0}, 0),
        (-1.0, {V - 1: 1.0, h: nan}, h),
        (-1.0, {V - 1: 2.0}, V - 1),
    ]
    rows = []
    for fill, spec, _ in cases:
        row = torch.full((V,), fill)
        for i, v in spec.items():
            row[i] = v
        rows.append(row)
    B = len(rows)
    logits = torch.stack(rows).view(B, 1, V).to(dtype)
    out, acc = run_both(torch.empty(B, 0, dtype=torch.int64), logits, torch.zeros(B, dtype=torch.int32))
    assert out[:, 0].tolist() == [want for *_, want in cases]


def test_every_fp16_and_bf16_value_orders_like_torch():
    """All 2^16 half / bfloat16 bit patterns against a few pivots (checks the fp32 conversion)."""
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    for dtype in (torch.float16, torch.bfloat16):
        vals = bits.view(dtype)
        for pivot in [0.0, -0.0, 1.0, -1.0, 6e-8, -6e-8, 65504.0, float("inf"), float("-inf")]:
            logits = torch.stack([vals, torch.full_like(vals, pivot), vals], 1).unsqueeze(1)  # [65536, 1, 3]
            out, _ = OP(torch.empty(65536, 0, dtype=torch.int64), logits, torch.zeros(65536, dtype=torch.int32))
            assert torch.equal(out[:, 0], logits.argmax(-1)[:, 0]), (dtype, pivot)


def test_strided_inputs():
    B, K, V = 3, 4, 53
    big = torch.randn(B, K + 3, V)
    logits = big[:, 1:K + 2]  # batch stride != (K+1)*V
    target = logits.argmax(-1)
    draft = torch.stack([target[:, :K], target[:, :K]], 2)[:, :, 0]  # non-contiguous draft
    num_draft = torch.tensor([K, 2, 0, 9], dtype=torch.int32)[:3]
    out, acc = run_both(draft, logits, num_draft)
    assert acc.tolist() == [K, 2, 0]
    # V axis not contiguous: the wrapper copies, the raw C++ op refuses with a clear message
    tlogits = torch.randn(B, V, K + 1).transpose(1, 2)
    out, acc = ops.greedy_accept(draft, tlogits, num_draft)
    assert torch.equal(out, reference.greedy_accept(draft, tlogits, num_draft)[0])
    if ops.backend_info()["ops"]["greedy_accept"]["cpu"] == "cpp":
        with pytest.raises(RuntimeError, match="contiguous along V"):
            OP(draft, tlogits, num_draft)


@pytest.mark.parametrize("threads", [1, 4])
def test_large_vocab_serial_and_parallel(threads):
    """One thread: serial rows. Four: rows in parallel (B >= 4) or rows x positions (B < 4)."""
    with torch_threads(threads):
        g = torch.Generator().manual_seed(threads)
        for B, K, V in [(1, 7, 49152), (3, 5, 32003), (8, 3, 20000)]:
            logits = torch.randn(B, K + 1, V, generator=g)
            draft = logits.argmax(-1)[:, :K].clone()
            draft[0, K // 2] = (draft[0, K // 2] + 1) % V
            num_draft = torch.randint(0, K + 1, (B,), generator=g, dtype=torch.int32)
            num_draft[0] = K
            _, acc = run_both(draft, logits, num_draft)
            assert acc[0] == K // 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_matches_cpu_reference(dtype):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 6, 49152, generator=g).to(dtype)
    draft = logits.argmax(-1)[:, :5].clone()
    draft[1, 2] += 1
    num_draft = torch.tensor([5, 5, 3, 0, 4], dtype=torch.int32)
    want = reference.greedy_accept(draft, logits, num_draft)
    out, acc = ops.greedy_accept(draft.cuda(), logits.cuda(), num_draft.cuda())
    assert out.is_cuda and torch.equal(out.cpu(), want[0]) and torch.equal(acc.cpu(), want[1])


# ---------------------------------------------------------------- tier 2: drawn shapes

@st.composite
def cases(draw):
    B = draw(st.integers(1, 9))
    K = draw(st.integers(0, 7))
    V = draw(st.sampled_from([1, 2, 111, 1000, 1000, 111, 2, 49152]))
    dtype = draw(st.sampled_from(DTYPES))
    seed = draw(st.integers(0, 2**31 - 1))
    ties = draw(st.booleans())
    return B, K, V, dtype, seed, ties


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_matches_reference_on_drawn_cases(case):
    B, K, V, dtype, seed, ties = case
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, K + 1, V, generator=g)
    if ties:  # few distinct values -> many ties
        logits = torch.round(logits * 1.5)
    logits = logits.to(dtype)
    target = logits.argmax(-1)  # [B, K+1]
    # drafts agree with the target on a random prefix, then are random
    prefix = torch.randint(0, K + 1, (B,), generator=g)
    draft = torch.randint(0, V, (B, K), generator=g)
    keep = torch.arange(K).unsqueeze(0) < prefix.unsqueeze(1)
    draft = torch.where(keep, target[:, :K], draft)
    num_draft = torch.randint(0, K + 1, (B,), generator=g, dtype=torch.int32)

    out, acc = run_both(draft, logits, num_draft)
    for b in range(B):
        a = int(acc[b])
        assert 0 <= a <= int(num_draft[b])
        assert a >= min(int(prefix[b]), int(num_draft[b]))
        assert out[b, :a].tolist() == draft[b, :a].tolist()
        assert int(out[b, a]) == int(target[b, a])
        assert (out[b, a + 1:] == -1).all()


# ---------------------------------------------------------------- tier 3: torch integration

def sample_inputs():
    g = torch.Generator().manual_seed(0)
    for B, K, V, dtype in [(3, 4, 111, torch.float32), (2, 0, 5, torch.bfloat16), (4, 2, 1, torch.float16),
                           (5, 3, 1000, torch.float32)]:
        logits = torch.randn(B, K + 1, V, generator=g).to(dtype)
        draft = logits.argmax(-1)[:, :K].clone()
        if K:
            draft[0, -1] = (draft[0, -1] + 1) % V
        yield draft, logits, torch.randint(0, K + 1, (B,), generator=g, dtype=torch.int32)


@pytest.mark.parametrize("args", list(sample_inputs()), ids=lambda a: f"{tuple(a[1].shape)}-{a[1].dtype}")
def test_opcheck(args):
    torch.library.opcheck(OP, args)


def test_torch_compile_fullgraph_matches_eager():
    def step(draft, logits, num_draft):
        out, acc = torch.ops.swiftkern.greedy_accept(draft, logits, num_draft)
        return out, acc + 1

    def step_wrapper(draft, logits, num_draft):
        return ops.greedy_accept(draft, logits, num_draft)

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    compiled_wrapper = torch.compile(step_wrapper, fullgraph=True, backend="aot_eager")
    for args in sample_inputs():
        for fn, eager in ((compiled, step), (compiled_wrapper, step_wrapper)):
            got, want = fn(*args), eager(*args)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def _good():
    return torch.zeros(2, 3, dtype=torch.int64), torch.randn(2, 4, 10), torch.tensor([1, 3], dtype=torch.int32)


@pytest.mark.parametrize(
    "patch, message",
    [
        (lambda d, l, n: (d[0], l, n), "draft_tokens must be 2-D"),
        (lambda d, l, n: (d, l[0], n), "target_logits must be 3-D"),
        (lambda d, l, n: (d, l, n[None]), "num_draft must be 1-D"),
        (lambda d, l, n: (d, l[:, :3], n), r"\[B, K\+1, V\] = \[2, 4, V\]"),
        (lambda d, l, n: (d, l[:1], n), r"\[B, K\+1, V\] = \[2, 4, V\]"),
        (lambda d, l, n: (d, l, n[:1]), "one entry per row"),
        (lambda d, l, n: (d, l[..., :0], n), "V = 0"),
        (lambda d, l, n: (d.int(), l, n), "draft_tokens must be int64"),
        (lambda d, l, n: (d, l.double(), n), "float32, bfloat16 or float16"),
        (lambda d, l, n: (d, l, n.float()), "num_draft must be int32"),
        (lambda d, l, n: (d, l, torch.tensor([1, 4], dtype=torch.int32)), r"\[0, K = 3\].*max 4"),
        (lambda d, l, n: (d, l, torch.tensor([-1, 0])), r"\[0, K = 3\].*min -1"),
        (lambda d, l, n: (d, l.to("meta"), n), "one device"),
        (lambda d, l, n: (d.tolist(), l, n), "must be a torch.Tensor"),
    ],
)
def test_bad_input_raises_swiftkern_error(patch, message):
    with pytest.raises(SwiftkernError, match=message):
        ops.greedy_accept(*patch(*_good()))


def test_int64_num_draft_is_accepted():
    d, l, n = _good()
    out, acc = ops.greedy_accept(d, l, n.long())
    assert acc.dtype == torch.int32 and torch.equal(out, reference.greedy_accept(d, l, n)[0])


def test_backend_info_reports_cpp_kernel_when_built():
    if os.environ.get("SWIFTKERN_BUILD_EXT") == "0":
        pytest.skip("SWIFTKERN_BUILD_EXT=0: the extension was deliberately not built")
    info = ops.backend_info()
    assert info["extension"].startswith("built"), info["extension"]
    assert info["ops"]["greedy_accept"]["cpu"] == "cpp"
    # CUDA tensors: the compiled CUDA kernel when built, else the Triton kernel when triton imports
    assert info["ops"]["greedy_accept"]["cuda"] in (("cuda",) if info["build"]["cuda"] else ("triton", "reference"))
    import swiftkern._C as ext
    assert set(ext.build_info()) >= {"cuda", "compiler", "flags", "openmp", "torch"}


def test_backend_knob():
    d, l, n = _good()
    want = reference.greedy_accept(d, l, n)
    ops.set_backend("reference")
    assert ops.backend_info()["ops"]["greedy_accept"] == {"cpu": "reference", "cuda": "reference"}
    assert torch.equal(ops.greedy_accept(d, l, n)[0], want[0])
    ops.set_backend("bogus")
    with pytest.raises(SwiftkernError, match="SWIFTKERN_BACKEND must be one of"):
        ops.greedy_accept(d, l, n)
    ops.set_backend("cpp")
    if ops.registry.extension is None:
        with pytest.raises(SwiftkernError, match="SWIFTKERN_BACKEND=cpp"):
            ops.greedy_accept(d, l, n)
    else:
        assert torch.equal(ops.greedy_accept(d, l, n)[0], want[0])


def test_reload_is_safe():
    """Reloading the registry, the backend choice and the package twice changes nothing: no kernel
    registered twice, the same backends, the reference kernels still known as the registry's own
    (process_state), none taken for compiled ones. In a fresh process, so that no other test's
    reloads (test_triton_backend's) have already changed the state it checks."""
    code = textwrap.dedent("""
        import importlib, warnings
        import torch
        from swiftkern import ops, reference
        before = ops.backend_info()
        compiled = {name: dict(used) for name, used in ops.registry.COMPILED.items()}  # {op: {device: kernel}}
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # e.g. the dispatcher's "overriding a previously registered kernel"
            for _ in range(2):  # the registration (registry), the backend choice, the package
                for module in (ops.registry, ops.backends, ops):
                    importlib.reload(module)
        assert ops.backend_info() == before, (before, ops.backend_info())
        assert ops.registry.COMPILED == compiled, (compiled, ops.registry.COMPILED)
        logits = torch.randn(3, 4, 50)
        draft, nd = logits.argmax(-1)[:, :3].contiguous(), torch.tensor([3, 1, 0], dtype=torch.int32)
        assert torch.equal(ops.greedy_accept(draft, logits, nd)[0], reference.greedy_accept(draft, logits, nd)[0])
        print("ok")
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-3000:]


def test_without_extension_the_reference_op_is_registered():
    """In a fresh process where swiftkern._C cannot be imported: the op still exists and works."""
    code = textwrap.dedent("""
        import importlib.abc, sys
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name == "swiftkern._C":
                    raise ModuleNotFoundError("blocked for the test", name=name)
        sys.meta_path.insert(0, Block())
        import torch
        from swiftkern import ops, reference
        info = ops.backend_info()
        assert info["extension"].startswith("not built"), info
        assert info["ops"]["greedy_accept"]["cpu"] == "reference", info
        assert info["ops"]["greedy_accept"]["cuda"] in ("triton", "reference"), info
        importlib.reload(ops.registry)
        logits = torch.randn(3, 4, 50)
        draft, nd = logits.argmax(-1)[:, :3].contiguous(), torch.tensor([3, 1, 0], dtype=torch.int32)
        torch.library.opcheck(torch.ops.swiftkern.greedy_accept, (draft, logits, nd))
        out, acc = ops.greedy_accept(draft, logits, nd)
        assert acc.tolist() == [3, 1, 0] and torch.equal(out, reference.greedy_accept(draft, logits, nd)[0])
        print("ok")
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-3000:]


def test_host_max_draft_skips_the_device_read_and_keeps_the_result(monkeypatch):
    """max_draft (the caller's host-known max(num_draft)): the same tokens, no aminmax of
    num_draft (on a GPU, a sync that would make the call wait for the forward), and a value
    outside [0, K] refused. The same for rejection_sample."""
    g = torch.Generator().manual_seed(4)
    B, K, V = 3, 4, 37
    draft = torch.randint(0, V, (B, K), generator=g)
    logits = torch.randn(B, K + 1, V, generator=g)
    nd = torch.tensor([4, 0, 2], dtype=torch.int32)
    want = ops.greedy_accept(draft, logits, nd)
    probs = torch.softmax(logits, -1)
    u_a, u_s = torch.rand(B, K, generator=g), torch.rand(B, K + 1, generator=g)
    want_rs = ops.rejection_sample(draft, None, probs, nd, u_a, u_s)
    reads = []
    real = torch.aminmax
    monkeypatch.setattr(torch, "aminmax", lambda t, *a, **k: reads.append(t.shape) or real(t, *a, **k))
    got = ops.greedy_accept(draft, logits, nd, max_draft=4)
    got_rs = ops.rejection_sample(draft, None, probs, nd, u_a, u_s, max_draft=4)
    assert reads == []
    assert all(torch.equal(a, b) for a, b in zip(got + got_rs, want + want_rs))
    ops.greedy_accept(draft, logits, nd)
    assert reads == [(B,)]  # without it: one read of num_draft
    for bad in (5, -1, 2.0, True):
        with pytest.raises(SwiftkernError, match=r"greedy_accept: max_draft must be an int in \[0, K = 4\]"):
            ops.greedy_accept(draft, logits, nd, max_draft=bad)
