// Native front door of flowexec::lerp: planned launches of the Triton kernels and a C++ autograd
// node, so that an eager forward+backward pays no Python autograd.Function and no Python
// launcher (see docs/kernels.md, "Native front door").
//
// Python plans everything (shapes, grids, compiled kernels, argument values) and hands this file
// *programs*: which buffers to allocate and which kernels to launch with which parameter
// values. A call only makes inputs contiguous, allocates, patches data pointers (and a Python
// float weight) into a copy of the parameter block, and calls cuLaunchKernel. A backward for a
// set of required gradients that was never planned, a misaligned tensor or another current
// device goes back to Python (`LerpPlan.py_backward`), which plans it for next time.
//
// Built by torch.utils.cpp_extension (flowexec/kernels/_native.py). With FLOWEXEC_WITH_CUDA the
// launches go to the driver; without it (CPU tests) to a Python hook that runs the same kernels
// in Triton's interpreter, so the packing and the autograd node are tested without a GPU.

#include <torch/extension.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <c10/core/CPUAllocator.h>
#include <ATen/ExpandUtils.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>

#include <array>
#include <atomic>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <type_traits>
#include <unordered_map>
#include <vector>

#ifdef FLOWEXEC_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAStream.h>
#include <dlfcn.h>
#endif

namespace py = pybind11;
using torch::autograd::Node;
using torch::autograd::SavedVariable;
using torch::autograd::variable_list;

namespace flowexec {

constexpr int kMaxParams = 64;

#ifdef FLOWEXEC_WITH_CUDA
// cuLaunchKernel from the driver torch already loaded: no link-time dependency on libcuda.
using LaunchFn = int (*)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void*,
                         void**, void**);
LaunchFn driver_launch() {
  static LaunchFn fn = [] {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (lib == nullptr) lib = dlopen("libcuda.so.1", RTLD_NOW);
    TORCH_CHECK(lib != nullptr, "flowexec::lerp: cannot open libcuda.so.1: ", dlerror());
    auto f = reinterpret_cast<LaunchFn>(dlsym(lib, "cuLaunchKernel"));
    TORCH_CHECK(f != nullptr, "flowexec::lerp: libcuda.so.1 has no cuLaunchKernel");
    return f;
  }();
  return fn;
}

// The calling thread must have a current context (a new thread may not have one yet, and the
// caching allocator can serve it without any CUDA call). Triton's launcher makes sure of the
// same before every launch; here once per thread and device: the primary context, as torch uses.
void ensure_context(int device) {
  thread_local int ready_for = -1;
  if (ready_for == device) return;
  using GetCurrent = int (*)(void**);
  using DeviceGet = int (*)(int*, int);
  using Retain = int (*)(void**, int);
  using SetCurrent = int (*)(void*);
  static void* lib = dlopen("libcuda.so.1", RTLD_NOW);
  static auto get_current = reinterpret_cast<GetCurrent>(dlsym(lib, "cuCtxGetCurrent"));
  static auto device_get = reinterpret_cast<DeviceGet>(dlsym(lib, "cuDeviceGet"));
  static auto retain = reinterpret_cast<Retain>(dlsym(lib, "cuDevicePrimaryCtxRetain"));
  static auto set_current = reinterpret_cast<SetCurrent>(dlsym(lib, "cuCtxSetCurrent"));
  TORCH_CHECK(get_current && device_get && retain && set_current, "flowexec::lerp: libcuda.so.1 lacks context calls");
  void* ctx = nullptr;
  TORCH_CHECK(get_current(&ctx) == 0, "flowexec::lerp: cuCtxGetCurrent failed");
  if (ctx == nullptr) {
    int dev = 0;
    TORCH_CHECK(device_get(&dev, device) == 0 && retain(&ctx, dev) == 0 && set_current(ctx) == 0,
                "flowexec::lerp: cannot make the primary context of device ", device, " current");
  }
  ready_for = device;
}
#else
py::object& test_hook() {  // CPU build: (test_id, grid, [(kind, value)], buffers) -> None
  static py::object* hook = new py::object();  // leaked: outlives interpreter shutdown ordering
  return *hook;
}
#endif

// One planned kernel launch: a parameter block with one 8-byte slot per kernel parameter.
struct Launch {
  int64_t function = 0;  // CUfunction (CUDA build) or the test id (CPU build)
  unsigned grid = 1, block = 128, shared = 0;
  std::vector<uint64_t> values;
  std::vector<char> kinds;                      // per parameter: p i l f d n H L
  std::vector<std::pair<int, int>> ptr_slots;   // (parameter, buffer)
  int w_hi = -1, w_lo = -1;                     // parameters that take the call's float weight

  void run(const std::vector<at::Tensor>& bufs, float hi, float lo, int device, int64_t stream) const {
    const size_t n = values.size();
    uint64_t vals[kMaxParams];
    void* ptrs[kMaxParams];
    std::memcpy(vals, values.data(), n * sizeof(uint64_t));
    for (const auto& [p, b] : ptr_slots) vals[p] = reinterpret_cast<uint64_t>(bufs[b].data_ptr());
    if (w_hi >= 0) std::memcpy(&vals[w_hi], &hi, sizeof(float));
    if (w_lo >= 0) std::memcpy(&vals[w_lo], &lo, sizeof(float));
    for (size_t i = 0; i < n; ++i) ptrs[i] = &vals[i];
#ifdef FLOWEXEC_WITH_CUDA
    ensure_context(device);
    int err = driver_launch()(reinterpret_cast<void*>(function), grid, 1, 1, block, 1, 1, shared,
                              reinterpret_cast<void*>(stream), ptrs,
                              nullptr);
    TORCH_CHECK(err == 0, "flowexec::lerp: cuLaunchKernel failed with CUresult ", err);
#else
    (void)device;
    (void)stream;
    (void)ptrs;
    py::gil_scoped_acquire gil;
    py::list params;
    for (size_t i = 0; i < n; ++i) {
      const char k = kinds[i];
      if (k == 'i') {
        int32_t v;
        std::memcpy(&v, &vals[i], 4);
        params.append(py::make_tuple("i", v));
      } else if (k == 'f' || k == 'H' || k == 'L') {
        float v;
        std::memcpy(&v, &vals[i], 4);
        params.append(py::make_tuple("f", v));
      } else if (k == 'd') {
        double v;
        std::memcpy(&v, &vals[i], 8);
        params.append(py::make_tuple("d", v));
      } else {  // pointers and 64-bit integers: the raw slot
        params.append(py::make_tuple(std::string(1, k), static_cast<int64_t>(vals[i])));
      }
    }
    py::list b;
    for (const auto& t : bufs) b.append(t);
    test_hook()(function, grid, params, b);
#endif
  }
};

// Allocations go straight to the caching allocator: at::empty_like is two dispatcher round trips
// (empty_like, then empty_strided) per buffer, and at::detail::empty_cuda, which ATen's own kernels
// allocate their outputs with, adds a device guard (two runtime calls) that a plan, which only runs
// on its own current device, does not need.

// `bytes` from the caching allocator (CUDA build: on the current device) as a bare storage;
// tensors are made over it (Region::make). Resizable as ATen's outputs are, except a block that
// several gradients share.
c10::Storage allocate_storage(int64_t bytes, bool resizable) {
#ifdef FLOWEXEC_WITH_CUDA
  c10::Allocator* a = c10::cuda::CUDACachingAllocator::get();
#else
  c10::Allocator* a = c10::GetCPUAllocator();  // as at::empty on the CPU
#endif
  return c10::Storage(c10::Storage::use_byte_size_t(), bytes, a->allocate(bytes), a, resizable);
}

// The dispatch keys of the tensors programs make: plain dense ones of the build's device type
// (TensorImpl adds the autograd keys, as it does for at::empty's).
#ifdef FLOWEXEC_WITH_CUDA
constexpr c10::DispatchKey kBackend = c10::DispatchKey::CUDA;
#else
constexpr c10::DispatchKey kBackend = c10::DispatchKey::CPU;
#endif


// The current stream of `device` as a number (its handle; 0 on the CPU build).
int64_t current_stream(int device) {
#ifdef FLOWEXEC_WITH_CUDA
  return reinterpret_cast<int64_t>(c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream());
#else
  (void)device;
  return 0;
#endif
}

std::vector<int64_t> contiguous_strides(const std::vector<int64_t>& shape) {
  std::vector<int64_t> st(shape.size(), 1);
  for (int i = static_cast<int>(shape.size()) - 2; i >= 0; --i) st[i] = st[i + 1] * std::max<int64_t>(shape[i + 1], 1);
  return st;
}

// A contiguous tensor of `shape` that a program puts in `buffer`, `offset` elements into the
// storage of a base the program allocated (so at storage offset 0): the zeroed buffer a forward
// left for its backward's atomic sums, or the one allocation a backward makes for its gradients.
struct Region {
  int buffer = 0;
  std::vector<int64_t> shape, strides;
  int64_t offset = 0;
  bool whole = false;  // a view that is the forward's atomic buffer itself (its start, its shape)

  // The region in `storage`, whose base starts `base` elements in (a tensor's storage offset).
  at::Tensor in(const c10::Storage& storage, at::ScalarType dtype, int64_t base = 0) const {
    return make(storage, dtype, shape, strides, base + offset);
  }

  // Made without the dispatcher: as_strided through it costs microseconds (autograd's view
  // bookkeeping) on the engine's worker thread. Not a view for autograd: a plain tensor sharing
  // the storage, as the narrowed gradients of CatBackward share their incoming gradient's.
  static at::Tensor make(c10::Storage storage, at::ScalarType dtype, at::IntArrayRef shape, at::IntArrayRef strides,
                         int64_t storage_offset) {
    auto t = at::detail::make_tensor<c10::TensorImpl>(std::move(storage), c10::DispatchKeySet(kBackend),
                                                      c10::scalarTypeToTypeMeta(dtype));
    t.unsafeGetTensorImpl()->set_sizes_and_strides(shape, strides, storage_offset);
    return t;
  }
};

// The zeroed buffers forwards leave for their backwards' atomic sums are carved from a slab per
// device and stream instead of one caching-allocator call each (on the forward's critical path):
// a few hundred bytes a call, slots never reused, a slab freed by the allocator once the last
// gradient made inside it (a `w.grad`, say) dies. Per stream, because the caching allocator
// orders a freed block's reuse after the work of the stream it was allocated on.
class Slabs {
 public:
  static constexpr int64_t kSlabBytes = 256 * 1024, kAlign = 256;

  // A tensor of `shape` and `dtype` (contiguous) in a fresh slot of the current stream's slab. The
  // slab's storage is not resizable: the gradients handed out in it are the user's tensors, and a
  // resize through one of them must not move the other calls' slots.
  at::Tensor take(int device, int64_t stream, at::ScalarType dtype, at::IntArrayRef shape, at::IntArrayRef strides,
                  int64_t bytes) {
    std::lock_guard<std::mutex> g(lock_);
    Slab& s = slabs_[{device, stream}];
    if (s.storage.unsafeGetStorageImpl() == nullptr || s.used + bytes > static_cast<int64_t>(s.storage.nbytes())) {
      s.storage = allocate_storage(std::max(kSlabBytes, bytes), /*resizable=*/false);
      s.used = 0;
    }
    const int64_t at = s.used;
    s.used += (bytes + kAlign - 1) / kAlign * kAlign;
    return Region::make(s.storage, dtype, shape, strides, at / static_cast<int64_t>(c10::elementSize(dtype)));
  }

  void clear() {
    std::lock_guard<std::mutex> g(lock_);
    slabs_.clear();
  }

 private:
  struct Slab {
    c10::Storage storage;
    int64_t used = 0;  // bytes
  };
  std::mutex lock_;
  std::map<std::pair<int, int64_t>, Slab> slabs_;
};

Slabs& slabs() {
  static Slabs* s = new Slabs();  // leaked: tensors must not be freed during static destruction
  return *s;
}

// An allocation of a program: a contiguous tensor in `dtype` on the first buffer's device,
// either its own or (`in_block`) a region of the one allocation the program makes for all such
// (`Program::block_bytes`): a backward that returns two or three full-size gradients pays the
// caching allocator once, not per gradient. Shapes are fixed when the program is planned: a plan
// runs only on the shapes it was registered (forward) or planned (backward, `planned_for`) for.
struct Alloc : Region {
  at::ScalarType dtype = at::kFloat;
  bool in_block = false;
  int64_t bytes = 0;

  at::Tensor alone() const { return in(allocate_storage(bytes, /*resizable=*/true), dtype); }
};

// Buffers 0..n_inputs-1 are the call's inputs; allocations and views of `acc` fill others; the
// rest alias buffer 0.
struct Program {
  int n_buffers = 0;
  int64_t block_bytes = 0;  // the one allocation the allocs `in_block` share (0: none)
  std::vector<Alloc> allocs;
  std::vector<Region> views;  // of `acc`: the gradients a backward adds into with atomics
  std::vector<Launch> launches;

  // `stream`: the current stream of `device` (current_stream), fetched once per call.
  void run(std::vector<at::Tensor>& bufs, float hi, float lo, int device, int64_t stream,
           const at::Tensor& acc = {}) const {
    for (const auto& v : views) bufs[v.buffer] = v.whole ? acc : v.in(acc.storage(), acc.scalar_type(), acc.storage_offset());
    c10::Storage block = block_bytes > 0 ? allocate_storage(block_bytes, false) : c10::Storage();
    for (const auto& a : allocs) bufs[a.buffer] = a.in_block ? a.in(block, a.dtype) : a.alone();
    for (auto& t : bufs)
      if (!t.defined()) t = bufs[0];
    for (const auto& l : launches) l.run(bufs, hi, lo, device, stream);
  }
};

struct LerpPlan {
  int device = -1;  // CUDA device index; -1: CPU tensors (test build)
  bool w_scalar = false;
  bool f64 = false;
  // fwd[1]: the forward that also zeroes an `acc_numel` buffer (buffer 4); bwd[8 + mask]: the
  // backwards that sum the broadcast operands' gradients into views of it with atomics (no
  // partial sums, no final pass). bwd[mask] by needs mask: bit 0 dx, bit 1 dy, bit 2 dw.
  int64_t acc_numel = 0;
  int64_t acc_bytes = 0;
  std::vector<int64_t> acc_shape, acc_strides;  // the buffer's tensor: shaped as the gradient at its start
  std::array<std::atomic<Program*>, 2> fwd{};
  std::array<std::atomic<Program*>, 16> bwd{};
  py::object py_backward;  // (g, x, y, w | None, wv, (nx, ny, nw), acc | None) -> (dx, dy, dw)
  std::mutex lock;
  std::vector<std::unique_ptr<Program>> owned;
  // What the programs were planned for (set when the plan is registered): a saved tensor that
  // comes back from an unpack hook as something else is not launched on.
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> x_sizes, y_sizes, w_sizes;

  bool planned_for(const at::Tensor& x, const at::Tensor& y, const at::Tensor& w) const {
    return x.scalar_type() == dtype && y.scalar_type() == dtype && x.sizes().equals(x_sizes) &&
           y.sizes().equals(y_sizes) && (w_scalar || (w.scalar_type() == dtype && w.sizes().equals(w_sizes)));
  }

  LerpPlan(int device_, bool w_scalar_, bool f64_, py::object py_backward_)
      : device(device_), w_scalar(w_scalar_), f64(f64_), py_backward(std::move(py_backward_)) {
    for (auto& f : fwd) f.store(nullptr);
    for (auto& b : bwd) b.store(nullptr);
  }
  ~LerpPlan() {
    // The last owner may be an autograd node freed on an engine thread: take the GIL for the
    // Python callable, or leak it if Python is already gone.
    if (Py_IsInitialized()) {
      py::gil_scoped_acquire gil;
      py_backward = py::object();
    } else {
      py_backward.release();
    }
  }

  void install(int slot, std::unique_ptr<Program> p) {
    std::lock_guard<std::mutex> g(lock);
    Program* raw = p.get();
    owned.push_back(std::move(p));
    (slot < 0 ? fwd.at(-1 - slot) : bwd.at(slot)).store(raw);
  }

  bool on_device(const at::Tensor& t) const {
#ifdef FLOWEXEC_WITH_CUDA
    return t.is_cuda() && t.get_device() == device && c10::cuda::current_device() == device;
#else
    return t.is_cpu() && device == -1;
#endif
  }

  std::pair<float, float> split(double wv) const {
    const float hi = static_cast<float>(wv);
    return {hi, f64 ? static_cast<float>(wv - static_cast<double>(hi)) : 0.0f};
  }
};

bool aligned(const at::Tensor& t) { return (reinterpret_cast<uintptr_t>(t.data_ptr()) & 15) == 0; }

// Atomic sums only where a forward's zeroing is sure to precede its backward once, and where
// bitwise reproducibility was not asked for: not in deterministic mode, not during CUDA-graph
// capture (a graph may replay a backward without the forward that zeroed its buffer).
bool atomics_allowed() {
  if (at::globalContext().deterministicAlgorithms()) return false;
#ifdef FLOWEXEC_WITH_CUDA
  return c10::cuda::currentStreamCaptureStatusMayInitCtx() == c10::cuda::CaptureStatus::None;
#else
  return true;
#endif
}

at::Tensor contiguous(const at::Tensor& t) { return t.is_contiguous() ? t : t.contiguous(); }

// Tensors the native kernels do not take: subclasses with __torch_dispatch__, functorch
// wrappers and batched gradients (a vmapped backward: no storage), functionalization, negated or
// conjugated views, anything not dense.
bool plain(const at::Tensor& t) {
  constexpr c10::DispatchKeySet unusual({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot,
                                          c10::DispatchKey::FuncTorchBatched, c10::DispatchKey::FuncTorchGradWrapper,
                                          c10::DispatchKey::Functionalize, c10::DispatchKey::Conjugate,
                                          c10::DispatchKey::Negative, c10::DispatchKey::Batched});
  return t.layout() == at::kStrided && !t.key_set().has_any(unusual) && t.has_storage();
}


template <class N>
auto make_node() {
  // torch >= 2.12 holds autograd nodes in intrusive pointers, earlier versions in shared_ptr.
  if constexpr (std::is_base_of_v<c10::intrusive_ptr_target, N>) {
    return c10::make_intrusive<N>();
  } else {
    return std::make_shared<N>();
  }
}

struct LerpBackward : public Node {
  SavedVariable x_, y_, w_;
  double wv = 0.0;
  std::shared_ptr<LerpPlan> plan;
  at::Tensor acc_;  // zeroed by the forward for this backward's atomic sums; used once

  std::string name() const override { return "FlowexecLerpBackward"; }

  void release_variables() override {
    x_.reset_data();
    y_.reset_data();
    w_.reset_data();
    acc_.reset();
  }

  variable_list apply(variable_list&& grads) override {
    variable_list out(3);
    at::Tensor acc = std::move(acc_);  // moved out: a second backward (retain_graph) sums partials
    const at::Tensor& g = grads[0];
    if (!g.defined()) return out;
    const bool nx = task_should_compute_output(0), ny = task_should_compute_output(1);
    const bool nw = !plan->w_scalar && task_should_compute_output(2);
    if (!(nx || ny || nw)) return out;
    at::Tensor x = x_.unpack(), y = y_.unpack(), w = plan->w_scalar ? at::Tensor() : w_.unpack();
    // Differentiable ATen formulas: for create_graph=True, and for what the kernels do not take
    // (a batched or negated gradient, saved tensors an unpack hook changed).
    if (at::GradMode::is_enabled() || !plain(g) || !plain(x) || !plain(y) || (w.defined() && !plain(w)) ||
        !plan->planned_for(x, y, w)) {
      auto one_minus = plan->w_scalar ? at::Tensor() : 1 - w;
      if (nx) out[0] = at::sum_to(plan->w_scalar ? g * (1 - wv) : g * one_minus, x.sym_sizes());
      if (ny) out[1] = at::sum_to(plan->w_scalar ? g * wv : g * w, y.sym_sizes());
      if (nw) out[2] = at::sum_to(g * (y - x), w.sym_sizes());
      return out;
    }
    const int mask = int(nx) | (int(ny) << 1) | (int(nw) << 2);
    if (acc.defined() && !atomics_allowed()) acc = at::Tensor();
    Program* p = plan->bwd[mask + (acc.defined() ? 8 : 0)].load();
    if (p != nullptr && plan->on_device(g)) {
      std::vector<at::Tensor> bufs(p->n_buffers);
      bufs[0] = contiguous(g);
      bufs[1] = contiguous(x);
      bufs[2] = contiguous(y);
      bufs[3] = plan->w_scalar ? bufs[1] : contiguous(w);
      if (aligned(bufs[0]) && aligned(bufs[1]) && aligned(bufs[2]) && aligned(bufs[3])) {
        const auto [hi, lo] = plan->split(wv);
        p->run(bufs, hi, lo, plan->device, current_stream(plan->device), acc);
        if (nx) out[0] = bufs[4];
        if (ny) out[1] = bufs[5];
        if (nw) out[2] = bufs[6];
        return out;
      }
    }
    py::gil_scoped_acquire gil;  // first use of this mask, or an unusual tensor: Python plans it
    py::object wobj = plan->w_scalar ? py::none() : py::cast(w);
    py::object accobj = py::none();  // Python takes the whole buffer, flat
    if (acc.defined())
      accobj = py::cast(Region::make(acc.storage(), acc.scalar_type(), {plan->acc_numel}, {1}, acc.storage_offset()));
    py::tuple r = plan->py_backward(g, x, y, wobj, wv, py::make_tuple(nx, ny, nw), accobj);
    for (int i = 0; i < 3; ++i)
      if (!r[i].is_none()) out[i] = r[i].cast<at::Tensor>();
    return out;
  }
};

// The eager forward. Returns an undefined tensor (None in Python) when it cannot take the call;
// the caller then uses the Python path.
at::Tensor forward(std::shared_ptr<LerpPlan> plan, const at::Tensor& x, const at::Tensor& y,
                   const std::optional<at::Tensor>& w_opt, double wv) {
  const at::Tensor w = w_opt.has_value() ? *w_opt : at::Tensor();
  const bool requires_grad = torch::autograd::compute_requires_grad(x, y, w);
  const bool with_acc = requires_grad && plan->acc_numel > 0 && atomics_allowed();
  Program* p = plan->fwd[with_acc].load();
  if (p == nullptr || !plan->on_device(x)) return {};
  std::vector<at::Tensor> bufs(p->n_buffers);
  {
    at::NoGradGuard no_grad;  // contiguous() copies must not enter the autograd graph
    bufs[0] = contiguous(x);
    bufs[1] = contiguous(y);
    bufs[2] = w.defined() ? contiguous(w) : bufs[0];
    if (!(aligned(bufs[0]) && aligned(bufs[1]) && aligned(bufs[2]))) return {};
    const int64_t stream = current_stream(plan->device);
    if (with_acc)
      bufs[4] = slabs().take(plan->device, stream, plan->dtype, plan->acc_shape, plan->acc_strides, plan->acc_bytes);
    const auto [hi, lo] = plan->split(wv);
    p->run(bufs, hi, lo, plan->device, stream);
  }
  at::Tensor out = bufs[3];
  if (requires_grad) {
    auto node = make_node<LerpBackward>();
    node->set_next_edges(torch::autograd::collect_next_edges(x, y, w));
    node->x_ = SavedVariable(x, false);
    node->y_ = SavedVariable(y, false);
    if (w.defined()) node->w_ = SavedVariable(w, false);
    node->wv = wv;
    node->plan = plan;
    if (with_acc) node->acc_ = bufs[4];
    torch::autograd::set_history(out, node);
  }
  return out;
}

// ---------------------------------------------------------------------------- plan registry
// The eager front door looks plans up here by (dtype, device, shapes), so that a call that was
// planned before never builds a Python key. Python registers a plan once it is installed and
// clears the registry with its own cache. Only touched with the GIL held.
struct KeyHash {
  size_t operator()(const std::vector<int64_t>& k) const {
    size_t h = k.size();
    for (int64_t v : k) h ^= std::hash<int64_t>()(v) + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
    return h;
  }
};
using Registry = std::unordered_map<std::vector<int64_t>, std::shared_ptr<LerpPlan>, KeyHash>;
Registry& registry() {
  static Registry* r = new Registry();  // leaked: plans may outlive static destruction order
  return *r;
}

void append_key(std::vector<int64_t>& key, const at::Tensor& t) {
  key.push_back(t.dim());
  for (int64_t s : t.sizes()) key.push_back(s);
}

// The key of a call, in a buffer of the calling thread's (no allocation per call).
const std::vector<int64_t>& key_of(const at::Tensor& x, const at::Tensor& y, const at::Tensor& w) {
  thread_local std::vector<int64_t> key;
  key.clear();
  key.push_back(static_cast<int64_t>(x.scalar_type()));
  key.push_back(static_cast<int64_t>(x.device().type()));
  key.push_back(x.device().index());
  append_key(key, x);
  append_key(key, y);
  if (w.defined())
    append_key(key, w);
  else
    key.push_back(-1);
  return key;
}

void register_plan(const std::shared_ptr<LerpPlan>& plan, const at::Tensor& x, const at::Tensor& y,
                   const std::optional<at::Tensor>& w) {
  plan->dtype = x.scalar_type();
  plan->x_sizes = x.sizes().vec();
  plan->y_sizes = y.sizes().vec();
  plan->w_sizes = w.has_value() ? w->sizes().vec() : std::vector<int64_t>();
  registry()[key_of(x, y, w.has_value() ? *w : at::Tensor())] = plan;
}

// The eager front door: the checks Python's lerp() would make, the plan lookup and the call
// (dual tensors never get here: lerp() sends an open forward-AD level to ATen first).
// An undefined result (None) sends the call down the Python path, which plans it or reports
// what is wrong with it.
at::Tensor lerp(const at::Tensor& x, const at::Tensor& y, const std::optional<at::Tensor>& w_opt, double wv) {
  // Dispatch modes (make_fx, fake tensors) and functorch transforms (which include their front
  // key in the thread-local set while any transform is active) need the registered op.
  if (c10::impl::TorchDispatchModeTLS::stack_len() > 0 ||
      c10::impl::tls_is_dispatch_key_included(c10::DispatchKey::FuncTorchDynamicLayerFrontMode))
    return {};
  const at::Tensor w = w_opt.has_value() ? *w_opt : at::Tensor();
  if (!plain(x) || !plain(y) || (w.defined() && !plain(w))) return {};
  if (y.scalar_type() != x.scalar_type() || y.device() != x.device()) return {};
  if (w.defined() && (w.scalar_type() != x.scalar_type() || w.device() != x.device())) return {};
  auto& reg = registry();
  auto it = reg.find(key_of(x, y, w));
  if (it == reg.end()) return {};
  // A copy: the registry entry can go (clear_plans from a saved-tensor hook) while forward runs.
  std::shared_ptr<LerpPlan> plan = it->second;
  return forward(std::move(plan), x, y, w_opt, wv);
}

// The front door as Python calls it, lerp(x, y, w | None, wv) -> Tensor | None: a plain CPython
// function (vectorcall), which costs the forward less than pybind11's argument machinery.
PyObject* lerp_py(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs != 4 || !THPVariable_Check(args[0]) || !THPVariable_Check(args[1]) ||
      (args[2] != Py_None && !THPVariable_Check(args[2]))) {
    PyErr_SetString(PyExc_TypeError, "flowexec lerp front door: expected (Tensor x, Tensor y, Tensor | None w, float wv)");
    return nullptr;
  }
  const double wv = PyFloat_AsDouble(args[3]);
  if (wv == -1.0 && PyErr_Occurred()) return nullptr;
  std::optional<at::Tensor> w;
  if (args[2] != Py_None) w = THPVariable_Unpack(args[2]);
  at::Tensor out = lerp(THPVariable_Unpack(args[0]), THPVariable_Unpack(args[1]), w, wv);
  if (!out.defined()) Py_RETURN_NONE;
  return THPVariable_Wrap(std::move(out));
  END_HANDLE_TH_ERRORS
}

PyMethodDef lerp_def = {"lerp", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(lerp_py)), METH_FASTCALL,
                        "lerp(x, y, w, wv) -> Tensor | None: the eager forward of a planned call, or None"};

Launch make_launch(int64_t function, unsigned grid, unsigned block, unsigned shared, const py::list& params) {
  Launch l;
  l.function = function;
  l.grid = grid;
  l.block = block;
  l.shared = shared;
  TORCH_CHECK(params.size() <= static_cast<size_t>(kMaxParams), "flowexec::lerp: too many kernel parameters");
  for (size_t i = 0; i < params.size(); ++i) {
    auto item = params[i].cast<py::tuple>();
    const auto kind = item[0].cast<std::string>();
    TORCH_CHECK(kind.size() == 1, "flowexec::lerp: bad parameter kind ", kind);
    const char k = kind[0];
    uint64_t slot = 0;
    switch (k) {
      case 'p': l.ptr_slots.emplace_back(static_cast<int>(i), item[1].cast<int>()); break;
      case 'i': { int32_t v = item[1].cast<int32_t>(); std::memcpy(&slot, &v, 4); break; }
      case 'l': { int64_t v = item[1].cast<int64_t>(); std::memcpy(&slot, &v, 8); break; }
      case 'f': { float v = item[1].cast<float>(); std::memcpy(&slot, &v, 4); break; }
      case 'd': { double v = item[1].cast<double>(); std::memcpy(&slot, &v, 8); break; }
      case 'n': break;
      case 'H': l.w_hi = static_cast<int>(i); break;
      case 'L': l.w_lo = static_cast<int>(i); break;
      default: TORCH_CHECK(false, "flowexec::lerp: bad parameter kind ", kind);
    }
    l.values.push_back(slot);
    l.kinds.push_back(k);
  }
  return l;
}

// Python: plan.install(slot, n_buffers, allocs=[(buffer, shape, dtype[, in_block])],
//                      launches=[(function, grid, block, shared, [(kind, value)])],
//                      views=[(buffer, offset, shape)]);
// slot -1: forward, -2: forward that zeroes the buffer for atomics, 0-7: backward by needs mask,
// 8-15: atomic backward by needs mask (views: its gradients inside that buffer).
void install(LerpPlan& plan, int slot, int n_buffers, const py::list& allocs, const py::list& launches,
             const py::list& views) {
  TORCH_CHECK(slot >= -2 && slot < 16, "flowexec::lerp: bad program slot ", slot);
  auto p = std::make_unique<Program>();
  p->n_buffers = n_buffers;
  for (const auto& v : views) {
    auto t = v.cast<py::tuple>();
    Region r;
    r.buffer = t[0].cast<int>();
    r.offset = t[1].cast<int64_t>();
    r.shape = t[2].cast<std::vector<int64_t>>();
    r.strides = contiguous_strides(r.shape);
    // The gradient at the buffer's start is the tensor the forward made for the buffer (shaped as it).
    r.whole = r.offset == 0 && r.shape == plan.acc_shape;
    TORCH_CHECK(r.buffer >= 0 && r.buffer < n_buffers, "flowexec::lerp: bad view");
    p->views.push_back(std::move(r));
  }
  for (const auto& a : allocs) {
    auto t = a.cast<py::tuple>();
    Alloc al;
    al.buffer = t[0].cast<int>();
    al.shape = t[1].cast<std::vector<int64_t>>();
    al.dtype = t[2].cast<at::ScalarType>();
    al.strides = contiguous_strides(al.shape);
    al.in_block = t.size() > 3 && t[3].cast<bool>();
    const int64_t item = static_cast<int64_t>(c10::elementSize(al.dtype));
    al.bytes = item;
    for (int64_t d : al.shape) al.bytes *= d;
    if (al.in_block) {  // from the block's next 512-byte boundary, in elements of its dtype
      const int64_t start = (p->block_bytes + 511) / 512 * 512;
      al.offset = start / item;
      p->block_bytes = start + al.bytes;
    }
    TORCH_CHECK(al.buffer >= 0 && al.buffer < n_buffers, "flowexec::lerp: bad allocation");
    p->allocs.push_back(std::move(al));
  }
  for (const auto& lo : launches) {
    auto t = lo.cast<py::tuple>();
    Launch l = make_launch(t[0].cast<int64_t>(), t[1].cast<unsigned>(), t[2].cast<unsigned>(), t[3].cast<unsigned>(),
                           t[4].cast<py::list>());
    for (const auto& [param, buf] : l.ptr_slots)
      TORCH_CHECK(buf >= 0 && buf < n_buffers, "flowexec::lerp: parameter ", param, " names buffer ", buf);
    p->launches.push_back(std::move(l));
  }
  plan.install(slot, std::move(p));
}

}  // namespace flowexec

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using flowexec::LerpPlan;
  py::class_<LerpPlan, std::shared_ptr<LerpPlan>>(m, "LerpPlan")
      .def(py::init<int, bool, bool, py::object>(), py::arg("device"), py::arg("w_scalar"), py::arg("f64"),
           py::arg("py_backward"))
      .def("has_forward", [](const LerpPlan& p) { return p.fwd[0].load() != nullptr; })
      .def("has_backward", [](const LerpPlan& p, int mask) { return p.bwd.at(mask).load() != nullptr; })
      .def("has_forward_acc", [](const LerpPlan& p) { return p.fwd[1].load() != nullptr; })
      .def("has_backward_atomic", [](const LerpPlan& p, int mask) { return p.bwd.at(8 + mask).load() != nullptr; })
      .def("set_acc", [](LerpPlan& p, int64_t numel, std::vector<int64_t> shape, at::ScalarType dtype) {
        int64_t n = 1;
        for (int64_t d : shape) n *= d;
        TORCH_CHECK(n <= numel, "flowexec::lerp: the atomic buffer's first gradient does not fit in it");
        p.acc_numel = numel;
        p.acc_bytes = numel * static_cast<int64_t>(c10::elementSize(dtype));
        p.acc_strides = flowexec::contiguous_strides(shape);
        p.acc_shape = std::move(shape);
      })
      .def("install", &flowexec::install);
  m.def("register_plan", &flowexec::register_plan);
  m.def("clear_plans", [] {
    flowexec::registry().clear();
    flowexec::slabs().clear();
  });
  m.attr("lerp") = py::reinterpret_steal<py::object>(PyCFunction_New(&flowexec::lerp_def, nullptr));
#ifdef FLOWEXEC_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
  m.def("set_test_hook", [](py::object f) { flowexec::test_hook() = std::move(f); });
#endif
}
