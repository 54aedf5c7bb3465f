"""Backend choice (SWIFTKERN_BACKEND), backend_info, and how the Triton kernels are loaded."""

import importlib
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

from swiftkern import ops, reference
from swiftkern.errors import SwiftkernError
from triton_cases import DEVICE, NATIVE, backend, triton_op

TRITON_OPS = ("rms_norm", "fused_add_rms_norm", "silu_mul", "rope_kv_append", "verify_attention",
              "greedy_accept", "rejection_sample", "kv_compact", "skinny_linear")


def run_python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=300)


def test_import_swiftkern_does_not_import_triton():
    r = run_python("""
        import sys
        import swiftkern
        from swiftkern import ops
        assert "triton" not in sys.modules, "import swiftkern imported triton"
        assert ops.backend_for("rms_norm", "cpu") in ("reference", "cpp")  # the CPU auto path needs no triton
        assert "triton" not in sys.modules, "the CPU auto path imported triton"
        info = ops.backend_info()  # reports the CUDA column: this may import triton
        assert info["ops"]["rms_norm"]["cuda"] == "triton", info
        print("ok")
    """)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_without_triton_cuda_auto_is_reference_and_forcing_triton_says_why():
    r = run_python("""
        import importlib.abc, sys
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name == "triton" or name.startswith("triton."):
                    raise ModuleNotFoundError("no triton for this test", name=name)
        sys.meta_path.insert(0, Block())
        from swiftkern import ops
        from swiftkern.errors import SwiftkernError
        info = ops.backend_info()
        assert info["triton"].startswith("not available"), info["triton"]
        assert info["ops"]["verify_attention"]["cuda"] == "reference", info
        ops.set_backend("triton")
        try:
            ops.backend_for("verify_attention", "cuda")
        except SwiftkernError as e:
            assert "cannot be imported" in str(e) and "SWIFTKERN_BACKEND" in str(e), e
            print("ok")
    """)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_auto_and_forced_choices():
    info = ops.backend_info()
    kernels = info["kernels"]
    for op in TRITON_OPS:
        assert "triton" in kernels[op]["cuda"], kernels[op]
        want_cuda = "cuda" if "cuda" in kernels[op]["cuda"] else "triton"
        assert info["ops"][op]["cuda"] == want_cuda
        assert info["ops"][op]["cpu"] == ("cpp" if "cpp" in kernels[op]["cpu"] else "reference")
    with backend("reference"):
        assert all(ops.backend_for(op, dev) == "reference" for op in TRITON_OPS for dev in ("cpu", "cuda"))
    with backend("triton"):
        assert all(ops.backend_for(op, "cuda") == "triton" for op in TRITON_OPS)
        assert ops.backend_for("rms_norm", DEVICE) == "triton"  # on CPU: the interpreter
        info = ops.backend_info()
        assert info["swiftkern_backend"] == "triton" and info["ops"]["rms_norm"]["cuda"] == "triton"
        assert info["ops"]["packed_linear"]["cuda"].startswith("unavailable: there is no Triton kernel")


def test_auto_on_the_cpu_without_a_cpp_kernel_is_the_reference(monkeypatch):
    """Under TRITON_INTERPRET=1 (these tests without a GPU) the Triton kernels are registered for
    CPU tensors too, but auto on the CPU takes the C++ kernel or else the reference: the
    interpreter runs only when backend triton is forced."""
    from swiftkern.triton_kernels import interpreting

    cuda = ops.registry.COMPILED["rms_norm"]["cuda"]
    monkeypatch.setitem(ops.registry.COMPILED, "rms_norm", {"cpu": "reference", "cuda": cuda})
    with backend("auto"):  # a fresh choice
        assert ("rms_norm" in ops.backends.triton_ops("cpu")) is interpreting()
        assert ops.backend_for("rms_norm", "cpu") == "reference"
    if interpreting():
        with backend("triton"):
            assert ops.backend_for("rms_norm", "cpu") == "triton"


def test_forcing_a_backend_that_cannot_run_raises():
    x, w = torch.randn(2, 8), torch.ones(8)
    with backend("cuda"):
        with pytest.raises(SwiftkernError, match="SWIFTKERN_BACKEND=cuda cannot run on cpu: cuda is the GPU backend"):
            ops.rms_norm(x, w, 1e-5)
    no_cpp = [op for op in TRITON_OPS if "cpp" not in ops.backend_info()["kernels"][op]["cpu"]]
    with backend("cpp"):
        for op in no_cpp:
            with pytest.raises(SwiftkernError, match=f"{op}: SWIFTKERN_BACKEND=cpp cannot run on cpu"):
                ops.backend_for(op, "cpu")
        with pytest.raises(SwiftkernError, match="cpp is the CPU backend"):
            ops.backend_for("rms_norm", "cuda")
    with backend("bogus"), pytest.raises(SwiftkernError, match="SWIFTKERN_BACKEND must be one of auto, reference, cpp, triton, cuda"):
        ops.rms_norm(x, w, 1e-5)


def test_env_var_is_read_at_import():
    r = run_python("""
        from swiftkern import ops
        print(ops.backend_info()["swiftkern_backend"], ops.backend_for("silu_mul", "cuda"))
    """, SWIFTKERN_BACKEND="Reference")
    assert r.returncode == 0 and r.stdout.split() == ["reference", "reference"], r.stderr


@pytest.mark.skipif(NATIVE, reason="checks the interpreter switch of tests/conftest.py (no GPU)")
def test_the_interpreter_runs_the_kernels_without_a_gpu():
    from swiftkern.triton_kernels import interpreting
    from swiftkern.triton_kernels.registry import registered

    assert interpreting() and set(TRITON_OPS) <= registered("cpu")


def test_reloading_registers_nothing_twice():
    import swiftkern.triton_kernels as tk

    x, w = torch.randn(3, 16, device=DEVICE), torch.rand(16, device=DEVICE)
    before = ops.backend_info()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "overriding a previously registered kernel"
        importlib.reload(tk)
        for module in (ops.registry, ops.backends, ops):
            importlib.reload(module)
    assert ops.backend_info() == before
    torch.testing.assert_close(triton_op("rms_norm")(x, w, 1e-5), reference.rms_norm(x, w, 1e-5))
