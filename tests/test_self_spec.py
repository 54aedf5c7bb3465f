"""Self-speculative decoding: greedy == ar == HF greedy for any layer set; sampling keeps the
distribution (chi-square against the exact marginals of the tokens a verify pass emits)."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import assert_follows, expected_probs, hf_greedy, next_token_marginals, tiny_model
from swiftkern import Generator, LayerSet, SkipModel, SwiftkernError

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [200]]
MODELS = {}


def model(arch):
    if arch not in MODELS:
        hf = tiny_model(arch, num_hidden_layers=6)
        ar = Generator(hf).generate(PROMPTS, max_new_tokens=24, eos_token_id=[]).tokens
        assert ar == [hf_greedy(hf, p, 24, eos_token_id=[]) for p in PROMPTS]  # the reference is HF's
        MODELS[arch] = (hf, ar)
    return MODELS[arch]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(arch=st.sampled_from(["llama", "qwen2"]), bits=st.lists(st.booleans(), min_size=12, max_size=12),
       k_max=st.integers(1, 8), eps=st.sampled_from([0.0, 0.05, 0.3, 0.8]), batched=st.booleans())
def test_greedy_equals_ar_for_any_layer_set(arch, bits, k_max, eps, batched):
    if all(bits):
        bits[0] = False
    hf, ar = model(arch)
    gen = Generator(hf, mode="self-spec", drafter="layer-skip", layer_set=LayerSet.from_bits(bits), k_max=k_max, eps=eps)
    if batched:
        assert gen.generate(PROMPTS, max_new_tokens=24, eos_token_id=[]).tokens == ar
    else:
        assert gen.generate([PROMPTS[2]], max_new_tokens=24, eos_token_id=[]).tokens[0] == ar[2]


def test_matches_hf_and_accepts_everything_with_the_empty_set():
    hf, ar = model("llama")
    out = Generator(hf, mode="self-spec", drafter="layer-skip", layer_set="none", k_max=6, eps=0.0).generate(
        PROMPTS, max_new_tokens=24, eos_token_id=[])
    assert out.tokens == ar
    s = out.stats
    assert s["accepted"] == s["drafted"] and s["acceptance_rate"] == 1.0  # the draft is the model
    assert s["new_tokens"] == 4 * 24
    # closed form of the schedule: 23 tokens after prefill, each verify drafts min(6, left) and
    # commits all of them plus the bonus: 6+1, 6+1, 6+1, then 2 drafts (the bonus cut at 24)
    for r in out.request_stats:
        assert (r["verifies"], r["drafted"], r["accepted"], r["mean_accepted"]) == (4, 20, 20, 5.0)
    assert (s["verify_steps"], s["row_verifies"], s["drafted"]) == (4, 16, 80)
    assert s["draft_steps"] == 6 + 6 + 6 + 2  # one draft forward per token of the step's drafts
    assert s["mean_accepted"] == 5.0 and s["drafter_steps"] == {"layer-skip": 16, "lookup": 0, "none": 0}


def test_eos_inside_an_accepted_run_and_max_new_tokens_are_exact():
    hf, ar = model("llama")
    eos = ar[0][5]
    gen = Generator(hf, mode="self-spec", drafter="layer-skip", layer_set="none", k_max=8, eps=0.0)  # long accepted runs
    out = gen.generate(PROMPTS, max_new_tokens=24, eos_token_id=eos)
    for row, full in zip(out.tokens, ar):
        assert row == (full[: full.index(eos) + 1] if eos in full else full)
    for n in (1, 2, 7):
        assert [len(t) for t in gen.generate(PROMPTS, max_new_tokens=n, eos_token_id=[]).tokens] == [n] * 4


def test_stats_count_drafts_and_verifies():
    hf, _ = model("llama")
    s = Generator(hf, mode="self-spec", drafter="layer-skip", layer_set="attn:2|mlp:3", k_max=4, eps=0.0).generate(
        [PROMPTS[0]], max_new_tokens=20, eos_token_id=[]).stats
    assert 0 <= s["accepted"] <= s["drafted"] <= 4 * s["verify_steps"]
    assert s["mean_accepted"] == pytest.approx(s["accepted"] / s["verify_steps"])
    # every verify commits accepted + 1 tokens; the first token comes from prefill
    assert s["new_tokens"] <= 1 + s["accepted"] + s["verify_steps"]


def schedule_by_hand(sm, layer_set, prompt, ar_tokens, n, k_max):
    """Reference for greedy self-spec with eps = 0, one request at a time from scratch: each
    verify drafts min(k_max, tokens left) with the skipped model (the committed context's KV from
    a fresh full-model pass), accepts the drafts' longest prefix that matches the greedy output
    ``ar_tokens``, and commits that prefix plus one token. -> the drafts of each verify, accepted."""
    out, steps = ar_tokens[:1], []  # the first token comes from prefill
    while len(out) < n:
        budget = min(k_max, n - len(out))
        context = prompt + out
        cache = sm.new_cache(1, len(context) + budget)
        sm.forward(torch.tensor([context[:-1]]), cache)
        token, drafts = context[-1], []
        for _ in range(budget):
            token = int(sm.forward(torch.tensor([[token]]), cache, layer_set=layer_set)[0, -1].argmax())
            drafts.append(token)
        want = ar_tokens[len(out):len(out) + budget]
        accepted = next((j for j, (d, w) in enumerate(zip(drafts, want)) if d != w), budget)
        steps.append((budget, accepted))
        out = ar_tokens[:len(out) + accepted + 1]
    return steps


def test_stats_match_a_schedule_worked_out_by_hand():
    """Per request (rows finish at different steps, so rows move in the batch) and for the call:
    verifies, drafted, accepted, their means, draft forwards and drafter steps, against
    ``schedule_by_hand`` run on each prompt alone (ar's tokens checked against HF)."""
    hf, ar = model("llama")
    sm, ls, n, k_max = SkipModel.from_hf(hf), LayerSet.parse("attn:2|mlp:3", 6), 16, 4
    out = Generator(sm, mode="self-spec", drafter="layer-skip", layer_set=ls, k_max=k_max, eps=0.0).generate(
        PROMPTS, max_new_tokens=n, eos_token_id=[])
    assert out.tokens == [t[:n] for t in ar]
    steps = [schedule_by_hand(sm, ls, p, t, n, k_max) for p, t in zip(PROMPTS, ar)]
    assert len({len(sched) for sched in steps}) > 1  # rows finish at different steps
    for r, sched in zip(out.request_stats, steps):
        drafted, accepted = sum(b for b, _ in sched), sum(a for _, a in sched)
        assert (r["verifies"], r["drafted"], r["accepted"]) == (len(sched), drafted, accepted)
        assert r["mean_accepted"] == pytest.approx(accepted / len(sched))
        assert r["acceptance_rate"] == pytest.approx(accepted / drafted)
    s, flat = out.stats, [x for sched in steps for x in sched]
    assert (s["verify_steps"], s["row_verifies"]) == (max(map(len, steps)), len(flat))
    assert (s["drafted"], s["accepted"]) == (sum(b for b, _ in flat), sum(a for _, a in flat))
    assert s["mean_accepted"] == pytest.approx(s["accepted"] / len(flat))
    assert s["acceptance_rate"] == pytest.approx(s["accepted"] / s["drafted"])
    # one draft forward per token of the step's longest draft
    widths = [max(sched[i][0] for sched in steps if i < len(sched)) for i in range(s["verify_steps"])]
    assert s["draft_steps"] == sum(widths)
    assert s["drafter_steps"] == {"layer-skip": len(flat), "lookup": 0, "none": 0}


def test_no_draft_passes_confidence_one():
    """eps = 1: no draft is confident enough, so every verify checks the pending token alone (K = 0):
    ar's tokens, and the closed-form stats of plain decoding (15 verifies a row after prefill)."""
    hf, ar = model("llama")
    out = Generator(hf, mode="self-spec", drafter="layer-skip", layer_set="attn:2|mlp:3", k_max=4, eps=1.0).generate(
        PROMPTS, max_new_tokens=16, eos_token_id=[])
    assert out.tokens == [t[:16] for t in ar]
    s = out.stats
    assert (s["drafted"], s["accepted"], s["mean_accepted"], s["acceptance_rate"]) == (0, 0, 0.0, 0.0)
    assert (s["verify_steps"], s["row_verifies"], s["draft_steps"]) == (15, 60, 15)  # one draft forward tried a step
    assert s["drafter_steps"] == {"layer-skip": 0, "lookup": 0, "none": 60}
    for r in out.request_stats:
        assert (r["verifies"], r["drafted"], r["accepted"], r["mean_accepted"]) == (15, 0, 0, 0.0)


@pytest.mark.parametrize("layer_set,temperature,top_k,top_p", [
    ("attn:1-5|mlp:0-4", 1.0, 0, 1.0),
    ("attn:1-4|mlp:0-5", 0.7, 20, 0.9),
])
def test_sampling_keeps_the_distribution(layer_set, temperature, top_k, top_p):
    """Chi-square of the second and third generated tokens (verified together, after two drafts:
    accept after accept, a rejection's residual draw, the bonus token after all drafts) against
    their exact marginals, with a draft that is rejected often."""
    V, n = 48, 3000
    hf = tiny_model("llama", num_hidden_layers=6, vocab_size=V)
    with torch.no_grad():
        hf.lm_head.weight.mul_(0.6)  # ~20 tokens carry the mass; these drafts are accepted 55-70 % of the time
    sm = SkipModel.from_hf(hf)
    prompt = [5, 9, 11]
    expect = next_token_marginals(sm, prompt, lambda z: expected_probs(z, temperature, top_k, top_p), 3)
    gen = Generator(sm, mode="self-spec", drafter="layer-skip", layer_set=layer_set, k_max=3, eps=0.0)
    out = gen.generate([prompt] * n, max_new_tokens=3, do_sample=True, temperature=temperature, top_k=top_k,
                       top_p=top_p, seed=list(range(n)), eos_token_id=[])
    s = out.stats
    assert s["drafted"] >= 1.8 * n and 0.2 < s["accepted"] / s["drafted"] < 0.8, s  # two drafts a row, both outcomes
    for j in (1, 2):
        assert_follows([t[j] for t in out.tokens], expect[j])


def test_sampled_self_spec_is_seeded():
    hf, _ = model("llama")
    gen = Generator(hf, mode="self-spec", drafter="layer-skip", layer_set="attn:2", k_max=4, eps=0.0)
    kw = dict(max_new_tokens=16, do_sample=True, temperature=0.9, top_p=0.95, eos_token_id=[])
    a = gen.generate(PROMPTS, seed=[1, 2, 3, 4], **kw).tokens
    assert gen.generate(PROMPTS, seed=[1, 2, 3, 4], **kw).tokens == a
    assert gen.generate([PROMPTS[1]], seed=2, **kw).tokens[0] == a[1]


def test_a_position_drafted_again_draws_a_fresh_uniform(monkeypatch):
    """After a rejection the next step drafts again positions the last step drafted past it.
    Keyed on (seed, position) alone, the redraft reused the uniform whose draw had already
    steered where the last step stopped drafting (and the drafter policy's next choice): the
    draft was then no independent draw from its distribution, which rejection sampling needs."""
    import swiftkern.layer_skip_draft as layer_skip_draft

    keyed_uniforms = layer_skip_draft.keyed_uniforms
    draws = {}  # position -> the draft uniforms drawn there, in order

    def recorded(seeds, positions, *args, **kw):
        u = keyed_uniforms(seeds, positions, *args, **kw)
        for position, value in zip(positions, u.tolist()):
            draws.setdefault(position, []).append(value)
        return u

    monkeypatch.setattr(layer_skip_draft, "keyed_uniforms", recorded)
    hf, _ = model("llama")
    gen = Generator(hf, mode="self-spec", drafter="layer-skip", layer_set="attn:1-4|mlp:1-4", k_max=4, eps=0.0)
    gen.generate([PROMPTS[0]], max_new_tokens=24, do_sample=True, temperature=1.2, seed=5, eos_token_id=[])
    again = {position: us for position, us in draws.items() if len(us) > 1}
    assert len(again) >= 3, draws  # rejections left drafted positions behind
    assert all(len(set(us)) == len(us) for us in again.values()), again


@pytest.mark.parametrize("config", [dict(drafter="lookup"), dict(layer_set="attn:2|mlp:3"), dict(layer_set="auto")],
                         ids=["lookup", "auto-drafter", "auto-layer-set"])
def test_a_sampled_row_keeps_its_tokens_in_any_batch(config):
    """Rejection sampling draws from the drafts, so the drafts a row verifies must follow its
    own tokens: the drafter policy fitted one pass width to the batch, and the lookup / auto
    drafters' rows then took other tokens batched than alone (prompt 2 repeats a pattern, so
    lookup drafts there). The layer-set search scores the whole batch: sampled calls skip it."""
    hf, _ = model("llama")
    prompts = [[5, 6, 7], [9, 9, 9, 9], [3, 4, 3, 4, 3, 4, 3, 4], [100, 101], [7]]
    seeds = [11, 12, 13, 14, 15]
    kw = dict(max_new_tokens=20, do_sample=True, temperature=1.2, eos_token_id=[])
    gen = Generator(hf, mode="self-spec", **config)
    alone = [gen.generate([p], seed=s, **kw).tokens[0] for p, s in zip(prompts, seeds)]
    assert gen.generate(prompts, seed=seeds, **kw).tokens == alone
    assert [gen.generate([p], seed=s, **kw).tokens[0] for p, s in zip(prompts, seeds)] == alone


def test_sampling_refuses_what_steers_a_row_by_the_batch():
    hf, _ = model("llama")
    kw = dict(max_new_tokens=4, do_sample=True, eos_token_id=[])
    with pytest.raises(SwiftkernError, match="adaptive_eps moves one eps"):
        Generator(hf, mode="self-spec", layer_set="attn:2", adaptive_eps=True).generate(PROMPTS, **kw)
    with pytest.raises(SwiftkernError, match="searches over the whole batch"):
        Generator(hf, mode="self-spec", drafter="layer-skip", layer_set="auto").generate(PROMPTS, **kw)
    for mode, extra in (("ar", {}), ("deterministic", dict(drafter="self-spec", layer_set="attn:2"))):
        with pytest.raises(SwiftkernError, match="would ignore it"):
            Generator(hf, mode=mode, adaptive_eps=True, **extra)


def test_bad_configuration_is_refused():
    hf, _ = model("llama")
    with pytest.raises(SwiftkernError, match="needs a layer set"):
        Generator(hf, mode="self-spec", drafter="layer-skip")
    with pytest.raises(SwiftkernError, match="for 4 layers, the model has 6"):
        Generator(hf, mode="self-spec", drafter="layer-skip", layer_set=LayerSet(4))
    with pytest.raises(SwiftkernError, match="k_max"):
        Generator(hf, mode="self-spec", drafter="layer-skip", layer_set="none", k_max=0)
    with pytest.raises(SwiftkernError, match="outside"):
        Generator(hf, mode="self-spec", drafter="layer-skip", layer_set="attn:9")


def test_accepted_drafts_cut_by_a_stop_are_not_counted():
    """A stop token inside an accepted run ends the output there: the drafts the verifier
    accepted after it never reach the output, and counting them made mean_accepted 8 for an
    output of 3 tokens."""
    hf, _ = model("llama")
    gen = Generator(hf, mode="self-spec", drafter="layer-skip", layer_set="none", eps=0.0, k_max=8)
    free = gen.generate([PROMPTS[0]], max_new_tokens=12, eos_token_id=[]).tokens[0]
    out = gen.generate([PROMPTS[0]], max_new_tokens=12, eos_token_id=free[2])  # the empty set: all accepted
    assert out.tokens[0] == free[:free.index(free[2]) + 1]
    s = out.stats
    assert s["accepted"] <= s["new_tokens"] - 1 and s["accepted"] == out.request_stats[0]["accepted"]


def test_per_request_stats_add_up():
    hf, _ = model("llama")
    out = Generator(hf, mode="self-spec", drafter="layer-skip", layer_set="attn:2|mlp:3", k_max=4, eps=0.0).generate(
        PROMPTS, max_new_tokens=12, eos_token_id=[])
    for key in ("drafted", "accepted"):
        assert sum(r[key] for r in out.request_stats) == out.stats[key]
    assert sum(r["verifies"] for r in out.request_stats) == out.stats["row_verifies"]
    for r in out.request_stats:
        # 1 token from prefill, then accepted + 1 per verify (the last verify may be cut short)
        assert r["new_tokens"] == 12 and r["new_tokens"] <= 1 + r["accepted"] + r["verifies"]
        assert r["mean_accepted"] == r["accepted"] / r["verifies"]


def test_adaptive_threshold_moves_toward_the_target_and_stays_lossless():
    from swiftkern.layer_skip_draft import DraftPolicy

    policy = DraftPolicy(eps=0.5, adaptive=True, target_acceptance=0.9)
    for _ in range(20):
        policy.update(accepted=1, drafted=4)  # 25 % accepted: drafts are too bold, raise eps
    assert policy.eps > 0.55
    high = policy.eps
    for _ in range(60):
        policy.update(accepted=4, drafted=4)  # all accepted: lower eps, draft more
    assert policy.eps < high
    hf, ar = model("llama")
    gen = Generator(hf, mode="self-spec", drafter="layer-skip", layer_set="attn:2|mlp:3", k_max=5, eps=0.2, adaptive_eps=True)
    assert gen.generate(PROMPTS, max_new_tokens=24, eos_token_id=[]).tokens == ar


def test_a_verify_step_reads_the_device_once(monkeypatch):
    """verify_and_accept queues everything before one read back to the host (on a GPU each read
    waits for the forward: more than one serialises the step's host work behind it): one
    tolist, no aminmax of num_draft (int32; the forward's CPU-only token check is not a
    device read), no item. The torch path a GPU takes (on the CPU a greedy step's one C++ call,
    greedy_verify, hands back host lists: no tolist at all, checked last)."""
    from swiftkern import ops
    from swiftkern.sampling import SamplingParams
    from swiftkern.verify_step import verify_and_accept

    host_verify = ops.greedy_verify_here("cpu")
    monkeypatch.setattr(ops, "greedy_verify_here", lambda device_type: None)

    sm = SkipModel(model("llama")[0])
    cache = sm.new_cache(2, 32)
    prompts = torch.tensor([[5, 6, 7], [9, 10, 11]])
    logits = sm.forward(prompts, cache)
    pending = logits[:, -1].argmax(-1)
    drafts = [[3, 4, 5], [6]]
    reads = {"tolist": 0, "aminmax": 0, "item": 0}
    for name in ("tolist", "item"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda t, *a, _r=real, _n=name, **k: reads.__setitem__(
            _n, reads[_n] + 1) or _r(t, *a, **k))
    real_aminmax = torch.aminmax
    monkeypatch.setattr(torch, "aminmax", lambda t, *a, **k: reads.__setitem__(
        "aminmax", reads["aminmax"] + (t.dtype == torch.int32)) or real_aminmax(t, *a, **k))
    copies = []  # host lists made into tensors: on a GPU each is a blocking copy
    real_tensor = torch.tensor
    monkeypatch.setattr(torch, "tensor", lambda *a, **k: copies.append(1) or real_tensor(*a, **k))
    made = {}
    for sample in (False, True):
        reads.update(tolist=0, aminmax=0, item=0)
        copies.clear()
        cache.rollback([3, 3])
        params = SamplingParams(do_sample=sample, temperature=1.0)
        verify_and_accept(sm, cache, pending, drafts, None, params, [1, 2], logprobs=True)
        assert reads == {"tolist": 1, "aminmax": 0, "item": 0}, (sample, reads)
        made[sample] = len(copies)
    copies.clear()
    cache.rollback([3, 3])
    verify_and_accept(sm, cache, pending, [[3], [6]], None, SamplingParams(do_sample=True), [1, 2])
    assert len(copies) == made[True]  # the uniforms: one copy a stream, not one a drafted column
    if host_verify is not None:
        monkeypatch.setattr(ops, "greedy_verify_here", lambda device_type: host_verify)
        cache.rollback([3, 3])
        reads.update(tolist=0, aminmax=0, item=0)
        copies.clear()
        verify_and_accept(sm, cache, pending, drafts, None, SamplingParams(), [1, 2], logprobs=True)
        assert reads == {"tolist": 0, "aminmax": 0, "item": 0} and len(copies) == 0


@pytest.mark.parametrize("logprobs,queued", [(False, False), (True, False), (True, True)])
def test_a_greedy_step_without_drafts_is_a_decode_step(monkeypatch, logprobs, queued):
    """Off the CPU's one C++ call, a greedy verify step in which no row drafts takes decode_ar's
    step (forward, greedy_tokens, one read) and not the acceptance op: the tokens greedy_accept
    gives at K = 0, on logits with a tie (the lowest index) and a NaN (the maximum), the cache
    one position on, and the logprobs (queued or per row) of those tokens, bit for bit."""
    from swiftkern import ops, verify_step
    from swiftkern.batch_invariant import bi_token_logprob
    from swiftkern.sampling import SamplingParams

    monkeypatch.setattr(ops, "greedy_verify_here", lambda device_type: None)
    monkeypatch.setattr(verify_step, "queue_logprobs", lambda device, positions: queued)
    sm = SkipModel(model("llama")[0])
    cache = sm.new_cache(3, 32)
    pending = sm.forward(torch.tensor([[5, 6, 7], [9, 10, 11], [3, 4, 5]]), cache)[:, -1].argmax(-1)  # [3]
    V = sm.vocab_size
    crafted = torch.randn(3, 1, V, generator=torch.Generator().manual_seed(1))  # [B, 1, V]
    crafted[0, 0, [9, 5, 200]] = 50.0  # a tie: index 5
    crafted[1, 0, 4] = float("nan")  # NaN is the maximum
    real_forward = sm.forward
    monkeypatch.setattr(sm, "forward", lambda tokens, c: real_forward(tokens, c) * 0 + crafted[:, :tokens.shape[1]])
    accepts = []
    real_accept = ops.greedy_accept
    monkeypatch.setattr(ops, "greedy_accept", lambda *a, **k: accepts.append(1) or real_accept(*a, **k))

    got = verify_step.verify_and_accept(sm, cache, pending, [[], [], []], None, SamplingParams(), [1, 2, 3],
                                        logprobs=logprobs)
    want_out, want_acc = real_accept(torch.zeros(3, 0, dtype=torch.int64), crafted, torch.zeros(3, dtype=torch.int32))
    assert not accepts and cache.host_lengths == [4, 4, 4]
    assert want_out[:, 0].tolist()[:2] == [5, 4] and want_acc.tolist() == [0, 0, 0]
    assert got.rows == want_out.tolist() and got.num_accepted == [0, 0, 0]
    assert torch.equal(got.out, want_out) and torch.equal(got.pending, want_out[:, 0])
    want_lps = bi_token_logprob(crafted[:, 0], want_out[:, 0])  # [B]
    assert (got.queued is not None) == queued
    for i in range(3):
        torch.testing.assert_close(got.logprobs(i, 1), want_lps[i:i + 1], rtol=0, atol=0, equal_nan=True)  # row 1: NaN
    verify_step.verify_and_accept(sm, cache, pending, [[1], [], []], None, SamplingParams(), [1, 2, 3])
    assert accepts  # a step with a draft takes the acceptance op


@pytest.mark.parametrize("queued", [False, True])
def test_logprobs_queued_for_every_position_have_the_rows_bits(monkeypatch, queued):
    """The GPU's way (every position's logprob before the read) and the CPU's (each row's kept
    tokens after it) give the same bits: mode deterministic's speculative loop without replay
    returns the logprobs of the invariant model, checked against a prefill of its output."""
    from swiftkern import verify_step
    from swiftkern.layer_kernels import invariant_kernels_available
    from swiftkern.deterministic import invariant_token_logprobs

    if not invariant_kernels_available("cpu", torch.float32):
        pytest.skip("needs the C++ invariant kernels (replay auto elided on the CPU)")
    monkeypatch.setattr(verify_step, "queue_logprobs", lambda device, positions: queued)
    sm = SkipModel(model("llama")[0])
    gen = Generator(sm, mode="deterministic", drafter="self-spec", layer_set="attn:1|mlp:2", eps=0.0, k_max=4)
    prompts = [[7, 8, 9, 10, 7, 8, 9, 10, 7], [40, 41, 40, 41, 40]]
    out = gen.generate(prompts, max_new_tokens=12, eos_token_id=[])
    assert out.stats["verify_steps"] > 0
    for p, toks, lp in zip(prompts, out.tokens, out.logprobs):
        assert torch.equal(invariant_token_logprobs(sm, p + toks, len(p)), lp)


def test_assembling_layer_skip_drafts_reads_them_once(monkeypatch):
    """_assemble takes every row's layer-skipped drafts from one read (a GPU sync), not one a row,
    each row cut to its own count and lookup rows from the host."""
    from swiftkern.drafter_policy import Choice
    from swiftkern.sampling import SamplingParams
    from swiftkern.speculative import _assemble

    skip = (torch.tensor([[4, 5, 6], [7, 8, 9], [1, 2, 3]]), None, [3, 1, 2])
    choices = [Choice("layer-skip", 3, 0.0), Choice("layer-skip", 3, 0.0), Choice("lookup", 2, 0.0)]
    reads = []
    real = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t.shape) or real(t))
    drafts, probs = _assemble(choices, [[], [], [11, 12, 13]], skip, SamplingParams(), 50, "cpu")
    assert len(reads) == 1 and probs is None
    assert drafts == [[4, 5, 6], [7], [11, 12]]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.lists(st.lists(st.integers(0, 49151), max_size=7), min_size=1, max_size=6), strided=st.booleans(),
       inference=st.booleans())
def test_verify_tokens_are_the_pending_token_then_the_padded_drafts(monkeypatch, rows, strided, inference):
    """verify_step.verify_tokens: on the CPU through one NumPy array, elsewhere the drafts copied
    in and joined to pending by torch.cat; both give each row's pending token, then its drafts,
    zero-padded to the longest row (int64 [B, K+1]), written out here from the lists, for a
    pending tensor made in inference mode or not, contiguous or a strided view."""
    from swiftkern import device_reads, verify_step

    B, K = len(rows), max(map(len, rows))
    with torch.inference_mode(inference):
        table = torch.arange(3 * B, dtype=torch.int64).view(B, 3) * 7 + 1  # [B, 3]
        pending = table[:, 1] if strided else table[:, 1].contiguous()  # [B]
    expected = [[7 * (3 * b + 1) + 1] + row + [0] * (K - len(row)) for b, row in enumerate(rows)]
    host = verify_step.verify_tokens(pending, rows)
    monkeypatch.setattr(device_reads, "writes_through_numpy", lambda device: False)
    joined = verify_step.verify_tokens(pending, rows)
    for tokens in (host, joined):
        assert tokens.dtype == torch.int64 and tokens.shape == (B, K + 1) and tokens.tolist() == expected


def test_sampled_mixed_rows_give_each_draft_its_own_draft_probability():
    """Rejection sampling reads q(draft) from draft_probs: a layer-skipped row keeps its draft's
    distribution, a lookup row (a deterministic draft) gets q = 1 at each of its tokens (with
    q = 0 there, p / q is infinite and every lookup draft would be accepted whatever p), a row
    without drafts stays zero."""
    from swiftkern.drafter_policy import Choice
    from swiftkern.sampling import SamplingParams
    from swiftkern.speculative import _assemble

    V = 10
    skip_q = torch.softmax(torch.randn(3, 3, V, generator=torch.Generator().manual_seed(0)), -1)  # [B, Ks, V]
    skip = (torch.tensor([[4, 5, 6], [0, 0, 0], [0, 0, 0]]), skip_q, [3, 0, 0])
    choices = [Choice("layer-skip", 3, 0.0), Choice("lookup", 2, 0.0), Choice("none", 0, 0.0)]
    drafts, probs = _assemble(choices, [[], [7, 8, 9], []], skip, SamplingParams(do_sample=True), V, "cpu")
    assert drafts == [[4, 5, 6], [7, 8], []] and probs.shape == (3, 3, V)
    assert torch.equal(probs[0], skip_q[0])
    lookup_q = torch.zeros(3, V)
    lookup_q[0, 7] = lookup_q[1, 8] = 1.0
    assert torch.equal(probs[1], lookup_q)
    assert not probs[2].any()
