// The C++ communication hooks (comm_hooks.h): allreduce, fp16/bf16
// compression and PowerSGD, each the same arithmetic in the same order as
// torch's Python hook of the name.
#include <fusetrain/dist/comm_hooks.h>

#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <map>
#include <random>
#include <unordered_map>
#include <vector>

namespace fusetrain::dist {

namespace {

using Future = c10::ivalue::Future;

c10::intrusive_ptr<Future> allreduce_future(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                            at::Tensor tensor) {
  std::vector<at::Tensor> tensors{std::move(tensor)};
  return group->allreduce(tensors)->getFuture();
}

// Waits for an in-place allreduce of `tensor`, naming the hook on failure.
void allreduce_and_wait(const c10::intrusive_ptr<c10d::ProcessGroup>& group, at::Tensor tensor,
                        const char* what) {
  std::vector<at::Tensor> tensors{std::move(tensor)};
  try {
    group->allreduce(tensors)->wait();
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "powersgd_hook: the allreduce of ", what,
                " failed (a rank may have exited or timed out): ", e.what());
  }
}

class AllreduceHook : public CommHook {
 public:
  explicit AllreduceHook(c10::intrusive_ptr<c10d::ProcessGroup> group) : group_(std::move(group)) {}
  c10::intrusive_ptr<Future> runHook(c10d::GradBucket& bucket) override {
    at::Tensor& buffer = bucket.getBufferRef();
    buffer.div_(group_->getSize());
    return allreduce_future(group_, buffer);
  }
  std::string name() const override { return "allreduce"; }
  bool issues_one_collective() const override { return true; }

 private:
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
};

class CompressHook : public CommHook {
 public:
  CompressHook(c10::intrusive_ptr<c10d::ProcessGroup> group, at::ScalarType dtype)
      : group_(std::move(group)), dtype_(dtype) {}
  // The reducer casts the compressed result back into the bucket.
  c10::intrusive_ptr<Future> runHook(c10d::GradBucket& bucket) override {
    at::Tensor compressed = bucket.getBuffer().to(dtype_).div_(group_->getSize());
    return allreduce_future(group_, compressed);
  }
  std::string name() const override { return dtype_ == at::kHalf ? "fp16" : "bf16"; }
  bool issues_one_collective() const override { return true; }

 private:
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  at::ScalarType dtype_;
};

// ------------------------------------------------------------------ PowerSGD

// numpy's legacy RandomState(seed).randint(1_000_000_000): MT19937 seeded as
// std::mt19937 is, then masked rejection sampling (the smallest all-ones mask
// covering the range, 2^30 - 1), as numpy's bounded integers do.
class NumpyRandint {
 public:
  explicit NumpyRandint(uint32_t seed) : mt_(seed) {}
  int64_t below_one_billion() {
    constexpr uint32_t kMax = 999999999, kMask = (1u << 30) - 1;
    uint32_t v;
    do {
      v = static_cast<uint32_t>(mt_()) & kMask;
    } while (v > kMax);
    return v;
  }

 private:
  std::mt19937 mt_;
};

// Orthonormal columns of each matrix of a [batch, n, r] tensor, in place:
// Gram-Schmidt for r <= 2 and 16-bit types, else QR (torch's _orthogonalize).
void orthogonalize(at::Tensor& matrices, double epsilon) {
  const int64_t rank = matrices.size(2);
  if (rank <= 2 || matrices.scalar_type() == at::kHalf || matrices.scalar_type() == at::kBFloat16) {
    for (int64_t i = 0; i < rank; ++i) {
      at::Tensor col = matrices.narrow(2, i, 1);
      at::Tensor norm = at::linalg_vector_norm(col, 2, at::IntArrayRef{1}, /*keepdim=*/true);
      if (epsilon == 0) {
        col.div_(norm);
      } else {
        col.div_(norm + epsilon);
      }
      if (i + 1 < rank) {
        at::Tensor rest = matrices.narrow(2, i + 1, rank - i - 1);
        rest.sub_(at::sum(col * rest, at::IntArrayRef{1}, /*keepdim=*/true) * col);
      }
    }
  } else {
    at::Tensor r = at::empty({matrices.size(0), rank, rank}, matrices.options());
    at::linalg_qr_out(matrices, r, matrices);
  }
}

class PowerSGDHook : public CommHook {
 public:
  PowerSGDHook(c10::intrusive_ptr<c10d::ProcessGroup> group, PowerSGDOptions o)
      : group_(std::move(group)), o_(o), rng_(static_cast<uint32_t>(o.random_seed())) {
    TORCH_CHECK_VALUE(o.matrix_approximation_rank() >= 1,
                      "powersgd_hook: matrix_approximation_rank must be >= 1, got ",
                      o.matrix_approximation_rank());
    TORCH_CHECK_VALUE(o.random_seed() >= 0 && o.random_seed() <= 0xffffffffLL,
                      "powersgd_hook: random_seed must be between 0 and 2**32 - 1, got ",
                      o.random_seed());
    // torch's PowerSGDState's words.
    TORCH_CHECK_VALUE(!((o.use_error_feedback() || o.warm_start()) && o.start_powerSGD_iter() <= 1),
                      "Expect `start_powerSGD_iter` > 1 if `use_error_feedback` or `warm_start` is "
                      "enabled, because PowerSGD can only be applied after the first two "
                      "iterations in DDP.");
  }

  std::string name() const override { return "powersgd"; }

  c10::intrusive_ptr<Future> runHook(c10d::GradBucket& bucket) override {
    at::Tensor input = bucket.getBufferRef();
    const double world = group_->getSize();
    if (iter_ < o_.start_powerSGD_iter()) {
      maybe_increase_iter(bucket);
      input.div_(world);
      return allreduce_future(group_, input);
    }
    const size_t index = bucket.getIndex();
    at::Tensor input_copy;
    if (o_.use_error_feedback()) {
      auto it = error_.find(index);
      if (it != error_.end()) {
        input.add_(it->second);
      } else {
        error_[index] = at::zeros({input.numel()}, input.options());
      }
      input_copy = input.clone();
    }
    // Which per-parameter matrices are worth compressing.
    const std::vector<at::Tensor> tensors = bucket.getGradients();
    std::vector<at::Tensor> to_compress, uncompressed;
    int64_t ps_size = 0, qs_size = 0;
    for (const at::Tensor& t : tensors) {
      const at::Tensor matrix = t.view({t.size(0), -1});
      const int64_t n = matrix.size(0), m = matrix.size(1);
      const int64_t r = std::min({n, m, o_.matrix_approximation_rank()});
      if (static_cast<double>((n + m) * r) * o_.min_compression_rate() <
          static_cast<double>(n * m)) {
        to_compress.push_back(matrix);
        ps_size += n * r;
        qs_size += m * r;
      } else {
        uncompressed.push_back(t);
      }
    }
    std::vector<at::Tensor> flat;
    for (const at::Tensor& t : uncompressed) flat.push_back(t.view(-1));
    at::Tensor uncompressed_memory = flat.empty() ? at::empty({0}, input.options()) : at::cat(flat);
    bool randomize_qs = false;
    if (!o_.warm_start() || p_memory_.count(index) == 0) {
      randomize_qs = true;
      p_memory_[index] = at::empty({ps_size}, input.options());
      q_memory_[index] = at::empty({qs_size}, input.options());
    }
    // Matrices of one shape side by side (in first-seen order), as torch
    // groups them; batched, or one by one.
    std::vector<std::vector<int64_t>> shapes;
    std::map<std::vector<int64_t>, std::vector<at::Tensor>> by_shape;
    for (const at::Tensor& t : to_compress) {
      const std::vector<int64_t> shape(t.sizes().begin(), t.sizes().end());
      if (by_shape.count(shape) == 0) shapes.push_back(shape);
      by_shape[shape].push_back(t);
    }
    std::vector<at::Tensor> batches, ps, qs;
    for (const auto& shape : shapes) {
      const auto& group = by_shape[shape];
      if (o_.batch_tensors_with_same_shape()) {
        batches.push_back(group.size() == 1 ? group[0].unsqueeze(0) : at::stack(group));
      } else {
        for (const at::Tensor& t : group) batches.push_back(t.unsqueeze(0));
      }
    }
    int64_t p_at = 0, q_at = 0;
    for (const at::Tensor& t : batches) {
      const int64_t b = t.size(0), n = t.size(1), m = t.size(2);
      const int64_t r = std::min({n, m, o_.matrix_approximation_rank()});
      ps.push_back(p_memory_[index].narrow(0, p_at, b * n * r).view({b, n, r}));
      qs.push_back(q_memory_[index].narrow(0, q_at, b * m * r).view({b, m, r}));
      p_at += b * n * r;
      q_at += b * m * r;
    }
    if (!randomize_qs) {
      for (at::Tensor& q : qs) orthogonalize(q, o_.orthogonalization_epsilon());
    } else {
      // torch seeds a forked CPU generator from numpy's RandomState; a
      // generator of our own draws the same numbers and leaves torch's
      // global one alone.
      auto gen = at::make_generator<at::CPUGeneratorImpl>(
          static_cast<uint64_t>(rng_.below_one_billion()));
      for (at::Tensor& q : qs) {
        q.copy_(at::randn(q.sizes(), gen, at::TensorOptions().dtype(q.scalar_type())));
        orthogonalize(q, o_.orthogonalization_epsilon());
      }
    }
    for (size_t k = 0; k < batches.size(); ++k) at::bmm_out(ps[k], batches[k], qs[k]);
    // The uncompressed tensors, averaged.
    allreduce_and_wait(group_, uncompressed_memory, "the uncompressed gradients");
    uncompressed_memory.div_(world);
    int64_t at = 0;
    for (at::Tensor& t : uncompressed) {
      t.copy_(uncompressed_memory.narrow(0, at, t.numel()).view_as(t));
      at += t.numel();
    }
    // P = sum M Q, orthogonalised; Q = M^T P, averaged; M ~ P Q^T.
    allreduce_and_wait(group_, p_memory_[index], "P");
    for (at::Tensor& p : ps) orthogonalize(p, o_.orthogonalization_epsilon());
    for (size_t k = 0; k < batches.size(); ++k) at::bmm_out(qs[k], batches[k].transpose(1, 2), ps[k]);
    allreduce_and_wait(group_, q_memory_[index], "Q");
    q_memory_[index].div_(world);
    for (size_t k = 0; k < batches.size(); ++k) at::bmm_out(batches[k], ps[k], qs[k].transpose(1, 2));
    if (o_.batch_tensors_with_same_shape()) {
      for (const at::Tensor& t : batches) {
        if (t.size(0) == 1) continue;
        const auto& originals = by_shape[std::vector<int64_t>(t.sizes().begin() + 1, t.sizes().end())];
        for (size_t i = 0; i < originals.size(); ++i) originals[i].copy_(t[static_cast<int64_t>(i)]);
      }
    }
    if (o_.use_error_feedback()) error_[index] = input_copy - input;
    if (!o_.warm_start()) {
      p_memory_.clear();
      q_memory_.clear();
    }
    maybe_increase_iter(bucket);
    auto done = c10::make_intrusive<Future>(c10::TensorType::get());
    done->markCompleted(c10::IValue(input));
    return done;
  }

 private:
  void maybe_increase_iter(const c10d::GradBucket& bucket) {
    if (bucket.isLast()) ++iter_;
  }

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  PowerSGDOptions o_;
  NumpyRandint rng_;
  int64_t iter_ = 0;
  // Per bucket index, as torch's state keeps them.
  std::unordered_map<size_t, at::Tensor> error_, p_memory_, q_memory_;
};

}  // namespace

at::Tensor CommHook::parseHookResult(const c10::IValue& result) {
  if (result.isTensor()) return result.toTensor();
  TORCH_CHECK(result.isTensorList() && !result.toTensorList().empty(), "communication hook ",
              name(), ": its future holds neither a tensor nor a list of tensors");
  return result.toTensorList().get(0);
}

std::shared_ptr<CommHook> allreduce_hook(c10::intrusive_ptr<c10d::ProcessGroup> group) {
  return std::make_shared<AllreduceHook>(std::move(group));
}

std::shared_ptr<CommHook> compress_hook(c10::intrusive_ptr<c10d::ProcessGroup> group,
                                        at::ScalarType dtype) {
  TORCH_CHECK_VALUE(dtype == at::kHalf || dtype == at::kBFloat16,
                    "compress_hook: dtype must be float16 or bfloat16, got ", dtype);
  return std::make_shared<CompressHook>(std::move(group), dtype);
}

std::shared_ptr<CommHook> powersgd_hook(c10::intrusive_ptr<c10d::ProcessGroup> group,
                                        PowerSGDOptions options) {
  return std::make_shared<PowerSGDHook>(std::move(group), options);
}

std::shared_ptr<CommHook> comm_hook_from_name(const std::string& name,
                                              c10::intrusive_ptr<c10d::ProcessGroup> group,
                                              int64_t powersgd_rank, int64_t start_powersgd_iter) {
  if (name == "none") return nullptr;
  if (name == "allreduce") return allreduce_hook(std::move(group));
  if (name == "fp16") return compress_hook(std::move(group), at::kHalf);
  if (name == "bf16") return compress_hook(std::move(group), at::kBFloat16);
  if (name == "powersgd") {
    return powersgd_hook(std::move(group), PowerSGDOptions()
                                               .matrix_approximation_rank(powersgd_rank)
                                               .start_powerSGD_iter(start_powersgd_iter));
  }
  TORCH_CHECK_VALUE(false, "unknown communication hook \"", name,
                    "\"; choose none, allreduce, fp16, bf16 or powersgd");
}

}  // namespace fusetrain::dist
