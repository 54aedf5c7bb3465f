"""An HF model changed after it was wrapped (swiftkern/modules_read.py): what replaces a module
or a weight tensor the runner reads, or changes its dtype or shape, is refused at the next
``generate`` naming it, where before the old weights' tokens came back or a kernel failed; what
changes values in place is read as it is, and equals HF greedy on the changed model."""

import pytest
import torch

from conftest import hf_greedy, tiny_model
from test_model import AdapterLinear
from swiftkern import Generator, SkipModel, SwiftkernError
from swiftkern.layer_kernels import invariant_kernels_available

PROMPT = [5, 6, 7, 8, 9, 10, 11]
OPTIONS = {"ar": {}, "self-spec": {"layer_set": "mlp:1"}, "deterministic": {}}


def new_head(hf):
    hf.lm_head.weight = torch.nn.Parameter(hf.lm_head.weight.detach() * -1)


def new_module(hf):
    old = hf.model.layers[0].mlp.down_proj
    hf.model.layers[0].mlp.down_proj = torch.nn.Linear(old.in_features, old.out_features, bias=False)


def new_norm(hf):
    hf.model.norm.weight = torch.nn.Parameter(torch.full_like(hf.model.norm.weight, 3.0))


def fewer_layers(hf):
    hf.model.layers = hf.model.layers[:2]
    hf.config.num_hidden_layers = 2


def adapter(hf):
    layer = hf.model.layers[1].self_attn
    layer.v_proj = AdapterLinear(layer.v_proj)


CHANGES = {  # name: (change, what the refusal names)
    "lm_head-parameter": (new_head, r"lm_head\.weight is another tensor"),
    "new-module": (new_module, r"model\.layers\.0\.mlp\.down_proj is another module \(Linear\)"),
    "final-norm-parameter": (new_norm, r"model\.norm\.weight is another tensor"),
    "fewer-layers": (fewer_layers, r"it has 2 layers, it had 4"),
    "adapter": (adapter, r"model\.layers\.1\.self_attn\.v_proj is another module \(AdapterLinear\)"),
    "to-bfloat16": (lambda hf: hf.to(torch.bfloat16), r"model\.embed_tokens\.weight is torch\.bfloat16 \(301, 64\)"),
    "half": (lambda hf: hf.half(), r"model\.embed_tokens\.weight is torch\.float16"),
    "resized-vocabulary": (lambda hf: hf.resize_token_embeddings(306, mean_resizing=False),
                           r"model\.embed_tokens\.weight is torch\.float32 \(306, 64\) on cpu, was torch\.float32 "
                           r"\(301, 64\)"),
}


@pytest.mark.parametrize("mode", list(OPTIONS))
@pytest.mark.parametrize("change", list(CHANGES))
def test_a_module_or_tensor_replaced_since_the_wrap_is_refused_by_name(change, mode):
    """Before: lm_head-parameter, new-module, final-norm-parameter and fewer-layers gave the old
    model's tokens, adapter gave the base weights' ones, to-bfloat16 and half failed inside a
    kernel. A model wrapped again after the change decodes as HF (bf16 / fp16: as itself in ar)."""
    hf = tiny_model("llama", seed=1)
    gen = Generator(SkipModel.from_hf(hf), mode=mode, **OPTIONS[mode])
    assert gen.generate([PROMPT], max_new_tokens=8, eos_token_id=[]).tokens[0] == hf_greedy(hf, PROMPT, 8, [])
    make, names = CHANGES[change]
    make(hf)
    with pytest.raises(SwiftkernError, match=r"the HF model changed since this SkipModel wrapped it: " + names):
        gen.generate([PROMPT], max_new_tokens=8, eos_token_id=[])
    if change == "adapter":  # refused when wrapped, as before
        with pytest.raises(SwiftkernError, match="not a plain torch.nn.Linear"):
            SkipModel.from_hf(hf)
        return
    if mode == "deterministic" and not invariant_kernels_available("cpu", hf.dtype):
        return  # half precision without the C++ kernels: mode deterministic refuses the model (test_deterministic)
    again = Generator(SkipModel.from_hf(hf), mode=mode, **OPTIONS[mode]).generate([PROMPT], max_new_tokens=8,
                                                                                  eos_token_id=[]).tokens[0]
    if hf.dtype == torch.float32:
        assert again == hf_greedy(hf, PROMPT, 8, [])
    else:  # half precision: swiftkern's own ar on the converted model (HF's rounding differs)
        assert again == Generator(SkipModel.from_hf(hf)).generate([PROMPT], max_new_tokens=8,
                                                                  eos_token_id=[]).tokens[0]


def write_in_place(hf):
    with torch.no_grad():
        hf.lm_head.weight.mul_(-1)


def write_through_data(hf):
    hf.model.norm.weight.data = torch.full_like(hf.model.norm.weight, 3.0)  # the same Parameter, new storage


def load_state(hf):
    state = {k: -v if k == "model.norm.weight" else v for k, v in hf.state_dict().items()}
    hf.load_state_dict(state)


@pytest.mark.parametrize("mode", list(OPTIONS))
@pytest.mark.parametrize("change", [write_in_place, write_through_data, load_state],
                         ids=["in-place", "through-data", "load_state_dict"])
def test_values_changed_in_place_are_read_as_they_are(change, mode):
    """The same modules and tensor objects with new values: not refused, and the next call
    equals HF greedy on the changed model (each change alone moves HF's tokens here)."""
    hf = tiny_model("llama", seed=1)
    gen = Generator(SkipModel.from_hf(hf), mode=mode, **OPTIONS[mode])
    before = gen.generate([PROMPT], max_new_tokens=8, eos_token_id=[]).tokens[0]
    change(hf)
    want = hf_greedy(hf, PROMPT, 8, [])
    assert want != before
    assert gen.generate([PROMPT], max_new_tokens=8, eos_token_id=[]).tokens[0] == want


def test_qwen3s_head_norm_replaced_is_refused():
    hf = tiny_model("qwen3", seed=1)
    model = SkipModel.from_hf(hf)
    model.check_unchanged()
    attn = hf.model.layers[2].self_attn
    attn.k_norm = type(attn.k_norm)(attn.k_norm.weight.shape[0])
    with pytest.raises(SwiftkernError, match=r"model\.layers\.2\.self_attn\.k_norm is another module"):
        model.check_unchanged()


@pytest.mark.parametrize("mode", ["ar", "self-spec"])
@pytest.mark.parametrize("write", ["through-data", "in-place"])
def test_graphs_captured_on_weights_that_moved_are_dropped(mode, write):
    """A write through ``param.data = ...`` keeps the parameter and moves its storage: a graph
    captured before reads the old address (the emulation failed: "used memory from outside the
    graph that has been freed since"; a GPU reads old or reused memory). The runner now drops its
    graphs when the weights' addresses moved, and the call equals HF greedy on the new weights;
    in-place writes keep the graphs."""
    from swiftkern.cuda_graphs import GraphRunner
    from swiftkern.graph_capture import EmulatedGraph

    hf = tiny_model("llama", seed=1)
    model = SkipModel.from_hf(hf)
    runner = GraphRunner(model, EmulatedGraph)
    gen = Generator(model, mode=mode, cuda_graphs=runner, **OPTIONS[mode])
    for _ in range(3):
        gen.generate([PROMPT], max_new_tokens=8, eos_token_id=[])
    assert runner.stats()["captures"] > 0 and runner.stats()["replays"] > 0
    graphs = len(runner.entries)
    if write == "through-data":
        hf.lm_head.weight.data = -hf.lm_head.weight.detach().clone()
        hf.model.norm.weight.data = hf.model.norm.weight.detach() * 2
    else:
        with torch.no_grad():
            hf.lm_head.weight.neg_()
    want = hf_greedy(hf, PROMPT, 8, [])
    assert gen.generate([PROMPT], max_new_tokens=8, eos_token_id=[]).tokens[0] == want
    if write == "through-data":
        assert runner.weight_moves == 1
    else:
        assert runner.weight_moves == 0 and len(runner.entries) >= graphs
