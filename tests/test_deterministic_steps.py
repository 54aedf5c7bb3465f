"""The deterministic loop's steps (swiftkern/deterministic_steps.py): its pure helpers against a
step-by-step simulation of the loop's rule for when a verify pass runs, and one verify pass's
commits against HF greedy."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import hf_greedy, tiny_model
from swiftkern import SkipModel
from swiftkern.deterministic_steps import DeterministicRun, Row, _steps_to_verify, _through_stop
from swiftkern.fast_path import FastPath
from swiftkern.requests import Requests
from swiftkern.sampling import SamplingParams
from swiftkern.verifier import Verifier


def _simulated_wait(rows: list[Row], me: Row, window: int, verify_batch: int) -> int:
    """Fast steps until ``decode_deterministic`` runs a verify pass with ``me`` stopped now: each
    step every verified row that is neither stopped nor at its window adds one unverified token;
    a pass runs once the due rows (stopped, or at the window) number verify_batch, or every
    verified row (``me`` included)."""
    verified = [r for r in rows if r.verified]
    counts = {id(r): len(r.unverified) for r in verified}
    steps = 0
    while True:
        due = sum(r is me or r.stopped or counts[id(r)] >= window for r in verified)
        if due >= min(verify_batch, len(verified)):
            return steps
        for r in verified:
            if not (r is me or r.stopped or counts[id(r)] >= window):
                counts[id(r)] += 1
        steps += 1


@settings(max_examples=300, deadline=None)
@given(window=st.integers(1, 9), verify_batch=st.integers(1, 6),
       others=st.lists(st.tuples(st.integers(0, 10), st.booleans(), st.booleans()), max_size=7),
       mine=st.integers(0, 9))
def test_steps_to_verify_matches_the_loops_rule(window, verify_batch, others, mine):
    rows = [Row(pending=0, verified=v, unverified=[1] * n, stopped=s) for n, s, v in others]
    me = Row(pending=0, unverified=[1] * min(mine, window))
    rows.insert(len(rows) // 2, me)
    assert _steps_to_verify(rows, me, window, verify_batch) == _simulated_wait(rows, me, window, verify_batch)


def test_through_stop_keeps_the_first_stop_and_drops_what_follows():
    from swiftkern.requests import Requests

    stops = Requests(1, 20, frozenset({2, 9}))
    assert _through_stop([5, 6, 2, 7, 9], stops, 0, []) == [5, 6, 2]
    assert _through_stop([9, 1], stops, 0, []) == [9]
    assert _through_stop([5, 6], stops, 0, []) == [5, 6]
    assert _through_stop([], stops, 0, []) == []
    # a stop string: the request's text (its output, the pending tokens, the match so far)
    text = Requests(1, 20, frozenset(), stop_check=lambda r, tokens: tokens[-3:] == [4, 5, 6])
    text.out[0].extend([1, 4])
    assert _through_stop([6, 7, 8], text, 0, [5]) == [6]  # 4 (output), 5 (pending), 6: the stop
    assert _through_stop([5, 6, 7], text, 0, []) == [5, 6]
    assert _through_stop([5, 7], text, 0, []) == [5, 7]


def test_a_verify_pass_commits_by_the_replay_rule():
    """One verify pass over three rows whose unverified tokens are set by hand against HF greedy
    (the reference): a full window matched with tokens past it (a stop among them holds), a short
    window of a stopped row matched (the verifier's next token is committed too: a free token),
    and a mismatch (the verifier's token replaces the rest). Checks the committed tokens, what
    stays unverified, the stop flags, the stats and the cache lengths the fast path resumes at."""
    hf = tiny_model("llama")
    model = SkipModel.from_hf(hf)
    prompts = [[5, 6, 7, 8], [10, 11, 12], [1, 2, 3, 4, 5, 6]]
    greedy = [hf_greedy(hf, p, 8, eos_token_id=[]) for p in prompts]
    window = 4
    requests = Requests(3, max_new_tokens=20, stop_ids=frozenset())
    cache = model.new_cache(3, 40)
    run = DeterministicRun(model, cache, prompts, SamplingParams(), [0, 0, 0], requests,
                           Verifier(model, window, 3), FastPath(), None, [True] * 3)
    with torch.inference_mode():
        rows = run.prefill([0, 1, 2], [0, 1, 2], batched=True)
        assert [row.pending for row in rows] == [g[0] for g in greedy]
        wrong = (greedy[2][2] + 1) % model.vocab_size
        rows[0].unverified, rows[0].stopped = greedy[0][1:7], True  # 6 tokens: a window and 2 past it
        rows[1].unverified, rows[1].stopped = greedy[1][1:3], True  # 2 tokens, then the row stopped
        rows[2].unverified = [greedy[2][1], wrong, greedy[2][3]]  # wrong at its second token
        run.verify(rows, [0, 1, 2])
    assert requests.out == [greedy[0][:1 + window], greedy[1][:4], greedy[2][:3]]
    assert [row.unverified for row in rows] == [greedy[0][5:7], [], []]
    assert [row.pending for row in rows] == [greedy[0][4], greedy[1][3], greedy[2][2]]
    assert [row.stopped for row in rows] == [True, False, False]
    assert (run.stats["rolled_back"], run.stats["corrected"]) == (2, 1)
    assert [r["rolled_back"] for r in run.per_row] == [0, 0, 2]
    # each row resumes after its pending token's position, its unverified tokens' KV kept
    assert cache.host_lengths == [len(p) + len(o) - 1 + len(row.unverified)
                                  for p, o, row in zip(prompts, requests.out, rows)]
    assert cache.lengths.tolist() == cache.host_lengths
