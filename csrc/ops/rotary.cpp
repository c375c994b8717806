// Fused rotary embedding (Note [Fused rotary] in rotary.h): dispatcher entry
// points, the argument checks, the row offsets of the broadcast cos/sin, and
// the Meta implementations.
#include <fusetrain/ops/checks.h>
#include <fusetrain/ops/rotary.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

namespace fusetrain::ops {

namespace {
bool is_float_type(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

std::vector<int64_t> table_shape(const at::Tensor& x, int64_t half) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = half;
  return shape;
}
}  // namespace

int64_t check_rotary_args(const char* op, const at::Tensor& q, const std::optional<at::Tensor>& k,
                          const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(q.defined() && is_float_type(q.scalar_type()) && q.dim() >= 1, op,
              ": q must be a float32, float16 or bfloat16 tensor [..., head_dim]");
  TORCH_CHECK(cos.defined() && sin.defined() && cos.sizes() == sin.sizes() &&
                  cos.scalar_type() == sin.scalar_type() && cos.dim() >= 1,
              op, ": cos and sin must be tensors of one shape and dtype [..., rotary_dim / 2]");
  TORCH_CHECK(cos.scalar_type() == at::kFloat || cos.scalar_type() == q.scalar_type(), op,
              ": cos and sin must be float32 or q's dtype (", q.scalar_type(), "), got ",
              cos.scalar_type());
  const int64_t half = cos.size(-1);
  check_same_device(cos, q, op, "cos", "q");
  check_same_device(sin, q, op, "sin", "q");
  const auto check_one = [&](const at::Tensor& x, const char* name) {
    TORCH_CHECK(2 * half <= x.size(-1), op, ": the rotary dimension 2 * cos.size(-1) = ", 2 * half,
                " exceeds ", name, "'s head_dim ", x.size(-1));
    TORCH_CHECK(x.dim() >= cos.dim(), op, ": cos of shape ", cos.sizes(),
                " has more dimensions than ", name, " ", x.sizes());
    const auto want = table_shape(x, half);
    for (int64_t i = 1; i <= cos.dim(); ++i) {
      const int64_t c = cos.size(-i), w = want[want.size() - i];
      TORCH_CHECK(c == w || c == 1, op, ": cos and sin of shape ", cos.sizes(),
                  " do not broadcast to ", name, "'s rows ", at::IntArrayRef(want),
                  " (", name, " ", x.sizes(), ")");
    }
  };
  check_one(q, "q");
  if (given(k)) {
    TORCH_CHECK(is_float_type(k->scalar_type()) && k->scalar_type() == q.scalar_type(), op,
                ": k must have q's dtype (", q.scalar_type(), "), got ", k->scalar_type());
    check_same_device(*k, q, op, "k", "q");
    check_one(*k, "k");
  }
  return half;
}

at::Tensor rotary_row_offsets(const at::Tensor& x, const at::Tensor& table, int64_t half) {
  const at::Tensor expanded = table.expand(table_shape(x, half));
  const auto opts = x.options().dtype(at::kLong);
  const int64_t lead = x.dim() - 1;
  std::vector<int64_t> row_shape(x.sizes().begin(), x.sizes().end() - 1);
  at::Tensor offsets = at::zeros(row_shape, opts);
  for (int64_t d = 0; d < lead; ++d) {
    if (expanded.stride(d) == 0 || x.size(d) == 1) continue;
    std::vector<int64_t> view(lead, 1);
    view[d] = x.size(d);
    offsets.add_(at::arange(x.size(d), opts).mul_(expanded.stride(d)).view(view));
  }
  return offsets.reshape({-1});
}

std::tuple<at::Tensor, at::Tensor> rotary(const at::Tensor& q, const std::optional<at::Tensor>& k,
                                          const at::Tensor& cos, const at::Tensor& sin,
                                          bool interleaved, bool inverse) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("fusetrain::rotary", "")
                       .typed<std::tuple<at::Tensor, at::Tensor>(
                           const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&,
                           const at::Tensor&, bool, bool)>();
  return op.call(q, k, cos, sin, interleaved, inverse);
}

void rotary_(at::Tensor& q, const std::optional<at::Tensor>& k, const at::Tensor& cos,
             const at::Tensor& sin, bool interleaved, bool inverse) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("fusetrain::rotary_", "")
                       .typed<void(at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&,
                                   const at::Tensor&, bool, bool)>();
  op.call(q, k, cos, sin, interleaved, inverse);
}

namespace {
std::tuple<at::Tensor, at::Tensor> rotary_meta(const at::Tensor& q,
                                               const std::optional<at::Tensor>& k,
                                               const at::Tensor& cos, const at::Tensor& sin, bool,
                                               bool) {
  check_rotary_args("fusetrain::rotary", q, k, cos, sin);
  return {at::empty(q.sizes(), q.options()),
          given(k) ? at::empty(k->sizes(), k->options()) : at::empty({0}, q.options())};
}

void rotary_meta_(at::Tensor& q, const std::optional<at::Tensor>& k, const at::Tensor& cos,
                  const at::Tensor& sin, bool, bool) {
  check_rotary_args("fusetrain::rotary_", q, k, cos, sin);
}
}  // namespace

TORCH_LIBRARY_IMPL(fusetrain, Meta, m) {
  m.impl("rotary", &rotary_meta);
  m.impl("rotary_", &rotary_meta_);
}

}  // namespace fusetrain::ops
