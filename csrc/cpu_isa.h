// The x86 instruction sets the CPU kernels come in, which of them this CPU runs, and their
// names (the *_isa test bindings take them). Each kernel's sets give the same bits, so the
// choice is speed alone: the widest the CPU runs (pick_isa), or a named one for the tests.
#pragma once

#include <initializer_list>

namespace swiftkern {
namespace cpu {

enum class Isa { kPortable, kAvx2, kAvx512 };

static inline bool isa_supported(Isa isa) {
#if defined(__x86_64__)
  if (isa == Isa::kAvx512) return __builtin_cpu_supports("avx512f");
  if (isa == Isa::kAvx2)
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#endif
  return isa == Isa::kPortable;
}

static inline Isa pick_isa() {
  for (Isa isa : {Isa::kAvx512, Isa::kAvx2})
    if (isa_supported(isa)) return isa;
  return Isa::kPortable;
}

static inline const char* isa_name(Isa isa) {
  return isa == Isa::kAvx512 ? "avx512" : isa == Isa::kAvx2 ? "avx2" : "portable";
}

// The sets this code has, widest first
constexpr Isa kIsas[] = {Isa::kAvx512, Isa::kAvx2, Isa::kPortable};

}  // namespace cpu
}  // namespace swiftkern
