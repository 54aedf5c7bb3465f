"""The current CUDA device around work on a model's device (swiftkern/cuda_device.py).

Triton launches on torch's current device, not its tensors': a model on cuda:1 had its Triton
kernels launched on cuda:0's stream. Without two GPUs the wiring is checked: every entry point
that launches kernels enters ``cuda_device.current`` with the model's (or the arguments')
device; with two GPUs, generation on cuda:1 gives cuda:0's tokens."""

import contextlib

import pytest
import torch

from conftest import tiny_model
from swiftkern import Generator, SkipModel, cuda_device, ops


def test_current_is_a_device_guard_on_cuda_and_nothing_elsewhere():
    assert isinstance(cuda_device.current("cpu"), contextlib.nullcontext)
    assert isinstance(cuda_device.current(None), contextlib.nullcontext)  # no tensor among the arguments
    guard = cuda_device.current(torch.device("cuda", 1))  # made, not entered: no GPU needed
    assert isinstance(guard, torch.cuda.device) and guard.idx == 1


def test_of_arguments_finds_the_first_tensor():
    t = torch.zeros(1, device="meta")
    assert cuda_device.of_arguments((3, [None, t], torch.zeros(1))) == torch.device("meta")
    assert cuda_device.of_arguments((3, "x", [])) is None


@pytest.fixture
def entered(monkeypatch):
    """The devices ``cuda_device.current`` was entered with."""
    seen = []
    original = cuda_device.current

    def recording(device):
        seen.append(torch.device(device))
        return original(device)

    monkeypatch.setattr(cuda_device, "current", recording)
    return seen


def test_generate_and_forward_run_on_the_models_device(entered):
    model = SkipModel(tiny_model("llama"), pack_weights=False)
    Generator(model).generate([[5, 6, 7]], max_new_tokens=2, eos_token_id=[])
    assert torch.device("cpu") in entered
    entered.clear()
    cache = model.new_cache(1, 8)
    ops.set_backend("reference")  # the op-by-op device path (not the CPU's one C++ call)
    try:
        model.forward(torch.tensor([[5, 6]]), cache)
    finally:
        ops.set_backend("auto")
    assert entered == [torch.device("cpu")]


def test_a_registered_triton_op_runs_on_its_arguments_device(entered):
    from triton_cases import DEVICE, triton_op  # CPU tensors under the interpreter, else the GPU's

    x, residual, weight = (torch.randn(shape, device=DEVICE) for shape in ((2, 8), (2, 8), (8,)))
    triton_op("fused_add_rms_norm")(x, residual, weight, 1e-6)
    assert entered == [x.device]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_generation_on_a_second_gpu_gives_the_first_gpus_tokens():
    hf = tiny_model("llama")
    out = [Generator(SkipModel(hf.to(f"cuda:{i}"))).generate([[5, 6, 7, 8]], max_new_tokens=16,
                                                                eos_token_id=[]).tokens for i in (0, 1)]
    assert out[0] == out[1]
