"""Streaming: ``Generator.generate(streamer=...)`` hands over each request's tokens as they become
final, in every mode, and ``TextStream`` makes text of them. The checks: what was streamed is
the output (and HF greedy's), also where drafts or the deterministic fast path were wrong and
rolled back, so a token that is not final would show."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import hf_greedy, tiny_model
from swiftkern import Generator, SkipModel, SwiftkernError, TextStream
from swiftkern.deterministic import decode_deterministic
from swiftkern.fast_path import FastPath
from swiftkern.layer_kernels import invariant_kernels_available
from swiftkern.requests import Requests
from swiftkern.sampling import SamplingParams

needs_invariant = pytest.mark.skipif(not invariant_kernels_available("cpu", torch.float32),
                                     reason="swiftkern._C is not built with the CPU kernels of the invariant set")
PROMPTS = [[4, 77, 31], list(range(10, 40)), [200, 3, 9, 9]]
SKIP = "attn:1|mlp:2"
CONFIGS = {  # name: (Generator options, generate options)
    "ar": (dict(mode="ar"), {}),
    "self-spec-layer-skip": (dict(mode="self-spec", drafter="layer-skip", layer_set=SKIP, k_max=4, eps=0.0), {}),
    "self-spec-lookup": (dict(mode="self-spec", drafter="lookup"), {}),
    "deterministic-replay": (dict(mode="deterministic", replay="always", window=4, verify_batch=2), {}),
    "deterministic-replay-self-spec": (dict(mode="deterministic", replay="always", drafter="self-spec",
                                            layer_set=SKIP, window=4, verify_batch=2), {}),
    "deterministic-some-unverified": (dict(mode="deterministic", replay="always", window=4, verify_batch=2),
                                      dict(deterministic=[True, False, True])),
    "deterministic-no-replay": pytest.param((dict(mode="deterministic", replay="auto"), {}), marks=needs_invariant),
    "deterministic-no-replay-self-spec": pytest.param(
        (dict(mode="deterministic", replay="auto", drafter="self-spec", layer_set=SKIP, eps=0.0), {}),
        marks=needs_invariant),
}


@pytest.fixture(scope="module")
def tiny():
    return SkipModel(tiny_model("llama"))


class Recorder:
    def __init__(self):
        self.calls: list[tuple[int, list[int]]] = []

    def __call__(self, request, tokens):
        self.calls.append((request, list(tokens)))

    def per_request(self, n):
        out = [[] for _ in range(n)]
        for r, tokens in self.calls:
            out[r] += tokens
        return out


@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_streamed_tokens_are_the_output(tiny, config, sample):
    gen_options, call_options = config
    gen = Generator(tiny, **gen_options)
    kw = dict(max_new_tokens=14, do_sample=sample, temperature=0.9, seed=[1, 2, 3], **call_options)
    stop = gen.generate(PROMPTS, stop_token_ids=[], **kw).tokens[0][5]  # ends row 0 (at least) early
    rec = Recorder()
    out = gen.generate(PROMPTS, stop_token_ids=[stop], streamer=rec, **kw)
    assert len(out.tokens[0]) <= 6
    assert rec.per_request(len(PROMPTS)) == out.tokens
    if not sample:  # greedy: the output is HF's, so the stream is too
        assert out.tokens == [hf_greedy(tiny.hf_model, p, 14, eos_token_id=[stop]) for p in PROMPTS]
    assert all(tokens and 0 <= r < len(PROMPTS) for r, tokens in rec.calls)
    assert len(rec.calls) > len(PROMPTS)  # in pieces while decoding, not once at the end


def test_ar_streams_each_token_as_it_is_decoded(tiny):
    rec = Recorder()
    out = Generator(tiny, mode="ar").generate([PROMPTS[1]], max_new_tokens=9, stop_token_ids=[], eos_token_id=[],
                                              streamer=rec)
    assert rec.calls == [(0, [t]) for t in out.tokens[0]] and len(out.tokens[0]) == 9


def test_self_spec_streams_only_accepted_tokens(tiny):
    """The layer-skipped drafts are often rejected here; the stream is still HF greedy's output."""
    rec = Recorder()
    gen = Generator(tiny, mode="self-spec", drafter="layer-skip", layer_set=SKIP, k_max=4, eps=0.0)
    out = gen.generate([PROMPTS[1]], max_new_tokens=20, streamer=rec)
    assert out.stats["accepted"] < out.stats["drafted"]  # some drafts were rolled back
    assert rec.per_request(1)[0] == out.tokens[0] == hf_greedy(tiny.hf_model, PROMPTS[1], 20)


class WrongFastPath(FastPath):
    """The regular fast path, except that every third proposal is a wrong token."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def propose(self, model, cache, last, params, seeds, **kw):
        tokens, ok, logits = super().propose(model, cache, last, params, seeds, **kw)
        self.calls += 1
        if self.calls % 3 == 0:
            tokens = [(t + 1) % model.vocab_size for t in tokens]
        return tokens, ok, logits


def _deterministic(model, fast_path, streamer=None, max_new=16):
    requests = Requests(len(PROMPTS), max_new, frozenset(), on_commit=streamer)
    cache = model.new_cache(len(PROMPTS), max(map(len, PROMPTS)) + max_new + 4)
    stats = decode_deterministic(model, cache, PROMPTS, SamplingParams(), [0] * len(PROMPTS), requests,
                                 window=4, verify_batch=2, fast_path=fast_path)
    return requests.out, stats


def test_deterministic_streams_only_verified_tokens(tiny):
    """LLM-42: an unverified token is never streamed. With a fast path that is wrong every third
    step, a stream of unverified tokens would carry the wrong ones; this one is the clean output."""
    clean, _ = _deterministic(tiny, FastPath())
    rec = Recorder()
    out, stats = _deterministic(tiny, WrongFastPath(), rec)
    assert stats["rolled_back"] > 0 and stats["corrected"] > 0
    assert rec.per_request(len(PROMPTS)) == out == clean


class ByteTokenizer:
    """Token i is byte i: a character past ASCII takes several tokens, as in byte-level BPE."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


TEXT = "héllo wörld: ✓ 日本語 — ok"


@settings(max_examples=40, deadline=None, derandomize=True)
@given(cuts=st.lists(st.integers(1, 6), min_size=1, max_size=30), requests=st.integers(1, 3))
def test_text_stream_writes_whole_characters_and_the_whole_text(cuts, requests):
    data = list(TEXT.encode())
    pieces = {r: [] for r in range(requests)}
    stream = TextStream(ByteTokenizer(), write=lambda r, text: pieces[r].append(text))
    at = 0
    for i, n in enumerate(cuts * 20):  # the same byte chunks for every request, interleaved
        if at >= len(data):
            break
        for r in range(requests):
            stream(r, data[at:at + n])
        at += n
    stream(0, data[at:])  # request 0 gets the rest; the others end where they are
    texts = stream.finish()
    for r in range(requests):
        got = data if r == 0 else data[:at]
        assert "".join(pieces[r]) == texts[r] == ByteTokenizer().decode(got)
        # only the last piece may end inside a character (a request cut there)
        assert all("\ufffd" not in p for p in pieces[r][:-1])
    assert texts[0] == TEXT


class CleanUpTokenizer:
    """Token i is WORDS[i], the text cleaned up by HF's own rule (" ," -> ",", " n't" -> "n't",
    " ' " -> "'", ...), as a tokenizer with clean_up_tokenization_spaces=True decodes."""

    WORDS = ["Hello", " ", ",", " n", "'t", " '", "s", " 's", " .", "do", " x", "!", " !", " ?", "\n", " 're", "'"]
    clean_up_tokenization_spaces = True

    def decode(self, ids, skip_special_tokens=True):
        import inspect

        from transformers import PreTrainedTokenizerBase

        text = "".join(self.WORDS[i] for i in ids)
        rule = inspect.getattr_static(PreTrainedTokenizerBase, "clean_up_tokenization")
        if isinstance(rule, staticmethod):  # transformers 4.x; a method of the tokenizer in 5.x
            return rule.__func__(text)
        return rule(None, text)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(ids=st.lists(st.integers(0, len(CleanUpTokenizer.WORDS) - 1), max_size=24),
       cuts=st.lists(st.integers(1, 3), min_size=1, max_size=8))
def test_text_stream_pieces_join_to_the_text_when_the_tokenizer_cleans_up_spaces(ids, cuts):
    """Decoding such a tokenizer's tokens is not prefix-stable ("Hello " then "Hello,"): the
    stream wrote a space the whole text no longer has."""
    pieces = []
    stream = TextStream(CleanUpTokenizer(), write=lambda r, text: pieces.append(text))
    at = 0
    for n in cuts * 24:
        if at >= len(ids):
            break
        stream(0, ids[at:at + n])
        at += n
    if not ids:
        stream(0, [])
    texts = stream.finish()
    assert "".join(pieces) == texts[0] == CleanUpTokenizer().decode(ids)


@pytest.mark.parametrize("ids", [[1, 16, 1, 11], [9, 1, 16, 1, 11], [1, 16, 1, 2], [1, 1, 16, 1, 6]])
def test_a_quote_cleaned_up_at_the_end_waits(ids):
    """A quote at the end: " ' " is cleaned to "'", but " ' !" to " '!" (HF cleans " !" first): the stream wrote "'"
    and the whole text begins with a space; "  ' s" cleans to "'s" (" ' " then " 's"), and the
    stream had written the first space (found by 60000 draws of the test above)."""
    pieces = []
    stream = TextStream(CleanUpTokenizer(), write=lambda r, text: pieces.append(text))
    for t in ids:
        stream(0, [t])
    stream.finish()
    assert "".join(pieces) == CleanUpTokenizer().decode(ids)


def test_bad_streamer_is_refused(tiny):
    with pytest.raises(SwiftkernError, match="streamer must be a callable"):
        Generator(tiny, mode="ar").generate([PROMPTS[0]], max_new_tokens=2, streamer="stdout")


@pytest.mark.parametrize("args", [["--prompt-file", "{file}"], ["--prompt", "hi", "--json"]])
def test_cli_stream_needs_one_prompt_and_no_json(args, tmp_path, capsys):
    from swiftkern.cli import main

    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    code = main(["generate", *[a.format(file=path) for a in args], "--stream"])
    err = capsys.readouterr().err
    assert code == 2 and "--stream" in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
def test_cli_streams_the_text_of_smollm2(smollm2, capsys, monkeypatch):
    """--stream prints, piece by piece, the text the non-streamed call returns."""
    from swiftkern import cli, loading

    model, tokenizer = smollm2
    prompt = "List three uses of a paperclip:"
    want = Generator(model, tokenizer, mode="self-spec", drafter="lookup").generate(prompt, max_new_tokens=24)
    monkeypatch.setattr(loading, "load_model", lambda *a, **k: smollm2)
    writes = []
    original = TextStream.__call__

    def counted(self, request, tokens):
        writes.append(len(tokens))
        original(self, request, tokens)

    monkeypatch.setattr(TextStream, "__call__", counted)
    code = cli.main(["generate", "--prompt", prompt, "--max-new-tokens", "24", "--mode", "self-spec",
                     "--drafter", "lookup", "--stream"])
    out = capsys.readouterr().out
    assert code == 0 and out.startswith(f"### {prompt}\n{want.texts[0]}\n\n[self-spec]")
    assert sum(writes) == len(want.tokens[0]) and len(writes) > 1


def test_a_text_stream_without_a_tokenizer_is_refused_when_made():
    """Not an AttributeError at the first token, inside generate."""
    for tokenizer in (None, 3):
        with pytest.raises(SwiftkernError, match=r"TextStream needs a tokenizer with decode\(ids\)"):
            TextStream(tokenizer)
    with pytest.raises(SwiftkernError, match="write must be a callable"):
        TextStream(ByteTokenizer(), write="stdout")
