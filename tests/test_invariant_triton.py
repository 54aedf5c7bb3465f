"""Decoding through the Triton batch-invariant set (``layer_kernels.invariant_backend`` "triton":
CUDA, or CPU tensors under TRITON_INTERPRET=1 with SWIFTKERN_BACKEND=triton, as here without a
GPU): ``SkipModel.batch_invariant`` and mode deterministic with ``replay="never"``.

It is checked against what could be wrong: the deterministic verifier (the replay; another code
path over the same kernels, which must give the very bits), the same prompt alone (the needle,
greedy and sampled), a prefill of the same tokens, and the refusal where no invariant set runs.
"""

from __future__ import annotations

import random

import pytest
import torch

from conftest import tiny_model
from swiftkern import Generator, SkipModel
from swiftkern.errors import SwiftkernError
from swiftkern.layer_kernels import LayerKernels, invariant_backend
from triton_cases import DEVICE, backend

PROMPTS = [[5, 17, 99, 3, 42, 8, 61, 3], [7, 7, 21], [250, 4, 4, 4, 9, 13, 77, 80, 100, 31, 6], [44]]


def tiny_on_device(dtype=torch.float32) -> SkipModel:
    """A tiny Llama whose down projection's K (160) spans two of bi_matmul's K chunks of 128, as
    every projection of a real model does (SmolLM2: 576 and 1536), so the chunks' sum runs too.
    Two layers (a layer's output feeds another's input; the interpreter takes ~0.16 s a launch,
    12 launches a layer a step)."""
    return SkipModel(tiny_model("llama", num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
                                hidden_size=96, intermediate_size=160, seed=3).to(DEVICE, dtype))


@pytest.fixture(scope="module")
def tiny():
    return tiny_on_device()


@pytest.fixture
def triton_backend():
    with backend("triton"):
        yield


def test_the_set_is_triton_and_runs_the_fixed_order_matmul(triton_backend):
    assert invariant_backend(DEVICE, torch.float32) == "triton"
    kern = LayerKernels.for_device(DEVICE, invariant=True)
    assert set(kern.backends.values()) == {"triton"} and kern.stack is None
    from swiftkern.batch_invariant import bi_linear
    assert kern.linear is bi_linear


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_never_replaying_gives_the_replays_bits(tiny, triton_backend, dtype):
    """The runner's invariant decode and the verifier's replay are two programs over one kernel
    set; a token's logprob must be the same bits from either (and so the same tokens). bfloat16:
    the GPU bench's serving dtype (``bi_matmul``'s bfloat16 plan, tensor cores on a GPU)."""
    if dtype != torch.float32:
        tiny = tiny_on_device(dtype)
    kw = dict(mode="deterministic", window=4, verify_batch=2)
    never = Generator(tiny, **kw, replay="never").generate(PROMPTS[:3], max_new_tokens=7, eos_token_id=[])
    always = Generator(tiny, **kw, replay="always").generate(PROMPTS[:3], max_new_tokens=7, eos_token_id=[])
    assert never.stats["replay"].startswith("elided") and never.stats["verify_passes"] == 0
    assert always.stats["verify_passes"] > 0
    assert never.tokens == always.tokens
    assert all(torch.equal(a, b) for a, b in zip(never.logprobs, always.logprobs))


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_needle_alone_and_in_random_batches(tiny, triton_backend, sampled):
    """A prompt's tokens and logprobs alone equal those at a random place in batches of random
    others and sizes (the plain regular set needs no such luck to differ: see the CPU negative
    controls in test_deterministic.py)."""
    kw = dict(temperature=0.8, top_p=0.9, seed=11) if sampled else {}
    gen = Generator(tiny, mode="deterministic", replay="never")
    needle = PROMPTS[0]
    alone = gen.generate([needle], max_new_tokens=6, eos_token_id=[], **kw)
    rng = random.Random(5)
    for _ in range(2):
        others = [[rng.randrange(3, 300) for _ in range(rng.randrange(1, 14))] for _ in range(rng.randrange(1, 5))]
        at = rng.randrange(len(others) + 1)
        batch = others[:at] + [needle] + others[at:]
        seeds = None
        if sampled:  # the needle keeps its own seed; the others draw theirs
            seeds = [rng.randrange(1000) for _ in batch]
            seeds[at] = 11
            kw = dict(temperature=0.8, top_p=0.9, seed=seeds)
        out = gen.generate(batch, max_new_tokens=6, eos_token_id=[], **kw)
        assert out.tokens[at] == alone.tokens[0]
        assert torch.equal(out.logprobs[at], alone.logprobs[0])


def test_decode_equals_prefill(tiny, triton_backend):
    """Logits of tokens decoded one by one equal those of one prefill of the same tokens, with
    another row of another length beside them."""
    tokens = torch.tensor([PROMPTS[2]], device=DEVICE)
    other = torch.tensor([PROMPTS[0] + [9, 9, 9]], device=DEVICE)
    with tiny.batch_invariant():
        cache = tiny.new_cache(1, 32)
        whole = tiny.forward(tokens, cache)[0]  # [T, V]
        cache = tiny.new_cache(2, 32)
        steps = []
        for t in range(tokens.shape[1]):
            pair = torch.cat([tokens[:, t:t + 1], other[:, t:t + 1]])  # [2, 1]
            steps.append(tiny.forward(pair, cache)[0, 0])
    assert torch.equal(torch.stack(steps), whole)


def test_self_spec_fast_path_gives_the_same_bits(tiny, triton_backend):
    """drafter self-spec with replay never: the drafts only choose what the invariant model
    verifies (passes of several tokens), so tokens and logprobs are plain invariant decoding's."""
    prompts = [[7, 8, 9, 10, 7, 8, 9, 10, 7, 8], [40, 41, 42, 40, 41, 42, 40]]  # repeats: lookup drafts
    plain = Generator(tiny, mode="deterministic", replay="never").generate(prompts, max_new_tokens=8,
                                                                           eos_token_id=[])
    spec = Generator(tiny, mode="deterministic", replay="never", drafter="self-spec",
                     layer_set="attn:1|mlp:0").generate(prompts, max_new_tokens=8, eos_token_id=[])
    assert spec.stats["drafted"] > 0 and spec.stats["verify_passes"] == 0
    assert spec.tokens == plain.tokens
    assert all(torch.equal(a, b) for a, b in zip(spec.logprobs, plain.logprobs))


def test_never_is_refused_where_no_invariant_set_runs(tiny):
    with backend("reference"):
        with pytest.raises(SwiftkernError, match="replay='auto' or 'always'"):
            Generator(tiny, mode="deterministic", replay="never")
        with pytest.raises(SwiftkernError, match="batch-invariant kernels run"):
            with tiny.batch_invariant():
                pass


def test_graphs_replay_the_invariant_steps_with_the_same_bits(tiny, triton_backend):
    """replay never through the graph runner (on the CPU the emulated graph that reruns each step
    and refuses a host read inside it or a replay that launches other than its capture; real
    graphs on a GPU): the Triton invariant steps replay, with the tokens and logprobs of eager
    steps."""
    from swiftkern.cuda_graphs import GraphRunner
    from swiftkern.graph_capture import EmulatedGraph

    kw = dict(mode="deterministic", replay="never")
    prompts = PROMPTS[:2]
    eager = Generator(tiny, **kw).generate(prompts, max_new_tokens=6, eos_token_id=[])
    runner = GraphRunner(tiny, None if DEVICE == "cuda" else EmulatedGraph)  # real graphs on a GPU
    for _ in range(2):
        graphed = Generator(tiny, cuda_graphs=runner, **kw).generate(prompts, max_new_tokens=6, eos_token_id=[])
        assert graphed.tokens == eager.tokens
        assert all(torch.equal(a, b) for a, b in zip(graphed.logprobs, eager.logprobs))
    assert runner.stats()["replays"] >= 4, runner.stats()


def test_last_adds_plans_decode_with_the_bits_of_plans(tiny, triton_backend, monkeypatch):
    """Invariant decoding with PLANS' plans and with their last_adds twins (chunks added by each
    tile's last program): the same tokens and logprobs. On a GPU through real CUDA graphs, where
    the tile counters' ordering across replays is what is checked; on the CPU eagerly (the
    interpreter runs programs one by one: it checks the sums, not the ordering; the graph
    runner's emulation is test_graphs_replay_the_invariant_steps_with_the_same_bits's)."""
    from dataclasses import replace

    from swiftkern.cuda_graphs import GraphRunner
    from swiftkern.triton_kernels import bi_matmul as module

    kw = dict(mode="deterministic", replay="never")
    runs = []
    for last_adds in (False, True):
        plans = {dtype: replace(plan, last_adds=last_adds) for dtype, plan in module.PLANS.items()}
        monkeypatch.setattr(module, "plans_in_use", lambda plans=plans: plans)
        if DEVICE != "cuda":
            runs.append(Generator(tiny, **kw).generate(PROMPTS[2:3], max_new_tokens=6, eos_token_id=[]))
            continue
        runner = GraphRunner(tiny)
        for _ in range(2):  # eager and capture, then replays
            out = Generator(tiny, cuda_graphs=runner, **kw).generate(PROMPTS[2:3], max_new_tokens=6, eos_token_id=[])
        assert runner.stats()["replays"] >= 4, runner.stats()
        runs.append(out)
    assert runs[1].tokens == runs[0].tokens
    assert all(torch.equal(a, b) for a, b in zip(runs[1].logprobs, runs[0].logprobs))


@pytest.mark.parametrize("device, drafter, replay, backend_name, cpp, elided", [
    ("cuda", "auto", "auto", "triton", False, True),        # the Triton set at every step: cheaper than the replay
    ("cuda", "self-spec", "auto", "triton", False, False),  # the self-spec drafter's steps: cheaper replayed
    ("cuda", "auto", "auto", None, False, False),           # no invariant set there (e.g. SWIFTKERN_BACKEND=reference)
    ("cuda", "auto", "always", "triton", False, False),
    ("cuda", "self-spec", "never", "triton", False, True),
    ("cpu", "auto", "auto", "triton", False, False),        # the interpreter's Triton set on the CPU: replayed
    ("cpu", "self-spec", "auto", "cpp", True, True),        # the C++ set: the replay could not change a bit
])
def test_auto_replay_follows_the_measured_cheaper_way(monkeypatch, device, drafter, replay, backend_name, cpp,
                                                      elided):
    """``replay="auto"``'s decision table (Generator.replay_elided), with the kernel sets that run
    faked: on CUDA every step through the Triton invariant set, except under the self-spec drafter;
    on the CPU only where the C++ set runs. (A stand-in Generator: the rule reads nothing else.)"""
    from types import SimpleNamespace

    import swiftkern.generator_options as options

    monkeypatch.setattr(options, "invariant_backend", lambda dev, dtype: backend_name)
    monkeypatch.setattr(options, "invariant_kernels_available", lambda dev, dtype: cpp)
    gen = SimpleNamespace(mode="deterministic", replay=replay, drafter=drafter,
                          model=SimpleNamespace(device=torch.device(device), dtype=torch.float32))
    assert Generator.replay_elided(gen) is elided
    assert Generator.replay_elided(SimpleNamespace(**{**vars(gen), "mode": "ar"})) is False
