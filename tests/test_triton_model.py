"""The model runner on SWIFTKERN_BACKEND=triton: every decoder-layer op, verification and
acceptance run as Triton kernels (the interpreter on CPU, natively on a GPU).

Tiny random models: logits against the reference backend, greedy tokens against HF. SmolLM2:
ar and self-spec greedy on the GPU, token-identical to HF greedy on the GPU.
"""

import pytest
import torch

from conftest import tiny_model
from swiftkern import Generator, LayerSet, SkipModel, ops
from triton_cases import DEVICE, backend, needs_gpu, plans  # noqa: F401 (plans: a fixture)

LAYER_OPS = ("rms_norm", "fused_add_rms_norm", "silu_mul", "rope_kv_append", "verify_attention")


def hf_greedy_on(hf, prompt_ids, max_new_tokens):
    """HF generate, greedy, batch 1, on the model's device -> new token ids, up to and
    including the first EOS (as conftest.hf_greedy, on any device)."""
    ids = torch.tensor([prompt_ids], device=hf.device)
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                          pad_token_id=0)[0, len(prompt_ids):].tolist()
    eos = hf.generation_config.eos_token_id
    eos = {eos} if isinstance(eos, int) else set(eos or [])
    return next((out[: i + 1] for i, t in enumerate(out) if t in eos), out)


def run_steps(model, layer_set):
    """Prefill rows of different lengths, a T = 3 verify chunk, a decode step -> all logits."""
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16]]
    cache = model.new_cache(3, 16)
    width = max(map(len, prompts))
    padded = torch.tensor([p + [1] * (width - len(p)) for p in prompts], device=DEVICE)
    logits = [model.forward(padded, cache)]
    cache.rollback([len(p) for p in prompts])
    logits.append(model.forward(torch.tensor([[20, 21, 22], [23, 24, 25], [26, 27, 28]], device=DEVICE), cache,
                                layer_set=layer_set))
    logits.append(model.forward(torch.tensor([[30], [31], [32]], device=DEVICE), cache, layer_set=layer_set))
    return logits, cache


@pytest.mark.parametrize("layer_set", [None, "attn:1|mlp:1,2", "attn:1,2|mlp:2"])
def test_forward_matches_the_reference_backend(layer_set, plans):
    model = SkipModel.from_hf(tiny_model("llama", num_hidden_layers=4).to(DEVICE))
    ls = LayerSet.parse(layer_set, 4) if layer_set else None
    with backend("reference"):
        want, want_cache = run_steps(model, ls)
    with backend("triton"):
        assert all(ops.backend_for(op, DEVICE) == "triton" for op in LAYER_OPS)
        got, got_cache = run_steps(model, ls)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
    for b, n in enumerate(want_cache.host_lengths):  # the cache of record agrees where it is valid
        torch.testing.assert_close(got_cache.k[:, b, :, :n], want_cache.k[:, b, :, :n], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # qwen3: the per-head q/k norms through Triton's rms_norm
def test_ar_and_self_spec_greedy_match_hf(plans, arch):
    hf = tiny_model(arch, num_hidden_layers=4).to(DEVICE)
    prompt = [5, 17, 99, 3, 250, 7]
    want = hf_greedy_on(hf, prompt, 10)
    with backend("triton"):
        ar = Generator(hf).generate([prompt], max_new_tokens=10).tokens[0]
        spec = Generator(hf, mode="self-spec", drafter="layer-skip", layer_set="attn:2|mlp:1", k_max=3,
                         eps=0.0).generate([prompt], max_new_tokens=10)
    assert ar == want
    assert spec.tokens[0] == want and spec.stats["verify_steps"] > 0


@needs_gpu
@pytest.mark.slow
def test_smollm2_on_gpu_with_triton_matches_hf_greedy():
    import swiftkern

    model, tok = swiftkern.load_model("smollm2", device="cuda")
    prompts = ["The capital of France is", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"]
    ids = [tok(p)["input_ids"] for p in prompts]
    want = [hf_greedy_on(model.hf_model, p, 48) for p in ids]
    with backend("triton"):
        info = ops.backend_info()["ops"]
        assert all(info[op]["cuda"] == "triton" for op in LAYER_OPS + ("greedy_accept",)), info
        ar = Generator(model, tok).generate(prompts, max_new_tokens=48)
        spec = Generator(model, tok, mode="self-spec", drafter="layer-skip", layer_set="attn:9,13,17,21|mlp:11,15,19",
                         eps=0.6).generate(prompts, max_new_tokens=48)
    assert ar.tokens == want
    assert spec.tokens == want and spec.stats["verify_steps"] > 0
