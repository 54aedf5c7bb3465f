"""greedy_verify (csrc/greedy_verify_cpu.cpp): greedy_accept with num_draft as host ints and the
speculative step's tail in one C++ call, against its twin, the torch path a GPU step takes
(reference.greedy_accept, the gather of the pending token, the read of the rows, each kept
token's bi_token_logprob)."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import bitwise_equal, tiny_model
from swiftkern import ops, reference, verify_step
from swiftkern.batch_invariant import bi_token_logprob
from swiftkern.model import SkipModel
from swiftkern.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("uninitialized_is_poison")  # conftest: unwritten outputs fail

HOST_VERIFY = ops.greedy_verify_here("cpu")
needs_cpp = pytest.mark.skipif(HOST_VERIFY is None, reason="the C++ extension is not built (greedy_verify)")


def twin(draft, logits, num_draft):
    """What verify_and_accept computes without greedy_verify: the op, the gather, the read, and
    each row's kept tokens' logprobs [a + 1] (what the loop asks for, at most)."""
    out, acc = reference.greedy_accept(draft, logits, torch.tensor(num_draft, dtype=torch.int32))
    acc = acc.to(torch.int64)
    pending = out.gather(1, acc.unsqueeze(1)).squeeze(1)
    lps = [bi_token_logprob(logits[b, :a + 1], out[b, :a + 1]) for b, a in enumerate(acc.tolist())]
    return out, pending, out.tolist(), acc.tolist(), lps


@st.composite
def cases(draw):
    B = draw(st.integers(0, 6))
    K = draw(st.integers(0, 7))
    V = draw(st.sampled_from([1, 2, 37, 1000, 49152]))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
    return B, K, V, dtype, draw(st.integers(0, 2**31 - 1)), draw(st.booleans()), draw(st.booleans())


@needs_cpp
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_matches_the_torch_path_on_drawn_cases(case):
    """Odd shapes, three dtypes, ties (few distinct values), NaN and -inf rows, drafts agreeing
    on a random prefix, num_draft 0 to K, B = 0, strided drafts: the same out tokens, pending
    tokens, host rows and acceptance counts as the twin."""
    B, K, V, dtype, seed, ties, strided = case
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, K + 1, V, generator=g)
    if ties:
        logits = torch.round(logits * 1.5)
    if B and V > 2:
        logits[0, 0, V // 2] = float("nan")
        logits[B - 1, K] = float("-inf")
    logits = logits.to(dtype)
    target = logits.argmax(-1)  # [B, K+1]
    prefix = torch.randint(0, K + 1, (B,), generator=g)
    draft = torch.where(torch.arange(K) < prefix.unsqueeze(1), target[:, :K], torch.randint(0, V, (B, K), generator=g))
    if strided:
        draft = torch.stack([draft, draft], 2)[:, :, 1]  # [B, K], stride 2 along K
    num_draft = torch.randint(0, K + 1, (B,), generator=g).tolist()

    want_out, want_pending, want_rows, want_accepted, want_lps = twin(draft, logits, num_draft)
    for logprobs in (False, True):
        out, pending, rows, accepted, lps = HOST_VERIFY(draft, logits, num_draft, logprobs)
        assert torch.equal(out, want_out) and torch.equal(pending, want_pending)
        assert rows == want_rows and accepted == want_accepted
        assert pending.dtype == torch.int64 and all(isinstance(a, int) for a in accepted)
        if not logprobs:
            assert lps is None
            continue
        assert lps.shape == (B, K + 1) and lps.dtype == torch.float32
        for b, a in enumerate(accepted):
            assert bitwise_equal(lps[b, :a + 1], want_lps[b])  # NaN where the twin's is NaN
            assert lps[b, a + 1:].isnan().all()


@needs_cpp
@pytest.mark.parametrize("num_draft, message", [([1], "one entry per row"), ([1, 3], r"num_draft\[1\] = 3 is outside"),
                                                ([-1, 0], r"num_draft\[0\] = -1 is outside")])
def test_bad_num_draft_is_refused_with_its_index(num_draft, message):
    with pytest.raises(RuntimeError, match=message):
        HOST_VERIFY(torch.zeros(2, 2, dtype=torch.int64), torch.randn(2, 3, 5), num_draft, False)


@needs_cpp
def test_bad_logits_are_refused_by_the_ops_checks():
    with pytest.raises(RuntimeError, match="contiguous along V"):
        HOST_VERIFY(torch.zeros(1, 2, dtype=torch.int64), torch.randn(1, 5, 3).transpose(1, 2), [2], True)


def test_only_where_greedy_accept_runs_its_cpp_kernel():
    """The reference backend (and CUDA) keep the torch path."""
    try:
        ops.set_backend("reference")
        assert ops.greedy_verify_here("cpu") is None
    finally:
        ops.set_backend("auto")
    assert ops.greedy_verify_here("cuda") is None or ops.backend_for("greedy_accept", "cuda") == "cpp"


@needs_cpp
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_cpu_verify_step_gives_the_torch_paths_result(monkeypatch, arch):
    """verify_and_accept on the CPU: greedy_verify in place of greedy_accept (not called), the
    same rows, counts, pending tokens, out tokens, logits and kept tokens' logprobs as the torch
    path, and the cache advanced the same."""
    sm = SkipModel(tiny_model(arch))
    results, real = [], ops.greedy_accept
    for host in (True, False):
        if not host:
            monkeypatch.setattr(ops, "greedy_verify_here", lambda device_type: None)
        calls = []
        monkeypatch.setattr(ops, "greedy_accept", lambda *a, **k: calls.append(1) or real(*a, **k))
        cache = sm.new_cache(2, 32)
        logits = sm.forward(torch.tensor([[5, 6, 7], [9, 10, 11]]), cache)
        pending = logits[:, -1].argmax(-1)
        drafts = [[int(logits[0, -1].argmax()), 4, 5], [int(logits[1, -1].argmax())]]
        v = verify_step.verify_and_accept(sm, cache, pending, drafts, None, SamplingParams(), [1, 2],
                                          logprobs=True)
        assert len(calls) == (0 if host else 1)
        results.append((v, list(cache.host_lengths)))
    (a, la), (b, lb) = results
    assert a.rows == b.rows and a.num_accepted == b.num_accepted and la == lb
    assert torch.equal(a.pending, b.pending) and torch.equal(a.out, b.out) and torch.equal(a.logits, b.logits)
    assert a.queued is not None and b.queued is None  # the CPU's logprobs came with the acceptance
    for i, n in enumerate(a.num_accepted):
        assert torch.equal(a.logprobs(i, n + 1), b.logprobs(i, n + 1))
