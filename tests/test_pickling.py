"""A Generator (and its SkipModel) copies and pickles: ``copy.deepcopy`` for an independent one,
a ``spawn`` / ``forkserver`` worker's argument (multiprocessing's default from Python 3.14, and
the fix for fork's OpenMP hang). Before, each failed with "cannot pickle '_thread.RLock' object".
The copy decodes the original's tokens in every mode, with a lock and packed weights of its own;
a CUDA graph runner is refused, naming what to do."""

import copy
import multiprocessing
import pickle

import pytest
import torch

from conftest import gguf_like, tiny_model
from swiftkern import Generator, SkipModel, SwiftkernError
from swiftkern.cuda_graphs import GraphRunner
from swiftkern.graph_capture import EmulatedGraph

PROMPTS = [[1, 2, 3, 1, 2, 3, 1, 2], [7, 30, 41]]
CONFIGS = [dict(mode="ar"), dict(mode="self-spec", drafter="lookup"), dict(mode="self-spec", layer_set="attn:1|mlp:2"),
           dict(mode="self-spec", layer_set="auto"), dict(mode="deterministic"),
           dict(mode="deterministic", replay="always", window=4)]
CALL = dict(max_new_tokens=24)


def decode(gen, **kwargs):
    return gen.generate(PROMPTS, **CALL, **kwargs).tokens


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "-".join(map(str, c.values())))
@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_decodes_the_originals_tokens(cfg, how):
    gen = Generator(tiny_model("llama"), **cfg)
    want = [decode(gen), decode(gen, do_sample=True, temperature=0.8, seed=5)]  # after a call: state to carry
    other = copy.deepcopy(gen) if how == "deepcopy" else pickle.loads(pickle.dumps(gen))
    assert other.model is not gen.model and other.model.lock is not gen.model.lock
    assert other.model.hf_model is not gen.model.hf_model
    assert [decode(other), decode(other, do_sample=True, temperature=0.8, seed=5)] == want
    assert [decode(gen), decode(gen, do_sample=True, temperature=0.8, seed=5)] == want  # the original unchanged


def test_a_copy_packs_its_own_weights():
    """Packed weights are made again from the copy's weights: a write to the copy's is the
    copy's alone, and each model reads its own codes."""
    gen = Generator(gguf_like(tiny_model("llama")))
    if gen.model.packed is None:
        pytest.skip("packed weights do not run on this CPU / build")
    want = decode(gen)
    other = copy.deepcopy(gen)
    assert other.model.packed is not None and other.model.packed is not gen.model.packed
    assert decode(other) == want
    with torch.no_grad():
        other.model.hf_model.lm_head.weight.mul_(-1.0)  # the copy's alone
    assert decode(other) != want and decode(gen) == want


def test_an_unpacked_model_stays_unpacked():
    model = SkipModel(gguf_like(tiny_model("llama")), pack_weights=False)
    assert pickle.loads(pickle.dumps(model)).packed is None


def test_a_graph_runner_is_refused_naming_the_fix():
    model = SkipModel(tiny_model("llama"))
    gen = Generator(model, cuda_graphs=GraphRunner(model, EmulatedGraph))
    with pytest.raises(SwiftkernError, match=r"GraphRunner's captured graphs .* cuda_graphs=False"):
        pickle.dumps(gen)
    with model.cuda_graphs(gen.graph_runner):
        with pytest.raises(SwiftkernError, match="inside its cuda_graphs"):
            copy.deepcopy(model)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_model_changed_since_the_wrap_is_not_copied(how):
    """A copy makes its snapshot of what was read from its own HF model (modules_read): after
    ``lm_head.weight = nn.Parameter(...)`` the copy took the new module tree as the wrapped one
    and decoded with the old head, where the original refuses. Now the copy is refused too."""
    hf = tiny_model("llama", seed=1)
    gen = Generator(SkipModel.from_hf(hf), mode="self-spec", layer_set="mlp:1")
    decode(gen)
    hf.lm_head.weight = torch.nn.Parameter(-hf.lm_head.weight.detach())
    with pytest.raises(SwiftkernError, match=r"cannot be copied after its HF model changed .* lm_head\.weight is another"):
        copy.deepcopy(gen) if how == "deepcopy" else pickle.dumps(gen)


def decode_in_worker(gen):
    return decode(gen)


def test_a_spawned_worker_gets_the_generator_and_its_tokens():
    gen = Generator(tiny_model("llama"), mode="self-spec", layer_set="attn:1|mlp:2")
    want = decode(gen)
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        assert pool.apply(decode_in_worker, (gen,)) == want
