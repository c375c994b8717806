// Float8 linear layers for C++ models: the mixed_float8 policy's GEMMs
// (Python: fusetrain.amp.Float8Linear, with the same numerics and state).
#pragma once

#include <torch/nn/cloneable.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <array>
#include <string>

namespace fusetrain::amp {

/// How a Float8Linear picks its per-tensor scales (Note [Float8 scaling],
/// csrc/kernels/fp8_scaling.h): scale = fp8_max / amax / 2^margin.
struct Float8Recipe {
  enum class Scaling {
    kDelayed,  ///< amax = max of the last amax_history_len amaxes (one pass)
    kCurrent,  ///< amax = this tensor's own (two passes)
  };
  Scaling scaling = Scaling::kDelayed;
  int64_t amax_history_len = 16;
  int64_t margin = 0;

  /// "delayed" or "current"; anything else throws, listing both.
  static Float8Recipe from_name(const std::string& scaling);
  /// Rows of the amax history buffer (1 for current scaling).
  int64_t history_len() const { return scaling == Scaling::kDelayed ? amax_history_len : 1; }
};

/// The three GEMMs of a Float8Linear step.
enum class Float8Gemm {
  kForward,     ///< output = input x weight^T
  kGradInput,   ///< input gradient = output gradient x weight
  kGradWeight,  ///< weight gradient = output gradient^T x input, summed over every row
};

/// Whether `gemm` runs in cuBLAS' fast-accumulation mode (at::_scaled_mm's
/// use_fast_accum; on Hopper its partial sums keep about 14 bits): the
/// forward only. Both backward GEMMs accumulate exactly, as in Transformer
/// Engine and torchao: the weight gradient sums over every token of the batch.
constexpr bool float8_fast_accum(Float8Gemm gemm) { return gemm == Float8Gemm::kForward; }

/// Layers at least this wide (in and out features) run in float8 by default.
constexpr int64_t kDefaultFp8MinFeatures = 1024;

/// True when a Linear of these sizes may run in float8: both >= min_features
/// and multiples of 16 (the shapes torch._scaled_mm takes on CUDA).
bool float8_eligible(int64_t in_features, int64_t out_features, int64_t min_features);

/// Throws c10::Error unless `device` has float8 GEMMs: the CPU (float32 GEMMs
/// of the upcast operands) or a CUDA GPU of compute capability >= 8.9. The
/// message names the GPU and its capability.
void check_float8_device(const c10::Device& device);

/// torch::nn::Linear with float8 GEMMs (at::_scaled_mm on CUDA): input and
/// weight in e4m3 in the forward, the output gradient in e5m2 in the
/// backward, fp32 accumulation; the weight gradient is fp32. Parameters
/// "weight" [out, in] and "bias" [out] as torch::nn::Linear (same
/// initialisation), plus the buffers "fp8_scale" [3] (input, weight, output
/// gradient), "fp8_amax_history" [3, H] and "fp8_seeded" [3] (uint8: which
/// delayed histories hold data). Under autocast the output is in
/// the autocast dtype, else in the input's. In eval mode each tensor is
/// scaled by itself and the scaling state is left alone. A layer may be
/// applied several times in one forward: each backward reads and updates the
/// scaling state as it is when it runs. With delayed scaling, a CUDA graph
/// capture of a training step needs one eager step first (it seeds the
/// histories); capturing the first step throws.
class Float8LinearImpl : public torch::nn::Cloneable<Float8LinearImpl> {
 public:
  Float8LinearImpl(int64_t in_features, int64_t out_features, bool bias = true,
                   Float8Recipe recipe = {});
  void reset() override;
  at::Tensor forward(const at::Tensor& input);

  /// Casting the module's dtype casts the parameters only: the scaling state
  /// stays float32 (and fp8_seeded uint8).
  void to(torch::Dtype dtype, bool non_blocking = false) override;
  void to(torch::Device device, torch::Dtype dtype, bool non_blocking = false) override;
  void to(torch::Device device, bool non_blocking = false) override;

  /// Call after writing the buffers from a checkpoint: the next forward
  /// rereads fp8_seeded (one device read; also after construction, reset()
  /// and clone()).
  void state_loaded() { seeded_known_ = false; }

  const Float8Recipe& recipe() const { return recipe_; }
  int64_t in_features() const { return in_features_; }
  int64_t out_features() const { return out_features_; }

  at::Tensor weight;
  at::Tensor bias;
  at::Tensor fp8_scale;
  at::Tensor fp8_amax_history;
  at::Tensor fp8_seeded;

 private:
  int64_t in_features_;
  int64_t out_features_;
  bool with_bias_;
  Float8Recipe recipe_;
  bool seeded_known_ = false;
  // Per operand: has its delayed history seen a tensor? Shared with the
  // backward nodes, which seed the output gradient's.
  c10::intrusive_ptr<torch::CustomClassHolder> seeded_;
};
TORCH_MODULE(Float8Linear);

}  // namespace fusetrain::amp
