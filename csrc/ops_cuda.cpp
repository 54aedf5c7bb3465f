// The torch-side CUDA wrappers: check arguments, allocate outputs, call the torch-free launchers
// (csrc/launchers.h) on the current stream of the inputs' device, and check the launch. Compiled
// only in the CUDA build (setup.py defines SWIFTKERN_WITH_CUDA); registered in bindings.cpp.
// SWIFTKERN_CUDA_EMULATION (tests/cuda_emu): the same wrappers over CPU tensors, the kernels run by
// a CPU emulation of CUDA's threads, so tests run this file and the kernels without a GPU.
#if defined(SWIFTKERN_WITH_CUDA) || defined(SWIFTKERN_CUDA_EMULATION)

#include <ATen/ATen.h>
#ifndef SWIFTKERN_CUDA_EMULATION
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <limits>
#include <optional>
#include <tuple>

#include "launchers.h"
#include "op_checks.h"
#include "ops_cuda.h"

namespace swiftkern {
namespace {

cuda::DType kernel_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return cuda::DType::kFloat32;
    case at::kBFloat16: return cuda::DType::kBFloat16;
    case at::kHalf: return cuda::DType::kFloat16;
    default: TORCH_CHECK(false, "swiftkern CUDA kernels take float32, bfloat16 or float16, got ", t);
  }
}

void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, op, " (CUDA kernel): launch failed: ", cudaGetErrorString(err));
}

#ifdef SWIFTKERN_CUDA_EMULATION
constexpr c10::DeviceType kDevice = c10::DeviceType::CPU;
struct DeviceGuard {
  explicit DeviceGuard(const c10::Device&) {}
};
cudaStream_t stream_of(const at::Tensor&) { return nullptr; }
#else
constexpr c10::DeviceType kDevice = c10::DeviceType::CUDA;
using DeviceGuard = c10::cuda::CUDAGuard;
cudaStream_t stream_of(const at::Tensor& t) { return c10::cuda::getCurrentCUDAStream(t.device().index()).stream(); }
#endif

}  // namespace

// draft_tokens int64 [B, K]; target_logits float [B, K+1, V]; num_draft int32 [B] in [0, K]
// -> (out_tokens int64 [B, K+1], num_accepted int32 [B])
std::tuple<at::Tensor, at::Tensor> greedy_accept_cuda(const at::Tensor& draft_tokens, const at::Tensor& target_logits,
                                                      const at::Tensor& num_draft) {
  TORCH_CHECK(draft_tokens.dim() == 2 && target_logits.dim() == 3 && num_draft.dim() == 1,
              "greedy_accept: expected draft_tokens [B, K], target_logits [B, K+1, V], num_draft [B], got ",
              draft_tokens.sizes(), ", ", target_logits.sizes(), ", ", num_draft.sizes());
  const int64_t B = draft_tokens.size(0), K = draft_tokens.size(1), V = target_logits.size(2);
  TORCH_CHECK(target_logits.size(0) == B && target_logits.size(1) == K + 1 && num_draft.size(0) == B,
              "greedy_accept: target_logits must be [B, K+1, V] = [", B, ", ", K + 1, ", V] and num_draft [B] for "
              "draft_tokens ", draft_tokens.sizes(), ", got ", target_logits.sizes(), " and ", num_draft.sizes());
  TORCH_CHECK(V > 0 && V <= std::numeric_limits<int32_t>::max(), "greedy_accept: V must be in [1, 2^31), got ", V);
  checks::same_device("greedy_accept", kDevice,
                      {{"draft_tokens", &draft_tokens}, {"target_logits", &target_logits}, {"num_draft", &num_draft}});
  TORCH_CHECK(draft_tokens.scalar_type() == at::kLong && num_draft.scalar_type() == at::kInt,
              "greedy_accept: draft_tokens must be int64 and num_draft int32, got ", draft_tokens.scalar_type(),
              " and ", num_draft.scalar_type());
  TORCH_CHECK(checks::is_float_dtype(target_logits.scalar_type()),
              "greedy_accept: target_logits must be float32, bfloat16 or float16, got ", target_logits.scalar_type());
  TORCH_CHECK(target_logits.stride(2) == 1 || V == 1 || target_logits.numel() == 0, "greedy_accept: target_logits must be contiguous along V, "
              "got strides ", target_logits.strides(), "; call .contiguous() first");
  const DeviceGuard guard(draft_tokens.device());
  auto out = at::empty({B, K + 1}, draft_tokens.options());
  auto num_accepted = at::empty({B}, num_draft.options());
  // each vocabulary chunk's best key when the vocabulary is split (few rows); uint64 held as int64
  const int64_t key_elems = cuda::greedy_keys_elems(B, K, V);
  const at::Tensor keys = key_elems ? at::empty({key_elems}, draft_tokens.options()) : at::Tensor();
  const cuda::GreedyAcceptArgs a{draft_tokens.data_ptr<int64_t>(), draft_tokens.stride(0), draft_tokens.stride(1),
                                 target_logits.data_ptr(), kernel_dtype(target_logits.scalar_type()),
                                 target_logits.stride(0), target_logits.stride(1), num_draft.data_ptr<int32_t>(),
                                 num_draft.stride(0), out.data_ptr<int64_t>(), num_accepted.data_ptr<int32_t>(), B, K, V,
                                 key_elems ? reinterpret_cast<uint64_t*>(keys.data_ptr<int64_t>()) : nullptr};
  check_launch(cuda::greedy_accept(a, stream_of(draft_tokens)), "greedy_accept");
  return {out, num_accepted};
}

// draft_tokens int64 [B, K]; draft_probs float32 [B, K, V] or None; target_probs float32
// [B, K+1, V]; num_draft int32 [B]; u_accept float32 [B, K]; u_sample float32 [B, K+1]
// -> (out_tokens int64 [B, K+1], num_accepted int32 [B])
std::tuple<at::Tensor, at::Tensor> rejection_sample_cuda(const at::Tensor& draft_tokens,
                                                         const std::optional<at::Tensor>& draft_probs,
                                                         const at::Tensor& target_probs, const at::Tensor& num_draft,
                                                         const at::Tensor& u_accept, const at::Tensor& u_sample) {
  const bool has_q = draft_probs.has_value() && draft_probs->defined();
  TORCH_CHECK(draft_tokens.dim() == 2 && target_probs.dim() == 3, "rejection_sample: expected draft_tokens [B, K] "
              "and target_probs [B, K+1, V], got ", draft_tokens.sizes(), " and ", target_probs.sizes());
  const int64_t B = draft_tokens.size(0), K = draft_tokens.size(1), V = target_probs.size(2);
  TORCH_CHECK(target_probs.size(0) == B && target_probs.size(1) == K + 1 && V > 0,
              "rejection_sample: target_probs must be [B, K+1, V] = [", B, ", ", K + 1, ", V >= 1], got ",
              target_probs.sizes());
  if (has_q)
    TORCH_CHECK(draft_probs->sizes() == at::IntArrayRef({B, K, V}), "rejection_sample: draft_probs must be [B, K, V] = [",
                B, ", ", K, ", ", V, "], got ", draft_probs->sizes());
  TORCH_CHECK(num_draft.dim() == 1 && num_draft.size(0) == B && u_accept.sizes() == at::IntArrayRef({B, K}) &&
                  u_sample.sizes() == at::IntArrayRef({B, K + 1}),
              "rejection_sample: num_draft must be [B], u_accept [B, K], u_sample [B, K+1] for B = ", B, ", K = ", K,
              ", got ", num_draft.sizes(), ", ", u_accept.sizes(), ", ", u_sample.sizes());
  checks::same_device("rejection_sample", kDevice,
                      {{"draft_tokens", &draft_tokens}, {"target_probs", &target_probs}, {"num_draft", &num_draft},
                       {"u_accept", &u_accept}, {"u_sample", &u_sample}});
  if (has_q)
    checks::same_device("rejection_sample", kDevice,
                        {{"draft_tokens", &draft_tokens}, {"draft_probs", &*draft_probs}});
  TORCH_CHECK(draft_tokens.scalar_type() == at::kLong && num_draft.scalar_type() == at::kInt,
              "rejection_sample: draft_tokens must be int64 and num_draft int32, got ", draft_tokens.scalar_type(),
              " and ", num_draft.scalar_type());
  TORCH_CHECK(target_probs.scalar_type() == at::kFloat && (!has_q || draft_probs->scalar_type() == at::kFloat) &&
                  u_accept.scalar_type() == at::kFloat && u_sample.scalar_type() == at::kFloat,
              "rejection_sample (CUDA kernel): probabilities and uniforms must be float32 "
              "(ops.rejection_sample converts bfloat16/float16 probabilities first)");
  TORCH_CHECK(((target_probs.stride(2) == 1 || target_probs.numel() == 0) &&
               (!has_q || draft_probs->stride(2) == 1 || draft_probs->numel() == 0)) || V == 1,
              "rejection_sample: target_probs and draft_probs must be contiguous along V; call .contiguous() first");
  TORCH_CHECK(V <= std::numeric_limits<int32_t>::max(), "rejection_sample: V must be < 2^31, got ", V);
  const DeviceGuard guard(draft_tokens.device());
  auto out = at::empty({B, K + 1}, draft_tokens.options());
  auto num_accepted = at::empty({B}, num_draft.options());
  const float* q = has_q ? draft_probs->data_ptr<float>() : nullptr;
  const cuda::RejectionSampleArgs a{draft_tokens.data_ptr<int64_t>(), draft_tokens.stride(0), draft_tokens.stride(1),
                                    q, has_q ? draft_probs->stride(0) : 0, has_q ? draft_probs->stride(1) : 0,
                                    target_probs.data_ptr<float>(), target_probs.stride(0), target_probs.stride(1),
                                    num_draft.data_ptr<int32_t>(), num_draft.stride(0),
                                    u_accept.data_ptr<float>(), u_accept.stride(0), u_accept.stride(1),
                                    u_sample.data_ptr<float>(), u_sample.stride(0), u_sample.stride(1),
                                    out.data_ptr<int64_t>(), num_accepted.data_ptr<int32_t>(), B, K, V};
  check_launch(cuda::rejection_sample(a, stream_of(draft_tokens)), "rejection_sample");
  return {out, num_accepted};
}

// x, residual [..., H]; weight [H]; one float dtype -> (normed [..., H], new_residual [..., H])
std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm_cuda(const at::Tensor& x, const at::Tensor& residual,
                                                           const at::Tensor& weight, double eps) {
  checks::fused_add_rms_norm(x, residual, weight);
  checks::same_device("fused_add_rms_norm", kDevice,
                      {{"x", &x}, {"residual", &residual}, {"weight", &weight}});
  const int64_t H = x.size(-1);
  const auto dt = kernel_dtype(x.scalar_type());
  const DeviceGuard guard(x.device());
  auto normed = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  auto new_residual = at::empty_like(normed);
  if (x.numel() == 0) return {normed, new_residual};
  const at::Tensor xs = unit_stride_rows(x), rs = unit_stride_rows(residual), ws = weight.contiguous();
  const cuda::FusedAddRmsNormArgs a{xs.data_ptr(), xs.stride(0), rs.data_ptr(), rs.stride(0), ws.data_ptr(),
                                    normed.data_ptr(), H, new_residual.data_ptr(), H, dt, xs.size(0), H,
                                    static_cast<float>(eps)};
  check_launch(cuda::fused_add_rms_norm(a, stream_of(x)), "fused_add_rms_norm");
  return {normed, new_residual};
}

// q [B, Hq, T, D]; k, v [B, Hkv, T, D]; cos, sin [B or 1, T, D]; k_cache, v_cache [B, Hkv, S, D]
// (written in place); positions int64 [B, T] in [0, S) -> rotated q [B, Hq, T, D]
at::Tensor rope_kv_append_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                               const at::Tensor& sin, at::Tensor k_cache, at::Tensor v_cache,
                               const at::Tensor& positions) {
  checks::rope_kv_append(q, k, v, cos, sin, k_cache, v_cache, positions);
  checks::same_device("rope_kv_append", kDevice,
                      {{"q", &q}, {"k", &k}, {"v", &v}, {"cos", &cos}, {"sin", &sin}, {"k_cache", &k_cache},
                       {"v_cache", &v_cache}, {"positions", &positions}});
  const DeviceGuard guard(q.device());
  at::Tensor out = at::empty(q.sizes(), q.options());  // contiguous, as the op's fake impl says
  const int64_t B = q.size(0), T = q.size(2), D = q.size(3);
  if (B * T == 0) return out;
  auto last_contig = [](const at::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); };
  const at::Tensor qc = last_contig(q), kc = last_contig(k), vc = last_contig(v);
  const at::Tensor cc = last_contig(cos).expand({B, T, D}), sc = last_contig(sin).expand({B, T, D});
  auto s4 = [](const at::Tensor& t) { return cuda::Strides4{t.stride(0), t.stride(1), t.stride(2)}; };
  const cuda::RopeKvAppendArgs a{qc.data_ptr(), s4(qc), kc.data_ptr(), s4(kc), vc.data_ptr(), s4(vc),
                                 cc.data_ptr(), cc.stride(0), cc.stride(1), sc.data_ptr(), sc.stride(0), sc.stride(1),
                                 k_cache.data_ptr(), s4(k_cache), v_cache.data_ptr(), s4(v_cache),
                                 positions.data_ptr<int64_t>(), positions.stride(0), positions.stride(1),
                                 out.data_ptr(), s4(out), kernel_dtype(q.scalar_type()), B, q.size(1), k.size(1), T, D,
                                 k_cache.size(2)};
  check_launch(cuda::rope_kv_append(a, stream_of(q)), "rope_kv_append");
  return out;
}

// k_cache, v_cache [L, B, H, S, D] (written in place); src_positions int64 [B, M]; dst_start
// int64 [B]; counts int32 [B]
void kv_compact_cuda(at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& src_positions,
                     const at::Tensor& dst_start, const at::Tensor& counts) {
  checks::kv_compact(k_cache, v_cache, src_positions, dst_start, counts);
  checks::same_device("kv_compact", kDevice,
                      {{"k_cache", &k_cache}, {"v_cache", &v_cache}, {"src_positions", &src_positions},
                       {"dst_start", &dst_start}, {"counts", &counts}});
  const DeviceGuard guard(k_cache.device());
  if (src_positions.size(1) == 0) {  // no kernel runs to check the counts: every one must be 0 (a sync, M = 0 only)
    TORCH_CHECK(counts.numel() == 0 || counts.eq(0).all().item<bool>(),
                "kv_compact: src_positions has M = 0 columns, so every counts[b] must be 0, got ", counts.cpu());
  }
  cuda::KvCompactArgs a{k_cache.data_ptr(), v_cache.data_ptr(), static_cast<int64_t>(k_cache.element_size()),
                        k_cache.size(0), k_cache.size(1), k_cache.size(2), k_cache.size(3), k_cache.size(4),
                        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3),
                        src_positions.data_ptr<int64_t>(), src_positions.stride(0), src_positions.stride(1),
                        dst_start.data_ptr<int64_t>(), dst_start.stride(0), counts.data_ptr<int32_t>(),
                        counts.stride(0), src_positions.size(1), nullptr};
  at::Tensor workspace;
  const int64_t bytes = cuda::kv_compact_workspace_bytes(a);
  if (bytes > 0) {
    workspace = at::empty({bytes}, k_cache.options().dtype(at::kByte));
    a.workspace = workspace.data_ptr();
  }
  check_launch(cuda::kv_compact(a, stream_of(k_cache)), "kv_compact");
}

}  // namespace swiftkern

#endif  // SWIFTKERN_WITH_CUDA || SWIFTKERN_CUDA_EMULATION
