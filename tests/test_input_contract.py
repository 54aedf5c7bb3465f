"""The public API's input contract, drawn: any input either works or is refused with a
SwiftkernError, never another exception from inside swiftkern (a TypeError, AttributeError, ...).

Each draw takes a valid configuration of every argument of ``Generator`` and ``generate`` (or
of HF ``generate`` with ``custom_generate``) and spoils at most one of them with a value of the
wrong kind or range; a valid draw must run and return one output per prompt.
"""

import traceback

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import tiny_model
from swiftkern import Generator, SwiftkernError
from swiftkern.integrations.transformers import generate as swift_generate
from swiftkern.layer_kernels import invariant_kernels_available

V = 301  # tiny_model's vocabulary
NAN, INF = float("nan"), float("inf")
SETTINGS = settings(max_examples=120, deadline=None, database=None, suppress_health_check=list(HealthCheck))

GOOD = dict(
    k_max=[1, 2, 5, 25], eps=[0.0, 0.5, 1.0], draft_vocab=[None, 1, 50, V, 8192], window=[1, 2, 32],
    verify_batch=[1, 2, 4], skip_ratio=["auto", 0.2, 0.6], replay=["auto", "always", "never"],
    verifier_kernels=["auto", "portable", "fused"], adaptive_eps=[False, True], cuda_graphs=[False],
    max_new_tokens=[1, 2, 6], temperature=[0.5, 1.0, 2.0], top_k=[0, 1, 5, V + 10], top_p=[1.0, 0.9, 1e-9],
    seed=[0, 3, -1, 2**64 - 1], eos_token_id=[None, 2, [2, 3], []], stop_token_ids=[None, 5, [5], []],
    chat=[False], search_options=[None],
)
BAD = dict(
    k_max=[0, -1, 1.5, True, "3", None], eps=[-0.1, 1.5, NAN, "0.5", None, True], draft_vocab=[0, -1, 2.5, "x", True],
    window=[0, 1.5, None, True], verify_batch=[0, 2.5, None], skip_ratio=[0.0, 1.0, NAN, "x", None],
    replay=["sometimes", None], verifier_kernels=["z", None], adaptive_eps=["yes", None, 1], cuda_graphs=[True, "yes"],
    max_new_tokens=[0, -1, 1.5, True, None, "4"], temperature=[0.0, -1.0, NAN, None, "1", True], top_k=[-1, 2.5, None],
    top_p=[0.0, 1.5, NAN, None, True], seed=[2**64, -(2**63) - 1, 1.5, "s", None, [1] * 7],
    eos_token_id=[V, -1, 2.0, [2, V], "2"], stop_token_ids=[[V + 1], [-3], [1.0], V, "x"],
    chat=["yes", None, 1], do_sample=["yes", None, 1],
    layer_set=["attn:9", "mlp:a", "attn:1|attn:2", "foo", "attn:-1", "attn:0,1,2,3|mlp:0,1,2,3", 3, ["attn:1"]],
    prompts=[[], [[]], "", [""], [[5] * 600], [[1.0, 2.0]], [[3, None]], [[V]], [[-1]], 5, None],
    deterministic=["yes", None, [True] * 7], arrive_at=[[1] * 7, [-1] * 7, [1.5] * 7, "0", [0, None], 0],
    streamer=["x", 3], search_options=[{"bogus": 1}, "x", {"window": 0}, {"skip_ratio": 0.3}],
)
GENERATOR_ARGS = ("k_max", "eps", "draft_vocab", "window", "verify_batch", "skip_ratio", "replay",
                  "verifier_kernels", "adaptive_eps", "cuda_graphs", "search_options")
GENERATE_ARGS = ("max_new_tokens", "temperature", "top_k", "top_p", "seed", "eos_token_id", "stop_token_ids",
                 "chat")


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


def _modes(draw):
    """A mode with a drafter and layer set that go together."""
    mode = draw(st.sampled_from(["ar", "self-spec", "deterministic"]))
    drafter = draw(st.sampled_from({"ar": ["auto", "none"], "self-spec": ["auto", "layer-skip", "lookup", "none"],
                                    "deterministic": ["auto", "none", "self-spec"]}[mode]))
    layered = (mode == "self-spec" and drafter in ("auto", "layer-skip")) or drafter == "self-spec"
    sets = ["attn:1|mlp:2", "mlp:1", "none"] + (["auto"] if mode == "self-spec" and drafter != "lookup" else [])
    return dict(mode=mode, drafter=drafter, layer_set=draw(st.sampled_from(sets)) if layered else None)


def _swiftkern_frames(error: BaseException) -> bool:
    return any("/swiftkern/" in frame.filename for frame in traceback.extract_tb(error.__traceback__))


@SETTINGS
@given(data=st.data())
def test_any_generator_input_runs_or_is_refused_with_a_swiftkern_error(llama, data):
    draw = data.draw
    spoiled = draw(st.sampled_from([None] * 4 + sorted(BAD)))

    def value(name):
        return draw(st.sampled_from(BAD[name] if name == spoiled else GOOD[name]))

    init = {**_modes(draw), **{name: value(name) for name in GENERATOR_ARGS}}
    for name in ("replay", "verifier_kernels"):  # mode deterministic's options: refused in another mode
        if init["mode"] != "deterministic" and name != spoiled:
            init[name] = "auto"
    # verifier_kernels picks the replay's ops: refused where no replay runs (replay never, or auto
    # where the C++ invariant set decodes every step, as on this CPU with the extension built)
    replays = init["replay"] == "always" or (
        init["replay"] == "auto" and not invariant_kernels_available("cpu", torch.float32))
    if init["mode"] == "deterministic" and not replays and spoiled != "verifier_kernels":
        init["verifier_kernels"] = "auto"
    if spoiled == "layer_set":
        init["layer_set"] = draw(st.sampled_from(BAD["layer_set"]))
    n = draw(st.integers(1, 3))
    prompts = [draw(st.lists(st.integers(3, V - 1), min_size=1, max_size=8)) for _ in range(n)]
    if spoiled == "prompts":
        prompts = draw(st.sampled_from(BAD["prompts"]))
    call = {name: value(name) for name in GENERATE_ARGS}
    call["do_sample"] = value("do_sample") if spoiled == "do_sample" else draw(st.booleans())
    sampled = call["do_sample"] is True
    # adaptive eps: mode self-spec's layer-skipped draft, greedy (one eps for the batch would steer
    # a sampled row by the others); a sampled layer-skip draft takes a given layer set, not "auto"
    if spoiled != "adaptive_eps" and (init["mode"] != "self-spec" or init["drafter"] not in ("auto", "layer-skip")
                                      or sampled):
        init["adaptive_eps"] = False
    if sampled and init["drafter"] == "layer-skip" and init["layer_set"] == "auto" and spoiled != "layer_set":
        init["layer_set"] = "mlp:1"
    # after the layer set is final (the line above may take "auto" away)
    if init["layer_set"] != "auto" and spoiled != "skip_ratio":  # the search's: refused without it
        init["skip_ratio"] = "auto"
    flags = [True, [i % 2 == 0 for i in range(n)]] if init["mode"] == "deterministic" and init["drafter"] != "self-spec" else [True]
    call["deterministic"] = value("deterministic") if spoiled == "deterministic" else draw(st.sampled_from(flags))
    call["arrive_at"] = value("arrive_at") if spoiled == "arrive_at" else draw(
        st.sampled_from([None, [0] + [draw(st.integers(0, 4)) for _ in range(n - 1)]]))
    if spoiled == "streamer":
        call["streamer"] = value("streamer")
    try:
        out = Generator(llama, **init).generate(prompts, **call)
    except SwiftkernError as e:
        assert spoiled is not None, f"a valid draw refused: {e}: Generator({init}).generate({prompts}, {call})"
        return
    except Exception as e:  # noqa: BLE001 (the point: no other kind may come out)
        raise AssertionError(f"{type(e).__name__} for Generator({init}).generate(..., {call})") from e
    # the one spoiled value that runs: a temperature that greedy decoding ignores (as HF does)
    assert spoiled is None or (spoiled == "temperature" and call["do_sample"] is False), \
        f"spoiled {spoiled} ran: Generator({init}).generate({prompts}, {call})"
    assert len(out.tokens) == len(prompts)


# Every bad value once, in a setting where it is the only thing wrong (the drawn test above
# reaches each one only by chance: a given value of ``prompts`` in ~1 of 3 runs).
GREEDY = dict(do_sample=False)  # the layer set search and adaptive eps are for greedy calls
SETTING_OF = {  # (Generator arguments of a mode that reads the value, the call's changes)
    **dict.fromkeys(("k_max", "eps", "draft_vocab", "adaptive_eps", "layer_set"),
                    (dict(mode="self-spec", drafter="layer-skip", layer_set="attn:1|mlp:2"), GREEDY)),
    **dict.fromkeys(("skip_ratio", "search_options"),
                    (dict(mode="self-spec", drafter="layer-skip", layer_set="auto"), GREEDY)),
    **dict.fromkeys(("window", "verify_batch", "replay", "verifier_kernels", "deterministic"),
                    (dict(mode="deterministic", replay="always"), {})),
}
GOOD_CALL = dict(max_new_tokens=2, do_sample=True, temperature=0.8, top_k=0, top_p=1.0, seed=0)
CALL_ARGS = GENERATE_ARGS + ("do_sample", "prompts", "arrive_at", "streamer", "deterministic")


@pytest.mark.parametrize("name, value", [(name, value) for name in sorted(BAD) for value in BAD[name]],
                         ids=lambda v: repr(v)[:24])
def test_each_bad_value_alone_is_refused_with_a_swiftkern_error(llama, name, value):
    init, changes = SETTING_OF.get(name, ({}, {}))
    init, call, prompts = dict(init), {**GOOD_CALL, **changes}, [[5, 6, 7], [8, 9]]
    if name == "prompts":
        prompts = value
    elif name in CALL_ARGS:
        call[name] = value
    else:
        init[name] = value
    with pytest.raises(SwiftkernError):
        Generator(llama, **init).generate(prompts, **call)


@pytest.mark.parametrize("init, changes", [({}, {})] + list({repr(v): v for v in SETTING_OF.values()}.values()),
                         ids=repr)
def test_the_settings_of_the_bad_values_run(llama, init, changes):
    """The control of the test above: each setting with no bad value in it runs."""
    out = Generator(llama, **init).generate([[5, 6, 7], [8, 9]], **{**GOOD_CALL, **changes})
    assert len(out.tokens) == 2 and all(len(t) == 2 for t in out.tokens)


HF_OPTIONS = dict(
    max_new_tokens=[1, 4, 0, -1, 2.5], max_length=[12, 3, 600], do_sample=[True, False, "yes"],
    temperature=[0.7, 0.0, -1.0, "x"], top_k=[0, 5, -1, 2.5], top_p=[0.9, 1.0, 0.0, 1.5],
    num_beams=[1, 2], num_return_sequences=[1, 2], repetition_penalty=[1.0, 1.2], min_new_tokens=[0, 2],
    eos_token_id=[2, [2, 3], V + 5, -1], pad_token_id=[0, V + 1], output_scores=[False, True],
    return_dict_in_generate=[False, True], stop_strings=[["a"]],
    swift_mode=["self-spec", "ar", "deterministic", "bogus"], drafter=["lookup", "layer-skip", "self-spec", "zz"],
    layer_set=["attn:1|mlp:2", "auto", "bogus", 3], k_max=[3, 0], eps=[0.5, 2.0], seed=[5, -1, 2**70, "s"],
    swift_kwargs=[{"window": 4}, {"bogus": 1}, {"mode": "ar"}, {"layer_set": "mlp:1"}, "x"],
)


def _hf_rows_or_refused(llama, ids, kwargs) -> int | None:
    """HF ``generate`` through the backend -> the rows it returned, or None where it was refused
    with a SwiftkernError or by HF itself; any other exception from inside swiftkern fails."""
    if "max_length" not in kwargs:
        kwargs.setdefault("max_new_tokens", 3)
    try:
        out = llama.generate(ids, attention_mask=torch.ones_like(ids), custom_generate=swift_generate, **kwargs)
    except SwiftkernError:
        return None
    except Exception as e:  # noqa: BLE001 (the point: no other kind may come out of swiftkern)
        if _swiftkern_frames(e):
            raise AssertionError(f"{type(e).__name__} from swiftkern for generate(..., {kwargs})") from e
        return None
    return (out.sequences if hasattr(out, "sequences") else out).shape[0]


@SETTINGS
@given(data=st.data())
def test_any_hf_generate_input_runs_or_is_refused_with_a_swiftkern_error(llama, data):
    """HF's own checks may refuse first (a ValueError raised before swiftkern is reached)."""
    draw = data.draw
    n, T = draw(st.integers(1, 3)), draw(st.integers(1, 6))
    ids = torch.tensor([draw(st.lists(st.integers(3, V - 1), min_size=T, max_size=T)) for _ in range(n)])
    names = draw(st.lists(st.sampled_from(sorted(HF_OPTIONS)), max_size=5, unique=True))
    kwargs = {name: draw(st.sampled_from(HF_OPTIONS[name])) for name in names}
    rows = _hf_rows_or_refused(llama, ids, kwargs)
    assert rows is None or rows == n


@pytest.mark.parametrize("name, value", [(name, value) for name in sorted(HF_OPTIONS) for value in HF_OPTIONS[name]],
                         ids=lambda v: repr(v)[:24])
def test_each_hf_option_alone_runs_or_is_refused(llama, name, value):
    """Each value of HF_OPTIONS once, alone (the drawn test above combines up to five, by chance):
    it runs, or is refused with a SwiftkernError, or by HF before swiftkern is reached. What the
    backend cannot honour (beams, scores, a repetition penalty, a minimum length) never runs."""
    cannot = [("num_beams", 2), ("output_scores", True), ("repetition_penalty", 1.2), ("min_new_tokens", 2)]
    rows = _hf_rows_or_refused(llama, torch.tensor([[5, 6, 7], [8, 9, 10]]), {name: value})
    assert rows is None or ((name, value) not in cannot and rows == 2), f"{name}={value!r} ran"
