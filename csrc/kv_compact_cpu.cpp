// kv_compact on CPU: (layer, row, head) slices in parallel; each slice gathers its kept entries
// into a local buffer, then writes them contiguously, so sources may overlap destinations.
// Entries are moved as raw bytes (any dtype).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "op_checks.h"

namespace swiftkern {
namespace cpu {
namespace {

struct CacheLayout {
  int64_t L, B, H, S, row_bytes;
  int64_t s_l, s_b, s_h, s_s;  // strides in bytes
};

void kv_compact_kernel(char* k, char* v, const CacheLayout& c, const int64_t* src, int64_t src_sb, int64_t src_sm,
                       const int64_t* dst_start, int64_t dst_s, const int32_t* counts, int64_t counts_s) {
  const int64_t slices = 2 * c.L * c.B * c.H;
  int64_t kept = 0;
  for (int64_t b = 0; b < c.B; ++b) kept += counts[b * counts_s];
  // threads only for more than ~64 KiB of moves: a parallel region costs more than a small copy
  const int64_t bytes_per_slice = std::max<int64_t>(1, kept * c.row_bytes / c.B);
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / bytes_per_slice);
  at::parallel_for(0, slices, grain, [&](int64_t s0, int64_t s1) {
    std::vector<char> buf;
    for (int64_t sl = s0; sl < s1; ++sl) {
      const int64_t h = sl % c.H, b = (sl / c.H) % c.B, l = (sl / (c.H * c.B)) % c.L;
      const int64_t n = counts[b * counts_s];
      if (n == 0) continue;
      char* base = (sl < slices / 2 ? k : v) + l * c.s_l + b * c.s_b + h * c.s_h;
      buf.resize(n * c.row_bytes);
      for (int64_t i = 0; i < n; ++i)
        std::memcpy(buf.data() + i * c.row_bytes, base + src[b * src_sb + i * src_sm] * c.s_s, c.row_bytes);
      const int64_t start = dst_start[b * dst_s];
      for (int64_t i = 0; i < n; ++i)
        std::memcpy(base + (start + i) * c.s_s, buf.data() + i * c.row_bytes, c.row_bytes);
    }
  });
}

}  // namespace
}  // namespace cpu

// k_cache, v_cache: [L, B, H, S, D] (written in place); src_positions int64 [B, M]; dst_start
// int64 [B]; counts int32 [B] in [0, M]. Entry i < counts[b] of row b moves from
// src_positions[b, i] to dst_start[b] + i (< S) in every layer and head.
void kv_compact_cpu(at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& src_positions,
                    const at::Tensor& dst_start, const at::Tensor& counts) {
  checks::kv_compact(k_cache, v_cache, src_positions, dst_start, counts);
  checks::same_device("kv_compact", c10::DeviceType::CPU,
                      {{"k_cache", &k_cache}, {"v_cache", &v_cache}, {"src_positions", &src_positions},
                       {"dst_start", &dst_start}, {"counts", &counts}});
  const int64_t B = k_cache.size(1), S = k_cache.size(3), M = src_positions.size(1);
  const int64_t* src = src_positions.data_ptr<int64_t>();
  const int64_t* dst = dst_start.data_ptr<int64_t>();
  const int32_t* cnt = counts.data_ptr<int32_t>();
  const int64_t src_sb = src_positions.stride(0), src_sm = src_positions.stride(1);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = cnt[b * counts.stride(0)], start = dst[b * dst_start.stride(0)];
    TORCH_CHECK(n >= 0 && n <= M, "kv_compact: counts[", b, "] = ", n, " is outside [0, M = ", M, "]");
    if (n == 0) continue;
    TORCH_CHECK(start >= 0 && start + n <= S, "kv_compact: row ", b, " writes ", n, " entries from dst_start = ",
                start, ", past the cache (S = ", S, ")");
    for (int64_t i = 0; i < n; ++i) {
      const int64_t p = src[b * src_sb + i * src_sm];
      TORCH_CHECK(p >= 0 && p < S, "kv_compact: src_positions[", b, ", ", i, "] = ", p, " is outside [0, S = ", S,
                  ")");
    }
  }
  if (k_cache.numel() == 0) return;
  const int64_t e = k_cache.element_size();
  const cpu::CacheLayout layout{k_cache.size(0), B, k_cache.size(2), S, k_cache.size(4) * e,
                                k_cache.stride(0) * e, k_cache.stride(1) * e, k_cache.stride(2) * e,
                                k_cache.stride(3) * e};
  cpu::kv_compact_kernel(static_cast<char*>(k_cache.data_ptr()), static_cast<char*>(v_cache.data_ptr()), layout, src,
                         src_sb, src_sm, dst, dst_start.stride(0), cnt, counts.stride(0));
}

}  // namespace swiftkern
