"""Liger-style patching of HF modules with swiftkern ops: same outputs, ops really used, undo."""

import pytest
import torch

import swiftkern
from swiftkern import ops, patching
from swiftkern.errors import SwiftkernError

from conftest import tiny_model

# dtype: (atol, rtol) of patched vs unpatched outputs
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 1.6e-2)}
APPLY = {"llama": swiftkern.apply_swiftkern_to_llama, "mistral": swiftkern.apply_swiftkern_to_mistral,
         "qwen2": swiftkern.apply_swiftkern_to_qwen2, "qwen3": swiftkern.apply_swiftkern_to_qwen3}


@pytest.fixture
def spy(monkeypatch):
    """Counts calls of swiftkern.ops.rms_norm / silu_mul (still computing with them)."""
    calls = {"rms_norm": 0, "silu_mul": 0}
    for name in calls:
        real = getattr(ops, name)

        def counted(*args, _real=real, _name=name):
            calls[_name] += 1
            return _real(*args)
        monkeypatch.setattr(ops, name, counted)
    return calls


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits.float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("level", ["instance", "class"])
def test_patched_model_matches_unpatched(arch, dtype, level, spy):
    model = tiny_model(arch, seed=2).to(dtype)
    ids = torch.randint(3, 300, (2, 19))
    want = _logits(model, ids)
    patch = APPLY[arch](model=model if level == "instance" else None)
    try:
        got = _logits(model, ids)
    finally:
        patch.undo()
    layers = model.config.num_hidden_layers
    head_norms = 2 * layers if arch == "qwen3" else 0  # qwen3: each attention's query and key norms too
    assert spy == {"rms_norm": 2 * layers + 1 + head_norms, "silu_mul": layers}  # the patched forwards ran
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(got, want, atol=atol * want.abs().max().item(), rtol=rtol)
    assert torch.equal(_logits(model, ids), want)  # undone


def test_a_second_patch_of_a_model_owns_nothing_the_first_patched():
    """p2 on a model p1 patched reported its modules patched, then p1.undo() unpatched them
    under it; now p2 takes (and reports) none, as a second class patch does."""
    model = tiny_model("llama")
    p1 = swiftkern.apply_swiftkern_to_llama(model=model)
    p2 = swiftkern.apply_swiftkern_to_llama(model=model)
    assert p1.targets and p2.targets == []
    p2.undo()
    assert patching.is_patched(model.model.norm)
    p1.undo()
    assert not patching.is_patched(model.model.norm)
    hooked = model.model.norm.forward  # a forward of the instance's own that is not swiftkern's (a
    model.model.norm.forward = lambda x: hooked(x)  # hook's, as accelerate sets): patched as before
    with swiftkern.apply_swiftkern_to_llama(model=model):
        assert patching.is_patched(model.model.norm)


def test_a_norm_weight_of_another_dtype_runs_as_hf():
    """A float32 norm weight in a bfloat16 model (HF promotes the output to float32) and a
    float64 model were refused by the patched norm: they now run HF's own arithmetic."""
    norm = tiny_model("llama").model.norm
    x = torch.randn(3, 64)
    for x_dtype, w_dtype in ((torch.bfloat16, torch.float32), (torch.float64, torch.float64)):
        norm.to(w_dtype)
        want = norm(x.to(x_dtype))
        patch = swiftkern.apply_swiftkern_to_llama(model=norm)
        try:
            got = norm(x.to(x_dtype))
        finally:
            patch.undo()
        assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize("backend", ["cpp", "triton", "reference"])
def test_a_patched_model_trains_with_the_unpatched_gradients(backend, spy):
    """The kernels compute forward only: a patched model's loss.backward() ran and only the LM
    head got a gradient (1 of 39 parameters). Now every parameter's gradient is HF's own."""
    from triton_cases import backend as use_backend

    model = tiny_model("llama", seed=4).train()
    ids = torch.randint(3, 300, (2, 11))

    def grads():
        model.zero_grad()
        model(ids, labels=ids).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    want = grads()
    patch = swiftkern.apply_swiftkern_to_llama(model=model)
    try:
        with use_backend(backend):
            got = grads()
    finally:
        patch.undo()
    assert spy["rms_norm"] and spy["silu_mul"]
    assert got.keys() == want.keys() and len(want) == len(list(model.parameters()))
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-5 * want[name].abs().max().item(), rtol=1e-4,
                                   msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [111, 64])
def test_modules_on_odd_shapes(dtype, hidden):
    from types import SimpleNamespace

    from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

    torch.manual_seed(0)
    norm = LlamaRMSNorm(hidden, eps=1e-5)
    norm.weight.data.normal_(1.0, 0.3)
    mlp = LlamaMLP(SimpleNamespace(hidden_size=hidden, intermediate_size=989, mlp_bias=True, hidden_act="silu"))
    norm, mlp = norm.to(dtype), mlp.to(dtype)
    x = torch.randn(3, 19, hidden, dtype=dtype) * 4
    with torch.no_grad():
        want = norm(x), mlp(x)
        with swiftkern.apply_swiftkern_to_llama(model=torch.nn.ModuleList([norm, mlp])):
            assert patching.is_patched(norm) and patching.is_patched(mlp)
            got = norm(x), mlp(x)
    atol, rtol = TOLERANCE[dtype]
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        torch.testing.assert_close(g, w, atol=atol * w.abs().max().item(), rtol=rtol)
    assert not patching.is_patched(norm) and not patching.is_patched(mlp)


def test_class_patch_reaches_models_built_after_it(spy):
    patch = swiftkern.apply_swiftkern_to_llama()
    try:
        assert set(patch.targets) == {"LlamaRMSNorm", "LlamaMLP"}
        model = tiny_model("llama")  # constructed after patching, as from_pretrained would
        assert patching.is_patched(model.model.norm) and patching.is_patched(model.model.layers[0].mlp)
        _logits(model, torch.tensor([[4, 5, 6]]))
        assert spy["rms_norm"] > 0 and spy["silu_mul"] > 0
        assert not patching.is_patched(tiny_model("qwen2").model.norm)  # other families untouched
        again = swiftkern.apply_swiftkern_to_llama()  # a second patch changes nothing
        assert again.targets == []
    finally:
        patch.undo()
    before = dict(spy)
    _logits(model, torch.tensor([[4, 5, 6]]))
    assert spy == before and not patching.is_patched(model.model.norm)


def test_options_select_what_is_patched(spy):
    model = tiny_model("llama")
    with swiftkern.apply_swiftkern_to_llama(model=model, rms_norm=False):
        _logits(model, torch.tensor([[4, 5]]))
    assert spy["rms_norm"] == 0 and spy["silu_mul"] == model.config.num_hidden_layers


def test_non_silu_mlp(spy):
    model = tiny_model("llama", hidden_act="gelu")
    with pytest.raises(SwiftkernError, match="swiglu=False"):
        swiftkern.apply_swiftkern_to_llama(model=model)
    want = _logits(model, torch.tensor([[4, 5, 6]]))
    with swiftkern.apply_swiftkern_to_llama():  # class level: the gelu MLP keeps HF's forward
        got = _logits(model, torch.tensor([[4, 5, 6]]))
    assert spy["silu_mul"] == 0 and spy["rms_norm"] > 0
    atol, rtol = TOLERANCE[torch.float32]  # the C++ norm sums in another order than torch's mean
    torch.testing.assert_close(got, want, atol=atol * want.abs().max().item(), rtol=rtol)


def test_wrong_family_or_object_is_refused():
    with pytest.raises(SwiftkernError, match="apply_swiftkern_to"):
        swiftkern.apply_swiftkern_to_llama(model=tiny_model("qwen2"))
    with pytest.raises(SwiftkernError, match="torch.nn.Module"):
        swiftkern.apply_swiftkern_to_llama(model="meta-llama/Llama-3")


def test_patched_model_generates_the_same_tokens():
    model = tiny_model("llama", seed=4)
    ids = torch.tensor([[7, 8, 9, 10]])
    kw = dict(max_new_tokens=12, do_sample=False)
    with torch.no_grad():
        want = model.generate(ids, **kw)
        with swiftkern.apply_swiftkern_to_llama(model=model):
            got = model.generate(ids, **kw)
    assert torch.equal(got, want)
