"""A model whose weights are not all in memory, on one device, in one dtype a kernel runs, is
refused when it is wrapped, naming the tensor and the fix. Before, each failed inside a kernel:
accelerate's offload with "Cannot copy out of meta tensor", a bf16 LM head in a float32 model
with "self.size(-1) must be divisible by 2 to view BFloat16 as Int", a float64 model in the
first kernel of the reference, C++ or Triton path."""

from types import SimpleNamespace

import pytest
import torch

from conftest import tiny_model
from swiftkern import Generator, SkipModel, SwiftkernError
from swiftkern.weight_checks import check_weights_placed


def one_layer_to(dtype_or_device, layer=1, part=None):
    model = tiny_model("llama")
    module = model.model.layers[layer] if part is None else model.model.layers[layer].get_submodule(part)
    module.to(dtype_or_device)
    return model


def accelerate_offloaded():
    accelerate = pytest.importorskip("accelerate")
    model = tiny_model("llama")
    accelerate.cpu_offload(model, execution_device=torch.device("cpu"))
    return model


def rope_buffer_on_meta():
    model = tiny_model("llama")
    rotary = model.model.rotary_emb
    rotary.inv_freq = torch.empty_like(rotary.inv_freq, device="meta")
    return model


def bf16_head():
    model = tiny_model("llama")
    model.lm_head.to(torch.bfloat16)
    return model


CASES = {
    "accelerate-offload": (accelerate_offloaded, r"model\.embed_tokens\.weight is on the meta device .*"
                                                 r"device_map=\{'': 'cpu'\}"),
    "one-layer-on-meta": (lambda: one_layer_to("meta", 3), r"model\.layers\.3\.self_attn\.q_proj\.weight is on the meta"),
    "rope-buffer-on-meta": (rope_buffer_on_meta, r"model\.rotary_emb\.inv_freq is on the meta device"),
    "a-bf16-layer": (lambda: one_layer_to(torch.bfloat16), r"model\.layers\.1\.self_attn\.q_proj\.weight is "
                                                           r"torch\.bfloat16, the embedding torch\.float32.*"
                                                           r"model\.to\(torch\.float32\)"),
    "a-float64-projection": (lambda: one_layer_to(torch.float64, 2, "mlp.up_proj"),
                             r"model\.layers\.2\.mlp\.up_proj\.weight is torch\.float64"),
    "a-bf16-norm": (lambda: one_layer_to(torch.bfloat16, 0, "post_attention_layernorm"),
                    r"model\.layers\.0\.post_attention_layernorm\.weight is torch\.bfloat16"),
    "a-bf16-head": (bf16_head, r"lm_head\.weight is torch\.bfloat16, the embedding torch\.float32"),
    "float64": (lambda: tiny_model("llama").to(torch.float64), r"the model's weights are torch\.float64: swiftkern "
                                                               r"runs float32, bfloat16 or float16"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_weights_it_cannot_run_are_refused_when_wrapped(case):
    make, match = CASES[case]
    with pytest.raises(SwiftkernError, match=match):
        SkipModel.from_hf(make())
    with pytest.raises(SwiftkernError, match=match):  # the Generator wraps an HF model the same way
        Generator(make())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_one_dtype_it_runs_is_taken(dtype):
    model = tiny_model("llama").to(dtype)
    out = Generator(model).generate([[1, 2, 3]], max_new_tokens=3)
    assert len(out.tokens[0]) == 3


def fake(device="cpu", dtype=torch.float32, meta=False):
    return SimpleNamespace(device=torch.device(device), dtype=dtype, is_meta=meta)


def test_a_second_device_is_refused_naming_both():
    """Without two devices here: the check alone, on stand-ins that say where they are."""
    embed = fake("cuda:0")
    model = SimpleNamespace(model=SimpleNamespace(embed_tokens=SimpleNamespace(weight=embed)),
                            named_parameters=lambda: [("model.embed_tokens.weight", embed),
                                                      ("model.layers.5.mlp.down_proj.weight", fake("cuda:1"))],
                            named_buffers=lambda: [])
    with pytest.raises(SwiftkernError, match=r"model\.layers\.5\.mlp\.down_proj\.weight is on cuda:1, the embedding "
                                             r"on cuda:0.*device_map=\{'': 'cuda:0'\}"):
        check_weights_placed(model)
    model.named_parameters = lambda: [("model.embed_tokens.weight", embed)]
    model.named_buffers = lambda: [("model.rotary_emb.inv_freq", fake("cpu"))]
    with pytest.raises(SwiftkernError, match=r"model\.rotary_emb\.inv_freq is on cpu, the embedding on cuda:0"):
        check_weights_placed(model)
    model.named_buffers = lambda: [("model.rotary_emb.inv_freq", fake("cuda:0", torch.float32))]
    check_weights_placed(model)  # one device; a float32 buffer beside float32 weights


def test_a_float32_buffer_beside_bf16_weights_is_taken():
    """RoPE's frequencies stay float32 in a bf16 HF model: only parameters must share the dtype."""
    model = tiny_model("llama").to(torch.bfloat16)
    model.model.rotary_emb.inv_freq = model.model.rotary_emb.inv_freq.float()
    SkipModel.from_hf(model)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_head_left_on_the_cpu_is_refused_on_a_gpu():
    model = tiny_model("llama").cuda()
    model.lm_head.to("cpu")
    with pytest.raises(SwiftkernError, match=r"lm_head\.weight is on cpu, the embedding on cuda:0"):
        SkipModel.from_hf(model)
