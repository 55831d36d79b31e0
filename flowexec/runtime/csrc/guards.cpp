// See guards.h. Every failure path is conservative: an exception while reading a value, a type
// it does not know, anything unexpected reads as "does not hold" (or -2: ask Python), so this
// check can send a call to the Python path but never let through one the Python path refuses.

#include "guards.h"

#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/autocast_mode.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/Device.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/python_variable.h>

namespace flowexec {

namespace {

constexpr int kItem = 0, kAttr = 1, kCell = 2, kLen = 3, kState = 4, kDict = 5, kKeys = 6;
constexpr int kIs = 0, kEq = 1, kGlobal = 2, kLength = 3, kRequiresGrad = 4, kGrad = 5, kGradKind = 6,
              kNoHooks = 7, kAbsent = 8, kKeyOrder = 9;

int64_t dtype_code(PyObject* o) {
  if (!THPDtype_Check(o)) return -1;
  return static_cast<int64_t>(reinterpret_cast<THPDtype*>(o)->scalar_type);
}

int step_kind(const std::string& s) {
  if (s == "item") return kItem;
  if (s == "attr") return kAttr;
  if (s == "cell") return kCell;
  if (s == "len") return kLen;
  if (s == "state") return kState;
  if (s == "dict") return kDict;
  if (s == "keys") return kKeys;
  TORCH_CHECK(false, "guards: unknown step ", s);
}

}  // namespace

std::vector<int64_t> global_state() {
  return {static_cast<int64_t>(at::GradMode::is_enabled()),
          static_cast<int64_t>(at::autocast::is_autocast_enabled(at::kCPU)),
          static_cast<int64_t>(at::autocast::get_autocast_dtype(at::kCPU)),
          static_cast<int64_t>(at::autocast::is_autocast_enabled(at::kCUDA)),
          static_cast<int64_t>(at::autocast::get_autocast_dtype(at::kCUDA)),
          static_cast<int64_t>(c10::typeMetaToScalarType(c10::get_default_dtype())),
          at::impl::PythonTorchFunctionTLS::stack_len()};
}

GuardChecker::GuardChecker(py::list guards, py::list feeds, std::vector<at::Tensor> hosts,
                           std::vector<at::Tensor> devices, py::list predicates,
                           std::vector<std::vector<at::Tensor>> staging, py::list uploaders)
    : hosts_(std::move(hosts)), devices_(std::move(devices)) {
  TORCH_CHECK(hosts_.size() == devices_.size() && staging.size() == hosts_.size() &&
                  py::len(uploaders) == hosts_.size(),
              "guards: one host copy, one staging list and one uploader list per device buffer");
  for (size_t d = 0; d < staging.size(); ++d) {
    Ring r;
    for (auto& t : staging[d]) {
      TORCH_CHECK(t.is_pinned() && t.sizes() == hosts_[d].sizes() && t.scalar_type() == at::kDouble,
                  "guards: staging copies are pinned float64 like their host copy");
      r.copies.push_back(t);
      r.events.push_back(std::make_unique<c10::Event>(devices_[d].device().type()));
    }
    r.uploader = uploaders[d].cast<py::list>();
    rings_.push_back(std::move(r));
  }
  for (auto& h : hosts_)
    TORCH_CHECK(h.device().is_cpu() && h.scalar_type() == at::kDouble && h.is_contiguous(),
                "guards: host copies are contiguous CPU float64");
  for (auto item : guards) {
    auto t = item.cast<py::tuple>();
    Guard g;
    g.root = t[0];
    for (auto s : t[1].cast<py::list>()) {
      auto st = s.cast<py::tuple>();
      g.steps.push_back(Step{step_kind(st[0].cast<std::string>()), st[1]});
    }
    g.expected = t[2];
    const auto match = t[3].cast<std::string>();
    g.match = match == "is" ? kIs : kEq;
    const auto n = g.steps.size();
    TORCH_CHECK(match == "is" || match == "eq" || match == "grad" || match == "absent", "guards: unknown match ", match);
    if (match == "absent") {
      TORCH_CHECK(n >= 1 && g.steps[n - 1].kind == kItem, "guards: an absent guard ends with an item");
      g.match = kAbsent;
    } else if (n == 1 && g.steps[0].kind == kState) {
      g.match = kGlobal;
      auto e = g.expected.cast<py::tuple>();
      TORCH_CHECK(e.size() == 7, "guards: the global state has 7 entries");
      g.state = {e[0].cast<bool>(), e[1].cast<bool>(), dtype_code(e[2].ptr()), e[3].cast<bool>(),
                 dtype_code(e[4].ptr()), dtype_code(e[5].ptr()), e[6].cast<int64_t>()};
    } else if (n >= 1 && g.steps[n - 1].kind == kKeys && g.match == kEq && PyTuple_CheckExact(g.expected.ptr())) {
      g.match = kKeyOrder;  // (a dict's keys compared in place, none copied: guards.order_guard)
      g.steps.pop_back();
    } else if (n >= 1 && g.steps[n - 1].kind == kLen) {
      g.match = kLength;
      g.length = g.expected.cast<int64_t>();
      g.steps.pop_back();
    } else if (n == 1 && g.steps[0].kind == kAttr && THPVariable_Check(g.root.ptr())) {
      const auto name = g.steps[0].arg.cast<std::string>();
      if (name == "requires_grad") {
        g.match = kRequiresGrad;
        g.flag = g.expected.cast<bool>();
      } else if (name == "grad" && match == "grad") {  // (dtype, device, sizes, strides) of an input
        g.match = kGradKind;
        auto e = g.expected.cast<py::tuple>();
        TORCH_CHECK(e.size() == 4 && THPDevice_Check(e[1].ptr()), "guards: a grad kind is (dtype, device, sizes, strides)");
        g.state = {dtype_code(e[0].ptr())};
        g.device = reinterpret_cast<THPDevice*>(e[1].ptr())->device;
        g.sizes = e[2].cast<std::vector<int64_t>>();
        g.strides = e[3].cast<std::vector<int64_t>>();
      } else if ((name == "_backward_hooks" || name == "_post_accumulate_grad_hooks") && g.match == kIs &&
                 g.expected.is_none()) {  // (no hooks: the tensor's own field, not its Python getter)
        g.match = kNoHooks;
        g.flag = name == "_post_accumulate_grad_hooks";
      } else if (name == "grad" && g.match == kIs) {
        g.match = kGrad;
        if (!g.expected.is_none()) {
          TORCH_CHECK(THPVariable_Check(g.expected.ptr()), "guards: a .grad guard expects a tensor or None");
          g.impl = THPVariable_Unpack(g.expected.ptr()).unsafeGetTensorImpl();
        }
      }
    }
    guards_.push_back(std::move(g));
  }
  for (auto item : feeds) {
    auto t = item.cast<py::tuple>();
    Feed f{t[0], t[1], t[2].cast<int>(), t[3].cast<int>(), t[4].cast<int64_t>(), t[5].cast<bool>()};
    TORCH_CHECK(f.device >= 0 && static_cast<size_t>(f.device) < hosts_.size() &&
                    f.position < hosts_[f.device].numel(), "guards: a feed outside its buffer");
    feeds_.push_back(std::move(f));
  }
  for (auto item : predicates) {
    auto t = item.cast<py::tuple>();
    predicates_.push_back(Predicate{t[0].cast<int>(), t[1].cast<int>(), t[2].cast<double>(), t[3].cast<bool>()});
  }
}

bool GuardChecker::holds(const Guard& g) const {
  if (g.match == kGlobal) return global_state() == g.state;
  if (g.match == kRequiresGrad) return THPVariable_Unpack(g.root.ptr()).requires_grad() == g.flag;
  if (g.match == kNoHooks) {  // (the getters answer None for a null field: python_variable.cpp)
    const auto* var = reinterpret_cast<const THPVariable*>(g.root.ptr());
    const PyObject* hooks = g.flag ? var->post_accumulate_grad_hooks : var->backward_hooks;
    return hooks == nullptr || hooks == Py_None;
  }
  if (g.match == kGradKind) {
    const at::Tensor& grad = THPVariable_Unpack(g.root.ptr()).grad();
    return grad.defined() && static_cast<int64_t>(grad.scalar_type()) == g.state[0] && grad.device() == g.device &&
           grad.sizes() == c10::IntArrayRef(g.sizes) && grad.strides() == c10::IntArrayRef(g.strides);
  }
  if (g.match == kGrad) {
    const at::Tensor& grad = THPVariable_Unpack(g.root.ptr()).grad();
    return g.impl == nullptr ? !grad.defined() : (grad.defined() && grad.unsafeGetTensorImpl() == g.impl);
  }
  // Borrowed references while the chain holds (a dict's item is kept alive by the dict, which is
  // kept alive by the root or the previous step's owned reference).
  PyObject* v = g.root.ptr();
  py::object owned;  // the last new reference, if any
  for (size_t i = 0; i < g.steps.size(); ++i) {
    const Step& s = g.steps[i];
    PyObject* next = nullptr;
    if (s.kind == kItem && PyDict_Check(v)) {  // (dict semantics: a defaultdict grows no entry)
      next = PyDict_GetItemWithError(v, s.arg.ptr());
      if (next == nullptr) {
        // (absent holds where the last dict has no such item; any other miss asks Python)
        const bool absent = g.match == kAbsent && i + 1 == g.steps.size() && !PyErr_Occurred();
        PyErr_Clear();
        return absent;
      }
      Py_INCREF(next);
    } else if (s.kind == kItem) {
      next = PyObject_GetItem(v, s.arg.ptr());
    } else if (s.kind == kAttr) {
      next = PyObject_GetAttr(v, s.arg.ptr());
    } else if (s.kind == kDict) {  // (an attribute in the instance __dict__: guards.native_path)
      PyObject* d = PyObject_GenericGetDict(v, nullptr);
      if (d == nullptr) {
        PyErr_Clear();
        return false;
      }
      next = PyDict_Check(d) ? PyDict_GetItemWithError(d, s.arg.ptr()) : nullptr;
      Py_XINCREF(next);
      Py_DECREF(d);
    } else if (s.kind == kKeys) {  // (a dict's keys in their order: guards.order_guard)
      next = PySequence_Tuple(v);
    } else if (s.kind == kCell && PyCell_Check(v)) {
      next = PyCell_GET(v);
      if (next == nullptr) return false;  // an empty cell
      Py_INCREF(next);
    }
    if (next == nullptr) {
      PyErr_Clear();
      return false;
    }
    owned = py::reinterpret_steal<py::object>(next);
    v = next;
  }
  if (g.match == kAbsent) return false;  // (the item is there, or the last step read no dict)
  if (g.match == kKeyOrder) {
    PyObject* e = g.expected.ptr();
    if (!PyDict_CheckExact(v)) {  // (an OrderedDict's or a subclass's own order: its iteration's)
      py::object keys = py::reinterpret_steal<py::object>(PySequence_Tuple(v));
      const int eq = keys ? PyObject_RichCompareBool(keys.ptr(), e, Py_EQ) : -1;
      if (eq != 1) PyErr_Clear();
      return eq == 1;
    }
    if (PyDict_GET_SIZE(v) != PyTuple_GET_SIZE(e)) return false;
    Py_ssize_t pos = 0, i = 0;
    PyObject *key, *value;
    while (PyDict_Next(v, &pos, &key, &value)) {
      PyObject* want = PyTuple_GET_ITEM(e, i++);
      if (key == want) continue;  // (else as tuple equality compares items)
      const int eq = PyObject_RichCompareBool(key, want, Py_EQ);
      if (eq != 1) {
        PyErr_Clear();
        return false;
      }
    }
    return true;
  }
  if (g.match == kLength) {
    const Py_ssize_t n = PyObject_Length(v);
    if (n < 0) {
      PyErr_Clear();
      return false;
    }
    return n == g.length;
  }
  PyObject* e = g.expected.ptr();
  if (v == e) return true;
  if (g.match == kIs || Py_TYPE(v) != Py_TYPE(e)) return false;
  const int eq = PyObject_RichCompareBool(v, e, Py_EQ);
  if (eq < 0) {
    PyErr_Clear();
    return false;
  }
  return eq == 1;
}

int GuardChecker::feeds() const {
  // Two passes: nothing is written unless every change can be taken here.
  std::vector<std::pair<int, double>> changed;
  for (size_t i = 0; i < feeds_.size(); ++i) {
    const Feed& f = feeds_[i];
    PyObject* v = PyDict_CheckExact(f.group.ptr()) ? PyDict_GetItemWithError(f.group.ptr(), f.key.ptr()) : nullptr;
    if (v == nullptr) {
      PyErr_Clear();
      return -2;
    }
    if (f.index >= 0) {
      if (!PyTuple_CheckExact(v) || PyTuple_GET_SIZE(v) <= f.index) return -2;
      v = PyTuple_GET_ITEM(v, f.index);
    }
    if (PyBool_Check(v) || !(PyFloat_CheckExact(v) || PyLong_CheckExact(v))) return -2;
    const double x = PyFloat_CheckExact(v) ? PyFloat_AS_DOUBLE(v) : PyLong_AsDouble(v);
    if (x == -1.0 && PyErr_Occurred()) {
      PyErr_Clear();
      return -2;
    }
    if (hosts_[f.device].data_ptr<double>()[f.position] == x) continue;
    if (f.other_reads) return -2;  // a host read this check cannot evaluate depends on it
    changed.emplace_back(static_cast<int>(i), x);
  }
  if (changed.empty()) return -1;
  for (const auto& p : predicates_) {
    for (const auto& [i, x] : changed) {
      if (i != p.feed) continue;
      bool r = false;
      switch (p.op) {
        case 0: r = x != p.constant; break;
        case 1: r = x == p.constant; break;
        case 2: r = x > p.constant; break;
        case 3: r = x >= p.constant; break;
        case 4: r = x < p.constant; break;
        case 5: r = x <= p.constant; break;
        default: return -2;
      }
      if (r != p.expected) return -2;  // the program's constant no longer holds: Python says which
    }
  }
  std::vector<bool> dirty(hosts_.size(), false);
  std::vector<double> was;
  for (const auto& [i, x] : changed) {
    const Feed& f = feeds_[i];
    double* h = hosts_[f.device].data_ptr<double>() + f.position;
    was.push_back(*h);
    *h = x;
    dirty[f.device] = true;
  }
  try {
    for (size_t d = 0; d < hosts_.size(); ++d)
      if (dirty[d]) upload(d);
  } catch (...) {
    // An upload that did not happen (a Python uploader interrupted) must not leave the host
    // copy claiming it did: the next check would see no change and keep the old values.
    for (size_t k = 0; k < changed.size(); ++k) {
      const Feed& f = feeds_[changed[k].first];
      hosts_[f.device].data_ptr<double>()[f.position] = was[k];
    }
    throw;
  }
  return -1;
}

void GuardChecker::upload(size_t d) const {
  if (devices_[d].is_same(hosts_[d])) return;  // the CPU: the program reads the host copy itself
  Ring& r = rings_[d];
  if (py::len(r.uploader) > 0) {  // written by the graph itself (runtime/feed_node.py): Python hands them over
    r.uploader[0]();
    return;
  }
  if (r.copies.empty()) {
    devices_[d].copy_(hosts_[d]);
    return;
  }
  const size_t k = r.next;
  r.next = (k + 1) % r.copies.size();
  r.events[k]->synchronize();  // (no wait unless that copy, RING calls ago, is still queued)
  r.copies[k].copy_(hosts_[d]);
  devices_[d].copy_(r.copies[k], /*non_blocking=*/true);
  c10::impl::VirtualGuardImpl impl(devices_[d].device().type());
  r.events[k]->record(impl.getStream(devices_[d].device()));
}

int GuardChecker::check() const {
  for (size_t i = 0; i < guards_.size(); ++i)
    if (!holds(guards_[i])) return static_cast<int>(i);
  return feeds_.empty() ? -1 : feeds();
}

void register_guards(py::module_& m) {
  py::class_<GuardChecker, std::shared_ptr<GuardChecker>>(m, "GuardChecker")
      .def(py::init<py::list, py::list, std::vector<at::Tensor>, std::vector<at::Tensor>, py::list,
                    std::vector<std::vector<at::Tensor>>, py::list>(),
           py::arg("guards"), py::arg("feeds"), py::arg("hosts"), py::arg("devices"), py::arg("predicates"),
           py::arg("staging"), py::arg("uploaders"))
      .def("check", &GuardChecker::check)
      .def("__len__", &GuardChecker::size);
  m.def("global_state", &global_state);
}

}  // namespace flowexec
