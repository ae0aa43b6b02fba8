// moekit's Python extension (moekit._moekit): the Experts module over DLPack arrays (torch tensors, CPU or
// CUDA), without copies. The Python package (python/moekit) wraps it with torch conveniences.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "moekit/cuda_graph.h"
#include "moekit/moekit.h"
#include "moekit/version.h"

namespace nb = nanobind;

namespace {

using AnyArray = nb::ndarray<>;

moekit::DType dtype_of(const AnyArray& a, const char* what) {
  const nb::dlpack::dtype t = a.dtype();
  const auto code = static_cast<nb::dlpack::dtype_code>(t.code);
  if (t.lanes == 1) {
    if (code == nb::dlpack::dtype_code::Float && t.bits == 32) return moekit::DType::f32;
    if (code == nb::dlpack::dtype_code::Float && t.bits == 16) return moekit::DType::f16;
    if (code == nb::dlpack::dtype_code::Bfloat && t.bits == 16) return moekit::DType::bf16;
    if (code == nb::dlpack::dtype_code::Int && t.bits == 32) return moekit::DType::i32;
    if (code == nb::dlpack::dtype_code::Int && t.bits == 64) return moekit::DType::i64;
  }
  throw moekit::Error(moekit::ErrorCode::invalid_argument,
                      std::string(what) + ": unsupported dtype (code " + std::to_string(t.code) + ", " +
                          std::to_string(t.bits) + " bits); expected float32, bfloat16, float16, int32 or int64");
}

moekit::Device device_of(const AnyArray& a, const char* what) {
  if (a.device_type() == nb::device::cpu::value) return moekit::Device::cpu();
  if (a.device_type() == nb::device::cuda::value) return moekit::Device::cuda(a.device_id());
  throw moekit::Error(moekit::ErrorCode::invalid_argument,
                      std::string(what) + ": unsupported device type " + std::to_string(a.device_type()) +
                          "; expected a CPU or CUDA tensor");
}

// A view of the array's memory: strides in elements, as both DLPack (through nanobind) and moekit count them.
moekit::TensorView view_of(const AnyArray& a, const char* what) {
  moekit::Shape shape(a.ndim()), strides(a.ndim());
  for (size_t i = 0; i < a.ndim(); ++i) {
    shape[i] = int64_t(a.shape(i));
    strides[i] = a.stride(i);
  }
  return moekit::TensorView(const_cast<void*>(a.data()), dtype_of(a, what), shape, device_of(a, what), strides);
}

// Experts over arrays that Python owns: the arrays are held for the life of the module, and moekit's
// tensors wrap their memory.
class PyExperts {
 public:
  PyExperts(std::map<std::string, AnyArray> params, int64_t num_experts, int64_t hidden, int64_t intermediate,
            const std::string& activation, bool has_gate, bool has_bias, bool is_transposed, bool is_concatenated,
            const std::string& gate, double alpha, double limit, const std::string& implementation)
      : params_(std::move(params)) {
    moekit::ExpertsSpec spec;
    spec.num_experts = num_experts;
    spec.hidden = hidden;
    spec.intermediate = intermediate;
    spec.activation = moekit::parse_activation(activation);
    spec.has_gate = has_gate;
    spec.has_bias = has_bias;
    spec.is_transposed = is_transposed;
    spec.is_concatenated = is_concatenated;
    if (gate == "act_mul") {
      spec.gate = moekit::GateKind::act_mul;
    } else if (gate == "clamped_swiglu") {
      spec.gate = moekit::GateKind::clamped_swiglu;
    } else {
      throw moekit::Error(moekit::ErrorCode::invalid_argument,
                          "gate '" + gate + "' is not one of: act_mul, clamped_swiglu");
    }
    spec.alpha = float(alpha);
    spec.limit = float(limit);
    std::map<std::string, moekit::Tensor> tensors;
    for (const auto& [name, a] : params_) tensors[name] = moekit::Tensor::wrap(view_of(a, name.c_str()), nullptr);
    experts_ = moekit::Experts(spec, moekit::make_experts_weights(spec, tensors), implementation);
  }

  // out = experts(hidden_states, top_k_index, top_k_weights), written into `out` on `stream` (a
  // cudaStream_t as an integer; 0: the default stream).
  void forward_into(const AnyArray& hidden_states, const AnyArray& top_k_index, const AnyArray& top_k_weights,
                    const AnyArray& out, uintptr_t stream, const std::optional<std::string>& implementation) {
    moekit::ExpertsCall call;
    call.hidden_states = view_of(hidden_states, "hidden_states");
    call.top_k_index = view_of(top_k_index, "top_k_index");
    call.top_k_weights = view_of(top_k_weights, "top_k_weights");
    call.out = view_of(out, "out");
    call.stream = reinterpret_cast<moekit::Stream>(stream);
    nb::gil_scoped_release release;
    if (implementation) {
      experts_.forward_with(*implementation, call);
    } else {
      experts_.forward_into(call);
    }
  }

  const moekit::Experts& experts() const { return experts_; }
  moekit::Experts& experts() { return experts_; }

 private:
  std::map<std::string, AnyArray> params_;
  moekit::Experts experts_;
};

nb::dict backend_info(const moekit::ExpertsBackend& b) {
  nb::dict d;
  d["name"] = std::string(b.name());
  d["description"] = std::string(b.description());
  std::vector<std::string> devices;
  for (auto t : b.devices()) devices.push_back(t == moekit::DeviceType::cpu ? "cpu" : "cuda");
  d["devices"] = devices;
  d["graph_capturable"] = b.graph_capturable();
  d["needs_host_sync"] = b.needs_host_sync();
  d["load_time_only"] = b.load_time_only();
  d["decode_backend"] = std::string(b.decode_backend());
  const moekit::Support cpu = b.available(moekit::Device::cpu());
  d["available_cpu"] = cpu.ok;
  d["reason_cpu"] = cpu.reason;
  const moekit::Support cuda = b.available(moekit::Device::cuda(0));
  d["available_cuda"] = cuda.ok;
  d["reason_cuda"] = cuda.reason;
  return d;
}

}  // namespace

NB_MODULE(_moekit, m) {
  m.doc() = "moekit: Mixture-of-Experts experts backends (C++ extension)";
  m.attr("__version__") = MOEKIT_VERSION_STRING;
#ifdef MOEKIT_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif

  // moekit::Error as Python exceptions, keeping moekit's message.
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const moekit::Error& e) {
      switch (e.code()) {
        case moekit::ErrorCode::invalid_argument:
        case moekit::ErrorCode::not_found:
          PyErr_SetString(PyExc_ValueError, e.what());
          break;
        case moekit::ErrorCode::not_supported:
          PyErr_SetString(PyExc_NotImplementedError, e.what());
          break;
        case moekit::ErrorCode::io:
          PyErr_SetString(PyExc_OSError, e.what());
          break;
        default:
          PyErr_SetString(PyExc_RuntimeError, e.what());
      }
    }
  });

  nb::class_<PyExperts>(m, "Experts")
      .def(nb::init<std::map<std::string, AnyArray>, int64_t, int64_t, int64_t, const std::string&, bool, bool, bool,
                    bool, const std::string&, double, double, const std::string&>(),
           nb::arg("params"), nb::arg("num_experts"), nb::arg("hidden"), nb::arg("intermediate"),
           nb::arg("activation") = "silu", nb::arg("has_gate") = true, nb::arg("has_bias") = false,
           nb::arg("is_transposed") = false, nb::arg("is_concatenated") = true, nb::arg("gate") = "act_mul",
           nb::arg("alpha") = 1.702, nb::arg("limit") = 7.0, nb::arg("implementation") = "")
      .def("forward_into", &PyExperts::forward_into, nb::arg("hidden_states"), nb::arg("top_k_index"),
           nb::arg("top_k_weights"), nb::arg("out"), nb::arg("stream") = 0, nb::arg("implementation") = nb::none())
      .def_prop_ro("implementation", [](const PyExperts& e) { return e.experts().implementation(); })
      .def("set_implementation", [](PyExperts& e, const std::string& name) { e.experts().set_implementation(name); },
           nb::arg("name"))
      .def("supports",
           [](const PyExperts& e, const std::string& backend, const std::string& act_dtype) {
             const moekit::Support s =
                 moekit::ExpertsInterface::global().get(backend)->supports(e.experts(), moekit::parse_dtype(act_dtype));
             return nb::make_tuple(s.ok, s.reason);
           },
           nb::arg("backend"), nb::arg("act_dtype"))
      .def("check_errors",
           [](const PyExperts& e, uintptr_t stream) {
             nb::gil_scoped_release release;
             moekit::check_experts_errors(e.experts(), reinterpret_cast<moekit::Stream>(stream));
           },
           nb::arg("stream") = 0,
           "Waits for `stream`, then raises ValueError naming the first out-of-range expert id that CUDA "
           "forwards on that stream dropped since the last check (no-op for CPU experts).")
      .def_prop_ro("spec", [](const PyExperts& e) { return e.experts().spec().to_string(); })
      .def("clear_state", [](const PyExperts& e) { e.experts().clear_state(); });

  m.def("backends", [] {
    std::vector<nb::dict> out;
    for (const auto& b : moekit::ExpertsInterface::global().backends()) out.push_back(backend_info(*b));
    return out;
  }, "The registered experts backends, in registry order, with what each needs and whether it runs here.");
  m.def("cuda_available", &moekit::cuda_available, "Built with CUDA and a device is present.");
}
