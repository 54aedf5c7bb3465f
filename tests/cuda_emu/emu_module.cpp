// The CUDA ops of csrc/ops_cuda.cpp (built with SWIFTKERN_CUDA_EMULATION: CPU tensors, kernels run
// by emu_runtime.cpp) as a Python module with the names and arguments of torch.ops.swiftkern.
#include <torch/extension.h>

#include "emu.h"
#include "ops_cuda.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "swiftkern's CUDA ops on CPU tensors, their kernels run by a CPU emulation of CUDA (tests only)";
  m.def("greedy_accept", &swiftkern::greedy_accept_cuda);
  m.def("rejection_sample", &swiftkern::rejection_sample_cuda);
  m.def("fused_add_rms_norm", &swiftkern::fused_add_rms_norm_cuda);
  m.def("rope_kv_append", &swiftkern::rope_kv_append_cuda);
  m.def("kv_compact", &swiftkern::kv_compact_cuda);
  m.def("stream_work", [] {  // (kernel launches, memsets) so far: the nodes a CUDA graph of them holds
    const auto& w = ::emu::stream_work();
    return std::make_tuple(w.kernels, w.memsets);
  });
}
