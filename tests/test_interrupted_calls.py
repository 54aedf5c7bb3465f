"""A generate call cut short leaves nothing behind: a streamer that raises (how a caller stops a
call early) or a KeyboardInterrupt inside a forward (Ctrl-C), then the same Generator's next
calls give what a Generator never interrupted gives (greedy: HF's tokens), the model's lock is
free, its invariant and graph contexts are off, and a graph runner's cache is not left leased."""

from __future__ import annotations

import threading

import pytest
import torch

from conftest import hf_greedy, tiny_model
from swiftkern import Generator, SkipModel
from swiftkern.cuda_graphs import GraphRunner
from swiftkern.graph_capture import EmulatedGraph
from swiftkern.layer_kernels import invariant_kernels_available

needs_invariant = pytest.mark.skipif(not invariant_kernels_available("cpu", torch.float32),
                                     reason="swiftkern._C is not built with the CPU kernels of the invariant set")
SKIP = "attn:1|mlp:2"
CONFIGS = {
    "ar": dict(mode="ar"),
    "self-spec-layer-skip": dict(mode="self-spec", drafter="layer-skip", layer_set=SKIP, k_max=4, eps=0.0),
    "self-spec-lookup": dict(mode="self-spec", drafter="lookup"),
    "self-spec-auto-search": dict(mode="self-spec", drafter="auto", layer_set="auto"),
    "deterministic-replay": dict(mode="deterministic", replay="always", window=4, verify_batch=2),
    "deterministic-replay-self-spec": dict(mode="deterministic", replay="always", drafter="self-spec",
                                           layer_set=SKIP, window=4, verify_batch=2),
    "deterministic-invariant": pytest.param(dict(mode="deterministic", replay="auto"), marks=needs_invariant),
}
PROMPTS = [[4, 77, 31], list(range(10, 40)), [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]]
GREEDY = dict(max_new_tokens=24)
SAMPLED = dict(max_new_tokens=24, do_sample=True, temperature=0.9, seed=[1, 2, 3])


class Stop(Exception):
    pass


def generator(config: dict, graphs: bool) -> Generator:
    model = SkipModel.from_hf(tiny_model("llama", num_hidden_layers=3))
    return Generator(model, None, cuda_graphs=GraphRunner(model, EmulatedGraph) if graphs else None, **config)


def stopping_streamer(n: int):
    """A streamer that raises at its n-th call."""
    calls = [0]

    def streamer(request, tokens):
        calls[0] += 1
        if calls[0] == n:
            raise Stop

    return streamer


def assert_left_as_it_was(gen: Generator) -> None:
    model = gen.model
    assert model.invariant is False and model.graphs is None
    if gen.graph_runner is not None:
        assert gen.graph_runner.cache_leased is False
    taken = []  # from another thread: a lock still held by this one would refuse it

    def take():
        taken.append(model.lock.acquire(blocking=False))
        if taken[0]:
            model.lock.release()

    thread = threading.Thread(target=take)
    thread.start()
    thread.join()
    assert taken == [True]


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-runner"])
@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_a_call_stopped_by_its_streamer_leaves_nothing_behind(config, graphs):
    calls = [GREEDY] if config.get("layer_set") == "auto" else [GREEDY, SAMPLED]
    untouched = generator(config, graphs)
    expected = [untouched.generate(PROMPTS, **call).tokens for call in calls]
    for n in (1, 4):
        gen = generator(config, graphs)
        with pytest.raises(Stop):
            gen.generate(PROMPTS, streamer=stopping_streamer(n), **calls[-1])
        assert_left_as_it_was(gen)
        assert [gen.generate(PROMPTS, **call).tokens for call in calls] == expected
    hf = [hf_greedy(untouched.model.hf_model, p, GREEDY["max_new_tokens"]) for p in PROMPTS]
    assert expected[0] == hf


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_a_keyboard_interrupt_in_a_forward_leaves_nothing_behind(config, monkeypatch):
    """Ctrl-C lands anywhere: here in the n-th forward of the call (the prefill, a draft, a
    verify pass, a search's scoring, a replay), with the graph runner's cache in use."""
    gen = generator(config, graphs=True)
    expected = generator(config, graphs=True).generate(PROMPTS, **GREEDY).tokens
    forward, count = SkipModel.forward, [0]

    def interrupted(self, *args, **kwargs):
        count[0] += 1
        if count[0] == n:
            raise KeyboardInterrupt
        return forward(self, *args, **kwargs)

    for n in (1, 3, 9):
        count[0] = 0
        monkeypatch.setattr(SkipModel, "forward", interrupted)
        with pytest.raises(KeyboardInterrupt):
            gen.generate(PROMPTS, **GREEDY)
        monkeypatch.setattr(SkipModel, "forward", forward)
        assert_left_as_it_was(gen)
        assert gen.generate(PROMPTS, **GREEDY).tokens == expected
