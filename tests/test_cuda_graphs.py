"""CUDA-graph replay (swiftkern/cuda_graphs.py).

On the CPU the runner's bookkeeping runs with two stand-ins for a graph
(tests/test_graph_emulation.py checks them on small bodies): ``EmulatedGraph`` (capture keeps
the body, replay calls it again on the static buffers, the cache's host lengths hidden so a body
that read them fails, and every replay must launch what the capture did: the same ops, host
values and addresses, as a real graph would replay them; planted changes outside a graph's key
fail) and ``RecordedGraph`` (the captured launches replayed into the same output tensors, the
body's Python run once): forwards through the runner give the logits of plain forwards, and
generation gives the
same tokens in every mode. On a GPU (skipped without one) real graphs replay: their logits equal
the emulated runner's bit for bit (the same kernels on the same static buffers; only the
launches differ), and SmolLM2's greedy tokens equal HF's.
"""

from __future__ import annotations

import contextlib
import os
import threading

import pytest
import torch

from conftest import tiny_model
from test_triton_model import hf_greedy_on
from swiftkern import Generator, SkipModel, ops
from swiftkern import generate as generate_module
from swiftkern.cuda_graphs import MIN_SPAN, GraphRunner, attention_span
from swiftkern.drafter_policy import DrafterPolicy
from swiftkern.graph_capture import EmulatedGraph, RecordedGraph
from swiftkern.errors import SwiftkernError
from swiftkern.layer_kernels import invariant_kernels_available
from swiftkern.layer_set import LayerSet

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# backend auto on the CPU is the C++ decoder stack only where the extension is built (CI builds it,
# and tests/test_greedy_accept.py fails there without it); a GPU lease may skip the build
needs_cpp = pytest.mark.skipif(ops.registry.extension is None,
                               reason="swiftkern._C is not built: backend auto is the reference on the CPU")
AUTO = pytest.param("auto", marks=needs_cpp)


@pytest.fixture(scope="module")
def tiny():
    return SkipModel(tiny_model("llama", seed=3))


@pytest.fixture(params=[EmulatedGraph, RecordedGraph], ids=["rerun", "recorded"])
def graph_type(request):
    """rerun: the body runs again at every replay, which must launch what the capture did;
    recorded: the capture's launches run again, the body's Python only at the capture."""
    return request.param


@pytest.fixture(params=[AUTO, "reference"])
def backend(request):
    """auto: the C++ decoder stack on the CPU; reference: the op-by-op loop with its masks."""
    ops.set_backend(request.param)
    yield request.param
    ops.set_backend("auto")


def test_attention_span():
    assert attention_span(1, 1000) == MIN_SPAN
    assert attention_span(MIN_SPAN, 1000) == MIN_SPAN
    assert attention_span(MIN_SPAN + 1, 1000) == 2 * MIN_SPAN
    assert attention_span(300, 1000) == 512
    assert attention_span(600, 700) == 700  # never past the cache
    assert [attention_span(n, 10, minimum=1) for n in (1, 2, 3, 5, 9)] == [1, 2, 4, 8, 10]  # the verifier's blocks


def _steps(model, runner, schedule, seed=0, prompt_len=9, layer_sets=None, cache=None):
    """Run forwards of the given token counts over a 3-row cache (rows of unequal lengths,
    a rollback after every verify-sized step) -> the list of logits. ``layer_sets``: the skip
    plan of each step (None: the full model for all). ``cache``: one to reuse (graphs are keyed
    on its storage; default a new one)."""
    gen = torch.Generator().manual_seed(seed)
    cache = model.new_cache(3, 200) if cache is None else cache
    cache.set_lengths([0, 0, 0])
    out = []
    with model.cuda_graphs(runner):
        prompt = torch.randint(0, model.vocab_size, (3, prompt_len), generator=gen).to(model.device)
        out.append(model.forward(prompt, cache))
        cache.rollback([prompt_len, prompt_len - 4, prompt_len - 2])
        for T, layer_set in zip(schedule, layer_sets or [None] * len(schedule)):
            tokens = torch.randint(0, model.vocab_size, (3, T), generator=gen).to(model.device)
            out.append(model.forward(tokens, cache, layer_set))
            if T > 1:
                cache.rollback([n - T + 1 for n in cache.host_lengths])
    return out


SCHEDULE = [1, 1, 4, 1, 4, 4, 1, 1, 2, 4, 1]


@pytest.fixture(params=[AUTO, "reference", "triton"])
def any_backend(request):
    """backend, plus the Triton kernels (under TRITON_INTERPRET=1 on the CPU): their launchers
    run inside the emulated graph, which refuses any read of a tensor's value on the host."""
    if request.param == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton runs on CPU tensors only under TRITON_INTERPRET=1 (conftest sets it without a GPU)")
    ops.set_backend(request.param)
    yield request.param
    ops.set_backend("auto")


def test_runner_logits_match_plain_forward(tiny, any_backend, graph_type):
    if any_backend == "triton":  # two layers: the interpreter takes ~0.16 s a launch
        tiny = SkipModel(tiny_model("llama", seed=3, num_hidden_layers=2))
    runner = GraphRunner(tiny, graph_type)
    plain = _steps(tiny, None, SCHEDULE)
    graphed = _steps(tiny, runner, SCHEDULE)
    for a, b in zip(plain, graphed):
        if any_backend != "reference":  # each row's keys alone, in blocks from 0: the span changes no bit
            assert torch.equal(a, b)
        else:  # SDPA over the span's masked keys rounds differently
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    stats = runner.stats()
    assert stats["captures"] >= 2 and stats["replays"] >= 6, stats  # T = 1 and T = 4 recur
    assert stats["eager"] >= 1  # the first sight of each key


def test_replays_follow_the_skip_plan_and_the_attention_span(tiny, backend, graph_type):
    """A graph replays the skip plan and the attention span it was captured with, so both
    belong to its key: steps of one width alternate between the full model and two layer sets,
    and the rows grow past MIN_SPAN keys (a span of 64, then 128). Each step's logits must equal
    a plain forward's, which no graph serves."""
    skips = [None, LayerSet.parse("attn:1|mlp:2", tiny.num_layers), LayerSet.parse("mlp:0,3", tiny.num_layers)]
    schedule = [1] * 12 + [3, 1, 3, 3, 1, 1]
    layer_sets = [skips[i % 3] for i in range(len(schedule))]
    runner = GraphRunner(tiny, graph_type)
    plain = _steps(tiny, None, schedule, prompt_len=MIN_SPAN - 6, layer_sets=layer_sets)
    graphed = _steps(tiny, runner, schedule, prompt_len=MIN_SPAN - 6, layer_sets=layer_sets)
    for a, b in zip(plain, graphed):
        if backend == "auto":
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert runner.stats()["replays"] >= 8, runner.stats()


def test_runner_catches_a_host_read(tiny, monkeypatch):
    """A body that reads host-side cache state would bake it into a real graph; here it fails."""
    original = SkipModel.forward_device

    def reads_host(self, tokens, cache, *args):
        max(cache.host_lengths)
        return original(self, tokens, cache, *args)

    monkeypatch.setattr(SkipModel, "forward_device", reads_host)
    with pytest.raises(TypeError):
        _steps(tiny, GraphRunner(tiny, EmulatedGraph), [1, 1, 1])


@pytest.mark.parametrize("read", [lambda t: t.max().item(), lambda t: t.tolist(), lambda t: int(t[0]),
                                  lambda t: t.nonzero(), lambda t: bool((t > 0).any()),
                                  # an output sized by the values (on CUDA its size is read back)
                                  lambda t: t[t > 0], lambda t: t.masked_select(t > 0), lambda t: torch.unique(t),
                                  lambda t: t.repeat_interleave(t)],
                         ids=["item", "tolist", "int", "nonzero", "bool", "mask-index", "masked_select", "unique",
                              "repeat_interleave"])
def test_emulated_replay_refuses_reading_tensor_values(tiny, monkeypatch, read):
    """A replayed body that reads a tensor's value on the host (a device sync, which a CUDA
    capture refuses) fails under the emulated graph; the first, eager sight of a key does not.
    The CPU kernels of ops whose output size follows the values count on the host with no op
    the emulation saw: they passed here and would fail to capture on a GPU."""
    original = SkipModel.forward_device

    def syncs(self, tokens, cache, *args):
        read(cache.lengths)
        return original(self, tokens, cache, *args)

    monkeypatch.setattr(SkipModel, "forward_device", syncs)
    runner = GraphRunner(tiny, EmulatedGraph)
    with pytest.raises(SwiftkernError, match="read a tensor's value on the host"):
        _steps(tiny, runner, [1, 1, 1])
    assert runner.eager >= 1 and runner.replays == 0


def test_ops_sized_by_their_arguments_pass_the_emulation():
    """The negative control: indexing by positions, repeats by an int or with output_size given
    have sizes known without reading values, and capture on a GPU."""
    from swiftkern.graph_capture import no_host_reads

    x, repeats, at = torch.arange(6.0), torch.tensor([1, 2, 0, 1, 1, 1]), torch.tensor([4, 0])
    with no_host_reads():
        assert x[at].shape == (2,)
        assert x.repeat_interleave(2).shape == (12,)
        assert x.repeat_interleave(repeats, output_size=6).shape == (6,)


def test_per_row_layer_sets_and_long_passes_run_eagerly(tiny):
    runner = GraphRunner(tiny, EmulatedGraph, max_tokens=8)
    cache = tiny.new_cache(2, 64)
    sets = [LayerSet.parse("attn:1|mlp:2", tiny.num_layers), None]
    with tiny.cuda_graphs(runner):
        tiny.forward(torch.zeros((2, 5), dtype=torch.int64), cache)  # 10 tokens > max_tokens
        for _ in range(3):
            tiny.forward(torch.zeros((2, 1), dtype=torch.int64), cache, layer_set=sets)
    assert runner.stats() == {"graphs": 0, "captures": 0, "replays": 0, "eager": 4, "replays_by_kind": {}}
    assert cache.host_lengths == [8, 8] and cache.lengths.tolist() == [8, 8]


def test_runner_keeps_at_most_max_graphs(tiny):
    runner = GraphRunner(tiny, EmulatedGraph, max_graphs=2)
    _steps(tiny, runner, [1, 1, 2, 2, 3, 3, 4, 4])
    assert runner.stats()["graphs"] == 2


def _generate(model, runner, **kw):
    gen = Generator(model, cuda_graphs=runner if runner is not None else False, **kw)
    prompts = [[5, 17, 99, 3, 42, 8], [7, 7, 21], list(range(30, 50))]
    return gen.generate(prompts, max_new_tokens=24, eos_token_id=[])


@pytest.mark.parametrize("kw", [
    dict(mode="ar"),
    dict(mode="self-spec", drafter="layer-skip", layer_set="attn:1|mlp:2", k_max=4, eps=0.0),
    dict(mode="self-spec", drafter="lookup"),
    dict(mode="deterministic", replay="always", window=8, verify_batch=2),
    dict(mode="deterministic", drafter="self-spec", layer_set="attn:1", replay="always", window=8,
         verify_batch=2),
], ids=["ar", "layer-skip", "lookup", "det", "det-self-spec"])
def test_generation_through_the_runner_gives_the_same_tokens(tiny, backend, kw, graph_type):
    runner = GraphRunner(tiny, graph_type)
    plain = _generate(tiny, None, **kw)
    graphed = _generate(tiny, runner, **kw)
    assert graphed.tokens == plain.tokens
    assert graphed.stats["cuda_graphs"]["replays"] > 0
    if kw["mode"] == "deterministic":  # the verifier's passes replayed too, to the same bits
        assert graphed.stats["cuda_graphs"]["replays_by_kind"]["verify"] > 0
        for a, b in zip(plain.logprobs, graphed.logprobs):
            assert torch.equal(a, b)


def test_verifier_replays_follow_the_key_length(graph_type):
    """The verifier's graphed passes are keyed on their key length (a power of two of key
    blocks): rows that grow past 64 and 128 keys take new graphs, and tokens and logprobs stay
    those of the replay without graphs."""
    model = SkipModel(tiny_model("llama", seed=3))
    kw = dict(max_new_tokens=90, eos_token_id=[])
    prompts = [list(range(3, 53)), [7, 7, 21]]
    gen = lambda graphs: Generator(model, mode="deterministic", replay="always", window=8, verify_batch=2,
                                   cuda_graphs=graphs)
    plain = gen(False).generate(prompts, **kw)
    runner = GraphRunner(model, graph_type)
    graphed = gen(runner).generate(prompts, **kw)
    assert graphed.tokens == plain.tokens
    assert all(torch.equal(a, b) for a, b in zip(plain.logprobs, graphed.logprobs))
    verify_keys = {key[3] for key in runner.entries if key[0] == "verify"}
    assert verify_keys == {64, 128, 256}, verify_keys
    assert runner.stats()["replays_by_kind"]["verify"] > 3


def test_verifier_prefills_replay_a_few_graphed_shapes(tiny, graph_type):
    """Inside graphs a prefill pass is a power of two wide and high (``prefill_shape``), so
    prompts of other lengths share its graph: the second and third calls (prompts of 20 and 27
    tokens, then 5 and 30, all in one 32-wide bucket) replay the prefill of the first instead
    of running eagerly, and every call keeps the tokens and logprobs it gets without graphs,
    where each pass is only as wide and high as its slots."""
    kw = dict(mode="deterministic", replay="always", window=8, verify_batch=4)
    runner = GraphRunner(tiny, graph_type)
    for prompts in ([list(range(3, 23)), list(range(40, 67))], [list(range(5, 25)), list(range(9, 36))],
                    [list(range(50, 55)), list(range(60, 90))]):
        plain = Generator(tiny, **kw).generate(prompts, max_new_tokens=10, eos_token_id=[])
        graphed = Generator(tiny, cuda_graphs=runner, **kw).generate(prompts, max_new_tokens=10, eos_token_id=[])
        assert graphed.tokens == plain.tokens
        assert all(torch.equal(a, b) for a, b in zip(plain.logprobs, graphed.logprobs))
    prefill_keys = {key[1:3] for key in runner.entries if key[0] == "prefill"}
    assert prefill_keys == {(2, 32)}, prefill_keys
    assert runner.stats()["replays_by_kind"]["prefill"] == 2


def test_prefill_shape():
    from swiftkern.verifier import prefill_shape

    assert prefill_shape(20, 3, 128, 8, graphed=False) == (32, 3)
    assert prefill_shape(40, 3, 128, 8, graphed=False) == (48, 3)
    assert prefill_shape(40, 3, 128, 8, graphed=True) == (64, 4)
    assert prefill_shape(100, 5, 128, 6, graphed=True) == (128, 6)
    assert prefill_shape(100, 1, 100, 6, graphed=True) == (100, 1)  # never past the chunk
    assert prefill_shape(1, 1, 128, 1, graphed=True) == (16, 1)


def test_cuda_graphs_refused_off_cuda(tiny):
    with pytest.raises(SwiftkernError, match="CUDA device"):
        Generator(tiny, cuda_graphs=True)
    with pytest.raises(SwiftkernError, match="cuda_graphs must be"):
        Generator(tiny, cuda_graphs="yes")
    with pytest.raises(SwiftkernError, match="another model"):
        Generator(SkipModel(tiny_model("llama")), cuda_graphs=GraphRunner(tiny, EmulatedGraph))


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_cuda_graphs_refused_where_the_rope_reads_positions_on_the_host(rope_type):
    """HF's dynamic / longrope rotary compares the forward's longest position on the host: the
    first forward of a shape ran, the capture of the second failed mid-generation."""
    scaling = {"rope_type": rope_type, "factor": 2.0}
    if rope_type == "longrope":
        half = 16 // 2  # tiny_model's head_dim 16
        scaling.update(short_factor=[1.0] * half, long_factor=[2.0] * half, original_max_position_embeddings=64)
    model = SkipModel(tiny_model("llama", rope_scaling=scaling))
    with pytest.raises(SwiftkernError, match=f"rope_type '{rope_type}'.*no CUDA graphs"):
        GraphRunner(model, EmulatedGraph)


# --------------------------------------------------------------------------- on a GPU

@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_real_graphs_equal_emulated_ones_bit_for_bit(dtype, graph_type):
    model = SkipModel(tiny_model("llama", seed=3).to("cuda", dtype))
    real = GraphRunner(model)
    emulated = GraphRunner(model, graph_type)
    a = _steps(model, real, SCHEDULE)
    b = _steps(model, emulated, SCHEDULE)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    assert real.stats()["replays"] >= 6


@needs_cuda
@pytest.mark.parametrize("mode", ["ar", "self-spec"])
def test_real_graphs_after_a_write_through_data_read_the_new_weights(mode):
    """A write through ``param.data = ...`` moves the storage a captured graph reads at its
    address; the runner drops its graphs then (``GraphRunner.follow_weights``; emulated on the
    CPU in tests/test_model_changes.py), so the next call decodes the new weights as HF does."""
    hf = tiny_model("llama", seed=1).to("cuda")
    options = {"layer_set": "mlp:1"} if mode == "self-spec" else {}
    gen = Generator(SkipModel.from_hf(hf), mode=mode, cuda_graphs=True, **options)
    prompt = [5, 6, 7, 8, 9, 10, 11]
    for _ in range(3):
        gen.generate([prompt], max_new_tokens=8, eos_token_id=[])
    assert gen.graph_runner.stats()["replays"] > 0
    hf.lm_head.weight.data = -hf.lm_head.weight.detach().clone()
    hf.model.norm.weight.data = hf.model.norm.weight.detach() * 2
    torch.cuda.empty_cache()  # the old storage back to the driver: a stale replay reads freed memory
    want = hf_greedy_on(hf, prompt, 8)
    assert gen.generate([prompt], max_new_tokens=8, eos_token_id=[]).tokens[0][: len(want)] == want
    assert gen.graph_runner.weight_moves == 1


@needs_cuda
@pytest.mark.slow
@pytest.mark.parametrize("kw", [dict(mode="ar"),
                                dict(mode="self-spec", drafter="layer-skip", layer_set="attn:9,13,17,21|mlp:11,15,19")],
                         ids=["ar", "self-spec"])
def test_smollm2_with_cuda_graphs_equals_hf_greedy(kw):
    import swiftkern

    model, tok = swiftkern.load_model("smollm2", device="cuda")
    prompt = tok("The history of the printing press begins")["input_ids"]
    expected = hf_greedy_on(model.hf_model, prompt, 48)
    gen = Generator(model, tok, cuda_graphs=True, **kw)
    for _ in range(2):  # the second call replays what the first captured
        out = gen.generate([prompt], max_new_tokens=48)
        assert out.tokens[0] == expected
    assert out.stats["cuda_graphs"]["replays"] > 0


def test_generator_reuses_its_cache_and_graphs_across_calls(tiny, graph_type):
    """With a runner, later calls of the same shape replay earlier calls' graphs (the prefill's
    key, seen once per call, is captured on the second call): no capture on the third, and the
    same tokens as a run without graphs."""
    runner = GraphRunner(tiny, graph_type)
    gen = Generator(tiny, cuda_graphs=runner)
    calls = [[[5, 17, 99, 3], [7, 7, 21, 4]], [[11, 12, 13, 14], [30, 31, 32, 33]], [[9, 8, 7, 6], [1, 2, 3, 4]]]
    outs, captures = [], []
    for prompts in calls:
        outs.append(gen.generate(prompts, max_new_tokens=12, eos_token_id=[]))
        captures.append(runner.captures)
    plain = Generator(tiny).generate(calls[2], max_new_tokens=12, eos_token_id=[])
    assert outs[2].tokens == plain.tokens and outs[0].tokens != outs[2].tokens
    assert captures[2] == captures[1], captures


def test_a_smaller_batch_reuses_the_runners_cache(tiny, graph_type):
    """A later call with fewer requests takes the first rows of the cache the runner handed out
    (the same storage, which graphs are keyed on) and gives the tokens of a run without graphs."""
    runner = GraphRunner(tiny, graph_type)
    gen = Generator(tiny, cuda_graphs=runner)
    gen.generate([[5, 17, 99, 3], [7, 7, 21, 4], [1, 2, 3]], max_new_tokens=12, eos_token_id=[])
    cache, address = runner.cache, runner.cache.k.data_ptr()
    prompts = [[11, 12, 13], [30, 31]]
    out = gen.generate(prompts, max_new_tokens=12, eos_token_id=[])
    assert runner.cache is cache and cache.k.data_ptr() == address and (cache.batch, cache.capacity) == (2, 3)
    assert out.tokens == Generator(tiny).generate(prompts, max_new_tokens=12, eos_token_id=[]).tokens


@pytest.mark.parametrize("mode", ["ar", "deterministic"])
def test_prompts_of_alternating_length_replay_without_capturing_again(tiny, graph_type, mode):
    """Batch-1 calls whose prompts alternate between short and long (as the determinism bench's
    batch-1 group runs them): the runner keeps the long call's cache for the short ones, so a
    round of calls after the cache and every key's second sight (rounds 1-3) captures nothing,
    and tokens equal a run without graphs."""
    kw = dict(mode=mode) if mode == "ar" else dict(mode=mode, window=8, verify_batch=1, replay="always")
    runner = GraphRunner(tiny, graph_type)
    gen = Generator(tiny, cuda_graphs=runner, **kw)
    prompts = [list(range(3, 23)), [3 + i % 290 for i in range(300)], list(range(40, 80))]
    captures = []
    for _ in range(4):
        outs = [gen.generate([p], max_new_tokens=12, eos_token_id=[]) for p in prompts]
        captures.append(runner.captures)
    assert captures[3] == captures[2], captures
    assert [o.tokens for o in outs] == [Generator(tiny, **kw).generate([p], max_new_tokens=12, eos_token_id=[]).tokens
                                        for p in prompts]


def test_drafter_costs_are_timed_on_replays_only(tiny, monkeypatch):
    """A first sight or a capture costs many replays; the drafter policy's cost model must not
    see them (it would shun that draft length for good)."""
    from swiftkern.drafter_policy import DrafterPolicy

    def run(runner):
        recorded = []
        monkeypatch.setattr(DrafterPolicy, "record_verify", lambda self, T, s: recorded.append(T))
        out = Generator(tiny, mode="self-spec", drafter="lookup", cuda_graphs=runner or False).generate(
            [[5, 6, 7, 5, 6, 7, 5, 6]], max_new_tokens=24, eos_token_id=[])
        return len(recorded), out.stats["verify_steps"]

    recorded, verifies = run(None)
    assert recorded == verifies
    runner = GraphRunner(tiny, EmulatedGraph)
    recorded, verifies = run(runner)
    unsteady = runner.stats()["eager"] + runner.stats()["captures"] - 1  # the prefill is not a verify
    assert recorded == verifies - unsteady and 0 < recorded < verifies


def test_hf_custom_generate_shares_a_runner_across_calls():
    """HF generate(custom_generate=...) makes a Generator per call; a runner passed in
    swift_kwargs keeps its cache and graphs across them, and the tokens equal HF greedy."""
    from swiftkern.integrations.transformers import generate as swift_generate

    hf = tiny_model("llama", seed=5)
    runner = GraphRunner(SkipModel(hf), EmulatedGraph)
    ids = torch.tensor([[5, 17, 99, 3, 42, 8]])
    expected = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    captures = []
    for _ in range(3):
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                          eos_token_id=None, pad_token_id=0, custom_generate=swift_generate, swift_mode="ar",
                          swift_kwargs={"cuda_graphs": runner})
        assert torch.equal(out, expected)
        captures.append(runner.captures)
    assert captures[2] == captures[1] and runner.replays > 0


def test_generation_stats_count_this_call_only(tiny):
    """stats["cuda_graphs"] counts one call; by the third call of a shape everything replays
    (the prefill's key, seen once per call, is captured in the second)."""
    runner = GraphRunner(tiny, EmulatedGraph)
    gen = Generator(tiny, cuda_graphs=runner)
    outs = [gen.generate([[5, 17, 99, 3]], max_new_tokens=10, eos_token_id=[]) for _ in range(3)]
    total = runner.stats()
    for key in ("captures", "replays", "eager"):
        assert sum(o.stats["cuda_graphs"][key] for o in outs) == total[key]
    third = outs[2].stats["cuda_graphs"]
    assert (third["captures"], third["eager"], third["replays"]) == (0, 0, 10)  # prefill + 9 decode steps


@pytest.mark.parametrize("make", [lambda t: torch.tensor([1, 2]), lambda t: torch.as_tensor([3])])
def test_emulated_replay_refuses_tensors_made_from_host_data(tiny, monkeypatch, make):
    """A replayed body that makes a tensor from host data (on a GPU a copy from pageable memory,
    refused by a capture, and baked into the graph) fails under the emulated graph."""
    original = SkipModel.forward_device

    def copies_in(self, tokens, cache, *args):
        make(cache.lengths)
        return original(self, tokens, cache, *args)

    monkeypatch.setattr(SkipModel, "forward_device", copies_in)
    with pytest.raises(SwiftkernError, match="made a tensor from host data"):
        _steps(tiny, GraphRunner(tiny, EmulatedGraph), [1, 1, 1])


@pytest.mark.parametrize("kw", [dict(mode="ar"), dict(mode="deterministic", replay="always", window=8, verify_batch=2)],
                         ids=["ar", "det"])
def test_arrivals_through_the_runner_give_the_same_tokens(tiny, kw, graph_type):
    """Requests joining mid-way take new cache rows (a new allocation past its capacity): the
    runner keys graphs on the storage and shape, so replays after an arrival read the cache in
    use, never a stale one."""
    prompts = [[5, 17, 99, 3, 42, 8], [7, 7, 21], list(range(30, 50)), [9, 9]]
    arrive = [0, 2, 2, 9]
    plain = Generator(tiny, **kw).generate(prompts, max_new_tokens=16, eos_token_id=[], arrive_at=arrive)
    runner = GraphRunner(tiny, graph_type)
    graphed = Generator(tiny, cuda_graphs=runner, **kw).generate(prompts, max_new_tokens=16, eos_token_id=[],
                                                                 arrive_at=arrive)
    assert graphed.tokens == plain.tokens and graphed.stats["cuda_graphs"]["replays"] > 0
    # the cache grown for the arrivals (inside deterministic decoding's inference mode) is the
    # runner's for the next call, made outside that mode: the determinism bench on an H200 failed
    # here ("Inplace update to inference tensor outside InferenceMode") when the growth made
    # inference tensors
    assert not runner.cache.k.is_inference() and not runner.cache.lengths.is_inference()
    again = Generator(tiny, cuda_graphs=runner).generate(prompts[:2], max_new_tokens=8, eos_token_id=[])
    assert again.tokens == Generator(tiny).generate(prompts[:2], max_new_tokens=8, eos_token_id=[]).tokens


def _decode_steps_then(model, runner, change, steps_before=3):
    """Decode steps of one key through ``runner`` (the first eager, the second captured, then
    replays), then ``change()`` (host state outside the key), then one more step."""
    cache = model.new_cache(2, 64)
    tokens = torch.tensor([[3], [5]])
    with model.cuda_graphs(runner):
        for _ in range(steps_before):
            model.forward(tokens, cache)
        assert runner.replays == steps_before - 1
        change()
        model.forward(tokens, cache)


def test_emulated_replay_refuses_launches_that_follow_a_changed_attribute(tiny, backend, monkeypatch):
    """A real graph replays its capture's launches: an eps changed on the model after the capture
    would not reach them, so a replay that launched with the new one is refused."""
    runner = GraphRunner(tiny, EmulatedGraph)
    with pytest.raises(SwiftkernError, match="launched differently from its capture"):
        _decode_steps_then(tiny, runner, lambda: monkeypatch.setattr(tiny, "eps", tiny.eps * 2))


def test_emulated_replay_refuses_a_weight_moved_to_a_new_address(tiny, backend, monkeypatch):
    """A real graph reads the weights at the addresses captured: a final norm weight replaced by a
    new tensor after the capture would not be read (nor an old one freed noticed)."""
    runner = GraphRunner(tiny, EmulatedGraph)
    with pytest.raises(SwiftkernError, match="launched differently from its capture"):
        _decode_steps_then(tiny, runner, lambda: monkeypatch.setattr(tiny, "final_norm", tiny.final_norm * 2))


def test_emulated_replay_refuses_triton_launches_that_changed(tiny):
    """Triton launches are logged with their grids and options: GPU launch plans entered after the
    capture (other block sizes and splits) change the launches of a replay, which is refused."""
    from swiftkern.triton_kernels import launch

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton runs on CPU tensors only under TRITON_INTERPRET=1 (conftest sets it without a GPU)")
    ops.set_backend("triton")
    try:
        with contextlib.ExitStack() as after_capture, pytest.raises(
                SwiftkernError, match=r"launched differently from its capture: launch \d+ \(triton:"):
            _decode_steps_then(tiny, GraphRunner(tiny, EmulatedGraph),
                               lambda: after_capture.enter_context(launch.gpu_launch_plans(132)))
    finally:
        ops.set_backend("auto")


def test_emulated_replay_accepts_unchanged_state(tiny):
    """The control for the three above: the same steps with nothing changed replay without
    complaint (the tensors made inside are matched by the launch that made them, not by
    address)."""
    runner = GraphRunner(tiny, EmulatedGraph)
    _decode_steps_then(tiny, runner, lambda: None)
    assert runner.replays == 3


@needs_cpp  # the fused set on the CPU is the C++ one
def test_verifier_kernel_sets_sharing_a_runner_get_their_own_graphs(tiny, graph_type):
    """Two deterministic Generators with other verifier kernel sets (portable: torch compositions,
    fused: one kernel per op) sharing one runner: each replays graphs of its own set's launches
    and gets the tokens and logprobs it gets without graphs."""
    kw = dict(mode="deterministic", replay="always", window=8, verify_batch=2)
    prompts = [[5, 17, 99, 3, 42, 8], [7, 7, 21]]
    runner = GraphRunner(tiny, graph_type)
    for kernels in ("portable", "fused", "portable"):
        plain = Generator(tiny, verifier_kernels=kernels, **kw).generate(prompts, max_new_tokens=24, eos_token_id=[])
        graphed = Generator(tiny, verifier_kernels=kernels, cuda_graphs=runner, **kw).generate(
            prompts, max_new_tokens=24, eos_token_id=[])
        assert graphed.tokens == plain.tokens
        assert all(torch.equal(a, b) for a, b in zip(plain.logprobs, graphed.logprobs))
    assert runner.stats()["replays_by_kind"]["verify"] > 3


@pytest.mark.parametrize("kernels", ["portable", pytest.param("fused", marks=needs_cpp)])
def test_verifier_graphs_outlive_the_generate_call_that_captured_them(tiny, graph_type, kernels):
    """Each generate call makes its own Verifier; the runner's graphs outlive it. On an H100 the
    fused set's RoPE read a positions table its Verifier kept: freed with it after the call that
    captured the pass, later replays read whatever the allocator put there, and the deterministic
    bench rolled back 94-97 % of the fast path's tokens from its third call on. The emulation
    kept the capture's closure (and the table) alive then; now it lets it go and checks the
    capture's memory (``launch_log.freed_since``; an address compare misses a freed address the
    allocator hands back): four calls, collected in between, keep the tokens and logprobs of the
    replay without graphs."""
    import gc

    kw = dict(mode="deterministic", replay="always", window=8, verify_batch=2, verifier_kernels=kernels)
    prompts = [[5, 17, 99, 3, 42, 8], [7, 7, 21]]
    plain = Generator(tiny, **kw).generate(prompts, max_new_tokens=12, eos_token_id=[])
    runner = GraphRunner(tiny, graph_type)
    for _ in range(4):
        graphed = Generator(tiny, cuda_graphs=runner, **kw).generate(prompts, max_new_tokens=12, eos_token_id=[])
        gc.collect()
        assert graphed.tokens == plain.tokens
        assert all(torch.equal(a, b) for a, b in zip(plain.logprobs, graphed.logprobs))
    assert runner.stats()["replays_by_kind"]["verify"] >= 4


@needs_cpp
def test_backends_sharing_a_runner_get_their_own_graphs(tiny, graph_type):
    """The ops backend picks the kernels a forward launches, so every graph's key holds it
    (``GraphRunner.run`` adds it): the C++ backend after the reference one on the same runner
    replays its own graphs and gets the bits of a plain forward, not the reference's."""
    runner = GraphRunner(tiny, graph_type)
    cache = tiny.new_cache(3, 200)  # one storage: the keys differ by the backend alone
    try:
        for backend in ("reference", "auto", "reference", "auto"):
            ops.set_backend(backend)
            plain = _steps(tiny, None, SCHEDULE)
            graphed = _steps(tiny, runner, SCHEDULE, cache=cache)
            for a, b in zip(plain, graphed):
                if backend == "auto":
                    assert torch.equal(a, b)
                else:  # SDPA over the span's masked keys rounds differently
                    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    finally:
        ops.set_backend("auto")
    assert runner.stats()["replays"] >= 12


def test_calls_from_threads_run_one_at_a_time(tiny, graph_type):
    """Threads sharing a graphed Generator, beside a deterministic one, on one model: a runner's
    cache and the model's graph and invariant contexts serve one call at a time (the model's
    lock), so each call gets its tokens alone and counts only its own replays. Unlocked, the
    runner handed its cache to two calls at once (an error from the launch log)."""
    graphed = Generator(tiny, cuda_graphs=GraphRunner(tiny, graph_type))
    det = Generator(tiny, mode="deterministic")
    prompts = [[5, 17, 99, 3, 42, 8], [7, 7, 21], list(range(30, 50))]
    alone = {(name, i): gen.generate([p], max_new_tokens=16, eos_token_id=[])
             for name, gen in (("graphed", graphed), ("det", det)) for i, p in enumerate(prompts)}
    results, errors = [], []

    def work(t):
        try:
            for k in range(3):
                name, i = ("graphed", "det")[t % 2], (t + k) % len(prompts)
                gen = graphed if name == "graphed" else det
                results.append(((name, i), gen.generate([prompts[i]], max_new_tokens=16, eos_token_id=[])))
        except Exception as e:  # noqa: BLE001 - reported below, with the thread's result
            errors.append(repr(e))

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(results) == 12
    for key, out in results:
        assert out.tokens == alone[key].tokens
        if key[0] == "det":
            assert torch.equal(out.logprobs[0], alone[key].logprobs[0])
        else:  # a call counts its own forwards: as many as alone
            assert _forwards(out) == _forwards(alone[key])


def _forwards(out) -> int:
    """A call's forwards: replayed or eager (a capture is followed by the replay of its forward)."""
    return out.stats["cuda_graphs"]["replays"] + out.stats["cuda_graphs"]["eager"]


@pytest.mark.parametrize("same", [True, False], ids=["same-generator", "other-generator"])
def test_a_streamer_may_generate_on_the_same_model(tiny, graph_type, same):
    """A streamer that calls generate on the model (the same graphed Generator, or another sharing
    its runner) gets its own cache: both calls give their tokens alone. The runner handed the
    inner call the cache the outer one was decoding in, and the outer call's tokens changed."""
    outer = Generator(tiny, cuda_graphs=GraphRunner(tiny, graph_type))
    inner = outer if same else Generator(tiny, mode="self-spec", drafter="lookup", cuda_graphs=outer.graph_runner)
    first, second = [5, 17, 99, 3, 42, 8], list(range(30, 50))
    alone = [g.generate([p], max_new_tokens=16, eos_token_id=[]).tokens[0] for g, p in ((outer, first), (inner, second))]
    nested = []

    def streamer(request, tokens):
        if len(nested) < 3:
            nested.append(inner.generate([second], max_new_tokens=16, eos_token_id=[]).tokens[0])

    assert outer.generate([first], max_new_tokens=16, eos_token_id=[], streamer=streamer).tokens[0] == alone[0]
    assert nested == [alone[1]] * 3


@pytest.mark.skipif(not ops.backends.cpu_kernel("skinny_linear", "cpu"),
                    reason="per-row float32 prefill needs the C++ skinny_linear kernel (swiftkern._C not built)")
def test_per_row_prefill_replays_across_calls(tiny, monkeypatch):
    """A prefill of one prompt at a time (a CPU where the C++ kernels take every projection, the
    invariant set, requests that join) runs through each row's view of the cache, whose length
    was a fresh copy per call: every call's prefill was a new graph key, run eagerly, and the
    runner's entries grew until they pushed out the decode steps' graphs. The view's length is
    the cache's own now: from the third call on, everything replays and no entry is added."""
    from swiftkern.ops import projections

    from swiftkern.prefill import per_row_pays

    monkeypatch.setattr(projections, "mkl_lags_here", lambda: True)
    assert per_row_pays(tiny)
    runner = GraphRunner(tiny, EmulatedGraph)
    gen = Generator(tiny, cuda_graphs=runner)
    outs = [gen.generate([[5, 17, 99, 3], [8, 8, 2, 41]], max_new_tokens=6, eos_token_id=[]) for _ in range(4)]
    graphs = [o.stats["cuda_graphs"]["graphs"] for o in outs]
    assert graphs[1] == graphs[2] == graphs[3], graphs
    assert [outs[2].stats["cuda_graphs"][k] for k in ("captures", "eager")] == [0, 0]
    assert all(o.tokens == outs[0].tokens for o in outs)


@pytest.mark.skipif(not invariant_kernels_available("cpu", torch.float32), reason="needs the C++ invariant set")
def test_invariant_graphs_never_read_a_rope_table_that_grew():
    """The invariant set reads RoPE from the model's table (``RopeTable``), which a graph of an
    invariant forward captures. It grew in blocks of 1024 positions as rows got longer, freeing
    the old table, and graphs captured before went on reading it (a replay here refuses that).
    The table now covers the whole cache at its first use, and graphs are keyed on it: steps
    replayed after a row ran past 1024 positions keep a plain forward's logits."""
    model = SkipModel(tiny_model("llama", seed=3, max_position_embeddings=2048))
    runner = GraphRunner(model, EmulatedGraph)
    cache = model.new_cache(3, 1600)
    with model.batch_invariant():
        plain = _steps(model, None, SCHEDULE)
        first = _steps(model, runner, SCHEDULE, cache=cache)
        cache.set_lengths([0, 0, 0])
        with model.cuda_graphs(runner):  # eager (too many tokens for a graph), past position 1024
            model.forward(torch.randint(0, model.vocab_size, (3, 1100), generator=torch.Generator().manual_seed(1)),
                          cache)
        again = _steps(model, runner, SCHEDULE, cache=cache)
    for a, b, c in zip(plain, first, again):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert runner.stats()["replays"] >= 12, runner.stats()


@pytest.mark.parametrize("batch,tokens,room,want", [
    (1, 1, 100, 1), (1, 2, 100, 2), (1, 3, 100, 4), (1, 5, 100, 8), (1, 8, 100, 8), (1, 9, 100, 16),
    (1, 5, 6, 6),  # the cache's room caps the padding
    (1, 5, 3, 5),  # never fewer than the pass's own positions (forward's room check refuses those)
    (40, 5, 100, 6),  # 40 x 8 > max_tokens 256: as many as a graph takes
    (64, 5, 100, 5),  # 64 x 5 is past a graph already: left alone (it runs eagerly)
])
def test_padded_tokens_are_the_next_power_of_two_within_the_room_and_a_graph(tiny, batch, tokens, room, want):
    assert GraphRunner(tiny, EmulatedGraph).padded_tokens(batch, tokens, room) == want


@pytest.mark.parametrize("kw", [
    dict(mode="self-spec", drafter="lookup"),
    dict(mode="self-spec", drafter="layer-skip", layer_set="attn:1|mlp:2", k_max=6, eps=0.0),
    dict(mode="self-spec", drafter="layer-skip", layer_set="attn:1|mlp:2", k_max=6, eps=0.0, do_sample=True,
         temperature=0.8, seed=5),
], ids=["lookup", "layer-skip", "layer-skip-sampled"])
def test_verify_passes_through_the_runner_take_a_few_widths(tiny, monkeypatch, kw):
    """Verify passes through the runner are padded to powers of two (a graph per width; the
    drafter policy's timed choices kept meeting new ones), and the tokens stay those of the
    unpadded, ungraphed loop (greedy and sampled). Without the padding the same runs meet widths
    that are not, so the check can fail. The lookup run's policy is on its fixed cost model
    (``measure=False``): timed, its widths follow the machine's clock, and one CI run met only
    powers of two without the padding."""
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8], [9, 10, 11, 12], list(range(30, 46))]  # powers of two: prefill keys too
    sample = {k: kw.pop(k) for k in ("do_sample", "temperature", "seed") if k in kw}
    monkeypatch.setattr(generate_module, "DrafterPolicy",
                        lambda *a, **k: DrafterPolicy(*a, **{**k, "measure": False}))

    def widths(pad: bool):
        runner = GraphRunner(tiny, EmulatedGraph)
        if not pad:
            monkeypatch.setattr(runner, "padded_tokens", lambda batch, tokens, room: tokens)
        gen = Generator(tiny, cuda_graphs=runner, **kw)
        out = [gen.generate([p], max_new_tokens=20, eos_token_id=[], **sample).tokens[0] for p in prompts]
        return {key[2] for key in runner.entries if key[0] == "forward"}, out

    padded, tokens = widths(True)
    unpadded, same = widths(False)
    plain = Generator(tiny, **kw)
    assert tokens == same == [plain.generate([p], max_new_tokens=20, eos_token_id=[], **sample).tokens[0]
                              for p in prompts]
    assert all(t & (t - 1) == 0 for t in padded), padded
    assert any(t & (t - 1) for t in unpadded), unpadded
