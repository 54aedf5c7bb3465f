"""What ``swiftkern info`` reports: versions, device, kernel backends built and in use."""

from __future__ import annotations

import os
import platform
from importlib import metadata

from .cpu_id import cpuinfo_field
from .errors import SwiftkernError


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo (Linux), else platform.processor()."""
    return cpuinfo_field("model name") or platform.processor() or platform.machine()


def collect_info() -> dict:
    import torch

    from . import __version__, ops

    info = {
        "swiftkern": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"cpu: {cpu_name()} ({torch.get_num_threads()} threads)",
    }
    for name in ("triton", "transformers"):  # from the installed metadata: importing them costs ~2 s
        try:
            info[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            info[name] = "not installed"
    info.update(ops.backend_info())
    from .layer_kernels import LayerKernels, invariant_backend, invariant_kernels_available

    # CPU forwards: the layer loop in one C++ call, or op by op from Python
    info["cpu_layer_loop"] = ("C++ decoder_stack (float32, bfloat16, float16)"
                              if LayerKernels.for_device("cpu").stack is not None else "Python, op by op")

    # GGUF-quantized float32 weights read as their codes (swiftkern/packed_weights.py)
    info["packed_weights"] = (f"cpu float32 ({ops.packed_kernels_here()}): projections and LM head of a GGUF model "
                              "read as 4/8-bit codes" if ops.packed_linear_fast()
                              else "no (needs the C++ kernels and AVX2 or AVX-512)")
    # which kernel takes the float32 projections on the CPU (ops.projections.mkl_lags_here)
    info["cpu_float32_projections"] = (
        f"torch's matmul at every size (the C++ kernels are not built or not allowed: SWIFTKERN_BACKEND="
        f"{ops.backends.current_backend()})" if not ops.backends.cpu_kernel("skinny_linear", "cpu") else
        f"C++ kernels at every size (torch's matmul is MKL, which runs AVX2 code on this "
        f"{ops.projections.cpu_vendor()} CPU)" if ops.mkl_lags_here() else
        f"C++ kernels up to {ops.SKINNY_MAX_ROWS} rows ({ops.PACKED_MAX_ROWS} from packed weights), "
        "torch's matmul past that")
    # which kernel takes the float32 projections on CUDA (ops.projections.CUDA_SKINNY_ROWS; the
    # regular set's grouped launches, layer_kernels._skinny_groups_for)
    try:
        lo, hi = ops.projections.cuda_skinny_rows()
        rows = f"{lo}-{hi} rows" + (" (SWIFTKERN_CUDA_SKINNY_ROWS)" if os.environ.get("SWIFTKERN_CUDA_SKINNY_ROWS") else "")
    except SwiftkernError as e:
        rows = f"no rows: {e}"
    plan = os.environ.get("SWIFTKERN_SKINNY_PLAN", "").strip()
    info["cuda_float32_projections"] = (
        f"the Triton skinny_linear at {rows} (a layer's q/k/v and gate/up one launch each, the "
        "SwiGLU in the down projection's with the Triton silu_mul), torch's matmul elsewhere"
        + (f"; plan {plan} (SWIFTKERN_SKINNY_PLAN)" if plan else "")
        if ops.triton_skinny_here("cuda") else
        f"torch's matmul at every size (the Triton kernels are not in use: SWIFTKERN_BACKEND="
        f"{ops.backends.current_backend()}, or Triton is not importable)")
    # the CUDA greedy_accept's vocabulary split for few rows: on unless turned off (docs/speed.md)
    split = os.environ.get("SWIFTKERN_CUDA_GREEDY_SPLIT") != "0"
    info["cuda_greedy_vocab_split"] = ("on (SWIFTKERN_CUDA_GREEDY_SPLIT=0 turns it off)" if split
                                       else "off (SWIFTKERN_CUDA_GREEDY_SPLIT=0)")
    info["cuda_graphs"] = ("available: Generator(cuda_graphs=True) / --cuda-graphs" if torch.cuda.is_available()
                           else "not available (no CUDA device)")
    # where the batch-invariant kernel set runs, mode deterministic needs no replay (replay="auto")
    cpu = "cpu float32, bfloat16, float16" if invariant_kernels_available("cpu", torch.float32) else ""
    cuda = ("cuda (the Triton set; the replay with drafter self-spec)"
            if torch.cuda.is_available() and invariant_backend("cuda", torch.float32) == "triton" else "")
    info["deterministic_without_replay"] = "; ".join(x for x in (cpu, cuda) if x) or "no (the LLM-42 replay runs)"
    # replay="never": every step through the invariant set of that device (layer_kernels.invariant_backend)
    info["deterministic_replay_never"] = {dev: invariant_backend(dev, torch.float32) or "not available"
                                          for dev in ("cpu", "cuda")}
    # modes ar and self-spec decode, draft and verify through the invariant set where it runs:
    # self-spec's greedy output is then ar's bit for bit (Generator.invariant_decode)
    info["decode_kernels"] = ("cpu: batch-invariant (self-spec equals ar bit for bit); cuda: regular"
                              if invariant_kernels_available("cpu", torch.float32) else "regular")
    # what the replay's verifier runs per row with verifier_kernels="auto" (swiftkern/verifier_kernels.py)
    from .verifier_kernels import verifier_kernels
    info["verifier_kernels_auto"] = {dev: verifier_kernels("auto", dev, torch.float32).name for dev in ("cpu", "cuda")}
    # the invariant matmul's plans on CUDA (triton_kernels/bi_matmul.py; SWIFTKERN_BI_MATMUL_PLAN)
    plan = os.environ.get("SWIFTKERN_BI_MATMUL_PLAN", "").strip()
    info["cuda_bi_matmul_plans"] = (f"{plan} (SWIFTKERN_BI_MATMUL_PLAN)" if plan
                                    else "PLANS (triton_kernels/bi_matmul.py)")
    return info
