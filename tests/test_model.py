"""SkipModel against HF transformers' own forward on tiny random models."""

import warnings

import pytest
import torch

from conftest import tiny_model
from swiftkern import LayerSet, SkipModel, SwiftkernError

ARCHS = ["llama", "qwen2", "mistral", "qwen3"]


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_matches_hf(arch):
    # random biases (conftest), the MLP's too where the family has them
    hf = tiny_model(arch, attention_bias=True, mlp_bias=True) if arch == "llama" else tiny_model(arch)
    model = SkipModel.from_hf(hf)
    ids = [5, 17, 99, 3, 250, 7, 8]
    cache = model.new_cache(1, 16)
    ours = model.forward(torch.tensor([ids]), cache)[0]
    torch.testing.assert_close(ours, hf_logits(hf, ids), rtol=1e-4, atol=1e-4)
    assert cache.host_lengths == [7]


@pytest.mark.parametrize("arch", ARCHS)
def test_rows_at_different_lengths_decode_and_verify(arch):
    """Rows continue at their own positions; a T=3 chunk is causal within itself."""
    hf = tiny_model(arch)
    model = SkipModel.from_hf(hf)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16]]
    cache = model.new_cache(3, 16)
    width = max(map(len, prompts))
    padded = torch.tensor([p + [1] * (width - len(p)) for p in prompts])
    model.forward(padded, cache)
    cache.rollback([len(p) for p in prompts])
    chunk = torch.tensor([[20, 21, 22], [23, 24, 25], [26, 27, 28]])
    ours = model.forward(chunk, cache)  # [3, 3, V]
    for b, p in enumerate(prompts):
        ref = hf_logits(hf, p + chunk[b].tolist())[-3:]
        torch.testing.assert_close(ours[b], ref, rtol=1e-4, atol=1e-4)
    assert cache.host_lengths == [9, 5, 7]


def test_logits_positions_selects_rows():
    hf = tiny_model("llama")
    model = SkipModel.from_hf(hf)
    tokens = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    full = model.forward(tokens, model.new_cache(2, 8))
    some = model.forward(tokens, model.new_cache(2, 8), logits_positions=torch.tensor([[3], [1]]))
    torch.testing.assert_close(some[:, 0], torch.stack([full[0, 3], full[1, 1]]))


def test_skipping_equals_zeroed_sublayers():
    """A skipped attention/MLP leaves the residual unchanged: the same as HF with that
    sub-layer's output projection zeroed (an independent reference)."""
    hf = tiny_model("llama", num_hidden_layers=5)
    model = SkipModel.from_hf(hf)
    ls = LayerSet(5, skip_attn=(1, 3), skip_mlp=(2, 3))
    ids = [4, 8, 15, 16, 23, 42]
    ours = model.forward(torch.tensor([ids]), model.new_cache(1, 8), layer_set=ls)[0]
    zeroed = tiny_model("llama", num_hidden_layers=5)
    with torch.no_grad():
        for i in ls.skip_attn:
            zeroed.model.layers[i].self_attn.o_proj.weight.zero_()
        for i in ls.skip_mlp:
            zeroed.model.layers[i].mlp.down_proj.weight.zero_()
    torch.testing.assert_close(ours, hf_logits(zeroed, ids), rtol=1e-4, atol=1e-4)


def test_skipped_attention_writes_no_kv():
    model = SkipModel.from_hf(tiny_model("llama"))
    cache = model.new_cache(1, 8)
    cache.k.fill_(float("nan"))
    model.forward(torch.tensor([[3, 4, 5]]), cache, layer_set=LayerSet(4, skip_attn=(2,)))
    assert torch.isnan(cache.k[2, :, :, :3]).all()
    assert not torch.isnan(cache.k[1, :, :, :3]).any()


def test_shares_weights_without_copies():
    hf = tiny_model("llama")
    model = SkipModel.from_hf(hf)
    assert model.layers[0].q.data_ptr() == hf.model.layers[0].self_attn.q_proj.weight.data_ptr()
    assert model.lm_head.data_ptr() == hf.lm_head.weight.data_ptr()


def test_refuses_unsupported_models_and_bad_input():
    from transformers import GPT2Config, GPT2LMHeadModel

    with pytest.raises(SwiftkernError, match="LlamaForCausalLM"):
        SkipModel.from_hf(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2)))
    model = SkipModel.from_hf(tiny_model("llama"))
    with pytest.raises(SwiftkernError, match="layer set is for"):
        model.forward(torch.tensor([[1]]), model.new_cache(1, 4), layer_set=LayerSet(3))
    with pytest.raises(SwiftkernError, match=r"\[B, T\]"):
        model.forward(torch.tensor([[1], [2]]), model.new_cache(1, 4))
    with pytest.raises(SwiftkernError, match="overflow"):
        model.forward(torch.tensor([[1] * 5]), model.new_cache(1, 4))


class AdapterLinear(torch.nn.Module):
    """A LoRA-style wrapper as PEFT's ``lora.Linear``: ``.weight`` is the base layer's and the
    forward adds B(A(x)), which a runner reading ``.weight`` never sees."""

    def __init__(self, base):
        super().__init__()
        self.base_layer = base
        self.lora_a = torch.nn.Linear(base.in_features, 2, bias=False)
        self.lora_b = torch.nn.Linear(2, base.out_features, bias=False)

    @property
    def weight(self):
        return self.base_layer.weight

    @property
    def bias(self):
        return self.base_layer.bias

    def forward(self, x):
        return self.base_layer(x) + self.lora_b(self.lora_a(x))


class ScaledLinear(torch.nn.Linear):
    """A Linear subclass whose forward is not its weight's matmul (as a quantized subclass's)."""

    def __init__(self, plain: torch.nn.Linear):
        super().__init__(plain.in_features, plain.out_features, bias=plain.bias is not None)
        self.load_state_dict(plain.state_dict())

    def forward(self, x):
        return 2.0 * super().forward(x)


def test_modules_it_would_bypass_are_refused():
    """A wrapped or quantized projection ran in HF's forward and not in the runner's: its tokens
    were the plain weights' ones, without an error."""
    model = tiny_model("llama")
    model.model.layers[1].self_attn.v_proj = AdapterLinear(model.model.layers[1].self_attn.v_proj)
    with pytest.raises(SwiftkernError, match=r"model\.layers\.1\.self_attn\.v_proj is a .*AdapterLinear, not a "
                                             r"plain torch\.nn\.Linear.*merge_and_unload"):
        SkipModel(model)
    with warnings.catch_warnings():  # torch 2.13 deprecates its quantized tensors; the module is still a real case
        warnings.simplefilter("ignore")
        quantized = torch.ao.quantization.quantize_dynamic(tiny_model("llama"), {torch.nn.Linear}, dtype=torch.qint8)
    with pytest.raises(SwiftkernError, match=r"lm_head is a torch\.ao\..*Linear, not a plain"):
        SkipModel(quantized)
    # a subclass of Linear with its own forward (bitsandbytes' Linear8bitLt / Linear4bit are): isinstance would take it
    model = tiny_model("llama")
    mlp = model.model.layers[2].mlp
    mlp.down_proj = ScaledLinear(mlp.down_proj)
    with pytest.raises(SwiftkernError, match=r"model\.layers\.2\.mlp\.down_proj is a .*ScaledLinear, not a plain "
                                             r"torch\.nn\.Linear"):
        SkipModel(model)
    SkipModel(tiny_model("llama"))  # plain modules: taken


@pytest.mark.parametrize("mode, options", [("ar", {}), ("self-spec", {"layer_set": "mlp:1"}),
                                           ("deterministic", {"replay": "always"})])
def test_a_config_vocab_size_other_than_the_heads_follows_the_tensors(mode, options):
    """HF's logits have the LM head's rows whatever config.vocab_size says (after surgery on a
    model that left the config behind). Before: a prompt id below the head's rows but past the
    config's was refused, and the replay's logits buffer took the config's width."""
    from conftest import hf_greedy
    from swiftkern import Generator

    hf = tiny_model("llama", seed=1)  # 301 rows
    hf.config.vocab_size = 290
    prompt = [5, 6, 7, 295]
    got = Generator(hf, mode=mode, **options).generate([prompt], max_new_tokens=10, eos_token_id=[]).tokens[0]
    assert got == hf_greedy(hf, prompt, 10, [])


def test_counts_the_runner_cannot_follow_are_refused():
    hf = tiny_model("llama")
    hf.config.num_hidden_layers = 3  # HF's forward runs the first 3 of its 4 layers
    with pytest.raises(SwiftkernError, match=r"config\.num_hidden_layers is 3, the model has 4 layers"):
        SkipModel(hf)
    hf = tiny_model("llama")
    hf.model.embed_tokens = torch.nn.Embedding(250, hf.config.hidden_size)
    with pytest.raises(SwiftkernError, match=r"the LM head has 301 rows, the embedding 250"):
        SkipModel(hf)


class LayerWrapper(torch.nn.Module):
    """A wrapper around a whole decoder layer (as activation checkpointing's wraps them)."""

    def __init__(self, layer):
        super().__init__()
        self.wrapped = layer

    def forward(self, *args, **kwargs):
        return self.wrapped(*args, **kwargs)


def test_a_wrapped_decoder_layer_is_refused_by_name():
    """Before: a KeyError ('self_attn') from inside the wrap."""
    model = tiny_model("llama")
    model.model.layers[1] = LayerWrapper(model.model.layers[1])
    with pytest.raises(SwiftkernError, match=r"model\.layers\.1 is a .*LayerWrapper without the decoder layer's "
                                             r"modules .* Unwrap the layers"):
        SkipModel(model)


@pytest.mark.parametrize("args, kwargs, match", [
    ([torch.tensor([[1.0, 2.0]])], {}, r"tokens must be int64 \(or int32\) ids"),
    ([[[1, 2]]], {}, r"tokens must be a tensor \[B, T\]"),
    ([torch.tensor([[1, 301]])], {}, r"tokens must be in \[0, 301\), got min 1, max 301"),
    ([torch.tensor([[-1, 2]])], {}, r"tokens must be in \[0, 301\)"),
    ([torch.tensor([[1, 2]])], dict(layer_set="attn:1"), "layer_set must be None, a LayerSet"),
    ([torch.tensor([[1, 2]])], dict(logits_positions=torch.tensor([[0.0]])), r"logits_positions must be int64 \[B, P\]"),
    ([torch.tensor([[1, 2]])], dict(logits_positions=torch.tensor([1])), r"logits_positions must be int64 \[B, P\]"),
    ([torch.tensor([[1, 2]])], dict(logits_positions=torch.tensor([[2]])), r"logits_positions must be in \[0, 2\)"),
], ids=["float-ids", "list", "id-past-vocab", "negative-id", "layer-set-string", "float-positions",
        "1-D-positions", "position-past-T"])
def test_forward_refuses_what_it_cannot_run(args, kwargs, match):
    """Each with a SwiftkernError before any kernel runs (they were a RuntimeError, IndexError
    or AttributeError from inside), and the cache is left as it was."""
    model = SkipModel.from_hf(tiny_model("llama"))
    cache = model.new_cache(1, 8)
    with pytest.raises(SwiftkernError, match=match):
        model.forward(*args, cache, **kwargs)
    assert cache.host_lengths == [0] and cache.lengths.tolist() == [0]


def test_forward_and_cache_arguments_of_the_wrong_kind_are_refused():
    model = SkipModel.from_hf(tiny_model("llama"))
    cache = model.new_cache(1, 8)
    with pytest.raises(SwiftkernError, match="cache must be a KVCache"):
        model.forward(torch.tensor([[1]]), None)
    for bad in (dict(batch=1.5, max_len=8), dict(batch=1, max_len="8")):
        with pytest.raises(SwiftkernError, match="must be an integer"):
            model.new_cache(**bad)
    with pytest.raises(SwiftkernError, match="rollback length must be an integer"):
        cache.rollback([0.5])


@pytest.mark.parametrize("backend", ["auto", "reference"])
@pytest.mark.parametrize("change", [dict(num_layers=5), dict(num_layers=3), dict(num_kv_heads=3),
                                    dict(head_dim=32), dict(dtype=torch.float64)],
                         ids=["more-layers", "fewer-layers", "heads", "head-dim", "dtype"])
def test_a_cache_made_for_another_model_is_refused(backend, change):
    """Before: the reference backend ran on a cache with a layer too many, and the others failed
    inside a kernel (an IndexError, or torch's "expanded size" / "same dtype" message)."""
    from triton_cases import backend as use_backend
    from swiftkern import KVCache

    model = SkipModel.from_hf(tiny_model("llama"))
    dims = dict(num_layers=model.num_layers, batch=1, num_kv_heads=model.num_kv_heads, max_len=8,
                head_dim=model.head_dim, dtype=model.dtype, device=model.device)
    cache = KVCache(**{**dims, **change})
    with use_backend(backend):
        with pytest.raises(SwiftkernError, match=r"the cache holds .* make it with model.new_cache"):
            model.forward(torch.tensor([[1, 2]]), cache)
        assert cache.host_lengths == [0]
        model.forward(torch.tensor([[1, 2]]), KVCache(**dims))  # the model's own shape runs


def test_load_model_refuses_a_dtype_it_would_not_use():
    import swiftkern

    for dtype in ("tpu", 5, torch.int64):  # the second positional argument is the dtype, not the device
        with pytest.raises(SwiftkernError, match="dtype must be float32, bfloat16 or float16"):
            swiftkern.load_model("smollm2", dtype)
    with pytest.raises(SwiftkernError, match="convert an HF model object yourself"):
        swiftkern.load_model(tiny_model("llama"), dtype=torch.bfloat16)
    model, tokenizer = swiftkern.load_model(tiny_model("llama"))
    assert tokenizer is None and model.dtype == torch.float32


def test_a_model_path_from_home_or_an_upper_case_gguf_is_found(tmp_path, monkeypatch):
    """From Python no shell expands "~": load_model("~/tiny") was "unknown model", and so was a
    file named "X.GGUF"."""
    import swiftkern

    monkeypatch.setenv("HOME", str(tmp_path))
    tiny_model("llama").save_pretrained(tmp_path / "tiny")
    with pytest.raises(SwiftkernError, match=r"could not load the tokenizer of '.*tiny'"):
        swiftkern.load_model("~/tiny")  # the folder is found and its model loads; it has no tokenizer
    with pytest.raises(SwiftkernError, match=rf"model file '{tmp_path}/X.GGUF' does not exist"):
        swiftkern.load_model("~/X.GGUF")


def test_a_damaged_model_folder_is_refused_in_one_line(tmp_path):
    """A truncated safetensors file and weights of other shapes than the config's came out of
    load_model as transformers' own tracebacks (the CLI exited 1, not 2); a pathlib.Path folder
    was refused as an unsupported model; a folder without tokenizer files was named a tokenizer
    problem even when the model itself could not load."""
    import json

    import swiftkern

    folder = tmp_path / "tiny"
    tiny_model("llama").save_pretrained(folder)
    with pytest.raises(SwiftkernError, match=r"could not load the tokenizer of .*tiny"):
        swiftkern.load_model(folder)  # a Path: its weights load, the folder has no tokenizer
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(config, intermediate_size=100)))
    with pytest.raises(SwiftkernError, match=r"could not load the model of .*tiny.*: RuntimeError"):
        swiftkern.load_model(str(folder))
    (folder / "config.json").write_text(json.dumps(config))
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(SwiftkernError, match=r"could not load the model of .*tiny"):
        swiftkern.load_model(str(folder))


def test_pack_weights_must_be_a_flag():
    with pytest.raises(SwiftkernError, match=r"pack_weights \(None: where it pays\) must be True or False"):
        SkipModel.from_hf(tiny_model("llama"), pack_weights="yes")
