// What this CPU can run, read once from cpuid (and xgetbv: the OS must save
// the vector state too), and the vector path the CPU ops take.
//
// Note [CPU paths]
// libfusetrain is compiled for baseline x86-64; its CPU ops carry AVX2 (with
// FMA and F16C) and AVX-512 (F, BW, VL, DQ) loops in functions compiled for
// those targets, and pick one at run time: the best the CPU has, or a lower
// one forced with FUSETRAIN_CPU_PATH=scalar|avx2|avx512 (asking for a path the
// CPU lacks is an error), so the tests can run every lower path on any
// machine. ATEN_CPU_CAPABILITY=default (torch's own switch) also selects the
// scalar loops, as it selects torch's. FUSETRAIN_CPU_PATH=generic, below them
// all, sends every CPU op to its device-generic implementation (ATen ops
// only, Note [Device-generic ops] in generic.h): what a backend without
// kernels of ours runs, tested here against the kernels.
#pragma once

#include <string>

namespace fusetrain::ops {

struct CpuFeatures {
  bool avx2 = false;         // with FMA and F16C
  bool avx512 = false;       // F, BW, VL and DQ, with the OS saving ZMM state
  bool avx512_bf16 = false;  // VCVTNEPS2BF16, VDPBF16PS
  bool avx512_fp16 = false;
  bool amx_bf16 = false;  // AMX tiles with bf16 (the OS saving tile state)
  std::string model;      // the brand string, e.g. "AMD EPYC 7B13"
};

/// This CPU's features (cpuid once; all false off x86-64).
const CpuFeatures& cpu_features();

enum class CpuPath { kGeneric = -1, kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

/// The path the CPU ops take (see Note [CPU paths]); decided once. A
/// FUSETRAIN_CPU_PATH the CPU cannot run, or not one of the names, throws
/// std::runtime_error naming the variable and what the CPU has.
CpuPath cpu_path();

/// "generic", "scalar", "avx2", "avx512".
const char* cpu_path_name(CpuPath path);

/// The best path this CPU has, whatever the environment says.
CpuPath best_cpu_path();

}  // namespace fusetrain::ops
