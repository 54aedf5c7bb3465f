"""CLI input errors exit 2 with one line on stderr, before any model is loaded."""

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import tiny_model
from swiftkern import SkipModel, cli, prompt_file
from swiftkern.layer_kernels import invariant_kernels_available


def run(*args):
    return subprocess.run([sys.executable, "-m", "swiftkern", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("args,msg", [
    (["generate", "--prompt", "   "], "prompt 0 is empty"),
    (["generate", "--prompt", "hi", "--model", "/no/such/model"], "unknown model"),
    (["generate", "--prompt", "hi", "--max-new-tokens", "0"], "must be >= 1"),
    (["generate", "--prompt", "hi", "--top-p", "2"], "must be in"),
    (["generate"], "required"),
])
def test_bad_input_exits_2_with_one_line(args, msg):
    r = run(*args)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and msg in lines[0] and "Traceback" not in r.stderr, r.stderr


def test_malformed_jsonl(tmp_path, capsys):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "ok"}\n{"prompt": 3}\n')
    assert cli.main(["generate", "--prompt-file", str(f)]) == 2
    assert "p.jsonl:2" in capsys.readouterr().err
    f.write_text('{"prompt": "ok"}\nnot json\n')
    assert cli.main(["generate", "--prompt-file", str(f)]) == 2
    assert cli.main(["generate", "--prompt-file", str(tmp_path / "missing.jsonl")]) == 2
    capsys.readouterr()
    f.write_bytes('{"prompt": "ok"}\n{"prompt": "caf\u00e9"}\n'.encode("latin-1"))  # a traceback before
    assert cli.main(["generate", "--prompt-file", str(f)]) == 2
    assert "p.jsonl:2: not UTF-8" in capsys.readouterr().err
    assert cli.main(["generate", "--prompt-file", str(tmp_path)]) == 2  # was "does not exist"
    assert "is a directory" in capsys.readouterr().err


def test_a_prompt_file_from_standard_input_or_a_pipe(tmp_path, monkeypatch):
    """`--prompt-file -` reads standard input; a FIFO (what `<(...)` and /dev/stdin on a pipe
    are) reads as a file. Both were refused as "not a file (a directory?)"."""
    import io
    import threading
    import types

    lines = b'{"prompt": "from a pipe"}\n{"prompt": "b", "arrive_at": 2}\n'
    monkeypatch.setattr(sys, "stdin", types.SimpleNamespace(buffer=io.BytesIO(lines)))
    assert prompt_file.read_prompt_records("-") == (["from a pipe", "b"], [0, 2])
    fifo = tmp_path / "prompts.fifo"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_bytes(lines))
    writer.start()
    try:
        assert prompt_file.read_prompt_records(str(fifo)) == (["from a pipe", "b"], [0, 2])
    finally:
        writer.join(timeout=60)
    monkeypatch.setattr(sys, "stdin", types.SimpleNamespace(buffer=io.BytesIO(b"")))
    with pytest.raises(cli.SwiftkernError, match="prompt file '-' has no prompts"):
        prompt_file.read_prompt_records("-")


def test_a_generation_option_in_a_prompt_file_is_refused_not_ignored(tmp_path):
    """A line's "seed" or "temperature" would be silently replaced by the command's flags; it is
    refused naming the line and the key. Other keys (a "kind", as in bench/prompts.jsonl) pass."""
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "ok", "kind": "x", "arrive_at": 1}\n{"prompt": "b", "seed": 3, "top_p": 0.5}\n')
    with pytest.raises(cli.SwiftkernError, match=r"p.jsonl:2: per-request 'seed', 'top_p' is not read"):
        prompt_file.read_prompt_records(str(f))
    f.write_text('{"prompt": "ok", "kind": "x", "arrive_at": 1}\n{"text": "b"}\n')
    assert prompt_file.read_prompt_records(str(f)) == (["ok", "b"], [1, 0])
    f.write_text('{"prompt": "ok"}\n\n{"text": "b", "arrive_at": 0}\n')  # no arrivals: None, as for --prompt
    assert prompt_file.read_prompt_records(str(f)) == (["ok", "b"], None)


def test_a_prompt_file_with_a_byte_order_mark_reads_and_one_prompt_under_two_keys_is_refused(tmp_path):
    """A file saved with a UTF-8 byte-order mark (Windows editors) was refused as "not valid JSON"
    at line 1; a line with both "prompt" and "text" generated the "prompt" and dropped the other."""
    f = tmp_path / "p.jsonl"
    f.write_bytes('{"prompt": "caf\u00e9"}\n{"text": "\ufeffb"}\n'.encode("utf-8-sig"))
    assert prompt_file.read_prompt_records(str(f)) == (["caf\u00e9", "\ufeffb"], None)  # only the file's mark goes
    f.write_text('{"prompt": "ok"}\n{"prompt": "a", "text": "b"}\n')
    with pytest.raises(cli.SwiftkernError, match=r'p.jsonl:2: has both "prompt" and "text"'):
        prompt_file.read_prompt_records(str(f))


def test_help_explains_itself():
    r = run("generate", "--help")
    assert r.returncode == 0
    for flag in ("--prompt-file", "--chat", "--max-new-tokens", "--temperature", "--json", "--replay"):
        assert flag in r.stdout


def test_top_level_help_names_every_command():
    r = run("--help")
    assert r.returncode == 0, r.stderr
    usage = r.stdout.splitlines()[0]
    assert all(c in usage for c in ("generate", "info", "search", "bench")), r.stdout


def test_info_names_backends():
    r = run("info")
    assert r.returncode == 0, r.stderr
    assert "torch:" in r.stdout and "greedy_accept" in r.stdout
    from swiftkern.layer_kernels import invariant_backend
    from swiftkern.ops import backends

    on_cpu = invariant_kernels_available("cpu", torch.float32)
    on_cuda = torch.cuda.is_available() and invariant_backend("cuda", torch.float32) == "triton"
    said = "cpu float32" if on_cpu else "cuda (the Triton set" if on_cuda else "no (the LLM-42 replay runs)"
    lines = r.stdout.splitlines()
    assert any(line.startswith(f"deterministic_without_replay: {said}") for line in lines), r.stdout
    assert ("cuda (the Triton set" in r.stdout) is on_cuda  # replay auto's way there (Generator.replay_elided)
    decoding = "cpu: batch-invariant" if invariant_kernels_available("cpu", torch.float32) else "regular"
    assert f"decode_kernels: {decoding}" in r.stdout
    cpu_set = '"fused (cpp)"' if invariant_kernels_available("cpu", torch.float32) else '"portable"'
    cuda_set = '"fused (triton)"' if "verify_attention_invariant" in backends.triton_ops("cuda") else '"portable"'
    assert f'verifier_kernels_auto: {{"cpu": {cpu_set}, "cuda": {cuda_set}}}' in r.stdout
    from swiftkern.layer_kernels import LayerKernels

    loop = "C++ decoder_stack" if LayerKernels.for_device("cpu").stack is not None else "Python, op by op"
    assert f"cpu_layer_loop: {loop}" in r.stdout
    graphs = "available" if torch.cuda.is_available() else "not available (no CUDA device)"
    assert f"cuda_graphs: {graphs}" in r.stdout
    assert "cuda_greedy_vocab_split: on" in r.stdout
    import transformers
    import triton

    # read from the installed metadata, not by importing them: the versions the modules say
    assert f"transformers: {transformers.__version__}" in lines
    assert any(line.split(" (")[0] == f"triton: {triton.__version__}" for line in lines)  # + what TRITON_INTERPRET does


@pytest.mark.parametrize("value,state", [("0", "off"), ("1", "on"), ("", "on")])
def test_info_says_when_the_cuda_greedy_split_is_off(value, state, monkeypatch):
    """Off for 0 alone, as the CUDA kernel reads it (csrc/greedy_accept.cu)."""
    monkeypatch.setenv("SWIFTKERN_CUDA_GREEDY_SPLIT", value)
    r = run("info")
    assert r.returncode == 0 and f"cuda_greedy_vocab_split: {state}" in r.stdout, r.stdout + r.stderr


def test_info_says_the_reference_backend_projects_with_torch(monkeypatch):
    monkeypatch.setenv("SWIFTKERN_BACKEND", "reference")  # the line named the C++ kernels here
    r = run("info")
    assert "cpu_float32_projections: torch's matmul at every size" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("backend,line", [
    ("auto", "cuda_float32_projections: the Triton skinny_linear at 2-32 rows (a layer's q/k/v and gate/up"),
    ("reference", "cuda_float32_projections: torch's matmul at every size (the Triton kernels are not in use: "
                  "SWIFTKERN_BACKEND=reference"),
])
def test_info_says_which_kernel_projects_float32_on_cuda(backend, line, monkeypatch):
    monkeypatch.setenv("SWIFTKERN_BACKEND", backend)
    r = run("info")
    assert line in r.stdout, r.stdout + r.stderr


def test_info_names_the_skinny_rows_and_plan_the_environment_sets(monkeypatch):
    monkeypatch.setenv("SWIFTKERN_CUDA_SKINNY_ROWS", "1-32")
    monkeypatch.setenv("SWIFTKERN_SKINNY_PLAN", "16x64x32-w4-s3-ieee-k128-last")
    r = run("info")
    assert ("at 1-32 rows (SWIFTKERN_CUDA_SKINNY_ROWS)" in r.stdout
            and "plan 16x64x32-w4-s3-ieee-k128-last (SWIFTKERN_SKINNY_PLAN)" in r.stdout), r.stdout + r.stderr
    monkeypatch.setenv("SWIFTKERN_CUDA_SKINNY_ROWS", "0-3")
    r = run("info")  # a bad value is shown, not a crash
    assert r.returncode == 0 and "no rows: SWIFTKERN_CUDA_SKINNY_ROWS='0-3'" in r.stdout, r.stdout + r.stderr


def test_info_names_the_bi_matmul_plan(monkeypatch):
    r = run("info")
    assert "cuda_bi_matmul_plans: PLANS (triton_kernels/bi_matmul.py)" in r.stdout, r.stdout + r.stderr
    monkeypatch.setenv("SWIFTKERN_BI_MATMUL_PLAN", "64x64x32-w4-s3-tf32x3")
    r = run("info")
    assert "cuda_bi_matmul_plans: 64x64x32-w4-s3-tf32x3 (SWIFTKERN_BI_MATMUL_PLAN)" in r.stdout, r.stdout


@pytest.mark.parametrize("args,msg", [
    (["generate", "--prompt", "hi", "--mode", "self-spec", "--skip-ratio", "1.5"], "skip ratio must be in"),
    (["search", "--prompt", "hi", "--skip-ratio", "x"], "expected 'auto' or a fraction"),
    (["search"], "required"),
    (["search", "--prompt", " "], "a prompt is empty"),
])
def test_search_and_skip_ratio_input_errors(args, msg):
    r = run(*args)
    assert r.returncode == 2 and msg in r.stderr, r.stderr


def test_bench_runs_the_checkouts_driver(capsys):
    """swiftkern bench is python -m bench: the same routines, and a smoke run of one."""
    import bench.__main__ as driver

    assert cli.main(["bench", "--list"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert listed == sorted(driver.routines())
    assert cli.main(["bench", "--routine", "silu_mul", "--smoke", "--providers", "reference", "--device", "cpu"]) == 0
    assert "== silu_mul" in capsys.readouterr().out
    assert cli.main(["bench", "--routine", "no_such_routine"]) == 2
    assert "swiftkern bench: unknown routine" in capsys.readouterr().err


def test_bench_without_a_checkout_says_what_to_do(monkeypatch, capsys):
    monkeypatch.setattr(cli, "bench_checkout", lambda: None)
    assert cli.main(["bench", "--list"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "source checkout" in err[0] and "pip install" in err[0]


@pytest.mark.parametrize("device,msg", [("mps", "runs on 'cpu' or 'cuda'"), ("gpu", "not a torch device"),
                                        pytest.param("cuda", "no CUDA device here", marks=pytest.mark.skipif(
                                            torch.cuda.is_available(), reason="this machine has a GPU"))])
def test_a_device_this_machine_lacks_is_refused_before_loading(device, msg, capsys):
    for command in (["generate", "--prompt", "hi"], ["search", "--prompt", "hi"]):
        assert cli.main([*command, "--device", device]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and msg in err[0], err


class _Reached(Exception):
    pass


def _spy_generator(monkeypatch) -> dict:
    """A spy Generator and load_model: -> the dict they fill with what reached them (the spy's
    generate stops the run by raising _Reached)."""
    import swiftkern.generate
    import swiftkern.loading

    seen = {}

    class Spy:
        def __init__(self, model, tokenizer, **kw):
            seen["init"] = kw

        def generate(self, prompts, **kw):
            seen["generate"] = dict(kw, prompts=prompts)
            raise _Reached

    monkeypatch.setattr(swiftkern.generate, "Generator", Spy)
    def load_model(model, device, dtype, pack_weights):
        seen["load"] = dict(model=model, device=device, dtype=dtype, pack_weights=pack_weights)
        return "m", "t"

    monkeypatch.setattr(swiftkern.loading, "load_model", load_model)
    return seen


def test_generate_options_reach_the_generator(monkeypatch):
    """Every `generate` option, each at a value other than its default, arrives at
    swiftkern.Generator / Generator.generate under its own name (a spy Generator stops the run)."""
    seen = _spy_generator(monkeypatch)
    with pytest.raises(_Reached):
        cli.main(["generate", "--prompt", "hi there", "--mode", "deterministic", "--drafter", "self-spec",
                  "--layer-set", "attn:1|mlp:2", "--k-max", "7", "--eps", "0.55", "--adaptive-eps",
                  "--draft-vocab", "999", "--window", "12", "--verify-batch", "3", "--skip-ratio", "0.3",
                  "--replay", "always", "--verifier-kernels", "portable", "--temperature", "0.7",
                  "--top-k", "13", "--top-p", "0.85", "--seed", "21", "--max-new-tokens", "17", "--chat",
                  "--dtype", "bfloat16", "--no-packed-weights"])
    assert seen["init"] == dict(mode="deterministic", layer_set="attn:1|mlp:2", k_max=7, eps=0.55,
                                adaptive_eps=True, drafter="self-spec", draft_vocab=999, window=12,
                                verify_batch=3, skip_ratio=0.3, replay="always", cuda_graphs=False,
                                verifier_kernels="portable")
    assert seen["load"] == dict(model="smollm2", device=None, dtype="bfloat16", pack_weights=False)
    assert seen["generate"] == dict(prompts=["hi there"], max_new_tokens=17, do_sample=True, temperature=0.7,
                                    top_k=13, top_p=0.85, seed=21, chat=True, streamer=None, arrive_at=None)


@pytest.mark.parametrize("mode,layer_set", [("ar", None), ("self-spec", "auto")])
def test_generate_defaults_are_greedy_and_self_spec_searches(mode, layer_set, monkeypatch):
    """With no options: greedy (the sampling flags at their neutral values), packed weights where
    they run, and in self-spec the layer set searched while generating."""
    seen = _spy_generator(monkeypatch)
    with pytest.raises(_Reached):
        cli.main(["generate", "--prompt", "hi", "--mode", mode])
    assert seen["init"] == dict(mode=mode, layer_set=layer_set, k_max=25, eps=0.8, adaptive_eps=False,
                                drafter="auto", draft_vocab=8192, window=32, verify_batch=4, skip_ratio="auto",
                                replay="auto", cuda_graphs=False, verifier_kernels="auto")
    assert seen["load"] == dict(model="smollm2", device=None, dtype=None, pack_weights=None)
    assert seen["generate"] == dict(prompts=["hi"], max_new_tokens=64, do_sample=False, temperature=1.0, top_k=0,
                                    top_p=1.0, seed=0, chat=False, streamer=None, arrive_at=None)


def _exit_code(argv) -> int:
    """cli.main(argv) in process -> its exit status, argparse's own exit for a bad flag value too."""
    try:
        return cli.main(argv)
    except SystemExit as e:
        return e.code


@pytest.mark.parametrize("args,msg", [
    (["generate", "--prompt", "hi", "--top-k", "-1"], "argument --top-k: must be >= 0, got -1"),
    (["generate", "--prompt", "hi", "--top-p", "0"], "must be in (0.0, 1.0], got 0.0"),
    (["generate", "--prompt", "hi", "--eps", "1.01"], "must be in [0.0, 1.0], got 1.01"),
    (["generate", "--prompt", "hi", "--temperature", "-0.5"], "must be in [0.0, 100.0], got -0.5"),
    (["generate", "--prompt", "hi", "--mode", "self-spec", "--skip-ratio", "0"], "skip ratio must be in (0, 1), got 0.0"),
    (["search", "--prompt", "hi", "--skip-ratio", "1"], "skip ratio must be in (0, 1), got 1.0"),
    (["search", "--prompt", "hi", "--budget", "0"], "must be in (0.0, 1000000.0], got 0.0"),
    (["generate", "--prompt-file", "TWO", "--stream"], "--stream prints one prompt's text"),
    (["generate", "--prompt", "hi", "--max-new-tokens", "ten"], "expected a whole number, got 'ten'"),
    (["generate", "--prompt", "hi", "--temperature", "warm"], "expected a number, got 'warm'"),
    (["generate", "--prompt", "hi", "--mode", "self-spec", "--skip-ratio", "half"],
     "expected 'auto' or a fraction in (0, 1), got 'half'"),
])
def test_values_at_the_edges_are_refused_before_loading(args, msg, tmp_path, monkeypatch, capsys):
    """The bounds themselves: where an interval is open, its end is refused (in process: no model loads)."""
    import swiftkern.loading

    monkeypatch.setattr(swiftkern.loading, "load_model", lambda *a, **k: pytest.fail("loaded a model"))
    two = tmp_path / "two.jsonl"
    two.write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    code = _exit_code([str(two) if a == "TWO" else a for a in args])
    err = capsys.readouterr().err
    assert code == 2 and msg in err, err


def test_search_options_reach_the_search(monkeypatch, capsys):
    """search's flags arrive at search_layer_set; --no-save stores nothing, its absence stores."""
    import swiftkern.loading
    import swiftkern.offline_search

    calls = []

    def search(model, tokenizer, prompts, **kw):
        calls.append(dict(kw, prompts=prompts))
        return dict(layer_set="mlp:1", skip_ratio=0.3, matchness=0.5, acceptance_rate=0.5, drafted=4, speedup=1.1)

    monkeypatch.setattr(swiftkern.loading, "load_model", lambda *a, **k: ("m", "t"))
    monkeypatch.setattr(swiftkern.offline_search, "search_layer_set", search)
    assert cli.main(["search", "--prompt", "a", "--prompt", "b", "--skip-ratio", "0.3", "--budget", "9",
                     "--max-new-tokens", "5", "--no-save", "--json"]) == 0
    assert cli.main(["search", "--prompt", "a"]) == 0
    saves = [(c.pop("save"), c.pop("log") is not print) for c in calls]
    assert saves == [(False, True), (True, False)]  # --json: the ratios' lines not printed
    assert calls == [dict(prompts=["a", "b"], skip_ratio=0.3, budget_s=9.0, max_new_tokens=5),
                     dict(prompts=["a"], skip_ratio="auto", budget_s=120.0, max_new_tokens=64)]


@pytest.mark.parametrize("speedup, said", [(0.67, True), (1.0, False), (1.3, False)])
def test_search_says_when_no_set_beats_ar(speedup, said, monkeypatch, capsys):
    """A search whose fastest set decodes slower than ar (SmolLM2 on the CPU) said only "x0.67 vs
    ar" beside "stored in": that the stored set does not pay here, and what may, is said now."""
    import swiftkern.loading
    import swiftkern.offline_search

    record = dict(layer_set="mlp:1", skip_ratio=0.3, matchness=0.5, acceptance_rate=0.5, drafted=4, speedup=speedup)
    monkeypatch.setattr(swiftkern.loading, "load_model", lambda *a, **k: ("m", "t"))
    monkeypatch.setattr(swiftkern.offline_search, "search_layer_set", lambda *a, **k: record)
    assert cli.main(["search", "--prompt", "a", "--no-save"]) == 0
    out = capsys.readouterr().out
    assert f"x{speedup:.2f} vs ar" in out
    assert ("no layer set decoded faster than ar" in out and "--drafter lookup or --mode ar" in out) == said


class _CharTokenizer:
    """Characters as token ids of tiny_model's vocabulary, with a chat template."""

    eos_token_id = 2

    def __call__(self, text):
        return {"input_ids": [3 + ord(c) % 298 for c in text]}

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        return [1, *self(messages[0]["content"])["input_ids"], 4]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(97 + int(t) % 26) for t in ids)


_GENERATE_FLAGS = {
    "--mode": ["ar", "self-spec", "deterministic"], "--drafter": ["auto", "layer-skip", "lookup", "none", "self-spec"],
    "--layer-set": ["attn:1|mlp:2", "auto", "none", "attn:9"], "--k-max": ["1", "5"], "--eps": ["0.5", "1.5"],
    "--window": ["1", "4"], "--verify-batch": ["1", "3"], "--replay": ["auto", "always"],
    "--verifier-kernels": ["auto", "portable", "fused"], "--skip-ratio": ["auto", "0.3", "1"], "--draft-vocab": ["1", "50"],
    "--temperature": ["0", "0.8", "-1"], "--top-k": ["0", "5", "-3"], "--top-p": ["1", "0.5", "0"],
    "--seed": ["0", "-1", str(2**70)], "--max-new-tokens": ["1", "4", "600"], "--device": ["cpu", "mps"],
    "--dtype": ["float32", "bfloat16", "float64"],
}


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_any_generate_command_prints_or_exits_2_with_one_line(data, tmp_path_factory, monkeypatch, capsys):
    """Drawn `swiftkern generate` flags (valid or not, prompt text or JSONL file) on a tiny model:
    exit 0, or exit 2 with one error line on stderr, never a traceback."""
    import swiftkern.loading

    model = SkipModel.from_hf(tiny_model("llama"))
    monkeypatch.setattr(swiftkern.loading, "load_model", lambda *a, **k: (model, _CharTokenizer()))
    draw = data.draw
    good = ['{"prompt": "hello there"}', '{"prompt": "abc abc abc", "arrive_at": 2}']  # drawn more often
    lines = draw(st.sampled_from([good, good, good, ['{"prompt": "x", "arrive_at": -1}'], ['{"text": "hi"}'],
                                  ['{"prompt": 5}'], ["no"]]))
    path = tmp_path_factory.mktemp("prompts") / "p.jsonl"
    path.write_text("\n".join(lines) + "\n")
    argv = ["generate"] + draw(st.sampled_from([["--prompt", "hello world"], ["--prompt", "abc abc abc abc"],
                                                ["--prompt", " "], ["--prompt", "x" * 700]] + [["--prompt-file", str(path)]] * 3))
    for flag in draw(st.lists(st.sampled_from(sorted(_GENERATE_FLAGS)), max_size=5, unique=True)):
        argv += [flag, draw(st.sampled_from(_GENERATE_FLAGS[flag]))]
    argv += draw(st.lists(st.sampled_from(["--chat", "--json", "--stream", "--adaptive-eps", "--cuda-graphs"]),
                          max_size=3, unique=True))
    code = _exit_code(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err and code in (0, 2), (argv, code, err)
    if code == 2:
        assert len(err.strip().splitlines()) == 1 and err.startswith("swiftkern: error: "), (argv, err)


def test_json_lines_carry_each_prompts_own_stats(tmp_path, monkeypatch, capsys):
    """--json: a line's stats are the call's with that prompt's own counts over them."""
    import json

    import swiftkern.loading

    model = SkipModel.from_hf(tiny_model("llama"))
    monkeypatch.setattr(swiftkern.loading, "load_model", lambda *a, **k: (model, _CharTokenizer()))
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "hello there"}\n{"prompt": "abc"}\n')
    assert cli.main(["generate", "--prompt-file", str(path), "--json", "--max-new-tokens", "4"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["prompt"] for r in rows] == ["hello there", "abc"]
    assert [r["stats"]["prompt_tokens"] for r in rows] == [11, 3]  # _CharTokenizer: a token a character
    assert all(r["stats"]["new_tokens"] == len(r["tokens"]) and r["stats"]["batch"] == 2 for r in rows)


@pytest.mark.parametrize("drafter", ["auto", "self-spec"])
def test_deterministic_replay_prints_the_stats_of_its_call(drafter, monkeypatch, capsys):
    """--mode deterministic --replay always: the [deterministic] lines print the call's own counts
    (the self-spec fast path's forwards by kind too)."""
    import re

    import swiftkern.loading
    from swiftkern.generate import Generator

    model = SkipModel.from_hf(tiny_model("llama"))
    monkeypatch.setattr(swiftkern.loading, "load_model", lambda *a, **k: (model, _CharTokenizer()))
    calls = []
    generate = Generator.generate

    def recorded(self, *args, **kwargs):
        calls.append(generate(self, *args, **kwargs))
        return calls[-1]

    monkeypatch.setattr(Generator, "generate", recorded)
    argv = ["generate", "--prompt", "abc abc abc abc", "--mode", "deterministic", "--replay", "always",
            "--window", "2", "--max-new-tokens", "7", "--drafter", drafter]
    if drafter == "self-spec":
        argv += ["--layer-set", "attn:1|mlp:2"]
    assert cli.main(argv) == 0
    stats = calls[0].stats
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[deterministic] ")]
    said = re.search(r"(\d+) fast steps \+ (\d+) verify passes \| (\d+)/(\d+) fast tokens rolled back", lines[1])
    assert said is not None, lines
    assert [int(n) for n in said.groups()] == [stats[k] for k in ("fast_steps", "verify_passes", "rolled_back",
                                                                  "fast_tokens")]
    # the first token is the verifier's own (it prefills); a pass of window 2 verifies 2 more at most
    assert stats["new_tokens"] == 7 and stats["verify_passes"] >= 3
    assert "window 2 x verify batch 1" in lines[1] and len(lines) == (3 if drafter == "self-spec" else 2), lines
    if drafter == "self-spec":
        kinds = stats["fast_kinds"]
        assert f"fast forwards full {kinds['full']}, draft {kinds['draft']}" in lines[2], lines


@pytest.mark.skipif(not invariant_kernels_available("cpu", torch.float32),
                    reason="swiftkern._C is not built with the CPU kernels of the invariant set")
@pytest.mark.parametrize("drafter", ["auto", "self-spec"])
def test_deterministic_without_replay_prints_why_and_its_forwards(drafter, monkeypatch, capsys):
    """--mode deterministic where the invariant set runs (no replay): the [deterministic] line
    says so and counts the call's forwards (this line was printed by no test)."""
    import swiftkern.loading
    from swiftkern.generate import Generator

    model = SkipModel.from_hf(tiny_model("llama"))
    monkeypatch.setattr(swiftkern.loading, "load_model", lambda *a, **k: (model, _CharTokenizer()))
    calls = []
    generate = Generator.generate
    monkeypatch.setattr(Generator, "generate", lambda self, *a, **k: calls.append(generate(self, *a, **k)) or calls[-1])
    argv = ["generate", "--prompt", "abc abc abc abc", "--mode", "deterministic", "--max-new-tokens", "7",
            "--drafter", drafter] + (["--layer-set", "attn:1|mlp:2"] if drafter == "self-spec" else [])
    assert cli.main(argv) == 0
    stats = calls[0].stats
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[deterministic] ")]
    assert lines[1:] == [f"[deterministic] no replay ({stats['replay']}) | fast path {stats['fast_path']} | "
                         f"{stats['fast_steps']} forwards"], lines
    assert stats["fast_steps"] >= 1 and stats["fast_path"].startswith("self-spec") == (drafter == "self-spec")


def test_drafter_self_spec_without_a_layer_set_is_refused_saying_what_to_give(capsys):
    """Refused before the model is loaded, naming a layer set's form, where one comes from, and
    'none' (prompt lookup alone), which Generator takes (tests/test_deterministic.py)."""
    assert cli.main(["generate", "--prompt", "hi", "--mode", "deterministic", "--drafter", "self-spec"]) == 2
    err = capsys.readouterr().err
    assert "needs --layer-set" in err and "swiftkern search" in err and "--layer-set none" in err
