// One C++ call that checks a call of a compiled signature: the arguments' container structure,
// every tensor leaf's metadata (what Dynamo's TensorGuards compares: Python type, dispatch keys
// under the thread's local include/exclude sets, dtype, device, requires_grad, sizes, strides),
// the captured address of each borrowed input, and that the staged inputs' storages are
// pairwise distinct and apart from the borrowed ones and closure state. It returns the tensor
// leaves in flattened order, or None whenever anything differs (the caller then takes the
// Python path, which decides; this check may only ever be stricter than that path).
//
// It also runs the program's guards (guards.cpp: the Python values its capture read, and the fed
// optimizer hyperparameters). Built by torch.utils.cpp_extension from flowexec/runtime/fastcall.py;
// no CUDA calls of its own (data pointers and metadata; a changed hyperparameter is one
// Tensor::copy_ to its device), so one CPU build serves CPU and CUDA tensors.

#include <torch/extension.h>
#include <torch/csrc/autograd/python_variable.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include "guards.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace py = pybind11;

namespace {

// Layout codes, in preorder: kTensor / kNone are leaves; kList / kTuple are followed by a count.
constexpr int kTensor = -1;
constexpr int kNone = -2;
constexpr int kList = 1;
constexpr int kTuple = 2;

c10::DispatchKeySet local_keys(const at::Tensor& t) {
  auto tls = c10::impl::tls_local_dispatch_key_set();
  return (t.key_set() | tls.included_) - tls.excluded_;
}

struct Leaf {
  PyTypeObject* pytype;
  uint64_t keys;
  c10::ScalarType dtype;
  c10::Device device;
  bool requires_grad;
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
  intptr_t ptr;  // borrowed: the captured data pointer; 0: not checked
  bool staged;
};

class CallGuard {
 public:
  // grad_params: parameters whose current .grad follows the arguments' tensors (the last
  // entries of `tensors`): read at each call and checked like an argument.
  CallGuard(std::vector<int> layout, py::list tensors, std::vector<int64_t> ptrs, std::vector<bool> staged,
            std::vector<int64_t> forbidden, std::shared_ptr<flowexec::GuardChecker> guards, py::list grad_params)
      : layout_(std::move(layout)), forbidden_(forbidden.begin(), forbidden.end()), guards_(std::move(guards)) {
    for (auto p : grad_params) {
      TORCH_CHECK(THPVariable_Check(p.ptr()), "fastcall: a grad parameter is not a tensor");
      grad_params_.push_back(py::reinterpret_borrow<py::object>(p));
    }
    std::sort(forbidden_.begin(), forbidden_.end());
    const auto n = static_cast<size_t>(py::len(tensors));
    TORCH_CHECK(ptrs.size() == n && staged.size() == n, "fastcall: one address and one staged flag per tensor");
    for (size_t i = 0; i < n; ++i) {
      PyObject* o = tensors[i].ptr();
      TORCH_CHECK(THPVariable_Check(o), "fastcall: leaf ", i, " is not a tensor");
      const at::Tensor& t = THPVariable_Unpack(o);
      TORCH_CHECK(!t.unsafeGetTensorImpl()->has_symbolic_sizes_strides(), "fastcall: symbolic shapes");
      leaves_.push_back(Leaf{Py_TYPE(o), local_keys(t).raw_repr(), t.scalar_type(), t.device(), t.requires_grad(),
                             t.sizes().vec(), t.strides().vec(), static_cast<intptr_t>(ptrs[i]), staged[i]});
      if (staged[i]) ++n_staged_;
    }
    size_t pos = 0, leaves = 0;
    TORCH_CHECK(grad_params_.size() <= n, "fastcall: more grad parameters than tensors");
    TORCH_CHECK(count(pos, leaves) && pos == layout_.size() && leaves == n - grad_params_.size(),
                "fastcall: layout does not match the tensors");
  }

  // The tensor leaves of `args` (a tuple) when the call fits, else None.
  py::object check(py::tuple args) const {
    PyObject* out = PyList_New(0);
    if (out == nullptr) throw py::error_already_set();
    size_t pos = 0, leaf = 0;
    std::vector<intptr_t> storages;
    storages.reserve(n_staged_);
    bool ok = false;
    try {
      // The program's guards (the values its capture read) after the arguments: -1 is a pass.
      ok = walk(args.ptr(), pos, leaf, out, storages) && grads(leaf, out, storages) && distinct(storages) &&
           (!guards_ || guards_->check() == -1);
    } catch (const c10::Error&) {  // a tensor without storage, say: the Python path decides
      ok = false;
    }
    if (!ok) {
      Py_DECREF(out);
      return py::none();
    }
    return py::reinterpret_steal<py::object>(out);
  }

  size_t n_tensors() const { return leaves_.size(); }

 private:
  bool count(size_t& pos, size_t& leaves) const {  // validates the layout at construction
    if (pos >= layout_.size()) return false;
    const int code = layout_[pos++];
    if (code == kTensor) { ++leaves; return true; }
    if (code == kNone) return true;
    if ((code != kList && code != kTuple) || pos >= layout_.size()) return false;
    const int n = layout_[pos++];
    for (int k = 0; k < n; ++k)
      if (!count(pos, leaves)) return false;
    return true;
  }

  bool walk(PyObject* o, size_t& pos, size_t& leaf, PyObject* out, std::vector<intptr_t>& storages) const {
    const int code = layout_[pos++];
    if (code == kTensor) return tensor(o, leaves_[leaf++], out, storages);
    if (code == kNone) return o == Py_None;
    const int n = layout_[pos++];
    if (code == kList) {
      if (!PyList_CheckExact(o) || PyList_GET_SIZE(o) != n) return false;
      for (int k = 0; k < n; ++k)
        if (!walk(PyList_GET_ITEM(o, k), pos, leaf, out, storages)) return false;
      return true;
    }
    if (!PyTuple_CheckExact(o) || PyTuple_GET_SIZE(o) != n) return false;
    for (int k = 0; k < n; ++k)
      if (!walk(PyTuple_GET_ITEM(o, k), pos, leaf, out, storages)) return false;
    return true;
  }

  bool grads(size_t leaf, PyObject* out, std::vector<intptr_t>& storages) const {
    for (const auto& p : grad_params_) {
      const at::Tensor& g = THPVariable_Unpack(p.ptr()).grad();
      if (!g.defined()) return false;
      auto o = py::reinterpret_steal<py::object>(THPVariable_Wrap(g));
      if (!o || !tensor(o.ptr(), leaves_[leaf++], out, storages)) return false;
    }
    return true;
  }

  bool tensor(PyObject* o, const Leaf& L, PyObject* out, std::vector<intptr_t>& storages) const {
    if (Py_TYPE(o) != L.pytype || !THPVariable_Check(o)) return false;
    const at::Tensor& t = THPVariable_Unpack(o);
    auto* impl = t.unsafeGetTensorImpl();
    if (impl->has_symbolic_sizes_strides()) return false;
    if (local_keys(t).raw_repr() != L.keys || t.scalar_type() != L.dtype || t.device() != L.device ||
        t.requires_grad() != L.requires_grad)
      return false;
    if (t.sizes() != c10::IntArrayRef(L.sizes) || t.strides() != c10::IntArrayRef(L.strides)) return false;
    if (L.ptr != 0 || L.staged) {
      if (!impl->has_storage()) return false;
      if (L.ptr != 0 && reinterpret_cast<intptr_t>(t.const_data_ptr()) != L.ptr) return false;
      if (L.staged) storages.push_back(reinterpret_cast<intptr_t>(impl->storage().data()));
    }
    if (PyList_Append(out, o) != 0) throw py::error_already_set();
    return true;
  }

  bool distinct(std::vector<intptr_t>& s) const {
    for (intptr_t p : s)
      if (p == 0 || std::binary_search(forbidden_.begin(), forbidden_.end(), p)) return false;
    if (s.size() < 2) return true;
    std::sort(s.begin(), s.end());
    return std::adjacent_find(s.begin(), s.end()) == s.end();
  }

  std::vector<int> layout_;
  std::vector<intptr_t> forbidden_;
  std::vector<Leaf> leaves_;
  size_t n_staged_ = 0;
  std::shared_ptr<flowexec::GuardChecker> guards_;
  std::vector<py::object> grad_params_;
};

}  // namespace

void register_event_clock(py::module_& m);  // eventclock.cpp: the job timer's events
void register_code_tracer(py::module_& m);  // codetracer.cpp: the capture's frame tracer
namespace flowexec {
void register_guards(py::module_& m);  // guards.cpp: a program's guards and fed hyperparameters
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  register_event_clock(m);
  register_code_tracer(m);
  flowexec::register_guards(m);
  py::class_<CallGuard>(m, "CallGuard")
      .def(py::init<std::vector<int>, py::list, std::vector<int64_t>, std::vector<bool>, std::vector<int64_t>,
                    std::shared_ptr<flowexec::GuardChecker>, py::list>(),
           py::arg("layout"), py::arg("tensors"), py::arg("ptrs"), py::arg("staged"), py::arg("forbidden"),
           py::arg("guards") = nullptr, py::arg("grad_params") = py::list())
      .def("check", &CallGuard::check, py::arg("args"))
      .def_property_readonly("n_tensors", &CallGuard::n_tensors);
}
