"""Generator.generate from several threads on one model: each call gets the tokens it gets alone.

The calls share the model's batch-invariant switch, for the same Generator the drafter policy's
costs, and through a graph runner (here the CPU stand-in for CUDA graphs) one KV cache and its
graphs; `SkipModel.lock` runs them one at a time (generate's docstring says so). Greedy and
seeded sampling, every mode, two threads on each Generator."""

from __future__ import annotations

import threading

from conftest import tiny_model
from swiftkern import Generator, SkipModel
from swiftkern.cuda_graphs import GraphRunner
from swiftkern.graph_capture import EmulatedGraph

CONFIGS = [dict(mode="ar"), dict(mode="self-spec", drafter="auto", layer_set="attn:1"),
           dict(mode="self-spec", drafter="lookup"),
           dict(mode="deterministic", replay="always", window=4, verify_batch=2),
           dict(mode="deterministic")]
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 5, 6, 7] * 2, [3, 4, 9, 9, 12, 40]]
CALLS = [dict(max_new_tokens=40), dict(max_new_tokens=40, temperature=0.8, seed=3)]


def test_calls_from_several_threads_equal_the_calls_alone():
    model = SkipModel.from_hf(tiny_model(num_hidden_layers=2))
    runner = GraphRunner(model, EmulatedGraph)  # one cache for every call through it
    gens = [Generator(model, None, **cfg) for cfg in CONFIGS]
    gens += [Generator(model, None, cuda_graphs=runner, **cfg) for cfg in CONFIGS[:2]]
    alone = [[gen.generate(PROMPTS, **call).tokens for call in CALLS] for gen in gens]
    problems, start = [], threading.Barrier(2 * len(gens))

    configs = CONFIGS + [{**cfg, "graphs": "shared runner"} for cfg in CONFIGS[:2]]

    def run(i: int) -> None:
        try:
            start.wait()
            for _ in range(3):
                for c, call in enumerate(CALLS):
                    got = gens[i].generate(PROMPTS, **call).tokens
                    if got != alone[i][c]:
                        problems.append(f"{configs[i]} {call}: {got} != {alone[i][c]}")
        except Exception as e:  # noqa: BLE001 - reported below with its config
            problems.append(f"{configs[i]}: {e!r}")

    threads = [threading.Thread(target=run, args=(i % len(gens),)) for i in range(2 * len(gens))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a call never returned"
    assert not problems, problems[:3]
