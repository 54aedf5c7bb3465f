// The one bindings file of swiftkern._C: op schemas (TORCH_LIBRARY), kernel registrations
// per dispatch key, and a small Python module with build_info().
//
// Adding an op: declare its schema below; a CPU kernel goes in csrc/<op>_cpu.cpp; a CUDA kernel
// goes in a torch-free csrc/<op>.cuh with a thin launcher in csrc/<op>.cu (compiled only when
// setup.py builds the CUDAExtension, which defines SWIFTKERN_WITH_CUDA), registered in the CUDA
// block. Ops with no kernel for a device get swiftkern/reference.py registered by ops.py.

#include <torch/extension.h>
#include <torch/library.h>
#include <torch/version.h>

#include <optional>
#include <tuple>

#ifndef SWIFTKERN_CXX_FLAGS
#define SWIFTKERN_CXX_FLAGS "unknown"
#endif

namespace swiftkern {
std::tuple<at::Tensor, at::Tensor> greedy_accept_cpu(const at::Tensor& draft_tokens,
                                                     const at::Tensor& target_logits,
                                                     const at::Tensor& num_draft);
at::Tensor skinny_linear_cpu(const at::Tensor& x, const at::Tensor& weight,
                             const std::optional<at::Tensor>& bias);
std::tuple<at::Tensor, at::Tensor> rejection_sample_cpu(const at::Tensor& draft_tokens,
                                                        const std::optional<at::Tensor>& draft_probs,
                                                        const at::Tensor& target_probs,
                                                        const at::Tensor& num_draft,
                                                        const at::Tensor& u_accept,
                                                        const at::Tensor& u_sample);
#ifdef SWIFTKERN_WITH_CUDA
// std::tuple<at::Tensor, at::Tensor> greedy_accept_cuda(...);  // csrc/greedy_accept.cu
#endif
}  // namespace swiftkern

TORCH_LIBRARY(swiftkern, m) {
  m.set_python_module("swiftkern.ops");  // fake (meta) impls live there; torch imports it on demand
  m.def("greedy_accept(Tensor draft_tokens, Tensor target_logits, Tensor num_draft) -> (Tensor, Tensor)");
  m.def("skinny_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("rejection_sample(Tensor draft_tokens, Tensor? draft_probs, Tensor target_probs, Tensor num_draft, "
        "Tensor u_accept, Tensor u_sample) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(swiftkern, CPU, m) {
  m.impl("greedy_accept", &swiftkern::greedy_accept_cpu);
  m.impl("skinny_linear", &swiftkern::skinny_linear_cpu);
  m.impl("rejection_sample", &swiftkern::rejection_sample_cpu);
}

#ifdef SWIFTKERN_WITH_CUDA
TORCH_LIBRARY_IMPL(swiftkern, CUDA, m) {
  // m.impl("greedy_accept", &swiftkern::greedy_accept_cuda);
}
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "swiftkern C++/CUDA kernels; importing this module registers torch.ops.swiftkern.*";
  m.def("build_info", [] {
    py::dict d;
#ifdef SWIFTKERN_WITH_CUDA
    d["cuda"] = true;
#else
    d["cuda"] = false;
#endif
#if defined(__clang__)
    d["compiler"] = std::string("clang ") + __clang_version__;
#elif defined(__GNUC__)
    d["compiler"] = std::string("gcc ") + __VERSION__;
#elif defined(_MSC_VER)
    d["compiler"] = std::string("msvc ") + std::to_string(_MSC_VER);
#endif
    d["flags"] = SWIFTKERN_CXX_FLAGS;
#ifdef _OPENMP
    d["openmp"] = _OPENMP;
#else
    d["openmp"] = py::none();
#endif
    d["torch"] = TORCH_VERSION;
    return d;
  }, "How this extension was compiled: cuda (bool), compiler, flags, openmp, torch version.");
}
