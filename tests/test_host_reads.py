"""Host reads of device tensors in mode deterministic's replay loop (swiftkern/deterministic_steps.py),
counted on the CPU.

On a GPU, reading a device tensor on the host (``tolist``, ``item``, ``int(t)``, ``bool(t)``,
``.cpu()``, ``nonzero``) and a blocking copy of host values in (``torch.tensor(..., device=cuda)``,
``t.to(cuda)`` or ``copy_`` from a host tensor) both wait for every kernel queued before them.
``Stream`` models one CUDA stream on the CPU: tensors made from host data without a device are
host tensors (as is what is computed from them alone), every other tensor is a device tensor;
a *sync* is a read of a device tensor or a copy of a host tensor into one, and it *stalls* when
device work was launched since the sync before it. A fast step and a verify pass should stall
once: their host values copied in before they launch anything, one read once all of their work
is queued. Before this was counted a verify pass stalled three times, four sampled (the rows
of its logits copied in after the pass, the sampled pass's uniforms after it too, the logprobs
launched after the read and waited for by the lengths' copy), and copied its inputs in six
times; a sampled fast step stalled twice (the uniforms), a draft step with eps twice (its
confidence read after its tokens), a full step with lookup drafts read back the tokens it had
just copied in.
"""

from __future__ import annotations

import contextlib
import traceback

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from conftest import tiny_model
import swiftkern.deterministic as deterministic
from swiftkern import device_reads, top_p, verify_step
from swiftkern import SkipModel
from swiftkern.cuda_graphs import GraphRunner
from swiftkern.graph_capture import RecordedGraph
from swiftkern.deterministic import decode_deterministic
from swiftkern.deterministic_steps import DeterministicRun
from swiftkern.fast_path import FastPath
from swiftkern.layer_set import LayerSet
from swiftkern.requests import Requests
from swiftkern.sampling import (SamplingParams, keyed_uniforms, probs_from_logits, sample_from_weights, select_tokens,
                                select_with_uniforms, token_uniforms)

READS = frozenset(("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy", "nonzero",
                   "equal"))
METADATA = frozenset(("__get__", "__set__", "size", "dim", "stride", "data_ptr", "numel", "is_contiguous",
                      "element_size", "__len__", "__hash__", "__repr__", "__format__", "get_device",
                      "is_floating_point", "storage_offset", "untyped_storage", "is_inference", "empty_like"))
VIEWS = frozenset(("view", "unsqueeze", "squeeze", "transpose", "t", "permute", "expand", "narrow", "select",
                   "split", "chunk", "unbind", "view_as", "as_strided", "detach"))
FACTORIES = frozenset(("tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint"))


def _is_host(t) -> bool:
    return getattr(t, "_host_side", False)


def _mark_host(out) -> None:
    for t in tree_flatten(out)[0]:
        if torch.is_tensor(t):
            t._host_side = True


def _basic_index(index) -> bool:
    index = index if isinstance(index, tuple) else (index,)
    return all(i is None or i is Ellipsis or isinstance(i, (int, slice)) for i in index)


# code that runs on the CPU only, left out: the forward's id checks, and top-p's value sort
# (``top_p.top_p_removed`` takes ``top_p_removed_by_sort`` on any other device, which reads nothing;
# ``test_top_p_off_the_cpu_reads_nothing``)
CPU_ONLY = frozenset(("_check_ids", "removed_from_value_sort"))


def host_values_written_as_on_a_device(monkeypatch) -> None:
    """CPU tensors stand for device tensors here: a KVCache writes its lengths, and
    ``verify_tokens`` a verify pass's tokens, by torch ops, as off the CPU (on the CPU both
    write through NumPy, no torch op to see)."""
    monkeypatch.setattr(device_reads, "writes_through_numpy", lambda device: False)


@pytest.fixture(autouse=True)
def _as_on_a_device(monkeypatch):
    host_values_written_as_on_a_device(monkeypatch)


class Stream(TorchFunctionMode):
    """Records every sync as (phase, "read" | "copy", name, stalls, where). ``phase``: set by
    ``phases``; where: the innermost swiftkern frame. Frames of ``CPU_ONLY`` are left out."""

    def __init__(self):
        super().__init__()
        self.syncs: list[tuple] = []
        self.phase = None
        self.queued = False  # device work launched since the last sync

    def _sync(self, kind: str, name: str) -> None:
        stack = traceback.extract_stack()
        if any(f.name in CPU_ONLY for f in stack):
            return
        where = next((f"{f.filename.split('/swiftkern/')[-1]}:{f.lineno} {f.name}" for f in reversed(stack)
                      if "/swiftkern/" in f.filename), "?")
        self.syncs.append((self.phase, kind, name, self.queued, where))
        self.queued = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        tensors = [t for t in tree_flatten((args, kwargs))[0] if torch.is_tensor(t)]
        host = bool(tensors) and all(_is_host(t) for t in tensors)
        out = func(*args, **kwargs)
        if name in METADATA:
            return out
        if name in FACTORIES:
            if kwargs.get("device") is None:
                _mark_host(out)
            elif name in ("tensor", "as_tensor"):
                self._sync("copy", f"torch.{name}")
            elif name != "empty":
                self.queued = True
        elif name in READS:
            if tensors and not host:
                self._sync("read", name)
            if name == "cpu":
                _mark_host(out)
        elif name in ("to", "copy_") and tensors:
            source = tensors[-1] if name == "copy_" else tensors[0]
            to_device = (not _is_host(tensors[0]) if name == "copy_" else
                         any(isinstance(a, (torch.device, str)) for a in list(args[1:]) + [kwargs.get("device")]))
            if _is_host(source) and to_device:
                self._sync("copy", name)
            elif _is_host(source):
                _mark_host(out)
            else:
                self.queued = True
        elif host:
            _mark_host(out)
        elif tensors and not (name in VIEWS or (name == "__getitem__" and _basic_index(args[1]))):
            self.queued = True
        return out

    def of(self, phase: str) -> list[list[tuple]]:
        """The syncs of each call of ``phase``, call by call."""
        calls, current = [], None
        for s in self.syncs:
            if s[0] == ("begin", phase):
                current = []
                calls.append(current)
            elif s[0] == phase and current is not None:
                current.append(s)
        return calls


@contextlib.contextmanager
def phases(stream: Stream, monkeypatch, names=("fast_step", "verify", "prefill")):
    """Each call of DeterministicRun.<name> is a phase of ``stream``."""
    for name in names:
        def call(*a, _fn=getattr(DeterministicRun, name), _name=name, **k):
            before, stream.phase = stream.phase, _name
            stream.syncs.append((("begin", _name), "", "", False, ""))
            try:
                return _fn(*a, **k)
            finally:
                stream.phase = before
        monkeypatch.setattr(DeterministicRun, name, call)
    with stream:
        yield stream


@pytest.fixture(scope="module")
def tiny():
    return SkipModel(tiny_model("llama"))


PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8], [40, 41, 42, 40, 41, 42, 40, 41], [100, 3, 9]]
SAMPLE = dict(do_sample=True, temperature=0.7, top_k=50, top_p=0.9)


def _decode(model, prompts, fast_path, sample, window=4, verify_batch=2, max_new=12, arrive_at=None):
    requests = Requests(len(prompts), max_new, frozenset(), arrive_at=arrive_at)
    first = [i for i in range(len(prompts)) if arrive_at is None or arrive_at[i] == 0]
    cache = model.new_cache(len(first), max(map(len, prompts)) + max_new + window)
    params = SamplingParams(**SAMPLE) if sample else SamplingParams()
    stats = decode_deterministic(model, cache, prompts, params, list(range(3, 3 + len(prompts))), requests, window,
                                 verify_batch, fast_path)
    return requests.out, stats


def _fast_paths(tiny):
    """name -> a FastPath: the regular one; the layer-skipped draft with eps (every step a
    draft: adaptive False), with prompt lookup; and with its policy on fixed costs (full steps,
    whose lookup drafts ride along: ``FastPath.check``)."""
    layer_set = LayerSet.parse("attn:1,2|mlp:2", tiny.num_layers)
    return {"regular": FastPath(),
            "draft": FastPath(layer_set, eps=0.06, lookup=True, adaptive=False),
            "full+check": FastPath(layer_set, eps=0.06, lookup=True)}


@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("fast", ["regular", "draft", "full+check"])
def test_every_fast_step_and_verify_pass_waits_for_the_device_once(tiny, monkeypatch, fast, sample):
    """One stall a fast step and a verify pass, and it is their one read; a fast step copies in
    at most its tokens and uniforms (and lengths when a waiting row is rolled back), a verify
    pass its uniforms, its inputs (one copy) and its rows' new lengths."""
    policy = deterministic.FastPathPolicy  # fixed costs: the full model wins every step
    monkeypatch.setattr(deterministic, "FastPathPolicy", lambda *a, **k: policy(*a, **k, measure=False))
    checks = []
    check = FastPath.check
    monkeypatch.setattr(FastPath, "check", lambda self, *a, **k: checks.append(1) or check(self, *a, **k))
    fast_path = _fast_paths(tiny)[fast]
    with phases(Stream(), monkeypatch) as stream:
        out, stats = _decode(tiny, PROMPTS, fast_path, sample, arrive_at=[0, 0, 3])
    monkeypatch.undo()
    assert stats["fast_steps"] > 3 and stats["verify_passes"] > 3 and all(len(t) == 12 for t in out)
    if fast == "full+check" and not sample:
        assert checks  # lookup drafts rode along in a full step
    steps, passes = stream.of("fast_step"), stream.of("verify")
    assert len(steps) >= stats["fast_steps"] and len(passes) == stats["verify_passes"]
    for kind, calls, copies in (("fast step", steps, 3), ("verify pass", passes, 3)):
        for syncs in calls:
            if not syncs:  # every row waited for its verify pass: no forward
                continue
            stalls = [s for s in syncs if s[3]]
            reads = [s for s in syncs if s[1] == "read"]
            assert len(stalls) == 1 and stalls == reads, (kind, syncs)
            assert len(syncs) - len(reads) <= copies - (not sample), (kind, syncs)
    for syncs in passes:
        assert sum(s[1] == "copy" and "_copy_in" in s[4] for s in syncs) == 1  # the pass's inputs: one copy


@pytest.mark.parametrize("fast", ["regular", "full+check"])
def test_with_cuda_graphs_too(tiny, monkeypatch, fast):
    """The same inside the graph runner (the captured launches replayed: RecordedGraph), whose
    verify passes take the inputs copied in as the graph's static inputs: the same tokens."""
    policy = deterministic.FastPathPolicy
    monkeypatch.setattr(deterministic, "FastPathPolicy", lambda *a, **k: policy(*a, **k, measure=False))
    plain, _ = _decode(tiny, PROMPTS, _fast_paths(tiny)[fast], False, arrive_at=[0, 0, 3])
    runner = GraphRunner(tiny, RecordedGraph)
    with tiny.cuda_graphs(runner), phases(Stream(), monkeypatch) as stream:
        out, stats = _decode(tiny, PROMPTS, _fast_paths(tiny)[fast], False, arrive_at=[0, 0, 3])
    monkeypatch.undo()
    assert out == plain and runner.replays_by_kind.get("verify", 0) > 0 and runner.replays_by_kind["forward"] > 0
    for syncs in stream.of("fast_step") + stream.of("verify"):
        assert [s[1] for s in syncs if s[3]] == ["read"] * bool(syncs), syncs


def test_a_draft_step_reads_its_tokens_and_confidence_at_once(tiny, monkeypatch):
    """The layer-skipped draft's low-confidence stops still happen (eps high enough to stop
    some), read in the same tolist as the tokens: the same output as the full model's."""
    layer_set = LayerSet.parse("attn:1,2|mlp:2", tiny.num_layers)
    confident = []
    propose = FastPath.propose

    def spy(*a, **k):
        out = propose(*a, **k)
        confident.extend(out[1])
        return out
    monkeypatch.setattr(FastPath, "propose", spy)
    with phases(Stream(), monkeypatch) as stream:
        out, stats = _decode(tiny, PROMPTS[:2], FastPath(layer_set, eps=0.06, adaptive=False), False)
    monkeypatch.undo()
    plain, _ = _decode(tiny, PROMPTS[:2], FastPath(), False)
    assert out == plain
    assert True in confident and False in confident  # some drafts fell below eps
    for syncs in stream.of("fast_step"):
        assert [s[1] for s in syncs if s[3]] == ["read"] * bool(syncs)


@pytest.mark.parametrize("sample", [False, True])
def test_device_lengths_follow_the_host_lengths(tiny, monkeypatch, sample):
    """A rollback that changes no length copies nothing to the device, which holds them: after
    every fast step and verify pass, with rows waiting, arriving and leaving, the device's
    lengths are the host's."""
    seen = []

    def checked(name):
        fn = getattr(DeterministicRun, name)

        def call(run, *a, **k):
            out = fn(run, *a, **k)
            assert run.cache.lengths.tolist() == run.cache.host_lengths, name
            seen.append(name)
            return out
        return call

    for name in ("fast_step", "verify"):
        monkeypatch.setattr(DeterministicRun, name, checked(name))
    prompts = PROMPTS + [[7, 7, 8]]
    out, stats = _decode(tiny, prompts, FastPath(), sample, max_new=10, arrive_at=[0, 0, 2, 5])
    assert {"fast_step", "verify"} <= set(seen)
    monkeypatch.undo()
    host_values_written_as_on_a_device(monkeypatch)  # undone with the rest
    cache = tiny.new_cache(2, 16)
    with Stream() as stream:
        tiny.forward(torch.tensor([[5, 6], [7, 8]], device=tiny.device), cache)
        stream.syncs.clear()
        cache.rollback([2, 2])
        assert stream.syncs == []  # unchanged: no copy
        cache.rollback([2, 1])
        assert [s[1:3] for s in stream.syncs] == [("copy", "copy_")]
    assert cache.lengths.tolist() == cache.host_lengths == [2, 1]


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(**SAMPLE), SamplingParams(True, 1.3)])
def test_tokens_drawn_with_uniforms_made_before_the_forward_are_select_tokens(params):
    """sampling.select_with_uniforms with sampling.token_uniforms (made before the forward, as
    the replay loop makes them) gives select_tokens' tokens: argmax when greedy, else the draw
    from the filtered distribution with the uniforms keyed on (seed, position), stream 0."""
    logits = torch.randn(64, 301, generator=torch.Generator().manual_seed(1)) * 3
    seeds, positions = [s % 5 for s in range(64)], list(range(100, 164))
    u = token_uniforms(params, seeds, positions, logits.device)
    want = (sample_from_weights(probs_from_logits(logits, params), keyed_uniforms(seeds, positions))
            if params.do_sample else logits.argmax(-1))
    assert (u is None) is (not params.do_sample)
    assert torch.equal(select_with_uniforms(logits, params, u), want)
    assert torch.equal(select_tokens(logits, params, seeds, positions), want)


@pytest.mark.parametrize("sample", [False, True])
def test_a_speculative_layer_skip_draft_stalls_once_a_forward(tiny, sample):
    """layer_skip_draft.draft_tokens: each draft forward waits for the device once (its tokens'
    confidence read); a sampled draft's uniforms are copied in before the forward, not after its
    launch (which stalled a second time)."""
    from swiftkern.layer_skip_draft import DraftPolicy, draft_tokens

    cache = tiny.new_cache(2, 40)
    logits = tiny.forward(torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]]), cache)
    pending = logits[:, -1].argmax(-1)
    layer_set = LayerSet.parse("attn:1|mlp:2", tiny.num_layers)
    with Stream() as stream:
        stream.phase = "draft"
        _, _, num_draft, forwards = draft_tokens(tiny, cache, pending, layer_set, DraftPolicy(k_max=4, eps=0.0),
                                                 SamplingParams(do_sample=sample, temperature=0.8), [1, 2], [4, 3])
    stalls = [s for s in stream.syncs if s[3]]
    assert forwards == 4 and num_draft == [4, 3]
    assert [s[1] for s in stalls] == ["read"] * forwards, stalls


@pytest.mark.parametrize("sample", [False, True])
def test_a_speculative_verify_step_stalls_once(tiny, sample):
    """verify_step.verify_and_accept: its host values copied in before the forward, everything
    queued before its one read (num_draft's range from the host, the pending token gathered on
    the device, the logprobs queued where a GPU would queue them)."""
    cache = tiny.new_cache(2, 40)
    logits = tiny.forward(torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]]), cache)
    pending = logits[:, -1].argmax(-1)
    with pytest.MonkeyPatch.context() as mp, Stream() as stream:
        mp.setattr(verify_step, "queue_logprobs", lambda device, positions: True)
        stream.phase = "verify"
        verify_step.verify_and_accept(tiny, cache, pending, [[3, 4, 5], [6]], None,
                                      SamplingParams(do_sample=sample, temperature=0.8), [1, 2], logprobs=True)
    assert [s[1] for s in stream.syncs if s[3]] == ["read"], stream.syncs


@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampled"])
def test_an_ar_decode_step_stalls_once(tiny, sample):
    """generate.decode_ar (mode ar, and deterministic without replay): between two decode
    forwards one stall, the step's tokens read; a sampled step's uniforms are copied in after
    that read and before the next forward (made after its launch they waited for it: two stalls
    a step). Steps where a row joins (its prefill) or leaves (the cache's lengths) may stall
    more. The tokens are those of select_tokens after each forward (the sampling test above)."""
    from swiftkern import Generator

    forward = tiny.forward
    with Stream() as stream:
        def marked(ids, cache, *a, **k):  # each decode forward begins a phase "step"
            if ids.shape[1] == 1:
                stream.syncs.append((("begin", "step"), "", "", False, ""))
                stream.phase = "step"
            return forward(ids, cache, *a, **k)
        tiny.forward = marked
        try:
            kw = dict(SAMPLE, seed=3) if sample else {}
            out = Generator(tiny, mode="ar").generate(PROMPTS, max_new_tokens=12, arrive_at=[0, 0, 3],
                                                      eos_token_id=[], **kw)
        finally:
            del tiny.forward
    assert all(len(t) == 12 for t in out.tokens)
    steps = stream.of("step")
    assert len(steps) >= 11
    plain = [syncs for syncs in steps if not any("_prefill" in s[4] or "set_lengths" in s[4] for s in syncs)]
    assert len(plain) >= 9
    for syncs in plain:
        assert [s[1] for s in syncs if s[3]] == ["read"], syncs
    if sample:
        assert sum("keyed_uniforms" in s[4] for syncs in plain for s in syncs) == len(plain) - 1  # not after the last


def test_top_p_off_the_cpu_reads_nothing(monkeypatch):
    """Top-p's way on a GPU (``top_p_removed_by_sort``) queues everything and reads nothing back,
    so ``CPU_ONLY`` may leave the CPU's value sort out of the counts above; counted, the CPU's
    way reads (its numpy copy and its tie check)."""
    x = torch.randn(3, 500, generator=torch.Generator().manual_seed(0)) * 4
    with Stream() as stream:
        top_p.top_p_removed_by_sort(x, 0.9)
    assert stream.syncs == []
    monkeypatch.setitem(globals(), "CPU_ONLY", frozenset())
    with Stream() as stream:
        top_p.top_p_removed(x, 0.9)
    assert {s[2] for s in stream.syncs} >= {"numpy", "__bool__"}


def test_generate_reports_its_reads_of_device_results(tiny):
    """stats device_reads / read_wait_s (swiftkern.device_reads): mode ar reads once a token at
    batch 1 (the first token's read included: it comes after prefill), the same count under
    Stream; the wait is inside decode_s; the clock counts nothing outside decoding."""
    from swiftkern import Generator, device_reads

    before = device_reads.CLOCK.snapshot()
    assert device_reads.read(torch.tensor([[1, 2], [3, 4]])) == [[1, 2], [3, 4]]
    assert device_reads.CLOCK.reads == before[1] + 1 and device_reads.CLOCK.seconds >= before[0]
    out = Generator(tiny, mode="ar").generate([PROMPTS[0]], max_new_tokens=9, eos_token_id=[])
    assert out.stats["device_reads"] == 9
    assert 0.0 <= out.stats["read_wait_s"] <= out.stats["decode_s"]
    with Stream() as stream:
        Generator(tiny, mode="ar").generate([PROMPTS[0]], max_new_tokens=9, eos_token_id=[])
    reads = [s for s in stream.syncs if s[1] == "read"]
    assert len(reads) == 9 and all("device_reads.py" in s[4] for s in reads)  # every read goes through it
    spec = Generator(tiny, mode="self-spec", drafter="lookup").generate([PROMPTS[1]], max_new_tokens=9, eos_token_id=[])
    assert spec.stats["device_reads"] == 1 + spec.stats["verify_steps"]  # the first token, then one a step
