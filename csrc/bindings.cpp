// The one bindings file of swiftkern._C: op schemas (TORCH_LIBRARY), kernel registrations
// per dispatch key, and a small Python module with build_info().
//
// Adding an op: declare its schema below (the same string as swiftkern/ops/registry.py's SCHEMAS);
// a CPU kernel goes in csrc/<op>_cpu.cpp; a CUDA kernel goes in a torch-free csrc/<op>.cuh with a
// thin launcher in csrc/<op>.cu (declared in csrc/launchers.h) and a torch-side wrapper in
// csrc/ops_cuda.cpp (compiled only when setup.py builds the CUDAExtension, which defines
// SWIFTKERN_WITH_CUDA), registered in the CUDA block. Ops with no kernel for a device get
// swiftkern/reference.py registered by swiftkern/ops/registry.py. The schemas are defined here
// once, when the library is loaded (Python caches the module, so a second import registers
// nothing).

#include <torch/extension.h>
#include <torch/library.h>
#include <torch/version.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "cpu_ops.h"
#include "decoder_stack.h"
#include "ops_cuda.h"
#include "version_watch.h"

#ifdef SWIFTKERN_WITH_CUDA
#include <cuda_runtime_api.h>  // CUDART_VERSION
#endif

#ifndef SWIFTKERN_CXX_FLAGS
#define SWIFTKERN_CXX_FLAGS "unknown"
#endif
#ifndef SWIFTKERN_CUDA_ARCHS
#define SWIFTKERN_CUDA_ARCHS "unknown"
#endif

namespace swiftkern {
at::Tensor skinny_linear_cpu(const at::Tensor& x, const at::Tensor& weight,
                             const std::optional<at::Tensor>& bias);
at::Tensor bi_exp_cpu(const at::Tensor& x);
at::Tensor bi_exp_sum_cpu(const at::Tensor& x);
at::Tensor top_p_cut_cpu(const at::Tensor& sorted_values, const at::Tensor& probs, double top_p);
at::Tensor skinny_linear_isa(const at::Tensor& x, const at::Tensor& weight, const std::string& isa);
std::vector<std::string> skinny_linear_isas();
at::Tensor packed_linear_cpu(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias);
at::Tensor bi_exp_isa(const at::Tensor& x, const std::string& isa);
std::tuple<at::Tensor, at::Tensor> bi_max_exp_sum_isa(const at::Tensor& x, const std::string& isa);
at::Tensor silu_mul_isa(const at::Tensor& gate, const at::Tensor& up, const std::string& isa);
at::Tensor round_rows_isa(const at::Tensor& x, const std::string& dtype, const std::string& isa);
std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm_isa(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                                                          const at::Tensor& weight, double eps, const std::string& isa);
at::Tensor packed_linear_isa(const at::Tensor& x, const at::Tensor& packed, const std::string& isa);
std::vector<std::string> packed_linear_isas();
std::string packed_linear_here();
at::Tensor verify_attention_isa(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                const at::Tensor& cache_lens, double scale, const std::string& isa, bool invariant);
bool packed_linear_fast();
std::optional<at::Tensor> pack_codes_cpu(const at::Tensor& weight, int64_t bits);
std::tuple<at::Tensor, at::Tensor> rejection_sample_cpu(const at::Tensor& draft_tokens,
                                                        const std::optional<at::Tensor>& draft_probs,
                                                        const at::Tensor& target_probs,
                                                        const at::Tensor& num_draft,
                                                        const at::Tensor& u_accept,
                                                        const at::Tensor& u_sample);
std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm_cpu(const at::Tensor& x, const at::Tensor& residual,
                                                          const at::Tensor& weight, double eps);
at::Tensor rope_kv_append_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                              const at::Tensor& sin, at::Tensor k_cache, at::Tensor v_cache,
                              const at::Tensor& positions);
at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor silu_mul_cpu(const at::Tensor& gate, const at::Tensor& up);
at::Tensor verify_attention_cpu(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                const at::Tensor& cache_lens, double scale);
at::Tensor verify_attention_invariant_cpu(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                          const at::Tensor& cache_lens, double scale);
void kv_compact_cpu(at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& src_positions,
                    const at::Tensor& dst_start, const at::Tensor& counts);

// The ops with a compiled kernel per device (what build_info() reports).
constexpr const char* kCpuKernels[] = {"greedy_accept", "rejection_sample", "skinny_linear", "rms_norm",
                                       "fused_add_rms_norm", "silu_mul",
                                       "rope_kv_append", "verify_attention", "verify_attention_invariant",
                                       "kv_compact", "bi_exp", "bi_exp_sum", "bi_max_exp_sum", "packed_linear",
                                       "top_p_cut"};
#ifdef SWIFTKERN_WITH_CUDA
constexpr const char* kCudaKernels[] = {"greedy_accept", "rejection_sample", "fused_add_rms_norm", "rope_kv_append",
                                        "kv_compact"};
#endif
}  // namespace swiftkern

TORCH_LIBRARY(swiftkern, m) {
  m.set_python_module("swiftkern.ops.registry");  // the fake (meta) impls live there; torch imports it on demand
  m.def("greedy_accept(Tensor draft_tokens, Tensor target_logits, Tensor num_draft) -> (Tensor, Tensor)");
  m.def("skinny_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("rejection_sample(Tensor draft_tokens, Tensor? draft_probs, Tensor target_probs, Tensor num_draft, "
        "Tensor u_accept, Tensor u_sample) -> (Tensor, Tensor)");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("fused_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("silu_mul(Tensor gate, Tensor up) -> Tensor");
  m.def("rope_kv_append(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor(a!) k_cache, "
        "Tensor(b!) v_cache, Tensor positions) -> Tensor");
  m.def("verify_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cache_lens, float scale) -> Tensor");
  m.def("verify_attention_invariant(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cache_lens, float scale) "
        "-> Tensor");
  m.def("kv_compact(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor src_positions, Tensor dst_start, "
        "Tensor counts) -> ()");
  m.def("bi_exp(Tensor x) -> Tensor");
  m.def("bi_exp_sum(Tensor x) -> Tensor");
  m.def("bi_max_exp_sum(Tensor x) -> (Tensor, Tensor)");
  m.def("packed_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
  m.def("top_p_cut(Tensor sorted_values, Tensor probs, float top_p) -> Tensor");
}

TORCH_LIBRARY_IMPL(swiftkern, CPU, m) {
  m.impl("greedy_accept", &swiftkern::greedy_accept_cpu);
  m.impl("skinny_linear", &swiftkern::skinny_linear_cpu);
  m.impl("rejection_sample", &swiftkern::rejection_sample_cpu);
  m.impl("fused_add_rms_norm", &swiftkern::fused_add_rms_norm_cpu);
  m.impl("rms_norm", &swiftkern::rms_norm_cpu);
  m.impl("silu_mul", &swiftkern::silu_mul_cpu);
  m.impl("rope_kv_append", &swiftkern::rope_kv_append_cpu);
  m.impl("verify_attention", &swiftkern::verify_attention_cpu);
  m.impl("verify_attention_invariant", &swiftkern::verify_attention_invariant_cpu);
  m.impl("kv_compact", &swiftkern::kv_compact_cpu);
  m.impl("bi_exp", &swiftkern::bi_exp_cpu);
  m.impl("bi_exp_sum", &swiftkern::bi_exp_sum_cpu);
  m.impl("bi_max_exp_sum", &swiftkern::bi_max_exp_sum_cpu);
  m.impl("packed_linear", &swiftkern::packed_linear_cpu);
  m.impl("top_p_cut", &swiftkern::top_p_cut_cpu);
}

#ifdef SWIFTKERN_WITH_CUDA
TORCH_LIBRARY_IMPL(swiftkern, CUDA, m) {
  m.impl("greedy_accept", &swiftkern::greedy_accept_cuda);
  m.impl("rejection_sample", &swiftkern::rejection_sample_cuda);
  m.impl("fused_add_rms_norm", &swiftkern::fused_add_rms_norm_cuda);
  m.impl("rope_kv_append", &swiftkern::rope_kv_append_cuda);
  m.impl("kv_compact", &swiftkern::kv_compact_cuda);
}
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "swiftkern C++/CUDA kernels; importing this module registers torch.ops.swiftkern.*";
  m.def("skinny_linear_isa", &swiftkern::skinny_linear_isa,
        "skinny_linear (no bias) with a named instruction set: avx512, avx2 or portable (tests)");
  m.def("decoder_stack", &swiftkern::decoder_stack_cpu,
        "every kept sub-layer of the decoder on the CPU in one call (csrc/decoder_stack_cpu.cpp)");
  m.def("decoder_forward", &swiftkern::decoder_forward_cpu,
        "a forward on the CPU in one call: embedding, decoder_stack, final norm, LM head "
        "(csrc/decoder_forward_cpu.cpp)");
  m.def("greedy_verify", &swiftkern::greedy_verify_cpu,
        "greedy_accept with num_draft as host ints -> (out_tokens, pending, out rows as lists, num_accepted as a "
        "list, the kept tokens' logprobs or None): a CPU speculative step's tail in one call "
        "(csrc/greedy_verify_cpu.cpp)");
  m.def("packed_linear_isa", &swiftkern::packed_linear_isa,
        "packed_linear (no bias) with named kernels: avx512, avx512-gather, avx2 or portable (tests)");
  m.def("packed_linear_isas", &swiftkern::packed_linear_isas, "the kernels packed_linear_isa runs on this CPU");
  m.def("packed_linear_here", &swiftkern::packed_linear_here,
        "the kernels packed_linear runs on this CPU (a name packed_linear_isas gives)");
  m.def("bi_exp_isa", &swiftkern::bi_exp_isa, "bi_exp with a named instruction set: avx512, avx2 or portable (tests)");
  m.def("bi_max_exp_sum_isa", &swiftkern::bi_max_exp_sum_isa,
        "bi_max_exp_sum with a named instruction set: avx512, avx2 or portable (tests)");
  m.def("silu_mul_isa", &swiftkern::silu_mul_isa,
        "silu_mul (float32, bf16 or fp16) with a named instruction set: avx512, avx2 or portable (tests)");
  m.def("round_rows_isa", &swiftkern::round_rows_isa,
        "float32 rounded into bfloat16 or float16 as c10 rounds, with a named instruction set: avx512, avx2 or "
        "portable (tests)");
  m.def("fused_add_rms_norm_isa", &swiftkern::fused_add_rms_norm_isa, py::arg("x"), py::arg("residual"),
        py::arg("weight"), py::arg("eps"), py::arg("isa"),
        "fused_add_rms_norm (residual None: rms_norm, new_residual None) with a named instruction set: avx512, avx2 "
        "or portable (tests)");
  m.def("verify_attention_isa", &swiftkern::verify_attention_isa,
        "verify_attention (invariant=True: its invariant variant) with a named instruction set: avx512, avx2 or "
        "portable "
        "(tests)");
  m.def("packed_linear_fast", &swiftkern::packed_linear_fast,
        "whether packed_linear has a vector kernel here (AVX2 or AVX-512), i.e. beats skinny_linear");
  m.def("pack_codes", &swiftkern::pack_codes_cpu,
        "float32 [N, K] -> its 4- or 8-bit codes packed as packed_linear reads them, or None "
        "(csrc/pack_codes_cpu.cpp; swiftkern/packed_weights.py has the torch twin)");
  m.def("skinny_linear_isas", &swiftkern::skinny_linear_isas, "the instruction sets this CPU runs, widest first");
  py::class_<swiftkern::VersionWatch>(m, "VersionWatch",
                                      "whether a list of tensors changed (version or data address) since the last look")
      .def(py::init<std::vector<at::Tensor>>())
      .def("changed", &swiftkern::VersionWatch::changed)
      .def("look", &swiftkern::VersionWatch::look);
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
    py::list cpu_kernels, cuda_kernels;
    for (const char* op : swiftkern::kCpuKernels) cpu_kernels.append(op);
#ifdef SWIFTKERN_WITH_CUDA
    for (const char* op : swiftkern::kCudaKernels) cuda_kernels.append(op);
    d["cuda_archs"] = SWIFTKERN_CUDA_ARCHS;
    d["cuda_runtime"] = std::to_string(CUDART_VERSION / 1000) + "." + std::to_string(CUDART_VERSION % 1000 / 10);
#endif
    d["cpu_kernels"] = cpu_kernels;
    d["cuda_kernels"] = cuda_kernels;
    return d;
  }, "How this extension was compiled: cuda (bool), compiler, flags, openmp, torch version, the ops "
     "with a compiled kernel per device (cpu_kernels, cuda_kernels) and, in a CUDA build, cuda_archs and "
     "cuda_runtime.");
}
