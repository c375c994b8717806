#include "cpu_features.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#define FUSETRAIN_X86 1
#endif

namespace fusetrain::ops {

namespace {

#ifdef FUSETRAIN_X86
struct Regs {
  unsigned a = 0, b = 0, c = 0, d = 0;
};

Regs cpuid(unsigned leaf, unsigned sub = 0) {
  Regs r;
  __cpuid_count(leaf, sub, r.a, r.b, r.c, r.d);
  return r;
}

uint64_t xgetbv0() {
  unsigned lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

bool bit(unsigned v, int b) { return ((v >> b) & 1U) != 0; }

CpuFeatures detect() {
  CpuFeatures f;
  const unsigned max_leaf = cpuid(0).a;
  if (max_leaf < 7) return f;
  const Regs l1 = cpuid(1);
  const bool osxsave = bit(l1.c, 27);
  const uint64_t xcr0 = osxsave ? xgetbv0() : 0;
  const bool os_ymm = (xcr0 & 0x6) == 0x6;           // SSE and AVX state
  const bool os_zmm = (xcr0 & 0xe6) == 0xe6;         // + opmask, ZMM_Hi256, Hi16_ZMM
  const bool os_tile = (xcr0 & 0x60000) == 0x60000;  // XTILECFG, XTILEDATA
  const Regs l7 = cpuid(7, 0);
  const bool fma = bit(l1.c, 12), f16c = bit(l1.c, 29), avx = bit(l1.c, 28);
  f.avx2 = os_ymm && avx && fma && f16c && bit(l7.b, 5);
  f.avx512 = f.avx2 && os_zmm && bit(l7.b, 16) /*F*/ && bit(l7.b, 17) /*DQ*/ &&
             bit(l7.b, 30) /*BW*/ && bit(l7.b, 31) /*VL*/;
  f.avx512_fp16 = f.avx512 && bit(l7.d, 23);
  f.amx_bf16 = os_tile && bit(l7.d, 22) && bit(l7.d, 24) /*AMX-TILE*/;
  if (l7.a >= 1) f.avx512_bf16 = f.avx512 && bit(cpuid(7, 1).a, 5);
  if (cpuid(0x80000000).a >= 0x80000004) {
    char brand[49] = {};
    for (unsigned i = 0; i < 3; ++i) {
      const Regs r = cpuid(0x80000002 + i);
      std::memcpy(brand + 16 * i, &r, 16);
    }
    std::string s(brand);
    s.erase(0, s.find_first_not_of(' '));
    s.erase(s.find_last_not_of(' ') + 1);
    f.model = s;
  }
  return f;
}
#else
CpuFeatures detect() { return {}; }
#endif

CpuPath decide() {
  const CpuPath best = best_cpu_path();
  const char* forced = std::getenv("FUSETRAIN_CPU_PATH");
  if (forced != nullptr && *forced != '\0') {
    const std::string name = forced;
    CpuPath want;
    if (name == "generic") {
      want = CpuPath::kGeneric;
    } else if (name == "scalar") {
      want = CpuPath::kScalar;
    } else if (name == "avx2") {
      want = CpuPath::kAvx2;
    } else if (name == "avx512") {
      want = CpuPath::kAvx512;
    } else {
      throw std::runtime_error("FUSETRAIN_CPU_PATH=" + name +
                               ": expected generic, scalar, avx2 or avx512");
    }
    if (static_cast<int>(want) > static_cast<int>(best)) {
      throw std::runtime_error("FUSETRAIN_CPU_PATH=" + name + ": this CPU (" +
                               (cpu_features().model.empty() ? "unknown" : cpu_features().model) +
                               ") runs at most the " + cpu_path_name(best) + " path");
    }
    return want;
  }
  const char* aten = std::getenv("ATEN_CPU_CAPABILITY");
  if (aten != nullptr && std::strcmp(aten, "default") == 0) return CpuPath::kScalar;
  if (aten != nullptr && std::strcmp(aten, "avx2") == 0 && best == CpuPath::kAvx512) {
    return CpuPath::kAvx2;
  }
  return best;
}

}  // namespace

const CpuFeatures& cpu_features() {
  static const CpuFeatures features = detect();
  return features;
}

CpuPath best_cpu_path() {
  const CpuFeatures& f = cpu_features();
  if (f.avx512) return CpuPath::kAvx512;
  if (f.avx2) return CpuPath::kAvx2;
  return CpuPath::kScalar;
}

CpuPath cpu_path() {
  static const CpuPath path = decide();
  return path;
}

const char* cpu_path_name(CpuPath path) {
  switch (path) {
    case CpuPath::kGeneric:
      return "generic";
    case CpuPath::kScalar:
      return "scalar";
    case CpuPath::kAvx2:
      return "avx2";
    case CpuPath::kAvx512:
      return "avx512";
  }
  return "scalar";
}

}  // namespace fusetrain::ops
