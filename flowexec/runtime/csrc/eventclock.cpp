// A pool of CUDA timing events driven through the driver's own functions, for the job timer
// (flowexec/profiler/timers.py, NativeEvents). A span costs two records and two elapsed-time
// reads; through ctypes each is ~1 µs of argument conversion on top of the driver call, and
// through torch.cuda.Event ~3-10 µs. Here each is one pybind call, and reading a batch of
// events is one call for all of them.
//
// The driver functions come in as addresses (ctypes hands them over from libcuda), so this
// file needs no CUDA headers or libraries and builds with the CPU extension; the tests drive it
// with ctypes callbacks standing in for the driver.

#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

using CreateFn = int (*)(void**, unsigned int);      // cuEventCreate(&ev, flags)
using RecordFn = int (*)(void*, void*);              // cuEventRecord(ev, stream)
using QueryFn = int (*)(void*);                      // cuEventQuery(ev)
using ElapsedFn = int (*)(float*, void*, void*);     // cuEventElapsedTime(&ms, start, end)
using DestroyFn = int (*)(void*);                    // cuEventDestroy_v2(ev)
using NameFn = int (*)(int, const char**);           // cuGetErrorName(code, &name)
constexpr int kNotReady = 600;                       // CUDA_ERROR_NOT_READY

class EventClock {
 public:
  EventClock(uintptr_t create, uintptr_t record, uintptr_t query, uintptr_t elapsed, uintptr_t destroy,
             uintptr_t name)
      : create_(reinterpret_cast<CreateFn>(create)),
        record_(reinterpret_cast<RecordFn>(record)),
        query_(reinterpret_cast<QueryFn>(query)),
        elapsed_(reinterpret_cast<ElapsedFn>(elapsed)),
        destroy_(reinterpret_cast<DestroyFn>(destroy)),
        name_(reinterpret_cast<NameFn>(name)) {}

  ~EventClock() {
    for (void* ev : events_) destroy_(ev);  // at exit the driver may be gone: codes ignored
  }

  // Record a free event (a new one when none is free) on `stream`; returns its slot.
  int record(uintptr_t stream) {
    int slot;
    if (free_.empty()) {
      void* ev = nullptr;
      check(create_(&ev, 0), "cuEventCreate");
      events_.push_back(ev);
      slot = static_cast<int>(events_.size()) - 1;
    } else {
      slot = free_.back();
      free_.pop_back();
    }
    int code = record_(events_[slot], reinterpret_cast<void*>(stream));
    if (code != 0) {
      free_.push_back(slot);
      check(code, "cuEventRecord");
    }
    return slot;
  }

  // Whether the device has passed the event (never waits).
  bool done(int slot) {
    int code = query_(at(slot));
    if (code == 0) return true;
    if (code != kNotReady) check(code, "cuEventQuery");
    return false;
  }

  // Nanoseconds on the device from `anchor` to each of `slots` (all must be complete).
  std::vector<int64_t> offsets_ns(int anchor, const std::vector<int>& slots) {
    std::vector<int64_t> out;
    out.reserve(slots.size());
    void* a = at(anchor);
    for (int s : slots) {
      float ms = 0.f;
      check(elapsed_(&ms, a, at(s)), "cuEventElapsedTime");
      out.push_back(static_cast<int64_t>(std::llround(static_cast<double>(ms) * 1e6)));
    }
    return out;
  }

  // Hand events back to the pool once read.
  void release(const std::vector<int>& slots) {
    for (int s : slots) {
      at(s);
      free_.push_back(s);
    }
  }

  int64_t created() const { return static_cast<int64_t>(events_.size()); }
  int64_t free_count() const { return static_cast<int64_t>(free_.size()); }

 private:
  void* at(int slot) const {
    if (slot < 0 || slot >= static_cast<int>(events_.size()))
      throw py::index_error("EventClock: no event in slot " + std::to_string(slot));
    return events_[slot];
  }

  void check(int code, const char* call) const {
    if (code == 0) return;
    const char* name = nullptr;
    std::string what = std::string(call) + " failed: ";
    what += (name_(code, &name) == 0 && name != nullptr) ? name : "CUDA_ERROR_UNKNOWN";
    what += " (" + std::to_string(code) + ")";
    throw std::runtime_error(what);
  }

  CreateFn create_;
  RecordFn record_;
  QueryFn query_;
  ElapsedFn elapsed_;
  DestroyFn destroy_;
  NameFn name_;
  std::vector<void*> events_;
  std::vector<int> free_;
};

}  // namespace

void register_event_clock(py::module_& m) {
  py::class_<EventClock>(m, "EventClock")
      .def(py::init<uintptr_t, uintptr_t, uintptr_t, uintptr_t, uintptr_t, uintptr_t>(), py::arg("create"),
           py::arg("record"), py::arg("query"), py::arg("elapsed"), py::arg("destroy"), py::arg("error_name"))
      .def("record", &EventClock::record, py::arg("stream"))
      .def("done", &EventClock::done, py::arg("slot"))
      .def("offsets_ns", &EventClock::offsets_ns, py::arg("anchor"), py::arg("slots"))
      .def("release", &EventClock::release, py::arg("slots"))
      .def_property_readonly("created", &EventClock::created)
      .def_property_readonly("free", &EventClock::free_count);
}
