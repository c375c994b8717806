// The chunked linear + cross-entropy ops: argument checks, the device-generic
// implementation (ATen GEMMs and fusetrain's softmax cross-entropy ops, so it
// runs on every backend those run on) and the Meta one.
//
// Note [Chunked linear cross-entropy]
// The loss of a language model's head, cross_entropy(x W^T + b, t) over N
// rows and C classes, holds [N, C] logits and as large a gradient in eager
// PyTorch: 8K tokens x 128K classes is 4 GiB in fp32 each way. These ops walk
// the rows in chunks and never hold more than one chunk's logits:
//   forward, per chunk of rows r:  z_r = x_r W^T + b         (one GEMM)
//                                  loss_r, lse_r = CE(z_r)    (fp32)
//   and, when the gradients are wanted in the same pass (`with_grad`),
//                                  g_r = dloss/dz_r           (the CE backward,
//                                                              over z_r in place)
//                                  dx_r = g_r W               (a GEMM: complete)
//                                  dW += g_r^T x_r, db += sum g_r (fp32)
// Computing the gradients in the forward costs three GEMMs a chunk against
// four for a backward that recomputes the logits, and holds dx and dW (fp32)
// from the forward to the backward, which only rescales them by the loss's
// gradient. That rescaling is exact only for a scalar loss, so "none" always
// recomputes (linear_cross_entropy_backward).
// Chunk size (linear_cross_entropy_chunk_rows): a chunk's logits and
// gradient take about the memory of the input itself (Liger Kernel's rule),
// and at least 64 MiB; and a chunk has at least 512 rows on the CPU, 2048 on
// CUDA, for the GEMMs rather than the memory. Each chunk of R rows reads and
// writes the whole fp32 dW (8 C H bytes) for 2 R C H flops of its dW GEMM,
// R / 4 flops a byte, which must stay well above the machine's balance or
// the accumulation, not the multiply-adds, sets the pace:
// - CPU: 2 Zen 4 cores, ~20 GB/s, about 30 flops a byte. fp32 at
//   8192 x 768 -> 50257 gets 128 rows from the memory rule (32 flops a
//   byte): 11.9 s a fwd+bwd against 10.6 s at 512 rows (128 flops a byte),
//   for 74 MiB more; 32768 fp32 6.6 s at 256 rows, 6.2 s at 512; bf16 (320
//   rows by memory at 50257) within 2%.
// - CUDA: H100 989 TFLOP/s over 3.35 TB/s, about 300 (H200 about 210, A100
//   about 160). At 16384 x 4096 -> 128256 the memory rule alone gives
//   R = 256: 64 chunks re-reading 2 GiB of fp32 dW each, about 80 ms of
//   traffic against 50 to 75 ms for all the GEMMs; and dx = g W has only
//   R x H outputs, 32 tiles of 128 x 256 for 132 SMs. R = 2048 makes it 8
//   chunks, 512 flops a byte and 256 tiles, for a 501 MiB chunk beside the
//   2 GiB accumulator.
// The unweighted cross-entropy is fusetrain's fused op (one pass each way,
// no fp32 copy of the logits); class weights take ATen's softmax in fp32 over
// the chunk, torch's weighted formula:
//   loss_i = (1 - ls) w_t (lse_i - z_it) + ls / C sum_j w_j (lse_i - z_ij)
//   dloss_i/dz_ij = p_ij ((1 - ls) w_t + ls / C sum_k w_k) - (1 - ls) w_t [j = t] - ls / C w_j
// and "mean" divides by the sum of the kept rows' target weights.
//
// Note [Split float32 sum]
// dW is summed in float32 and rounded to the linear's dtype once. Held as a
// float32 [C, H] and then rounded into a bf16 one, it would cost 6 bytes a
// weight at the end, the largest figure of the loss's peak on the CPU. For a
// bf16 linear on the CPU the float32 sum is kept instead as its two 16-bit
// halves: `high`, a bf16 [C, H] holding each float32's upper 16 bits (sign,
// exponent, 7 mantissa bits: the float truncated to bf16), and `low`, an
// int16 [C, H] holding the lower 16. Each chunk's product is added to the
// float32 put back together from its halves, bit for bit float32
// accumulation; the end rounds each (high, low) to the nearest bf16 (ties to
// even, as .to(bfloat16) does) into `high`, which becomes the gradient, and
// frees `low`. 4 bytes a weight throughout, the same bits. (CUDA keeps one
// float32 accumulator: cuBLAS adds into it in the GEMM's epilogue, which a
// split sum would replace with a float32 product and a pass of its own.)
//
// Note [Accumulation precision]
// torch's LinearCrossEntropyOptions.acc_policy, for 16-bit linears (float32
// and float64 ones compute in their own dtype throughout):
// - "compact" (`accurate` false): a chunk's GEMMs run in the linear's dtype;
//   the logits and their gradient are 16-bit (each GEMM accumulates in fp32
//   and rounds its output once), as in eager PyTorch, where F.linear's
//   output and the gradient flowing back into it have the linear's dtype.
//   The weight and bias gradients are summed over the chunks in fp32.
// - "accurate" (`accurate` true): the chunk is computed in float32, the
//   weight (and bias) cast once and each chunk's rows as it comes: fp32
//   logits, fp32 logits' gradient, fp32 GEMMs, as torch's CPU default. On
//   the CPU it is also the fast one for float16, whose GEMMs have no
//   hardware path there (a 512 x 50257 x 768 fp16 GEMM takes 79 s on a Zen 4
//   core pair against 0.21 s in fp32).
// float16 in the forward's gradients: a loss's gradient reaches the logits
// as 1 / N per row ("mean") times the GradScaler's scale, which the forward
// does not know. Stored at 1 / N in float16, every non-target gradient of a
// large vocabulary falls below float16's smallest subnormal (6e-8) or keeps
// a few bits. So for float16 the forward holds the input and weight
// gradients in float32 (the weight's accumulator is float32 anyway; the
// input's costs 2 more bytes an element until the backward), and float16
// GEMMs ("compact") take the logits' gradient at the scale of one row's loss
// (|g| <= 1: no overflow, and subnormal only where a probability is below
// 6e-8) while the forward's `grad_scale` output carries the 1 / N. The
// backward multiplies the held float32 gradients by the loss's gradient and
// grad_scale and rounds once to float16.
#include <fusetrain/ops/checks.h>
#include <fusetrain/ops/cross_entropy.h>
#include <fusetrain/ops/linear_cross_entropy.h>

#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/bit_cast.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <string>
#include <utility>

namespace fusetrain::ops {

namespace {

constexpr const char* kForwardOp = "fusetrain::linear_cross_entropy_forward";
constexpr const char* kBackwardOp = "fusetrain::linear_cross_entropy_backward";

bool is_linear_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16 || t == at::kDouble;
}

// The dtype a chunk's logits, their gradient and its GEMMs are computed in
// (Note [Accumulation precision]).
at::ScalarType compute_dtype(at::ScalarType dtype, bool accurate) {
  return accurate && (dtype == at::kHalf || dtype == at::kBFloat16) ? at::kFloat : dtype;
}

// The dtype of the losses, log-sum-exps and sums: float64 for float64
// linears, float32 otherwise.
at::ScalarType acc_dtype(at::ScalarType dtype) {
  return dtype == at::kDouble ? at::kDouble : at::kFloat;
}

// Every argument of either op, each message naming what is at fault.
void check_args(const char* op, const at::Tensor& input, const at::Tensor& linear_weight,
                const std::optional<at::Tensor>& linear_bias, const at::Tensor& target,
                const std::optional<at::Tensor>& weight, double label_smoothing,
                const std::string& reduction, int64_t chunk_rows) {
  TORCH_CHECK(input.defined() && linear_weight.defined() && target.defined(), op,
              ": input, linear_weight and target must be defined");
  TORCH_CHECK(input.dim() == 2, op, ": input must be 2-D [rows, in_features], got shape ",
              input.sizes());
  TORCH_CHECK(is_linear_dtype(input.scalar_type()), op,
              ": input must be float32, float64, float16 or bfloat16, got ", input.scalar_type());
  TORCH_CHECK(linear_weight.dim() == 2, op,
              ": linear_weight must be 2-D [classes, in_features], got shape ",
              linear_weight.sizes());
  TORCH_CHECK(linear_weight.size(1) == input.size(1), op, ": input has ", input.size(1),
              " features (shape ", input.sizes(), ") but linear_weight has shape ",
              linear_weight.sizes(), "; they must agree in in_features");
  TORCH_CHECK(linear_weight.scalar_type() == input.scalar_type(), op, ": input is ",
              input.scalar_type(), " but linear_weight is ", linear_weight.scalar_type(),
              "; cast one to the other (or run under autocast)");
  check_same_device(linear_weight, input, op, "linear_weight", "input");
  const int64_t classes = linear_weight.size(0);
  if (given(linear_bias)) {
    TORCH_CHECK(linear_bias->dim() == 1 && linear_bias->size(0) == classes, op,
                ": linear_bias must have shape [", classes, "] (classes), got ",
                linear_bias->sizes());
    TORCH_CHECK(linear_bias->scalar_type() == input.scalar_type(), op, ": linear_bias is ",
                linear_bias->scalar_type(), " but input and linear_weight are ",
                input.scalar_type());
    check_same_device(*linear_bias, input, op, "linear_bias", "input");
  }
  TORCH_CHECK(target.scalar_type() == at::kLong, op, ": target must be int64 class indices, got ",
              target.scalar_type());
  TORCH_CHECK(target.dim() == 1 && target.size(0) == input.size(0), op,
              ": target must have one class index per row of input, shape [", input.size(0),
              "], got ", target.sizes());
  check_same_device(target, input, op, "target", "input");
  if (given(weight)) {
    TORCH_CHECK(weight->dim() == 1 && weight->size(0) == classes, op,
                ": weight (class weights) must have shape [", classes, "], got ", weight->sizes());
    TORCH_CHECK(at::isFloatingType(weight->scalar_type()), op,
                ": weight (class weights) must be floating point, got ", weight->scalar_type());
    check_same_device(*weight, input, op, "weight", "input");
  }
  TORCH_CHECK(label_smoothing >= 0.0 && label_smoothing <= 1.0, op,
              ": label_smoothing must be in [0, 1], got ", label_smoothing);
  parse_reduction(reduction, op);
  (void)chunk_rows;  // <= 0: the rule's (linear_cross_entropy_chunk_rows)
}

// On the CPU the targets are checked up front, so that the error names the
// row of the whole batch (a chunk's cross-entropy would name its own row);
// on CUDA the kernels' device-side asserts catch them, as in torch.
void check_targets(const at::Tensor& target, int64_t classes, int64_t ignore_index) {
  if (!target.is_cpu()) return;
  const at::Tensor t = target.contiguous();
  const int64_t* p = t.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < t.numel(); ++i) {
    TORCH_CHECK_INDEX(p[i] == ignore_index || (p[i] >= 0 && p[i] < classes),
                      "fusetrain::linear_cross_entropy: target[", i, "] = ", p[i],
                      " is out of range for ", classes, " classes (valid: 0 to ", classes - 1,
                      ", or ignore_index = ", ignore_index, ")");
  }
}

// What one pass over the chunks computes: row losses (forward), and the
// gradients for per-row loss gradients `scale` (0-d: every row's, or [N]).
struct Pass {
  at::Tensor input;  // the operands contiguous: the GEMMs and row loops take spans
  at::Tensor linear_weight;               // in the compute dtype
  std::optional<at::Tensor> linear_bias;  // in the compute dtype
  at::Tensor target;
  at::Tensor class_weight;  // [C] in the accumulation dtype, undefined when unweighted
  int64_t ignore_index;
  double label_smoothing;
  int64_t chunk_rows;
  at::ScalarType compute;  // the dtype of a chunk's GEMMs and logits
};

struct Grads {
  at::Tensor input;       // [N, H] (the stored dtype), or undefined
  at::Tensor weight;      // [C, H] float32 (float64) accumulator, or undefined;
                          // for bf16 GEMMs on the CPU the high halves of its values
  at::Tensor weight_low;  // ... and then their low halves (Note [Split float32 sum])
  at::Tensor bias;        // [C] float32 (float64) accumulator, or undefined
};

// Rows of a [rows, cols] output per CPU GEMM block: the block's product (and
// the float32 copy mm_accumulate_'s mixed-dtype add makes of it, about 4 MiB)
// stay in cache, where whole-output temporaries in each dtype cost 18% of the
// loss's time and 220 MiB (50257 x 768, bf16).
int64_t cpu_block_rows(int64_t cols) {
  constexpr int64_t kBlockBytes = int64_t{4} << 20;
  return std::max<int64_t>(
      256, kBlockBytes / std::max<int64_t>(cols * static_cast<int64_t>(sizeof(float)), 1));
}

// (high, low) += mat1 @ mat2 (Note [Split float32 sum]): bf16 GEMMs over
// blocks of rows, each block's product added to the float32 sums.
void split_sum_add_mm_(at::Tensor& high, at::Tensor& low, const at::Tensor& mat1,
                       const at::Tensor& mat2) {
  const int64_t block = cpu_block_rows(high.size(1));
  for (int64_t r0 = 0; r0 < high.size(0); r0 += block) {
    const int64_t r = std::min(block, high.size(0) - r0);
    at::Tensor high_rows = high.narrow(0, r0, r);
    at::Tensor low_rows = low.narrow(0, r0, r);
    split_sum_add_(high_rows, low_rows, at::mm(mat1.narrow(0, r0, r), mat2));
  }
}

// Softmax cross-entropy of one chunk by ATen ops in the accumulation dtype
// (float32, float64 for float64 logits), torch's weighted formula (Note
// [Chunked linear cross-entropy]; `w` undefined: every class weighs 1): the
// row losses (when row_loss is given) and, when `scale` is defined, the
// logits' gradient in z's dtype. Class weights and float64 logits come here;
// the rest takes the fused ops.
at::Tensor generic_chunk(const at::Tensor& z, const at::Tensor& t, const at::Tensor& w,
                         int64_t ignore_index, double ls, const at::Tensor& row_loss,
                         const at::Tensor& lse_out, const at::Tensor& lse_in,
                         const at::Tensor& scale) {
  const int64_t classes = z.size(1);
  const at::ScalarType acc = acc_dtype(z.scalar_type());
  at::Tensor zf = z.to(acc);
  const at::Tensor lse = lse_in.defined() ? lse_in.to(acc) : at::logsumexp(zf, {1});
  const at::Tensor kept = t.ne(ignore_index);
  const at::Tensor keptf = kept.to(acc);
  const at::Tensor tc = at::where(kept, t, 0).unsqueeze(1);
  const at::Tensor wt = w.defined() ? w.index_select(0, tc.squeeze(1)).mul(keptf) : keptf;
  const at::Tensor wsum =
      w.defined() ? w.sum() : at::scalar_tensor(static_cast<double>(classes), zf.options());
  const double smooth = ls / static_cast<double>(classes);
  if (row_loss.defined()) {
    at::Tensor loss = lse.sub(zf.gather(1, tc).squeeze(1)).mul(wt).mul(1.0 - ls);
    if (ls != 0.0) {
      // sum_j w_j (lse - z_j) = lse sum_j w_j - z . w
      const at::Tensor zw = w.defined() ? at::mv(zf, w) : zf.sum(1);
      loss.add_(lse.mul(wsum).sub(zw).mul(keptf).mul(smooth));
    }
    row_loss.copy_(loss);
    if (lse_out.defined()) lse_out.copy_(lse);
  }
  if (!scale.defined()) return {};
  // In place over the logits in the accumulation dtype (the chunk's own, or
  // their copy): the loss above was their last other use.
  at::Tensor grad = zf.sub_(lse.unsqueeze(1)).exp_();
  grad.mul_(wt.mul(1.0 - ls).add(keptf.mul(wsum).mul(smooth)).unsqueeze(1));
  if (ls != 0.0) {
    grad.sub_(w.defined() ? keptf.unsqueeze(1).mul(w.unsqueeze(0)).mul(smooth)
                          : keptf.unsqueeze(1).mul(smooth));
  }
  grad.scatter_add_(1, tc, wt.mul(-(1.0 - ls)).unsqueeze(1));
  // Ignored rows stay exact zeros even when the scale is inf ("mean" over no
  // kept row: 0 / 0 is the loss, not the gradient).
  grad.mul_(at::where(kept, scale.to(acc), 0).unsqueeze(1));
  return grad.to(z.scalar_type());
}

// A chunk's logits x W^T + b, [r, C] row-major. On the CPU a float32
// x @ W^T (its [C, H] operand transposed) ran at 113 GFLOP/s on a Zen 4 core
// pair at 512 x 768 -> 50257, where W_block @ x^T over blocks of 1024
// classes ran at 165: with at least 512 features the logits are built from
// those blocks, each [1024, r] product transposed into its columns (a 2 MiB
// temporary at 512 rows). 0.24 s a chunk against 0.37 there; at 256 features
// the blocks were no faster, and 16-bit GEMMs slower (0.18 s against 0.12).
at::Tensor chunk_logits(const Pass& p, const at::Tensor& x) {
  constexpr int64_t kClassBlock = 1024;
  constexpr int64_t kMinFeatures = 512;
  const at::Tensor& w = p.linear_weight;
  if (!(x.is_cpu() && p.compute == at::kFloat && x.size(1) >= kMinFeatures)) {
    return given(p.linear_bias) ? at::addmm(*p.linear_bias, x, w.t()) : at::mm(x, w.t());
  }
  const int64_t classes = w.size(0);
  at::Tensor z = at::empty({x.size(0), classes}, x.options());
  const at::Tensor xt = x.t();
  for (int64_t c0 = 0; c0 < classes; c0 += kClassBlock) {
    const int64_t c = std::min(kClassBlock, classes - c0);
    z.narrow(1, c0, c).copy_(at::mm(w.narrow(0, c0, c), xt).t());
  }
  if (given(p.linear_bias)) z.add_(*p.linear_bias);
  return z;
}

// Runs the chunks: fills row_loss and lse (when defined: the forward) and
// accumulates the gradients for `scale` into `grads` (when scale is defined).
// `lse_in` (the backward's) spares recomputing each row's log-sum-exp.
void run_chunks(const Pass& p, const at::Tensor& row_loss, const at::Tensor& lse_out,
                const at::Tensor& lse_in, const at::Tensor& scale, Grads& grads) {
  const int64_t n = p.input.size(0);
  const bool per_row_scale = scale.defined() && scale.dim() == 1;
  const bool generic = p.class_weight.defined() || p.compute == at::kDouble;
  for (int64_t r0 = 0; r0 < n; r0 += p.chunk_rows) {
    const int64_t r = std::min(p.chunk_rows, n - r0);
    // The chunk's rows in the compute dtype (a float32 copy of 16-bit rows
    // under "accurate": chunk-sized, not [N, H]).
    const at::Tensor x = p.input.narrow(0, r0, r).to(p.compute);
    const at::Tensor t = p.target.narrow(0, r0, r);
    at::Tensor z = chunk_logits(p, x);
    const at::Tensor chunk_loss = row_loss.defined() ? row_loss.narrow(0, r0, r) : at::Tensor();
    const at::Tensor chunk_lse_out = lse_out.defined() ? lse_out.narrow(0, r0, r) : at::Tensor();
    const at::Tensor chunk_lse_in = lse_in.defined() ? lse_in.narrow(0, r0, r) : at::Tensor();
    const at::Tensor chunk_scale =
        !scale.defined() ? at::Tensor() : (per_row_scale ? scale.narrow(0, r0, r) : scale);
    at::Tensor g;
    if (generic) {
      g = generic_chunk(z, t, p.class_weight, p.ignore_index, p.label_smoothing, chunk_loss,
                        chunk_lse_out, chunk_lse_in, chunk_scale);
    } else {
      at::Tensor lse = chunk_lse_in;
      if (chunk_loss.defined()) {
        auto [rows, chunk_lse, kept] =
            softmax_cross_entropy_forward(z, t, p.ignore_index, p.label_smoothing, "none");
        chunk_loss.copy_(rows);
        if (chunk_lse_out.defined()) chunk_lse_out.copy_(chunk_lse);
        lse = chunk_lse;
      }
      if (chunk_scale.defined()) {
        // The logits' gradient replaces the logits: one chunk of [rows,
        // classes] memory in all.
        g = softmax_cross_entropy_backward_out(chunk_scale, z, t, lse, p.ignore_index,
                                               p.label_smoothing, per_row_scale ? "none" : "sum",
                                               std::nullopt, z);
      }
    }
    if (!g.defined()) continue;
    if (grads.input.defined()) {
      at::Tensor dx = grads.input.narrow(0, r0, r);
      if (dx.scalar_type() == g.scalar_type()) {
        at::mm_out(dx, g, p.linear_weight);
      } else {
        dx.copy_(at::mm(g, p.linear_weight));
      }
    }
    if (grads.weight_low.defined()) {
      split_sum_add_mm_(grads.weight, grads.weight_low, g.t(), x);
    } else if (grads.weight.defined()) {
      mm_accumulate_(grads.weight, g.t(), x);
    }
    if (grads.bias.defined()) grads.bias.add_(g.sum(0, /*keepdim=*/false, grads.bias.scalar_type()));
  }
}

// Either op's operands, made contiguous (the linear's in the compute dtype),
// with the targets checked.
Pass pass_of(const at::Tensor& input, const at::Tensor& linear_weight,
             const std::optional<at::Tensor>& linear_bias, const at::Tensor& target,
             const std::optional<at::Tensor>& weight, int64_t ignore_index,
             double label_smoothing, int64_t chunk_rows, bool accurate) {
  const at::ScalarType compute = compute_dtype(input.scalar_type(), accurate);
  const at::ScalarType acc = acc_dtype(input.scalar_type());
  Pass p{input.contiguous(),
         linear_weight.to(compute).contiguous(),
         given(linear_bias) ? std::optional<at::Tensor>(linear_bias->to(compute).contiguous())
                            : std::nullopt,
         target.contiguous(),
         given(weight) ? weight->to(acc).contiguous() : at::Tensor(),
         ignore_index,
         label_smoothing,
         chunk_rows,
         compute};
  check_targets(p.target, p.linear_weight.size(0), ignore_index);
  return p;
}

// Inside either op: autocast does not recast the GEMMs (they run in the
// linear's dtype as given; the callers cast for autocast), and autograd does
// not record the ATen calls (the op is one node: the faces' Functions).
struct BelowAutocastAndAutograd {
  c10::impl::ExcludeDispatchKeyGuard no_autocast{c10::autocast_dispatch_keyset};
  at::AutoDispatchBelowADInplaceOrView below_autograd;
};

// What "mean" divides by: the kept rows, or the sum of their targets'
// class weights (torch's weighted mean); 1 for "sum" and "none". 0-d, in
// the accumulation dtype.
at::Tensor denominator_of(const Pass& p, Reduction red) {
  const auto options = p.input.options().dtype(acc_dtype(p.input.scalar_type()));
  if (red != Reduction::kMean) return at::ones({}, options);
  const at::Tensor kept = p.target.ne(p.ignore_index);
  if (!p.class_weight.defined()) return kept.sum().to(options.dtype());
  const at::Tensor tc = at::where(kept, p.target, 0);
  return p.class_weight.index_select(0, tc).mul(kept).sum();
}

// The dtype the forward keeps a gradient in until the backward scales it
// (Note [Accumulation precision]): the linear's, but float32 for float16,
// whose 5-bit exponent would lose the small gradients before the loss scale
// lifts them.
at::ScalarType held_dtype(at::ScalarType dtype) {
  return dtype == at::kHalf ? at::kFloat : dtype;
}

// Grads with the accumulators the mask asks for; the input's gradient in
// `input_dtype`.
Grads grads_for(const Pass& p, std::array<bool, 3> mask, at::ScalarType input_dtype) {
  const auto acc = p.input.options().dtype(acc_dtype(p.input.scalar_type()));
  Grads g;
  if (mask[0]) g.input = at::empty(p.input.sizes(), p.input.options().dtype(input_dtype));
  if (mask[1] && p.input.is_cpu() && p.compute == at::kBFloat16) {
    // Zero bits in both halves: float32 zeros (Note [Split float32 sum]).
    g.weight = at::zeros(p.linear_weight.sizes(), p.input.options());
    g.weight_low = at::zeros(p.linear_weight.sizes(), p.input.options().dtype(at::kShort));
  } else if (mask[1]) {
    g.weight = at::zeros(p.linear_weight.sizes(), acc);
  }
  if (mask[2] && given(p.linear_bias)) g.bias = at::zeros({p.linear_weight.size(0)}, acc);
  return g;
}

// The accumulated gradients in `dtype` (accumulators already of it returned
// as they are, a split sum's rounded high halves as they are), empty where
// not computed. Frees the accumulators.
std::tuple<at::Tensor, at::Tensor, at::Tensor> finish(Grads g, at::ScalarType dtype,
                                                      const at::TensorOptions& options) {
  if (g.weight_low.defined()) {
    split_sum_round_(g.weight, g.weight_low);
    g.weight_low.reset();
  }
  const auto out = [&](at::Tensor& t) {
    return t.defined() ? std::exchange(t, {}).to(dtype) : at::empty({0}, options.dtype(dtype));
  };
  return {out(g.input), out(g.weight), out(g.bias)};
}

// The chunk rows the caller gave, or the rule's for the compute dtype.
int64_t resolved_chunk_rows(int64_t chunk_rows, const at::Tensor& input, int64_t classes,
                            bool accurate) {
  if (chunk_rows > 0) return chunk_rows;
  return linear_cross_entropy_chunk_rows(input.size(0), input.size(1), classes,
                                         compute_dtype(input.scalar_type(), accurate),
                                         input.device().type());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
forward_generic(const at::Tensor& input_in, const at::Tensor& linear_weight_in,
                const std::optional<at::Tensor>& linear_bias_in, const at::Tensor& target_in,
                const std::optional<at::Tensor>& weight, int64_t ignore_index,
                double label_smoothing, c10::string_view reduction_view, int64_t chunk_rows,
                std::array<bool, 3> grad_mask, bool accurate) {
  const std::string reduction(reduction_view);
  check_args(kForwardOp, input_in, linear_weight_in, linear_bias_in, target_in, weight,
             label_smoothing, reduction, chunk_rows);
  const Reduction red = parse_reduction(reduction, kForwardOp);
  const bool with_grad = grad_mask[0] || grad_mask[1] || (grad_mask[2] && given(linear_bias_in));
  TORCH_CHECK(!with_grad || red != Reduction::kNone, kForwardOp,
              ": gradients in the forward need a scalar loss (reduction \"mean\" or \"sum\"); "
              "\"none\" recomputes in linear_cross_entropy_backward");
  const BelowAutocastAndAutograd below;
  const at::ScalarType dtype = input_in.scalar_type();
  const Pass p = pass_of(input_in, linear_weight_in, linear_bias_in, target_in, weight,
                         ignore_index, label_smoothing,
                         resolved_chunk_rows(chunk_rows, input_in, linear_weight_in.size(0),
                                             accurate),
                         accurate);
  const auto acc = p.input.options().dtype(acc_dtype(dtype));
  const int64_t n = p.input.size(0);
  at::Tensor row_loss = at::empty({n}, acc);
  at::Tensor lse = at::empty({n}, acc);
  const at::Tensor denominator = denominator_of(p, red);
  // The gradient of the loss with respect to each row's loss, for a loss
  // gradient of 1: 1 / denominator for "mean", 1 for "sum"; float16 GEMMs
  // take 1 (Note [Accumulation precision]) and grad_scale the rest.
  const bool per_row = p.compute == at::kHalf;
  at::Tensor scale, grad_scale;
  if (with_grad) {
    scale = per_row ? at::ones({}, acc) : at::reciprocal(denominator);
    // (No kept row, denominator 0: the held gradients are zeros, and so are
    // torch's, not 0 x inf.)
    grad_scale = per_row ? at::where(denominator.ne(0), at::reciprocal(denominator), 0)
                         : at::ones({}, acc);
  } else {
    grad_scale = at::ones({}, acc);
  }
  Grads grads = with_grad ? grads_for(p, grad_mask, held_dtype(dtype)) : Grads{};
  run_chunks(p, row_loss, lse, at::Tensor(), scale, grads);

  at::Tensor loss = row_loss;
  if (red != Reduction::kNone) {
    // A double sum of the row losses, rounded once (the fused
    // cross-entropy's reduction); all rows ignored under "mean": 0 / 0 = NaN.
    const at::Tensor total = row_loss.sum(0, /*keepdim=*/false, at::kDouble);
    loss = (red == Reduction::kMean ? total.div(denominator) : total).to(acc_dtype(dtype));
  }
  auto [gi, gw, gb] = finish(std::move(grads), held_dtype(dtype), p.input.options());
  return {loss, lse, denominator, gi, gw, gb, grad_scale};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_generic(
    const at::Tensor& grad_loss, const at::Tensor& input_in, const at::Tensor& linear_weight_in,
    const std::optional<at::Tensor>& linear_bias_in, const at::Tensor& target_in,
    const std::optional<at::Tensor>& weight, const at::Tensor& lse, const at::Tensor& denominator,
    int64_t ignore_index, double label_smoothing, c10::string_view reduction_view,
    int64_t chunk_rows, std::array<bool, 3> output_mask, bool accurate) {
  const std::string reduction(reduction_view);
  check_args(kBackwardOp, input_in, linear_weight_in, linear_bias_in, target_in, weight,
             label_smoothing, reduction, chunk_rows);
  const Reduction red = parse_reduction(reduction, kBackwardOp);
  const int64_t n = input_in.size(0);
  const at::ScalarType acc = acc_dtype(input_in.scalar_type());
  TORCH_CHECK(grad_loss.defined() && grad_loss.is_floating_point(), kBackwardOp,
              ": grad_loss must be a floating point tensor");
  TORCH_CHECK(red == Reduction::kNone ? (grad_loss.dim() == 1 && grad_loss.size(0) == n)
                                      : grad_loss.numel() == 1,
              kBackwardOp, ": grad_loss must have shape ",
              red == Reduction::kNone ? "[" + std::to_string(n) + "]" : std::string("[]"),
              " for reduction \"", reduction, "\", got ", grad_loss.sizes());
  TORCH_CHECK(lse.defined() && lse.scalar_type() == acc && lse.dim() == 1 && lse.size(0) == n,
              kBackwardOp, ": lse must be the forward's ", acc, " [", n, "] output, got ",
              lse.scalar_type(), " ", lse.sizes());
  TORCH_CHECK(denominator.defined() && denominator.numel() == 1, kBackwardOp,
              ": denominator must be the forward's one-element output, got ", denominator.sizes());
  const BelowAutocastAndAutograd below;
  const Pass p = pass_of(input_in, linear_weight_in, linear_bias_in, target_in, weight,
                         ignore_index, label_smoothing,
                         resolved_chunk_rows(chunk_rows, input_in, linear_weight_in.size(0),
                                             accurate),
                         accurate);
  at::Tensor scale = grad_loss.to(acc);
  scale = red == Reduction::kNone ? scale.contiguous() : scale.reshape({});
  if (red == Reduction::kMean) scale = scale.div(denominator.reshape({}).to(acc));
  Grads grads = grads_for(p, output_mask, input_in.scalar_type());
  if (output_mask[0] || output_mask[1] || (output_mask[2] && given(p.linear_bias))) {
    run_chunks(p, at::Tensor(), at::Tensor(), lse.contiguous(), scale, grads);
  }
  return finish(std::move(grads), p.input.scalar_type(), p.input.options());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
forward_meta(const at::Tensor& input, const at::Tensor& linear_weight,
             const std::optional<at::Tensor>& linear_bias, const at::Tensor& target,
             const std::optional<at::Tensor>& weight, int64_t ignore_index,
             double label_smoothing, c10::string_view reduction_view, int64_t chunk_rows,
             std::array<bool, 3> grad_mask, bool accurate) {
  const std::string reduction(reduction_view);
  check_args(kForwardOp, input, linear_weight, linear_bias, target, weight, label_smoothing,
             reduction, chunk_rows);
  const Reduction red = parse_reduction(reduction, kForwardOp);
  const auto acc = input.options().dtype(acc_dtype(input.scalar_type()));
  const auto held = input.options().dtype(held_dtype(input.scalar_type()));
  const int64_t n = input.size(0);
  const auto grad_like = [&](const at::Tensor& t, bool want) {
    return want ? at::empty(t.sizes(), held) : at::empty({0}, held);
  };
  return {red == Reduction::kNone ? at::empty({n}, acc) : at::empty({}, acc),
          at::empty({n}, acc),
          at::empty({}, acc),
          grad_like(input, grad_mask[0]),
          grad_like(linear_weight, grad_mask[1]),
          given(linear_bias) ? grad_like(*linear_bias, grad_mask[2]) : at::empty({0}, held),
          at::empty({}, acc)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_meta(
    const at::Tensor& grad_loss, const at::Tensor& input, const at::Tensor& linear_weight,
    const std::optional<at::Tensor>& linear_bias, const at::Tensor& target,
    const std::optional<at::Tensor>& weight, const at::Tensor& lse, const at::Tensor& denominator,
    int64_t ignore_index, double label_smoothing, c10::string_view reduction_view,
    int64_t chunk_rows, std::array<bool, 3> output_mask, bool accurate) {
  const std::string reduction(reduction_view);
  check_args(kBackwardOp, input, linear_weight, linear_bias, target, weight, label_smoothing,
             reduction, chunk_rows);
  const auto grad_like = [&](const at::Tensor& t, bool want) {
    return want ? at::empty(t.sizes(), input.options()) : at::empty({0}, input.options());
  };
  return {grad_like(input, output_mask[0]), grad_like(linear_weight, output_mask[1]),
          given(linear_bias) ? grad_like(*linear_bias, output_mask[2])
                             : at::empty({0}, input.options())};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
linear_cross_entropy_forward(const at::Tensor& input, const at::Tensor& linear_weight,
                             const std::optional<at::Tensor>& linear_bias,
                             const at::Tensor& target, const std::optional<at::Tensor>& weight,
                             int64_t ignore_index, double label_smoothing,
                             const std::string& reduction, int64_t chunk_rows,
                             std::array<bool, 3> grad_mask, bool accurate) {
  using Fn = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                        at::Tensor>(
      const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&,
      const std::optional<at::Tensor>&, int64_t, double, c10::string_view, int64_t,
      std::array<bool, 3>, bool);
  static auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow(kForwardOp, "").typed<Fn>();
  return op.call(input, linear_weight, linear_bias, target, weight, ignore_index, label_smoothing,
                 reduction, chunk_rows, grad_mask, accurate);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_cross_entropy_backward(
    const at::Tensor& grad_loss, const at::Tensor& input, const at::Tensor& linear_weight,
    const std::optional<at::Tensor>& linear_bias, const at::Tensor& target,
    const std::optional<at::Tensor>& weight, const at::Tensor& lse, const at::Tensor& denominator,
    int64_t ignore_index, double label_smoothing, const std::string& reduction,
    int64_t chunk_rows, std::array<bool, 3> output_mask, bool accurate) {
  using Fn = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
      const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&, const at::Tensor&,
      int64_t, double, c10::string_view, int64_t, std::array<bool, 3>, bool);
  static auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow(kBackwardOp, "").typed<Fn>();
  return op.call(grad_loss, input, linear_weight, linear_bias, target, weight, lse, denominator,
                 ignore_index, label_smoothing, reduction, chunk_rows, output_mask, accurate);
}

void mm_accumulate_(at::Tensor& out, const at::Tensor& mat1, const at::Tensor& mat2) {
  if (mat1.scalar_type() == out.scalar_type()) {
    out.addmm_(mat1, mat2);
  } else if (out.is_cuda()) {
    // cuBLAS with a float32 C and beta = 1: no [rows, cols] temporary.
    at::addmm_out(out, out, mat1, mat2, out.scalar_type());
  } else {
    // No 16-bit GEMM with a float32 C on the CPU: the product goes through
    // 16-bit blocks of output rows (with the float32 copy the mixed-dtype add
    // makes of each), not a [rows, cols] temporary in each dtype.
    const int64_t block = cpu_block_rows(out.size(1));
    for (int64_t r0 = 0; r0 < out.size(0); r0 += block) {
      const int64_t r = std::min(block, out.size(0) - r0);
      out.narrow(0, r0, r).add_(at::mm(mat1.narrow(0, r0, r), mat2));
    }
  }
}

namespace {

float join_halves(uint16_t high, uint16_t low) {
  return c10::bit_cast<float>(static_cast<uint32_t>(high) << 16 | low);
}

void check_split_sum(const char* op, const at::Tensor& high, const at::Tensor& low) {
  TORCH_CHECK(high.is_cpu() && high.scalar_type() == at::kBFloat16 && high.is_contiguous(), op,
              ": high must be a contiguous bfloat16 CPU tensor");
  TORCH_CHECK(low.is_cpu() && low.scalar_type() == at::kShort && low.is_contiguous() &&
                  low.sizes() == high.sizes(),
              op, ": low must be a contiguous int16 CPU tensor of high's shape ", high.sizes(),
              ", got ", low.scalar_type(), " ", low.sizes());
}

constexpr int64_t kSplitSumGrain = 16384;

}  // namespace

void split_sum_add_(at::Tensor& high, at::Tensor& low, const at::Tensor& addend) {
  check_split_sum("split_sum_add_", high, low);
  TORCH_CHECK(addend.scalar_type() == at::kBFloat16 && addend.sizes() == high.sizes(),
              "split_sum_add_: addend must be bfloat16 of shape ", high.sizes(), ", got ",
              addend.scalar_type(), " ", addend.sizes());
  const at::Tensor a = addend.contiguous();
  auto* h = reinterpret_cast<uint16_t*>(high.mutable_data_ptr<at::BFloat16>());
  auto* l = reinterpret_cast<uint16_t*>(low.mutable_data_ptr<int16_t>());
  const at::BFloat16* p = a.const_data_ptr<at::BFloat16>();
  at::parallel_for(0, high.numel(), kSplitSumGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const uint32_t bits =
          c10::bit_cast<uint32_t>(join_halves(h[i], l[i]) + static_cast<float>(p[i]));
      h[i] = static_cast<uint16_t>(bits >> 16);
      l[i] = static_cast<uint16_t>(bits);
    }
  });
}

void split_sum_round_(at::Tensor& high, const at::Tensor& low) {
  check_split_sum("split_sum_round_", high, low);
  auto* h = high.mutable_data_ptr<at::BFloat16>();
  const auto* l = reinterpret_cast<const uint16_t*>(low.const_data_ptr<int16_t>());
  at::parallel_for(0, high.numel(), kSplitSumGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) h[i] = at::BFloat16(join_halves(h[i].x, l[i]));
  });
}

int64_t linear_cross_entropy_chunk_rows(int64_t rows, int64_t in_features, int64_t classes,
                                        at::ScalarType dtype, c10::DeviceType device) {
  constexpr int64_t kMinBytes = int64_t{64} << 20;
  constexpr int64_t kMultiple = 64;
  // The fp32 dW sum's flops a byte, R / 4 (Note [Chunked linear cross-entropy]).
  const int64_t min_rows = device == c10::DeviceType::CUDA ? 2048 : 512;
  const int64_t element = static_cast<int64_t>(c10::elementSize(dtype));
  const int64_t budget = std::max(rows * in_features * element, kMinBytes);
  // The chunk's logits and their gradient: 2 x chunk x classes elements.
  int64_t chunk = budget / std::max<int64_t>(2 * classes * element, 1);
  chunk = std::max(kMultiple, chunk / kMultiple * kMultiple);
  chunk = std::max(chunk, min_rows);
  return std::max<int64_t>(1, std::min(chunk, rows));
}

TORCH_LIBRARY_IMPL(fusetrain, CompositeExplicitAutograd, m) {
  m.impl("linear_cross_entropy_forward", &forward_generic);
  m.impl("linear_cross_entropy_backward", &backward_generic);
}

TORCH_LIBRARY_IMPL(fusetrain, Meta, m) {
  m.impl("linear_cross_entropy_forward", &forward_meta);
  m.impl("linear_cross_entropy_backward", &backward_meta);
}

}  // namespace fusetrain::ops
