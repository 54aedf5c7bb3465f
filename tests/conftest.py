"""Shared fixtures: tiny random LLaMA-family models, and SmolLM2 for the slow real-text checks."""

import atexit
import contextlib
import os
import shutil
import tempfile

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# stored layer sets (swiftkern search) go to a fresh directory: a developer's own never leak in
os.environ["SWIFTKERN_CACHE_DIR"] = tempfile.mkdtemp(prefix="swiftkern-test-cache-")
atexit.register(shutil.rmtree, os.environ["SWIFTKERN_CACHE_DIR"], ignore_errors=True)  # each process its own
# No GPU: run the Triton kernels in Triton's CPU interpreter (read when triton is first imported,
# which swiftkern does lazily); on a GPU machine they run natively.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    from interpreter_speed import skip_nested_lang_patches

    skip_nested_lang_patches()  # a quarter of the interpreter's time went to re-patching triton.language


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: loads the real SmolLM2 model (runs in CI, kept few)")
    config.addinivalue_line("markers", "first: minutes on a fresh machine; collected first (see below)")
    if os.environ.get("TRITON_INTERPRET") == "1":
        from interpreter_check import runtime_loop_bound_problem

        problem = runtime_loop_bound_problem()
        if problem is not None:
            pytest.exit(problem, returncode=4)


def pytest_runtest_logreport(report):
    """With SWIFTKERN_FAILURE_LOG set, each failure's id and traceback is appended to that file as
    it happens (by the process that prints the run: xdist's workers pass their reports to it), so
    a run cut at its time limit on a lent GPU machine still says why its failures failed (pytest
    prints tracebacks only at the end)."""
    path = os.environ.get("SWIFTKERN_FAILURE_LOG")
    if path and report.failed and "PYTEST_XDIST_WORKER" not in os.environ:
        with open(path, "a") as log:
            log.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext[-4000:]}\n")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``first`` run before the rest, in their order. Under ``make test``'s two
    xdist workers the first worker starts them at once and the other worker takes the rest
    meanwhile; collected in file order they came last, and one worker ran them alone at the end
    (the GPU compile check: 37 s with Triton's cache warm, ~10 min on a fresh CI machine)."""
    items.sort(key=lambda item: item.get_closest_marker("first") is None)  # a stable sort


def tiny_model(arch: str = "llama", seed: int = 0, **overrides):
    """A small random HF causal LM of the given family (float32, eval mode)."""
    from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                              Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

    common = dict(num_hidden_layers=4, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=301, max_position_embeddings=512,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
    common.update(overrides)
    torch.manual_seed(seed)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    elif arch == "qwen3":  # per-head q/k norms; head_dim 24, not hidden_size / heads (16)
        model = Qwen3ForCausalLM(Qwen3Config(**{"head_dim": 24, **common}))
    elif arch == "mistral":
        model = MistralForCausalLM(MistralConfig(**{"sliding_window": None, **common}))
    else:
        raise ValueError(arch)
    # random init gives near-uniform logits; scale up so greedy choices are not near-ties
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
        for name, p in model.named_parameters():  # HF zeroes biases (qwen2's q/k/v): a dropped one would pass
            if name.endswith(".bias"):
                p.normal_(0.0, 0.5)
            elif name.endswith("norm.weight"):  # HF's ones: a dropped or swapped norm weight would pass
                p.normal_(1.0, 0.3)
    return model.eval()


def gguf_weight(N: int, K: int, qtype, seed: int) -> torch.Tensor:
    """A float32 [N, K] weight as transformers loads a GGUF tensor: gguf's quantize, then its
    dequantize."""
    import numpy as np
    from gguf import quants

    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((N, K)) / K ** 0.5).astype(np.float32)
    return torch.from_numpy(np.ascontiguousarray(quants.dequantize(quants.quantize(w, qtype), qtype)))


def gguf_like(hf):
    """Quantize an HF model's projection weights to Q4_1 and its LM head to Q8_0 in place, as a
    GGUF file would hold them (packed_weights then finds every one's codes)."""
    from gguf import GGMLQuantizationType as Q
    from gguf import quants

    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                qtype = Q.Q8_0 if "lm_head" in name else Q.Q4_1
                p.copy_(torch.from_numpy(quants.dequantize(quants.quantize(p.detach().numpy(), qtype), qtype)))
    return hf


@pytest.fixture
def fixed_costs(monkeypatch):
    """Generators built in the test use the drafter policy's fixed cost model (verify(T) = 1 +
    0.15 (T - 1), a draft 0.5) instead of timings, so which drafters and how many drafts a step
    takes do not vary with this machine's load from run to run."""
    import swiftkern.generate as generate_module

    policy = generate_module.DrafterPolicy
    monkeypatch.setattr(generate_module, "DrafterPolicy", lambda *a, **k: policy(*a, **dict(k, measure=False)))


@pytest.fixture
def launch_names(monkeypatch):
    """The names of the runner's one-call C++ launches (``layer_kernels.opaque_call``:
    decoder_stack, decoder_forward) in order, recorded while the test runs."""
    from swiftkern import layer_kernels

    names, opaque = [], layer_kernels.opaque_call

    def recording(name, *args, **kwargs):
        names.append(name)
        return opaque(name, *args, **kwargs)
    monkeypatch.setattr(layer_kernels, "opaque_call", recording)
    return names


@pytest.fixture
def uninitialized_is_poison():
    """Every new uninitialized tensor (torch.empty, and at::empty inside the C++ kernels) holds NaN
    or the largest integer while the test runs, so an output element a kernel forgets to write
    fails the comparison by design rather than by luck of the memory it got."""
    was, fill = torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    yield
    torch.use_deterministic_algorithms(was)
    torch.utils.deterministic.fill_uninitialized_memory = fill


@pytest.fixture(scope="session")
def smollm2():
    """(SkipModel, tokenizer) for the bundled SmolLM2-135M-Instruct, loaded once."""
    import swiftkern

    return swiftkern.load_model("smollm2")


@contextlib.contextmanager
def torch_threads(n: int):
    """torch (and the C++ kernels' OpenMP) at n threads inside the block, as before after it."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (so -0.0 and 0.0, or two NaNs' payloads, are told apart)."""
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)))


def hf_greedy(hf_model, prompt_ids, max_new_tokens, eos_token_id=None):
    """HF generate, greedy, batch 1: the new token ids (EOS included if generated)."""
    ids = torch.tensor([prompt_ids])
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, attention_mask=torch.ones_like(ids))
    if eos_token_id is not None:
        kwargs["eos_token_id"] = eos_token_id
    pad = hf_model.generation_config.pad_token_id
    kwargs["pad_token_id"] = 0 if pad is None else pad
    with torch.no_grad():
        out = hf_model.generate(ids, **kwargs)[0, len(prompt_ids):].tolist()
    eos = hf_model.generation_config.eos_token_id if eos_token_id is None else eos_token_id
    return until_stop(out, {eos} if isinstance(eos, int) else set(eos or []))  # HF pads finished rows


def top_logit_gaps(hf_model, prompt_ids, new_ids) -> torch.Tensor:
    """float32 [len(new_ids)]: how far below the top of HF's own logits each new token was, in one
    full forward over prompt + new tokens (0 where the token is the argmax). Where greedy is
    defined only to rounding (bf16 / fp16), a token a little below the top is still greedy's."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt_ids + new_ids[:-1]])).logits[0, len(prompt_ids) - 1:].float()
    return logits.max(-1).values - logits.gather(1, torch.tensor(new_ids)[:, None])[:, 0]


def until_stop(tokens, stop_ids):
    """``tokens`` up to and including the first one in ``stop_ids`` (all of them if none is)."""
    for i, t in enumerate(tokens):
        if t in stop_ids:
            return tokens[: i + 1]
    return tokens


def expected_probs(logits, temperature, top_k, top_p):
    """softmax(logits / T) restricted to top-k, then to the smallest top-p nucleus (closed form, HF's
    order of the warpers). logits: [V] -> float64 [V]."""
    z = logits.double() / temperature
    order = torch.argsort(z, descending=True)
    keep = torch.zeros_like(z, dtype=torch.bool)
    keep[order[:top_k] if top_k else order] = True
    p = torch.where(keep, z, torch.tensor(float("-inf"), dtype=z.dtype)).softmax(-1)
    mass, nucleus = 0.0, torch.zeros_like(keep)
    for i in order.tolist():
        if not keep[i] or mass >= top_p:
            break
        nucleus[i] = True
        mass += float(p[i])
    return torch.where(nucleus, p, torch.zeros_like(p)) / p[nucleus].sum()


def next_token_marginals(sm, prompt, filtered, steps):
    """Exact P(generated token j) for j < steps: sum over every earlier continuation of its
    probability times filtered(logits) after it (``filtered``: logits [V] -> probabilities [V]).
    -> [steps, V] float64."""
    seqs, weights, out = [list(prompt)], torch.ones(1, dtype=torch.float64), []
    for _ in range(steps):
        logits = sm.forward(torch.tensor(seqs), sm.new_cache(len(seqs), len(seqs[0])))[:, -1]  # [N, V]
        probs = torch.stack([filtered(row) for row in logits])  # [N, V]
        out.append(weights @ probs)
        V = probs.shape[1]
        weights = (weights[:, None] * probs).reshape(-1)
        seqs = [s + [t] for s in seqs for t in range(V)]
    return torch.stack(out)


def chi_square_pooled(counts, expect, n, least=5.0):
    """(chi-square, dof) of observed counts against n * expect, bins expected below ``least``
    pooled into one so the statistic keeps its distribution."""
    exp = expect * n
    small = exp < least
    obs = torch.cat([counts[~small], counts[small].sum().reshape(1)])
    exp = torch.cat([exp[~small], exp[small].sum().reshape(1)])
    keep = exp > 0
    assert counts[expect == 0].sum() == 0, "a token of probability 0 was sampled"
    return float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()), int(keep.sum()) - 1


def assert_follows(tokens, expect):
    """Chi-square of drawn tokens against the probabilities ``expect`` [V] (p < 1e-4 under the
    null: dof + 4.5 sqrt(2 dof) + 10 bounds the tail for these dofs)."""
    counts = torch.bincount(torch.tensor(tokens), minlength=expect.shape[0]).double()
    chi2, dof = chi_square_pooled(counts, expect, len(tokens))
    assert chi2 < dof + 4.5 * (2 * dof) ** 0.5 + 10, (chi2, dof)

