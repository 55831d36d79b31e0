// The capture's frame tracer in C: guards.Recorder must see the first frame of every code
// object that runs while fn is traced (to scan its global and closure reads), and every frame
// of a code whose first argument it guards. A Python function given to sys.settrace is called
// for each of the ~millions of frames a transformer's training step starts; this one answers
// the frames it has already seen with two set lookups and calls back into Python only for a new
// code object (``on_new(frame)``) or one in ``per_object`` (``on_object(frame)``). The sets are
// the Recorder's own (its callbacks add to them). Like a Python trace function: only the
// 'call' event is used, and an exception raised by a callback turns tracing off and
// propagates into the frame that started.

#include <torch/extension.h>
#include <frameobject.h>

namespace py = pybind11;

namespace {

struct CodeTracer {
  PyObject_HEAD
  PyObject* seen;
  PyObject* per_object;
  PyObject* on_new;
  PyObject* on_object;
};

int trace(PyObject* obj, PyFrameObject* frame, int what, PyObject* /*arg*/) {
  if (what != PyTrace_CALL) {
    return 0;
  }
  auto* self = reinterpret_cast<CodeTracer*>(obj);
  PyObject* code = reinterpret_cast<PyObject*>(PyFrame_GetCode(frame));
  PyObject* callback = nullptr;
  int seen = PySet_Contains(self->seen, code);
  if (seen == 1) {
    int per = PySet_Contains(self->per_object, code);
    if (per == 1) {
      callback = self->on_object;
    } else if (per < 0) {
      seen = -1;
    }
  } else if (seen == 0) {
    callback = self->on_new;
  }
  Py_DECREF(code);
  if (seen < 0) {
    PyEval_SetTrace(nullptr, nullptr);
    return -1;
  }
  if (callback == nullptr) {
    return 0;
  }
  PyObject* result = PyObject_CallOneArg(callback, reinterpret_cast<PyObject*>(frame));
  if (result == nullptr) {
    PyEval_SetTrace(nullptr, nullptr);
    return -1;
  }
  Py_DECREF(result);
  return 0;
}

void tracer_dealloc(PyObject* obj) {
  auto* self = reinterpret_cast<CodeTracer*>(obj);
  Py_XDECREF(self->seen);
  Py_XDECREF(self->per_object);
  Py_XDECREF(self->on_new);
  Py_XDECREF(self->on_object);
  Py_TYPE(obj)->tp_free(obj);
}

PyObject* tracer_install(PyObject* obj, PyObject* /*unused*/) {
  PyEval_SetTrace(trace, obj);
  Py_RETURN_NONE;
}

PyMethodDef tracer_methods[] = {
    {"install", tracer_install, METH_NOARGS, "Make this the current thread's trace function."},
    {nullptr, nullptr, 0, nullptr},
};

PyTypeObject tracer_type = [] {
  PyTypeObject t{PyVarObject_HEAD_INIT(nullptr, 0)};
  t.tp_name = "flowexec_native.CodeTracer";
  t.tp_basicsize = sizeof(CodeTracer);
  t.tp_flags = Py_TPFLAGS_DEFAULT;
  t.tp_dealloc = tracer_dealloc;
  t.tp_methods = tracer_methods;
  t.tp_doc = "A C trace function for guards.Recorder (codetracer.cpp).";
  return t;
}();

}  // namespace

void register_code_tracer(py::module_& m) {
  if (PyType_Ready(&tracer_type) < 0) {
    throw py::error_already_set();
  }
  m.attr("CodeTracer") = py::handle(reinterpret_cast<PyObject*>(&tracer_type));
  m.def(
      "code_tracer",
      [](py::set seen, py::set per_object, py::object on_new, py::object on_object) {
        auto* self = PyObject_New(CodeTracer, &tracer_type);
        if (self == nullptr) {
          throw py::error_already_set();
        }
        self->seen = seen.release().ptr();
        self->per_object = per_object.release().ptr();
        self->on_new = on_new.release().ptr();
        self->on_object = on_object.release().ptr();
        return py::reinterpret_steal<py::object>(reinterpret_cast<PyObject*>(self));
      },
      py::arg("seen"), py::arg("per_object"), py::arg("on_new"), py::arg("on_object"),
      "A tracer calling on_new(frame) for a code object not in seen, on_object(frame) for one in per_object.");
}
