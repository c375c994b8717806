// fusetrain._C: the Python face of libfusetrain. Thin: conversions only; the
// behaviour lives in the C++ components and is documented there.
#include <fusetrain/fusetrain.h>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/python_comm_hook.h>
#include <torch/extension.h>

#include <pybind11/chrono.h>
#include <pybind11/stl.h>

namespace py = pybind11;
using fusetrain::amp::GradScaler;

namespace {

std::vector<at::Tensor> from_optional(const std::vector<std::optional<at::Tensor>>& grads) {
  std::vector<at::Tensor> out;
  out.reserve(grads.size());
  for (const auto& g : grads) out.push_back(g.has_value() ? *g : at::Tensor());
  return out;
}

// Note [Holders that let go of a process group]
// A Reducer or ShardedParameters may hold the last reference to a process
// group, whose gloo backend joins its worker threads when it dies. A worker
// that has just finished a collective called from Python drops that
// collective's tensors next, and dropping a tensor Python has seen takes the
// GIL. pybind11 deletes a holder with the GIL held, so the join and the
// worker would wait on each other forever (pytorch/pytorch#56297): the first
// `del model` after a Python all_reduce and destroy_process_group() hung.
// Our holders delete with the GIL released, as torch's own process-group
// holders do; anything Python that the object still owns takes the GIL back
// itself (c10's decref and c10d::PythonCommHook's destructor do).
template <typename T>
struct DeleteWithoutGil {
  void operator()(T* p) const noexcept {
    if (PyGILState_Check()) {
      py::gil_scoped_release no_gil;
      delete p;
    } else {
      delete p;
    }
  }
};

template <typename T>
using HolderWithoutGil = std::unique_ptr<T, DeleteWithoutGil<T>>;

std::optional<at::Tensor> maybe(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

c10::DeviceType parse_device_type(const std::string& device) {
  return c10::Device(device).type();
}

py::dict to_py(const c10::impl::GenericDict& state) {
  py::dict out;
  for (const auto& item : state) {
    const c10::IValue& v = item.value();
    const py::str key(item.key().toStringRef());
    if (v.isInt()) {
      out[key] = v.toInt();
    } else {
      out[key] = v.toDouble();
    }
  }
  return out;
}

c10::impl::GenericDict from_py(const py::dict& state) {
  c10::impl::GenericDict out(c10::StringType::get(), c10::AnyType::get());
  for (const auto& item : state) {
    const std::string key = py::str(item.first);
    const py::handle v = item.second;
    if (py::isinstance<py::bool_>(v)) {
      throw py::type_error("GradScaler.load_state_dict: \"" + key + "\" must be a number");
    } else if (py::isinstance<py::int_>(v)) {
      out.insert(key, v.cast<int64_t>());
    } else if (py::isinstance<py::float_>(v)) {
      out.insert(key, v.cast<double>());
    } else if (THPVariable_Check(v.ptr())) {
      const at::Tensor t = v.cast<at::Tensor>();
      TORCH_CHECK_VALUE(t.numel() == 1, "GradScaler.load_state_dict: \"", key,
                        "\" must be a number or a one-element tensor");
      out.insert(key, t.is_floating_point() ? c10::IValue(t.item<double>())
                                            : c10::IValue(t.item<int64_t>()));
    } else {
      throw py::type_error("GradScaler.load_state_dict: \"" + key + "\" must be a number, got " +
                           std::string(py::str(py::type::of(v))));
    }
  }
  return out;
}

std::optional<at::ScalarType> parse_comm_dtype(const std::optional<std::string>& name) {
  if (!name.has_value()) return std::nullopt;
  if (*name == "float16") return at::kHalf;
  if (*name == "bfloat16") return at::kBFloat16;
  if (*name == "float32") return at::kFloat;
  throw py::value_error("comm_dtype must be None, torch.float16, torch.bfloat16 or torch.float32, got " +
                        *name);
}

using ProcessGroupPtr = c10::intrusive_ptr<c10d::ProcessGroup>;

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "fusetrain's C++ core";
  m.def("version", &fusetrain::version);
  m.def("compiled_with_cuda", &fusetrain::compiled_with_cuda);
  m.def("best_policy", [](const std::string& device) {
    const fusetrain::amp::Policy p = fusetrain::amp::best_policy(parse_device_type(device));
    return py::make_tuple(p.name(), p.reason());
  }, py::arg("device_type"));
  // fusetrain.nn.functional.softmax_cross_entropy's eager path: the C++
  // autograd Function, whose backward runs without the Python autograd
  // Function's ~100 us a call (issue 14's small-model overhead).
  m.def("softmax_cross_entropy",
        [](const at::Tensor& logits, const at::Tensor& target, int64_t ignore_index,
           double label_smoothing, const std::string& reduction) {
          fusetrain::nn::SoftmaxCrossEntropyOptions options;
          options.ignore_index = ignore_index;
          options.label_smoothing = label_smoothing;
          options.reduction = reduction;
          return fusetrain::nn::softmax_cross_entropy(logits, target, options);
        },
        py::arg("logits"), py::arg("target"), py::arg("ignore_index"), py::arg("label_smoothing"),
        py::arg("reduction"));
  // fusetrain.nn.functional.linear_cross_entropy's eager chunked path: the
  // C++ autograd Function (no Python in the backward), as above.
  m.def("linear_cross_entropy",
        [](const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
           const std::optional<at::Tensor>& linear_bias, const std::optional<at::Tensor>& weight,
           const std::string& reduction, int64_t ignore_index, double label_smoothing,
           int64_t chunk_rows, bool accurate, bool allow_retain_graph, bool reference_autograd,
           bool gradients_in_forward) {
          fusetrain::nn::ChunkedPlan plan;
          plan.chunk_rows = chunk_rows;  // <= 0: the rule's
          plan.accurate = accurate;
          plan.allow_retain_graph = allow_retain_graph;
          plan.reference_autograd = reference_autograd;
          plan.gradients_in_forward = gradients_in_forward;
          return fusetrain::nn::linear_cross_entropy_chunked(
              input, linear_weight, linear_bias.value_or(at::Tensor()), target,
              weight.value_or(at::Tensor()), reduction, ignore_index, label_smoothing, plan);
        },
        py::arg("input"), py::arg("linear_weight"), py::arg("target"), py::arg("linear_bias"),
        py::arg("weight"), py::arg("reduction"), py::arg("ignore_index"),
        py::arg("label_smoothing"), py::arg("chunk_rows"), py::arg("accurate"),
        py::arg("allow_retain_graph"), py::arg("reference_autograd"),
        py::arg("gradients_in_forward"));
  m.def("linear_cross_entropy_chunk_rows",
        [](int64_t rows, int64_t in_features, int64_t classes, py::object dtype,
           const std::string& device_type) {
          return fusetrain::ops::linear_cross_entropy_chunk_rows(
              rows, in_features, classes, torch::python::detail::py_object_to_dtype(dtype),
              c10::Device(device_type).type());
        },
        py::arg("rows"), py::arg("in_features"), py::arg("classes"), py::arg("dtype"),
        py::arg("device_type"));
  m.def("cpu_bf16_speed", &fusetrain::amp::measure_cpu_bf16_speed,
        py::call_guard<py::gil_scoped_release>());
  m.def("cpu_features", [] {
    const fusetrain::ops::CpuFeatures& f = fusetrain::ops::cpu_features();
    py::dict d;
    d["model"] = f.model;
    d["avx2"] = f.avx2;
    d["avx512"] = f.avx512;
    d["avx512_bf16"] = f.avx512_bf16;
    d["avx512_fp16"] = f.avx512_fp16;
    d["amx_bf16"] = f.amx_bf16;
    d["path"] = fusetrain::ops::cpu_path_name(fusetrain::ops::cpu_path());
    return d;
  });

  py::class_<GradScaler>(m, "GradScalerCore")
      .def(py::init([](const std::string& device, double init_scale, double growth_factor,
                       double backoff_factor, int64_t growth_interval, bool enabled,
                       double max_scale, int64_t hysteresis) {
             fusetrain::amp::GradScalerOptions o;
             o.init_scale(init_scale)
                 .growth_factor(growth_factor)
                 .backoff_factor(backoff_factor)
                 .growth_interval(growth_interval)
                 .enabled(enabled)
                 .max_scale(max_scale)
                 .hysteresis(hysteresis);
             return GradScaler(parse_device_type(device), o);
           }),
           py::arg("device"), py::arg("init_scale"), py::arg("growth_factor"),
           py::arg("backoff_factor"), py::arg("growth_interval"), py::arg("enabled"),
           py::arg("max_scale"), py::arg("hysteresis"))
      .def("scale", py::overload_cast<const at::Tensor&>(&GradScaler::scale))
      .def("unscale_grads_",
           [](GradScaler& s, uintptr_t key, const std::vector<std::optional<at::Tensor>>& grads) {
             s.unscale_grads_(key, from_optional(grads));
           })
      .def("prepare_step",
           [](GradScaler& s, uintptr_t key, const std::vector<std::optional<at::Tensor>>& grads,
              bool optimizer_takes_scale) {
             return s.prepare_step(key, from_optional(grads), optimizer_takes_scale);
           })
      .def("mark_stepped", &GradScaler::mark_stepped)
      .def("in_iteration", &GradScaler::in_iteration)
      .def("stage", [](const GradScaler& s, uintptr_t key) { return static_cast<int>(s.stage(key)); })
      .def("update", py::overload_cast<>(&GradScaler::update))
      .def("update", py::overload_cast<double>(&GradScaler::update))
      .def("update", py::overload_cast<const at::Tensor&>(&GradScaler::update))
      .def("get_scale", &GradScaler::get_scale)
      .def("get_growth_factor", &GradScaler::get_growth_factor)
      .def("set_growth_factor", &GradScaler::set_growth_factor)
      .def("get_backoff_factor", &GradScaler::get_backoff_factor)
      .def("set_backoff_factor", &GradScaler::set_backoff_factor)
      .def("get_growth_interval", &GradScaler::get_growth_interval)
      .def("set_growth_interval", &GradScaler::set_growth_interval)
      .def("get_max_scale", &GradScaler::get_max_scale)
      .def("get_hysteresis", &GradScaler::get_hysteresis)
      .def("is_enabled", &GradScaler::is_enabled)
      .def_property_readonly("scale_tensor",
                             [](const GradScaler& s) { return maybe(s.scale_tensor()); })
      .def_property_readonly("found_inf", [](const GradScaler& s) { return maybe(s.found_inf()); })
      .def("step_was_skipped", &GradScaler::step_was_skipped)
      .def_static("non_finite_indices",
                  [](const std::vector<std::optional<at::Tensor>>& grads) {
                    return GradScaler::non_finite_indices(from_optional(grads));
                  })
      .def("state_dict", [](const GradScaler& s) { return to_py(s.state_dict()); })
      .def("load_state_dict",
           [](GradScaler& s, const py::dict& state) { s.load_state_dict(from_py(state)); })
      .def("save", &GradScaler::save)
      .def("load", &GradScaler::load);

  namespace dist = fusetrain::dist;
  // The torch.distributed backend "fusetrain" (fusetrain.parallel): gloo with
  // the shared-memory allreduce in front when every rank is on this host.
  m.def(
      "shared_memory_backend",
      [](const c10::intrusive_ptr<c10d::Store>& store, int rank, int world_size,
         std::chrono::milliseconds timeout, c10::intrusive_ptr<c10d::Backend> gloo) {
        auto shm = dist::make_shared_memory_backend(store, rank, world_size, timeout, gloo);
        return shm ? shm : gloo;
      },
      py::call_guard<py::gil_scoped_release>());
  m.def("uses_shared_memory",
        [](const ProcessGroupPtr& group) { return dist::uses_shared_memory(group); });
  m.def("shared_memory_collectives",
        [](const ProcessGroupPtr& group) { return dist::shared_memory_collectives(group); });
  // Note [Holders that let go of a process group]
  py::class_<dist::Reducer, HolderWithoutGil<dist::Reducer>>(m, "Reducer")
      .def(py::init([](std::vector<at::Tensor> params, std::vector<std::string> names,
                       ProcessGroupPtr group, double bucket_cap_mb, double first_bucket_cap_mb,
                       bool find_unused_parameters, bool gradient_as_bucket_view,
                       std::optional<std::string> comm_dtype, double gradient_predivide_factor,
                       bool shard_gradients) {
             dist::DDPOptions o;
             o.bucket_cap_mb(bucket_cap_mb)
                 .first_bucket_cap_mb(first_bucket_cap_mb)
                 .find_unused_parameters(find_unused_parameters)
                 .gradient_as_bucket_view(gradient_as_bucket_view)
                 .comm_dtype(parse_comm_dtype(comm_dtype))
                 .gradient_predivide_factor(gradient_predivide_factor)
                 .shard_gradients(shard_gradients);
             return HolderWithoutGil<dist::Reducer>(
                 new dist::Reducer(std::move(params), std::move(names), std::move(group), o));
           }),
           py::arg("params"), py::arg("names"), py::arg("process_group"), py::arg("bucket_cap_mb"),
           py::arg("first_bucket_cap_mb"), py::arg("find_unused_parameters"),
           py::arg("gradient_as_bucket_view"), py::arg("comm_dtype"),
           py::arg("gradient_predivide_factor"), py::arg("shard_gradients") = false)
      // Collectives release the GIL (as torch's own bindings do): a gloo
      // worker thread that frees a finished work holding Python-owned tensors
      // takes the GIL while holding the group's queue lock, which enqueueing
      // a collective needs, so holding the GIL here can deadlock.
      .def("prepare_for_backward", &dist::Reducer::prepare_for_backward,
           py::call_guard<py::gil_scoped_release>())
      .def("set_require_sync", &dist::Reducer::set_require_sync)
      // torch's PythonCommHook: the bucket reaches the hook as a
      // torch.distributed.GradBucket; the hook runs with the GIL taken.
      .def("register_comm_hook",
           [](dist::Reducer& r, py::object state, py::object hook) {
             r.register_comm_hook(
                 std::make_shared<c10d::PythonCommHook>(std::move(state), std::move(hook)));
           },
           py::arg("state"), py::arg("hook"))
      // fusetrain's C++ hooks (csrc/dist/comm_hooks.h), PowerSGD's options
      // under torch's PowerSGDState names.
      .def("register_builtin_comm_hook",
           [](dist::Reducer& r, const std::string& name, ProcessGroupPtr group,
              int64_t matrix_approximation_rank, int64_t start_powerSGD_iter,
              double min_compression_rate, bool use_error_feedback, bool warm_start,
              double orthogonalization_epsilon, int64_t random_seed,
              bool batch_tensors_with_same_shape) {
             std::shared_ptr<dist::CommHook> hook;
             if (name == "powersgd") {
               hook = dist::powersgd_hook(
                   std::move(group), dist::PowerSGDOptions()
                                         .matrix_approximation_rank(matrix_approximation_rank)
                                         .start_powerSGD_iter(start_powerSGD_iter)
                                         .min_compression_rate(min_compression_rate)
                                         .use_error_feedback(use_error_feedback)
                                         .warm_start(warm_start)
                                         .orthogonalization_epsilon(orthogonalization_epsilon)
                                         .random_seed(random_seed)
                                         .batch_tensors_with_same_shape(batch_tensors_with_same_shape));
             } else {
               hook = dist::comm_hook_from_name(name, std::move(group));
               TORCH_CHECK_VALUE(hook != nullptr, "register_builtin_comm_hook: \"none\" is no hook");
             }
             r.register_comm_hook(std::move(hook));
           },
           py::arg("name"), py::arg("process_group"), py::arg("matrix_approximation_rank"),
           py::arg("start_powerSGD_iter"), py::arg("min_compression_rate"),
           py::arg("use_error_feedback"), py::arg("warm_start"),
           py::arg("orthogonalization_epsilon"), py::arg("random_seed"),
           py::arg("batch_tensors_with_same_shape"))
      .def("has_comm_hook", &dist::Reducer::has_comm_hook)
      .def("set_divide_factor", &dist::Reducer::set_divide_factor, py::arg("factor"))
      .def("shadow_synchronized_backward", &dist::Reducer::shadow_synchronized_backward,
           py::call_guard<py::gil_scoped_release>())
      .def("require_sync", &dist::Reducer::require_sync)
      .def("bucket_indices", &dist::Reducer::bucket_indices)
      .def("grad_pieces", &dist::Reducer::grad_pieces)
      .def("has_gradient", &dist::Reducer::has_gradient)
      .def("zero_grad_pieces", &dist::Reducer::zero_grad_pieces)
      .def("shard_gradients", &dist::Reducer::shard_gradients)
      // Waits for a device event on NCCL: without the GIL.
      .def("last_exposed_comm_seconds", &dist::Reducer::last_exposed_comm_seconds,
           py::call_guard<py::gil_scoped_release>())
      // (stream_id, device_index, device_type) as torch.Stream takes them,
      // and the device type's name; None for CPU parameters.
      .def("stream",
           [](const dist::Reducer& r)
               -> std::optional<std::tuple<int64_t, int64_t, int64_t, std::string>> {
             const std::optional<c10::Stream> s = r.stream();
             if (!s) return std::nullopt;
             return std::make_tuple(s->id(), static_cast<int64_t>(s->device_index()),
                                    static_cast<int64_t>(s->device_type()),
                                    c10::DeviceTypeName(s->device_type(), /*lower_case=*/true));
           });
  m.def("verify_param_shapes", &dist::verify_param_shapes, py::arg("process_group"),
        py::arg("params"), py::arg("names"), py::call_guard<py::gil_scoped_release>());
  m.def("broadcast_from_rank0", &dist::broadcast_from_rank0, py::arg("process_group"),
        py::arg("tensors"), py::call_guard<py::gil_scoped_release>());
  m.def("broadcast_from", &dist::broadcast_from, py::arg("process_group"), py::arg("tensors"),
        py::arg("root"), py::call_guard<py::gil_scoped_release>());
  // Note [Holders that let go of a process group]
  py::class_<dist::ShardedParameters, HolderWithoutGil<dist::ShardedParameters>>(
      m, "ShardedParameters")
      .def(py::init<std::vector<at::Tensor>, std::vector<std::vector<size_t>>, ProcessGroupPtr,
                    bool>(),
           py::arg("params"), py::arg("buckets"), py::arg("process_group"),
           py::arg("parameters_as_bucket_view") = false)
      .def("param_slices", &dist::ShardedParameters::param_slices)
      .def("slices",
           [](const dist::ShardedParameters& s) {
             std::vector<std::tuple<size_t, size_t, int64_t, int64_t, int64_t>> out;
             for (const auto& x : s.slices()) {
               out.emplace_back(x.param, x.bucket, x.begin, x.length, x.piece_offset);
             }
             return out;
           })
      .def("piece_numels",
           [](const dist::ShardedParameters& s) {
             std::vector<int64_t> out;
             for (size_t b = 0; b < s.layout().buckets().size(); ++b) {
               out.push_back(s.layout().piece_numel(b));
             }
             return out;
           })
      .def("grad_slices",
           [](const dist::ShardedParameters& s) {
             std::vector<std::optional<at::Tensor>> out;
             for (const auto& g : s.grad_slices()) out.push_back(maybe(g));
             return out;
           })
      .def("slices_of_pieces",
           [](const dist::ShardedParameters& s, const std::vector<at::Tensor>& pieces,
              const std::vector<bool>& has) {
             std::vector<std::optional<at::Tensor>> out;
             for (const auto& g : s.slices_of_pieces(pieces, has)) out.push_back(maybe(g));
             return out;
           },
           py::arg("pieces"), py::arg("has") = std::vector<bool>{})
      .def("all_gather_params", &dist::ShardedParameters::all_gather_params,
           py::call_guard<py::gil_scoped_release>())
      .def("start_all_gather", &dist::ShardedParameters::start_all_gather,
           py::call_guard<py::gil_scoped_release>())
      .def("finish_bucket", &dist::ShardedParameters::finish_bucket, py::arg("bucket"),
           py::call_guard<py::gil_scoped_release>())
      .def("finish_all_gather", &dist::ShardedParameters::finish_all_gather,
           py::call_guard<py::gil_scoped_release>())
      .def("all_gather_pending", &dist::ShardedParameters::all_gather_pending)
      .def("gather",
           [](const dist::ShardedParameters& s, const std::vector<std::optional<at::Tensor>>& t,
              at::ScalarType dtype, int to) {
             std::vector<at::Tensor> out;
             {
               py::gil_scoped_release release;
               out = s.gather(from_optional(t), dtype, to);
             }
             std::vector<std::optional<at::Tensor>> result;
             for (const auto& x : out) result.push_back(maybe(x));
             return result;
           },
           py::arg("per_slice"), py::arg("dtype"), py::arg("to"))
      .def("shard",
           [](const dist::ShardedParameters& s, const std::vector<std::optional<at::Tensor>>& t) {
             std::vector<std::optional<at::Tensor>> result;
             for (const auto& x : s.shard(from_optional(t))) result.push_back(maybe(x));
             return result;
           },
           py::arg("full"))
      .def("global_norm",
           [](const dist::ShardedParameters& s, const std::vector<std::optional<at::Tensor>>& t) {
             const auto list = from_optional(t);
             py::gil_scoped_release release;
             return s.global_norm(list);
           },
           py::arg("tensors"))
      .def("any_non_finite",
           [](const dist::ShardedParameters& s, const std::vector<std::optional<at::Tensor>>& t) {
             const auto list = from_optional(t);
             py::gil_scoped_release release;
             return s.any_non_finite(list);
           },
           py::arg("tensors"));
  m.def("compute_bucket_assignment", &dist::compute_bucket_assignment, py::arg("params"),
        py::arg("first_cap_bytes"), py::arg("cap_bytes"), py::arg("order") = std::vector<size_t>{});
  m.def("compute_bucket_offsets", &dist::compute_bucket_offsets, py::arg("numels"),
        py::arg("element_size"));
}
