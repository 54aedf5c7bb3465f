"""The HF transformers backend (custom_generate) against plain HF generate."""

import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import swiftkern
from swiftkern.errors import SwiftkernError
from swiftkern.integrations import compat
from swiftkern.integrations.transformers import _refusals, generate as swift_generate
from swiftkern.transient import transient

from conftest import tiny_model

PROMPT = [[5, 6, 7, 8, 9, 10, 11, 5, 6, 7]]
MODES = [dict(swift_mode="ar"), dict(swift_mode="self-spec", layer_set="attn:1|mlp:2"),
         dict(swift_mode="self-spec", drafter="lookup", k_max=4)]


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


def _hf(model, ids, **kw):
    with torch.no_grad():
        return model.generate(ids, **kw)


class Recorder:
    """A streamer that records what it is given (HF's BaseStreamer protocol)."""

    def __init__(self):
        self.calls = []

    def put(self, value):
        self.calls.append(value.tolist())

    def end(self):
        self.calls.append("end")


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("options", MODES, ids=["ar", "self-spec", "lookup"])
def test_greedy_equals_hf_generate(arch, options):
    model = tiny_model(arch, seed=1)
    ids = torch.tensor(PROMPT)
    want = _hf(model, ids, max_new_tokens=20, do_sample=False)
    got = _hf(model, ids, max_new_tokens=20, do_sample=False, custom_generate=swift_generate, **options)
    assert got.dtype == want.dtype and torch.equal(got, want)


def _left_pad(rows, pad=0):
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


@pytest.mark.parametrize("options", MODES[:2], ids=["ar", "self-spec"])
def test_left_padded_batch_with_eos_equals_hf(llama, options):
    rows = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15], [20, 21, 22, 23, 24]]
    ids, mask = _left_pad(rows)
    free = _hf(llama, ids, attention_mask=mask, max_new_tokens=16, do_sample=False, eos_token_id=None)
    eos = int(free[1, ids.shape[1] + 3])  # a token row 1 emits early: rows stop at different steps
    kw = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, eos_token_id=eos, pad_token_id=0)
    want = _hf(llama, ids, **kw)
    got = _hf(llama, ids, custom_generate=swift_generate, **kw, **options)
    assert (want[:, ids.shape[1]:] == 0).any(), "the test needs a row that finished early"
    assert torch.equal(got, want)


_family = functools.cache(lambda arch: tiny_model(arch, seed=1))
ANY_MODE = MODES + [dict(swift_mode="self-spec", drafter="auto"),
                    dict(swift_mode="self-spec", drafter="layer-skip", layer_set="none", eps=0.0, k_max=5),
                    dict(swift_mode="deterministic", swift_kwargs=dict(window=3, verify_batch=2, replay="always"))]
ROW = st.one_of(st.lists(st.integers(3, 300), min_size=1, max_size=20),
                st.tuples(st.lists(st.integers(3, 300), min_size=1, max_size=4), st.integers(1, 8))
                .map(lambda p: (p[0] * p[1])[:20]))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(arch=st.sampled_from(["llama", "mistral", "qwen2", "qwen3"]), options=st.sampled_from(ANY_MODE),
       rows=st.lists(ROW, min_size=1, max_size=4), max_new=st.integers(1, 16),
       eos_at=st.one_of(st.none(), st.tuples(st.integers(0, 3), st.integers(0, 15))))
def test_any_left_padded_batch_equals_hf(arch, options, rows, max_new, eos_at):
    """Drawn: a family, a mode (every drafter, deterministic), left-padded rows of any lengths
    (repetitive ones, so lookup drafts), max_new_tokens, and an EOS that some row's output really
    holds (rows then stop at different steps): the same tensor as HF greedy."""
    model = _family(arch)
    ids, mask = _left_pad(rows)
    eos = None
    if eos_at is not None:
        free = _hf(model, ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False, eos_token_id=None,
                   pad_token_id=0)
        eos = int(free[eos_at[0] % len(rows), ids.shape[1] + eos_at[1] % max_new])
    kw = dict(attention_mask=mask, max_new_tokens=max_new, do_sample=False, eos_token_id=eos, pad_token_id=0)
    want = _hf(model, ids, **kw)
    got = _hf(model, ids, custom_generate=swift_generate, **kw, **options)
    assert got.shape == want.shape and torch.equal(got, want)


def test_return_dict_and_max_length(llama):
    ids = torch.tensor(PROMPT)
    want = _hf(llama, ids, max_length=ids.shape[1] + 7, do_sample=False, return_dict_in_generate=True)
    got = _hf(llama, ids, max_length=ids.shape[1] + 7, do_sample=False, return_dict_in_generate=True,
              custom_generate=swift_generate, swift_mode="ar")
    assert type(got) is compat.output_class()
    assert got.sequences.shape == (1, ids.shape[1] + 7)
    assert torch.equal(got.sequences, want.sequences)


def test_direct_call_equals_hf(llama):
    ids = torch.tensor(PROMPT)
    want = _hf(llama, ids, max_new_tokens=9, do_sample=False)
    got = swift_generate(llama, ids, max_new_tokens=9, do_sample=False, swift_mode="self-spec",
                         layer_set="attn:2")
    assert torch.equal(got, want)


@pytest.mark.parametrize("options", MODES, ids=["ar", "self-spec", "lookup"])
def test_streamer_receives_what_hf_streams(llama, options):
    """Prompt first, then every token in its own put (as HF's greedy loop), then end()."""
    ids = torch.tensor(PROMPT)
    want, got = Recorder(), Recorder()
    out_hf = _hf(llama, ids, max_new_tokens=12, do_sample=False, streamer=want)
    out = _hf(llama, ids, max_new_tokens=12, do_sample=False, streamer=got, custom_generate=swift_generate,
              **options)
    assert torch.equal(out, out_hf)
    assert got.calls == want.calls


def test_streamer_puts_tokens_before_the_end(llama):
    """Tokens reach the streamer while decoding runs, not all after it."""
    seen_at_put = []
    rec = Recorder()
    original_put = rec.put

    def put(value):
        original_put(value)
        seen_at_put.append(len(rec.calls))

    rec.put = put
    _hf(llama, torch.tensor(PROMPT), max_new_tokens=6, do_sample=False, streamer=rec,
        custom_generate=swift_generate, swift_mode="ar")
    assert seen_at_put == list(range(1, 8)) and rec.calls[-1] == "end"


def test_sampling_uses_the_config_warpers(llama):
    """do_sample with temperature/top-k/top-p: the same tokens as swiftkern.Generator given
    those values and the same seed (so none was dropped or changed on the way)."""
    ids = torch.tensor(PROMPT)
    kw = dict(max_new_tokens=16, do_sample=True, temperature=0.7, top_k=20, top_p=0.9)
    got = _hf(llama, ids, custom_generate=swift_generate, swift_mode="ar", seed=11, **kw)
    want = swiftkern.Generator(llama).generate(PROMPT, seed=[11], **kw).tokens[0]
    assert got[0, ids.shape[1]:].tolist() == want
    other = _hf(llama, ids, custom_generate=swift_generate, swift_mode="ar", seed=11, **{**kw, "top_k": 2})
    assert other[0, ids.shape[1]:].tolist() != want  # top_k reaches the sampler


def test_sampled_batch_rows_use_seed_plus_row(llama):
    """A left-padded sampled batch: row b holds the tokens swiftkern.Generator samples for that
    prompt alone with seed + b (the documented seeding), padding stripped."""
    rows = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15], [5, 6, 7]]  # rows 0 and 2 differ by their seed only
    ids, mask = _left_pad(rows)
    kw = dict(max_new_tokens=12, do_sample=True, temperature=1.3, top_k=30)  # HF would add its top_k=50 itself
    got = _hf(llama, ids, attention_mask=mask, eos_token_id=None, custom_generate=swift_generate,
              swift_mode="ar", seed=40, **kw)
    gen = swiftkern.Generator(llama)
    for b, prompt in enumerate(rows):
        want = gen.generate([prompt], seed=[40 + b], eos_token_id=[], **kw).tokens[0]
        assert got[b, ids.shape[1]:].tolist() == want, b
    assert not torch.equal(got[0], got[2])


def test_sampling_seed_follows_torch_manual_seed(llama):
    ids = torch.tensor(PROMPT)
    kw = dict(max_new_tokens=16, do_sample=True, custom_generate=swift_generate, swift_mode="ar")
    runs = []
    for s in (0, 0, 1):
        torch.manual_seed(s)
        runs.append(_hf(llama, ids, **kw))
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])


def test_top_k_1_sampling_is_greedy(llama):
    ids = torch.tensor(PROMPT)
    greedy = _hf(llama, ids, max_new_tokens=12, do_sample=False)
    got = _hf(llama, ids, max_new_tokens=12, do_sample=True, top_k=1, custom_generate=swift_generate,
              swift_mode="self-spec", layer_set="mlp:1")
    assert torch.equal(got, greedy)


@pytest.mark.parametrize("kwargs, named", [
    (dict(num_beams=2), "num_beams"),
    (dict(do_sample=True, num_return_sequences=2), "num_return_sequences"),
    (dict(repetition_penalty=1.3), "RepetitionPenaltyLogitsProcessor"),
    (dict(min_new_tokens=3), "MinNewTokensLengthLogitsProcessor"),
    (dict(output_scores=True, return_dict_in_generate=True), "output_scores"),
    (dict(prompt_lookup_num_tokens=3), "prompt_lookup_num_tokens"),
    (dict(max_time=5.0), "MaxTimeCriteria"),
])
def test_unsupported_options_are_refused(llama, kwargs, named):
    with pytest.raises(SwiftkernError, match=named):
        _hf(llama, torch.tensor(PROMPT), max_new_tokens=4, custom_generate=swift_generate, swift_mode="ar", **kwargs)


@pytest.mark.parametrize("kwargs", [dict(min_new_tokens=0), dict(min_length=len(PROMPT[0]))])
def test_a_minimum_length_the_prompt_already_reaches_is_taken(llama, kwargs):
    """HF adds a minimum-length processor that changes nothing (min_new_tokens=0; a min_length
    at most the prompt's width): it was refused like one that bans EOS."""
    ids = torch.tensor(PROMPT)
    assert ids.shape[-1] >= 3
    want = _hf(llama, ids, max_new_tokens=8, do_sample=False, **kwargs)
    got = _hf(llama, ids, max_new_tokens=8, do_sample=False, custom_generate=swift_generate, swift_mode="ar", **kwargs)
    assert torch.equal(got, want)
    sampled = dict(max_new_tokens=8, do_sample=True, temperature=0.7, top_k=20)  # beside the warpers
    got = _hf(llama, ids, custom_generate=swift_generate, swift_mode="ar", seed=3, **sampled, **kwargs)
    assert got[0, ids.shape[1]:].tolist() == swiftkern.Generator(llama).generate(PROMPT, seed=[3], **sampled).tokens[0]
    with pytest.raises(SwiftkernError, match="MinLengthLogitsProcessor"):  # one that bans EOS for a while
        _hf(llama, ids, max_new_tokens=8, min_length=ids.shape[-1] + 2, custom_generate=swift_generate,
            swift_mode="ar")


def test_assistant_model_is_refused(llama):
    with pytest.raises(SwiftkernError, match="assistant_model"):
        _hf(llama, torch.tensor(PROMPT), max_new_tokens=4, assistant_model=tiny_model("llama", seed=3),
            custom_generate=swift_generate, swift_mode="ar")


def test_right_padding_and_batched_streamer_are_refused(llama):
    ids = torch.tensor([[5, 6, 0], [5, 6, 7]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    with pytest.raises(SwiftkernError, match="left-padded"):
        _hf(llama, ids, attention_mask=mask, max_new_tokens=4, custom_generate=swift_generate, swift_mode="ar")
    # a one-row mask for two rows: transformers 5.24 broadcasts it over the batch and makes
    # one-row positions of it (once an IndexError here), 5.17 passes the mask on as it is; either
    # way one of the two shape checks refuses it
    with pytest.raises(SwiftkernError, match="position_ids have shape|attention_mask has shape"):
        _hf(llama, ids, attention_mask=torch.ones_like(ids[:1]), max_new_tokens=4,
            custom_generate=swift_generate, swift_mode="ar")
    with pytest.raises(SwiftkernError, match="streamer"):
        _hf(llama, ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, streamer=Recorder(),
            custom_generate=swift_generate, swift_mode="ar")


def test_position_ids_are_taken_when_they_count_the_real_tokens_and_refused_otherwise(llama):
    """Positions 0.. over each row's real tokens (what HF makes of the mask itself) give HF's
    tokens; shifted ones (a continuation's) would place the prompt elsewhere and are refused."""
    ids = torch.tensor([[0, 5, 6, 7], [8, 9, 10, 11]])
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    positions = (mask.cumsum(1) - 1).clamp_min(0)
    want = _hf(llama, ids, attention_mask=mask, position_ids=positions, max_new_tokens=5, do_sample=False)
    got = _hf(llama, ids, attention_mask=mask, position_ids=positions, max_new_tokens=5, do_sample=False,
              custom_generate=swift_generate, swift_mode="self-spec", drafter="lookup")
    assert torch.equal(got, want)
    with pytest.raises(SwiftkernError, match=r"position_ids row 0 is not 0..2 over its real tokens"):
        _hf(llama, ids, attention_mask=mask, position_ids=positions + 3, max_new_tokens=5, do_sample=False,
            custom_generate=swift_generate, swift_mode="ar")


def test_continuing_from_a_filled_cache_is_refused(llama):
    """The KV cache generate prepares (model kwarg past_key_values, named cache from transformers
    5.24) passes when empty, as in every test above; one an earlier call filled is refused."""
    out = _hf(llama, torch.tensor(PROMPT), max_new_tokens=3, return_dict_in_generate=True)
    filled = getattr(out, "past_key_values", None) or getattr(out, "cache")
    assert filled.get_seq_length() > 0
    name = "cache" if compat.transformers_version() >= (5, 24) else "past_key_values"
    with pytest.raises(SwiftkernError, match=f"a filled {name}"):
        _hf(llama, out.sequences, max_new_tokens=3, custom_generate=swift_generate, swift_mode="ar", **{name: filled})


def test_model_inputs_the_caller_passed_are_refused(llama):
    """A model input the caller passes and the backend does not use is refused; one that
    generate adds by itself (as 5.24 added its cache) is not the caller's request and passes.
    Without the calling generate to ask, every unknown one is refused."""
    ids = torch.tensor(PROMPT)
    with pytest.raises(SwiftkernError, match="model inputs labels"):
        _hf(llama, ids, max_new_tokens=3, labels=ids, custom_generate=swift_generate, swift_mode="ar")
    added = {"attention_mask": torch.ones_like(ids), "internal_state": object()}
    config = llama.generation_config
    assert not _refusals(config, [], [], added, {"kwargs": {}}, 4)
    assert _refusals(config, [], [], added, {"kwargs": {"internal_state": 1}}, 4) == ["model inputs internal_state"]
    assert _refusals(config, [], [], added, {}, 4) == ["model inputs internal_state"]


@pytest.mark.parametrize("kwargs, message", [
    (dict(swift_kwargs="window=4"), "swift_kwargs must be a dict"),
    (dict(swift_kwargs=dict(mode="ar")), "pass the mode as swift_mode"),
    (dict(swift_kwargs=dict(windw=4)), "Generator has no option 'windw'; it takes layer_set, k_max"),
    (dict(layer_set="mlp:1", swift_kwargs=dict(layer_set="mlp:2")), "layer_set given twice"),
    (dict(do_sample=True, seed="3"), "seed must be an integer"),
    (dict(do_sample=True, seed=2**64), "seed must be in"),
])
def test_bad_swiftkern_options_are_refused(llama, kwargs, message):
    with pytest.raises(SwiftkernError, match=message):
        _hf(llama, torch.tensor(PROMPT), max_new_tokens=4, custom_generate=swift_generate, **kwargs)


def test_unknown_mode_is_refused(llama):
    with pytest.raises(SwiftkernError, match="mode"):
        _hf(llama, torch.tensor(PROMPT), max_new_tokens=4, custom_generate=swift_generate, swift_mode="beam")


def test_compat_helpers(monkeypatch):
    from transformers import GenerationConfig

    cfg = GenerationConfig(eos_token_id=[2, 3], pad_token_id=0)
    assert compat.special_tokens(cfg) == ([2, 3], 0)
    assert compat.config_value(GenerationConfig(), "do_sample") is False
    assert compat.config_value(GenerationConfig(top_k=7), "top_k") == 7
    assert compat.generate_call_arguments() == {}  # not called from HF generate
    for older in ((4, 55), (4, 56)):  # 4.56.2: its generate refuses swift_mode as an unused model kwarg
        monkeypatch.setattr(compat, "transformers_version", lambda: older)
        with pytest.raises(SwiftkernError, match="4.57 on; 4.56 refuses them"):
            compat.check_version()
    monkeypatch.setattr(compat, "transformers_version", lambda: (4, 57))
    compat.check_version()


@pytest.mark.slow
def test_smollm2_greedy_equals_hf_generate(smollm2):
    model, tok = smollm2
    hf = model.hf_model
    text = tok.apply_chat_template([{"role": "user", "content": "Name three primary colors."}],
                                   add_generation_prompt=True, tokenize=False)
    enc = tok(text, return_tensors="pt")
    kw = dict(max_new_tokens=16, do_sample=False, pad_token_id=tok.pad_token_id or 0)
    want = _hf(hf, enc["input_ids"], attention_mask=enc["attention_mask"], **kw)
    for options in (dict(swift_mode="ar"), dict(swift_mode="self-spec", drafter="lookup", k_max=5)):
        got = _hf(hf, enc["input_ids"], attention_mask=enc["attention_mask"], custom_generate=swift_generate,
                  **kw, **options)
        assert torch.equal(got, want), options


def test_the_generator_is_kept_across_calls_with_the_same_options(llama):
    """What swiftkern learns while generating (the searched layer set, the drafter's timed costs)
    carries over between model.generate calls with the same options, and only with them."""
    ids = torch.tensor(PROMPT)
    kw = dict(max_new_tokens=12, do_sample=False, custom_generate=swift_generate, swift_mode="self-spec",
              drafter="lookup", k_max=4)
    want = _hf(llama, ids, max_new_tokens=12, do_sample=False)
    first = _hf(llama, ids, **kw)
    kept = dict(transient(llama)["generators"])
    gen = next(g for (mode, opts), g in kept.items() if mode == "self-spec" and "'lookup'" in opts and "4)" in opts)
    assert gen._drafter_costs and 1 in gen._drafter_costs and gen._drafter_costs[1].known()
    second = _hf(llama, ids, **kw)
    assert torch.equal(first, want) and torch.equal(second, want)
    assert transient(llama)["generators"] == kept  # the same Generator, no new one
    _hf(llama, ids, **dict(kw, k_max=3))
    assert len(transient(llama)["generators"]) == len(kept) + 1  # other options: another Generator
    sampled = [_hf(llama, ids, **dict(kw, do_sample=True, temperature=0.9, seed=3)) for _ in range(2)]
    assert torch.equal(sampled[0], sampled[1])  # sampling: a new Generator each call, same seed same tokens
    assert len(transient(llama)["generators"]) == len(kept) + 1


def test_a_changed_model_gets_a_new_generator_and_copies_carry_none(llama):
    """The kept Generator read the parameters of its first call: after a load with assign=True
    it returned the old weights' tokens, after resize_token_embeddings it refused the new ids,
    after .to(bfloat16) it failed; and once kept, the model could not be deep-copied or saved
    (a Generator holds a lock). A call also left a training model in eval mode."""
    import copy
    import io

    hf = tiny_model("llama", seed=11)
    ids = torch.tensor(PROMPT)
    kw = dict(max_new_tokens=8, do_sample=False)
    _hf(hf, ids, custom_generate=swift_generate, **kw)
    other = tiny_model("llama", seed=12)
    hf.load_state_dict(other.state_dict(), assign=True)
    assert torch.equal(_hf(hf, ids, custom_generate=swift_generate, **kw), _hf(other, ids, **kw))
    third, before = tiny_model("llama", seed=13), list(transient(hf)["generators"].values())
    with torch.no_grad():  # the same Parameter objects, new storage: what a Generator derived is stale
        for mine, theirs in zip(hf.parameters(), third.parameters()):
            mine.data = theirs.data.clone()
    assert torch.equal(_hf(hf, ids, custom_generate=swift_generate, **kw), _hf(third, ids, **kw))
    assert not any(g is old for g in transient(hf)["generators"].values() for old in before)
    copy.deepcopy(hf)
    torch.save(hf, io.BytesIO())
    assert transient(copy.deepcopy(hf)) == {}
    hf.train()
    _hf(hf, ids, custom_generate=swift_generate, **kw)
    assert hf.training


def test_a_module_replaced_between_calls_gets_a_new_generator():
    """A projection module replaced by another holding the same weight Parameter keeps
    ``weights_key``: the kept Generator refused, telling a caller who never wrapped anything to
    wrap the model again. Now the call makes a new one: a plain Linear decodes as HF, a Linear
    subclass with its own forward is refused as when a model is first wrapped."""

    class Doubled(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    ids = torch.tensor(PROMPT)
    kw = dict(max_new_tokens=8, do_sample=False)
    for kind in (torch.nn.Linear, Doubled):
        hf = tiny_model("llama", seed=11)
        _hf(hf, ids, custom_generate=swift_generate, **kw)
        old = hf.model.layers[0].mlp.down_proj
        new = kind(old.in_features, old.out_features, bias=False)
        new.weight = old.weight
        hf.model.layers[0].mlp.down_proj = new
        if kind is torch.nn.Linear:
            assert torch.equal(_hf(hf, ids, custom_generate=swift_generate, **kw), _hf(hf, ids, **kw))
        else:
            with pytest.raises(SwiftkernError, match=r"down_proj is a .*Doubled, not a plain torch\.nn\.Linear"):
                _hf(hf, ids, custom_generate=swift_generate, **kw)
