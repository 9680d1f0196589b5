// The op's C++ kernels: layernorm::forward and layernorm::backward on CPU, their
// autograd, and a front door for the common eager call (layernorm/compiled.py builds and
// loads this file and says why).
//
// Python defines the ops (layernorm._op: schemas, fake kernels, vmap rules, autocast,
// a Python autograd and Python kernels for every device). set_up registers, for CPU
// tensors, kernels that torch's dispatcher prefers to those:
//
//   CPU          forward_cpu / backward_cpu: the numba backend's compiled entries called
//                through their C addresses, in spans of rows over torch's OpenMP workers
//                when _threads.lend grants them (a row flagged for the exact fallback is
//                rewritten by Python, that row only); any call they were not built for
//                (another backend, zero-size, large, strided) goes to the Python kernel
//                (_op._forward_impl / _op._backward_impl), so every backend keeps working
//   AutogradCPU  forward_autograd: NormBackward, a C++ autograd node whose backward
//                calls layernorm::backward through the dispatcher (a batched gradient
//                meets the vmap rule there, a mode or the profiler sees it), or calls
//                backward_cpu itself when no mechanism would see the call
//                (mechanism_active); a backward that builds a graph (create_graph) runs
//                Python's differentiable composite_backward
//
// norm(x, residual, normalized_shape, weight, bias, eps, rms, backend) is the front door
// of ops._norm: for the common call (plain contiguous CPU tensors, an int or 1-tuple
// normalized_shape, a float or None eps, the automatic backend; the Python checks would
// pass it unchanged), when no PyTorch mechanism would see it (mechanism_active), it
// answers (y, residual_out) itself: with a gradient
// by the op's autograd kernel (so autograd records NormBackward), without one by the CPU
// kernel's own function, without statistics. Any other call gets None before any work.
// norm(..., backend, offset, mode, out, residual_out, y_dtype, memory_efficient) is the
// front door of layernorm.options.call for the options `offset`, `casting_mode` "gemma"
// and "llama" (mode 0, 1, 2), `memory_efficient` alone (with a gradient: a
// MemoryEfficientBackward node in the place of Python's MemoryEfficientNorm; without one
// the plain call), the preallocated outputs and another `out_dtype` (y_dtype: the
// kernels of that pair round into it, as layernorm::forward_to's; float32 from a 16-bit x
// without a gradient only; with a gradient NormBackward records a narrower one, dy
// widened exactly to x's dtype as forward_to's backward): the
// same torch operations around the same kernel call as options.norm (the gain, the llama
// product), where their arithmetic is one IEEE operation (an offset that is a float32
// value), with the kernels writing into `out` and `residual_out` (options.write_into's
// rule); it declines every other call, options.norm then answers it (or raises).
// fused(...) is the front door of layernorm.fused_norm (its arguments, in its order) for
// the call with dropout, x1 or a rowscale: the seed draw, the numba dropout-add entry
// (with a C++ autograd node, DropoutAddBackward) and the norm of h per weight set, as
// fused_norm runs them; without them, the norm's front door on x (and the residual);
// every other call gets None.
// norm_linear(...) is the front door of layernorm.layer_norm_linear with a gradient: the
// norm's forward kernel and at::linear, recorded by a NormLinearBackward node in the
// place of Python's NormLinear; every other call gets None.

#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/record_function.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/Generator.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/frontend/tracer.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <dlfcn.h>
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

using torch::Tensor;
using torch::autograd::variable_list;
using OptionalTensor = std::optional<Tensor>;
using Outputs = std::tuple<Tensor, Tensor, Tensor, Tensor>;
using Gradients = std::tuple<Tensor, Tensor, Tensor>;

// The kernel entries (layernorm.backends._numba_kernels.entry): void functions of
// addresses, sizes and flags. *_SIGNATURE spell their parameters in the form of
// layernorm.backends._kernel_abi; set_up compares them, so a mismatch raises.
using ForwardKernel = void (*)(int64_t x, int64_t x_stride, int64_t residual,
                               int64_t residual_stride, bool has_residual, int64_t residual_out,
                               int64_t weight, int64_t bias, bool params_x_dtype, int64_t y,
                               int64_t mean,
                               int64_t rstd, int64_t m, int64_t n, double eps, bool rms,
                               bool stream, bool store_stats, int64_t flags);
const char* const FORWARD_SIGNATURE =
    "x:i64,x_stride:i64,residual:i64,residual_stride:i64,has_residual:bool,"
    "residual_out:i64,weight:i64,bias:i64,params_x_dtype:bool,y:i64,mean:i64,rstd:i64,m:i64,"
    "n:i64,eps:f64,"
    "rms:bool,stream:bool,store_stats:bool,flags:i64";
using BackwardKernel = void (*)(int64_t dy, int64_t dy_stride, int64_t x, int64_t x_stride,
                                int64_t dresidual_out, int64_t dresidual_out_stride,
                                int64_t weight, bool params_x_dtype, int64_t mean,
                                int64_t rstd, int64_t dx,
                                int64_t dweight, int64_t dbias, int64_t m, int64_t n, bool rms,
                                bool stream, double eps, int64_t flags);
const char* const BACKWARD_SIGNATURE =
    "dy:i64,dy_stride:i64,x:i64,x_stride:i64,dresidual_out:i64,dresidual_out_stride:i64,"
    "weight:i64,params_x_dtype:bool,mean:i64,rstd:i64,dx:i64,dweight:i64,dbias:i64,m:i64,"
    "n:i64,rms:bool,"
    "stream:bool,eps:f64,flags:i64";

// The dropout-add's entries (layernorm.backends._numba_dropout.entry): rows
// [row_lo, row_hi) of a call of m rows, every tensor in the entry's dtype.
using DropoutAddKernel = void (*)(int64_t x0, int64_t x0_stride, int64_t x1, int64_t x1_stride,
                                  int64_t residual, int64_t residual_stride, int64_t rowscale,
                                  int64_t h, int64_t mask0, int64_t mask1, int64_t m, int64_t n,
                                  int64_t k0, int64_t k1, double p32, double s, bool has_x1,
                                  bool has_residual, bool has_rowscale, bool want_masks,
                                  int64_t row_lo, int64_t row_hi);
const char* const DROPOUT_ADD_SIGNATURE =
    "x0:i64,x0_stride:i64,x1:i64,x1_stride:i64,residual:i64,residual_stride:i64,"
    "rowscale:i64,h:i64,mask0:i64,mask1:i64,m:i64,n:i64,k0:i64,k1:i64,p32:f64,s:f64,"
    "has_x1:bool,has_residual:bool,has_rowscale:bool,want_masks:bool,row_lo:i64,row_hi:i64";
using Sum3Kernel = void (*)(int64_t x0, int64_t x0_stride, int64_t x1, int64_t x1_stride,
                            int64_t residual, int64_t residual_stride, int64_t h, int64_t m,
                            int64_t n, int64_t row_lo, int64_t row_hi);
const char* const SUM3_SIGNATURE =
    "x0:i64,x0_stride:i64,x1:i64,x1_stride:i64,residual:i64,residual_stride:i64,h:i64,"
    "m:i64,n:i64,row_lo:i64,row_hi:i64";

using DropoutAddBackwardKernel = void (*)(int64_t dh, int64_t dh_stride, int64_t rowscale,
                                          int64_t dx0, int64_t dx1, int64_t dresidual,
                                          int64_t m, int64_t n, int64_t k0, int64_t k1,
                                          double p32, double s, bool has_rowscale,
                                          bool has_x1, bool has_residual, int64_t row_lo,
                                          int64_t row_hi);
const char* const DROPOUT_ADD_BACKWARD_SIGNATURE =
    "dh:i64,dh_stride:i64,rowscale:i64,dx0:i64,dx1:i64,dresidual:i64,m:i64,n:i64,k0:i64,"
    "k1:i64,p32:f64,s:f64,has_rowscale:bool,has_x1:bool,has_residual:bool,row_lo:i64,"
    "row_hi:i64";

// The memory-efficient backward's entry (layernorm.backends._numba_recompute.entry):
// rows [row_lo, row_hi) (whole blocks of recompute_block rows) of dx and their blocks'
// float64 partial sums, from dy, the saved output y, gamma and beta (float64) and rstd
// (float32); dy, y and dx in the entry's dtype.
using MemoryEfficientBackwardKernel = void (*)(int64_t dy, int64_t dy_stride, int64_t y,
                                               int64_t gamma, int64_t beta, int64_t rstd,
                                               int64_t dx, int64_t dw_part, int64_t db_part,
                                               int64_t m, int64_t n, bool rms, bool need_dw,
                                               bool need_db, int64_t row_lo, int64_t row_hi);
const char* const MEMORY_EFFICIENT_BACKWARD_SIGNATURE =
    "dy:i64,dy_stride:i64,y:i64,gamma:i64,beta:i64,rstd:i64,dx:i64,dw_part:i64,db_part:i64,"
    "m:i64,n:i64,rms:bool,need_dw:bool,need_db:bool,row_lo:i64,row_hi:i64";

// (the *_parallel entries run one span of a call's rows: see run_spans)
enum Entry {
    FORWARD_SERIAL,
    FORWARD_PARALLEL,
    BACKWARD_SERIAL,
    BACKWARD_PARALLEL,
    COLUMN_SUMS,
    DROPOUT_ADD,
    SUM3,
    DROPOUT_ADD_BACKWARD,
    MEMORY_EFFICIENT_BACKWARD,
    ENTRIES
};
const char* const ENTRY_NAMES[] = {"forward_serial",    "forward_parallel", "backward_serial",
                                   "backward_parallel", "column_sums",      "dropout_add",
                                   "sum3",              "dropout_add_backward",
                                   "memory_efficient_backward"};
using ColumnSums = void (*)(int64_t partial, int64_t blocks, int64_t n, int64_t out);
constexpr int DTYPES = 4;  // the kernels' input dtypes, in compiled.DTYPES' order

// What Python hands over at set_up (compiled._use): the rules live there, not here.
struct State {
    PyObject* tensor_type = nullptr;     // torch.Tensor
    PyObject* parameter_type = nullptr;  // torch.nn.Parameter
    PyObject* resolve = nullptr;  // (dtype index, entry name) -> C address, or None
    PyObject* python_forward = nullptr;   // _op._forward_impl: the op's Python kernel
    PyObject* python_backward = nullptr;  // _op._backward_impl
    PyObject* fix_forward = nullptr;   // compiled._fix_forward_rows: the exact fallback
    PyObject* fix_backward = nullptr;  // compiled._fix_backward_rows
    PyObject* composite_backward = nullptr;  // _op.composite_backward
    PyObject* kernel_rows = nullptr;         // _op.kernel_rows
    PyObject* backend_named = nullptr;  // whether LAYERNORM_BACKEND names a backend now
    PyObject* lend = nullptr;       // _threads.lend: helpers and spans for a threaded call
    PyObject* give_back = nullptr;  // _threads.give_back
    int64_t grain = 0;              // _threads.GRAIN: no helper for less work than this
    int64_t row_block = 0;          // _numba_kernels.ROW_BLOCK: spans split rows there
    int64_t max_bytes = 0;     // numba_.STREAM_BYTES: larger inputs go through Python
    int64_t seed_draw_high = 0;  // _philox.SEED_DRAW_HIGH: a seed drawn is below it
    PyObject* dropout_constants = nullptr;  // compiled._dropout_constants: p -> (s, p32)
    PyObject* dropout_gradients = nullptr;  // compiled._dropout_gradients: Python's backward
    PyObject* norm_of_h = nullptr;  // compiled._norm_of_h: fused_norm's norm with options
    double layer_norm_eps = 0;              // _op.LAYER_NORM_EPS: fused_norm's eps=None
    PyObject* memory_efficient_gradients = nullptr;  // recompute.gradients: torch's ops
    PyObject* norm_linear_gradients = nullptr;       // recompute.norm_linear_gradients
    int64_t recompute_block = 0;  // _numba_recompute.BLOCK: rows per partial-sum block
    int64_t kernels[DTYPES][ENTRIES] = {};  // C addresses: 0 not asked yet, -1 none
    // the forward entries (serial, parallel) whose y has another dtype, by x's and y's
    int64_t pair_kernels[DTYPES][DTYPES][2] = {};
    // the dropout-add's entries (dropout_add, sum3, dropout_add_backward) whose stream (the
    // residual, h, dh) has another dtype than the terms, by the terms' and the stream's
    int64_t stream_kernels[DTYPES][DTYPES][3] = {};
    double default_eps[DTYPES] = {};        // eps=None per dtype: _op.default_eps's values
    at::ScalarType dtypes[DTYPES] = {};      // compiled.DTYPES
    at::ScalarType acc_dtypes[DTYPES] = {};  // their accumulation dtypes (torch_'s rule)
    // narrower[x][y]: y is an out_dtype narrower than x (options._NARROWER), by index
    bool narrower[DTYPES][DTYPES] = {};
};
State state;

int dtype_index(at::ScalarType t) {
    for (int d = 0; d < DTYPES; ++d)
        if (state.dtypes[d] == t) return d;
    return -1;
}

at::ScalarType acc_dtype(int d) { return state.acc_dtypes[d]; }

int64_t address(const Tensor& t) { return reinterpret_cast<int64_t>(t.data_ptr()); }

// An uninitialized contiguous CPU tensor: at::empty's CPU kernel, called without the
// dispatcher (a fifth of a small call's allocations' cost). For the kernels' own outputs
// and buffers only, made inside a CPU kernel or for a call no mechanism sees.
Tensor empty(at::IntArrayRef sizes, at::ScalarType dtype) {
    return at::detail::empty_cpu(sizes, dtype);
}

// Calls a Python function with the GIL (kernels may run without it: the autograd engine
// releases it) and returns its result as an R, or throws its exception.
template <typename R = void, typename... Args>
R call_python(PyObject* function, Args&&... args) {
    pybind11::gil_scoped_acquire gil;
    pybind11::object result = pybind11::handle(function)(std::forward<Args>(args)...);
    if constexpr (!std::is_void_v<R>) return result.template cast<R>();
}

// The kernel's C address, asked of Python the first time.
int64_t kernel(int d, Entry e) {
    int64_t& a = state.kernels[d][e];
    if (a == 0) {
        a = call_python<std::optional<int64_t>>(state.resolve, d, ENTRY_NAMES[e]).value_or(-1);
    }
    return a;
}

// The forward entry e (FORWARD_SERIAL or FORWARD_PARALLEL) for x of DTYPES[d] and y of
// DTYPES[yd] (yd < 0: x's own dtype), as kernel() resolves the others.
int64_t forward_kernel(int d, int yd, Entry e) {
    if (yd < 0 || yd == d) return kernel(d, e);
    int64_t& a = state.pair_kernels[d][yd][e == FORWARD_PARALLEL];
    if (a == 0) {
        a = call_python<std::optional<int64_t>>(state.resolve, d, ENTRY_NAMES[e], yd)
                .value_or(-1);
    }
    return a;
}

// The dropout-add entry e (DROPOUT_ADD, SUM3 or DROPOUT_ADD_BACKWARD) for terms of
// DTYPES[d] and a stream of DTYPES[hd] (hd == d: one dtype), as kernel() resolves the others.
int64_t dropout_kernel(int d, int hd, Entry e) {
    if (hd == d) return kernel(d, e);
    int64_t& a = state.stream_kernels[d][hd][e - DROPOUT_ADD];
    if (a == 0) {
        a = call_python<std::optional<int64_t>>(state.resolve, d, ENTRY_NAMES[e], hd)
                .value_or(-1);
    }
    return a;
}

void forget_kernels() {
    std::fill(&state.kernels[0][0], &state.kernels[0][0] + DTYPES * ENTRIES, 0);
    std::fill(&state.pair_kernels[0][0][0], &state.pair_kernels[0][0][0] + DTYPES * DTYPES * 2,
              0);
    std::fill(&state.stream_kernels[0][0][0],
              &state.stream_kernels[0][0][0] + DTYPES * DTYPES * 3, 0);
}

// Whether LAYERNORM_BACKEND names a backend now (Python's rule, asked per call as
// Python's pick reads it per call; C++ only reads the variable's presence to skip asking).
bool environment_chooses() {
    const char* name = std::getenv("LAYERNORM_BACKEND");
    if (name == nullptr) return false;
    return call_python<bool>(state.backend_named);
}

// The cached (N,) tensor full of value that Python's numba_._constant gives (ones for a
// missing weight, -0.0 for a missing bias or residual gradient), kept here once asked.
PyObject* constant_python = nullptr;
Tensor constant(int64_t n, at::ScalarType dtype, double value) {
    static std::mutex mutex;
    static std::map<std::tuple<int64_t, int, bool, double>, Tensor> cache;
    const auto key = std::make_tuple(n, static_cast<int>(dtype), std::signbit(value), value);
    {
        std::lock_guard<std::mutex> lock(mutex);
        auto found = cache.find(key);
        if (found != cache.end()) return found->second;
    }
    // (asked without the lock: a thread holding the GIL may be waiting for it)
    Tensor t = call_python<Tensor>(constant_python, n, dtype_index(dtype), value);
    std::lock_guard<std::mutex> lock(mutex);
    if (cache.size() > 64) cache.clear();
    return cache[key] = t;
}

template <typename From, typename To>
void convert(const Tensor& from, const Tensor& to) {
    const From* source = from.const_data_ptr<From>();
    To* target = to.mutable_data_ptr<To>();
    for (int64_t i = 0, n = from.numel(); i < n; ++i)
        target[i] = static_cast<To>(static_cast<float>(source[i]));
}

template <typename From>
bool convert_to(const Tensor& from, const Tensor& to) {
    switch (to.scalar_type()) {
        case at::kHalf: convert<From, at::Half>(from, to); return true;
        case at::kBFloat16: convert<From, at::BFloat16>(from, to); return true;
        case at::kFloat: convert<From, float>(from, to); return true;
        case at::kDouble: convert<From, double>(from, to); return true;
        default: return false;
    }
}

// t in dtype, as t.to(dtype) gives it, never recorded by autograd: for the 16- and
// 32-bit float sources, c10's conversions (those .to runs on CPU: exact widening,
// round-to-nearest-even narrowing) in a plain loop, without the dispatcher's cost.
Tensor converted(const Tensor& t, at::ScalarType dtype) {
    if (t.scalar_type() == dtype) return t;
    if (t.is_cpu() && t.is_contiguous()) {
        Tensor out = empty(t.sizes(), dtype);
        bool done = false;
        switch (t.scalar_type()) {
            case at::kHalf: done = convert_to<at::Half>(t, out); break;
            case at::kBFloat16: done = convert_to<at::BFloat16>(t, out); break;
            case at::kFloat: done = convert_to<float>(t, out); break;
            default: break;
        }
        if (done) return out;
    }
    at::AutoDispatchBelowADInplaceOrView guard;
    return t.to(dtype);
}

// A gradient in its leaf's dtype (recorded by autograd when a graph is being built).
Tensor as_dtype(const Tensor& t, at::ScalarType dtype) {
    if (t.scalar_type() == dtype) return t;
    return torch::GradMode::is_enabled() && t.requires_grad() ? t.to(dtype) : converted(t, dtype);
}

// A parameter as the kernels take it: in `dtype` (the accumulation dtype, or x's where
// params_x_dtype says so), or the default row.
Tensor kernel_param(const Tensor& p, int64_t n, at::ScalarType dtype, double missing) {
    if (!p.defined()) return constant(n, dtype, missing);
    return p.scalar_type() == dtype ? p : converted(p, dtype).contiguous();
}

// Whether the kernels read the parameters in x's dtype (params_x_dtype of
// layernorm.backends._kernel_abi; numba_._in_x_dtype's rule): x is 16-bit, one is given
// and every given one holds x's dtype. The kernels then widen them once per call.
bool params_in_x_dtype(at::ScalarType x, at::ScalarType acc, const Tensor& w, const Tensor& b) {
    if (x == acc || !(w.defined() || b.defined())) return false;
    return (!w.defined() || w.scalar_type() == x) && (!b.defined() || b.scalar_type() == x);
}

Tensor value(const OptionalTensor& t) { return t.has_value() ? *t : Tensor(); }
OptionalTensor as_optional(const Tensor& t) {
    return t.defined() ? OptionalTensor(t) : OptionalTensor();
}
bool requires_grad(const Tensor& t) { return t.defined() && t.requires_grad(); }

// A plain contiguous (N,) floating parameter, or absent.
bool kernel_ready_param(const Tensor& p, int64_t n) {
    return !p.defined() || (p.dim() == 1 && p.size(0) == n && p.is_contiguous() &&
                            p.is_floating_point() && p.is_cpu());
}

// Whether t is a kernel argument of m rows of n (contiguous, or 2-D with contiguous rows).
bool kernel_rows_of(const Tensor& t, int64_t m, int64_t n) {
    if (t.is_contiguous()) return t.numel() == m * n && t.size(-1) == n;
    return t.dim() == 2 && t.size(0) == m && t.size(1) == n && t.stride(1) == 1;
}

int64_t row_stride(const Tensor& t, int64_t n) { return t.is_contiguous() ? n : t.stride(0); }

// The numba entry for x when the forward or backward kernel below runs the call (the
// automatic backend is numba, x is non-empty kernel rows, and small enough that Python's
// cost would count), else -1 (the Python kernel runs it).
int64_t entry_for(const Tensor& x, c10::string_view backend, Entry serial, int yd = -1) {
    const int d = dtype_index(x.scalar_type());
    const int64_t numel = x.numel();
    if (!backend.empty() || d < 0 || numel == 0 || x.dim() == 0 ||
        !kernel_rows_of(x, numel / x.size(-1), x.size(-1)) ||
        numel * static_cast<int64_t>(x.element_size()) >= state.max_bytes ||
        environment_chooses())
        return -1;
    return serial == FORWARD_SERIAL ? forward_kernel(d, yd, serial) : kernel(d, serial);
}

// ---------------------------------------------------------------------------------------
// Threaded calls. A call's rows split into spans of whole ROW_BLOCKs give the same bits
// for any split (rows are independent; the backward's dweight/dbias partial sums belong
// to fixed blocks of rows, added in a fixed order afterwards: layernorm.backends._threads).
// The spans run on the calling thread and on as many more threads as _threads.lend
// grants: it counts them with the Python pool's, so the process's kernel threads never
// outnumber its CPUs, and it follows torch.get_num_threads() at call time.
//
// Those threads are torch's own OpenMP workers (torch_parallel_region), the team torch's
// kernels run on: between torch's operations they spin, awake, so a call among torch's
// finds them ready instead of sharing a core with one (threads of our own lost up to half
// their speed so: benchmarks/RESULTS.md, "Threads: torch's own OpenMP workers").
// libgomp's pool does not survive a fork (torch's own kernels hang in a child forked after
// they ran), so a child forked after the library loaded, or a torch without OpenMP, runs
// its spans on C++ helper threads of our own (no Python, no OpenMP), started on first
// need; after a task a helper spins for SPIN before it sleeps (a wake-up from sleep costs
// a few microseconds; calls that follow each other closely, as a layer's forward and
// backward can, find it awake), short so that it takes little CPU from other work. A
// forked child starts without helpers (after_fork_in_child).

constexpr auto SPIN = std::chrono::microseconds(20);

inline void relax() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#else
    std::this_thread::yield();
#endif
}

class Helpers {
  public:
    // Starts helper threads until there are `count` (they live as long as the process).
    void ensure(int64_t count) {
        std::lock_guard<std::mutex> lock(mutex_);
        for (; started_ < count; ++started_) std::thread([this] { serve(); }).detach();
    }

    void post(std::function<void()> task) {
        {
            std::lock_guard<std::mutex> lock(mutex_);
            tasks_.push_back(std::move(task));
            pending_.fetch_add(1, std::memory_order_release);
        }
        wake_.notify_one();
    }

  private:
    bool take(std::function<void()>* task) {
        if (pending_.load(std::memory_order_acquire) == 0) return false;
        std::lock_guard<std::mutex> lock(mutex_);
        return pop(task);
    }

    bool pop(std::function<void()>* task) {  // (mutex_ held)
        if (tasks_.empty()) return false;
        *task = std::move(tasks_.front());
        tasks_.pop_front();
        pending_.fetch_sub(1, std::memory_order_relaxed);
        return true;
    }

    void serve() {
        for (;;) {
            std::function<void()> task;
            const auto until = std::chrono::steady_clock::now() + SPIN;
            while (!take(&task)) {
                if (std::chrono::steady_clock::now() < until) {
                    relax();
                    continue;
                }
                std::unique_lock<std::mutex> lock(mutex_);
                wake_.wait(lock, [this] { return !tasks_.empty(); });
                pop(&task);
                break;
            }
            task();
        }
    }

    std::mutex mutex_;
    std::condition_variable wake_;
    std::deque<std::function<void()>> tasks_;
    std::atomic<int64_t> pending_{0};
    int64_t started_ = 0;
};

// Never destroyed (detached helpers may wait on it at exit); replaced in a forked child,
// where the parent's helpers do not exist (and its lock may have been held).
Helpers* helpers = new Helpers();

// Whether this process was forked after the library was loaded (see run_spans).
bool forked = false;

void after_fork_in_child() {
    helpers = new Helpers();
    forked = true;
}

using Ranges = std::vector<std::pair<int64_t, int64_t>>;

// One threaded call: span(start, stop) for each range, each run once, by whoever takes it.
struct Job {
    std::function<void(int64_t, int64_t)> span;
    Ranges ranges;
    std::atomic<size_t> next{0}, done{0};

    void work() {
        for (size_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < ranges.size();) {
            span(ranges[i].first, ranges[i].second);
            done.fetch_add(1, std::memory_order_release);
        }
    }
};

// The spans (ranges of blocks, in order, covering [0, blocks) once) of a call of `blocks`
// blocks of `block_numel` elements, and how many helpers run them with the calling
// thread, as _threads.lend grants them; no ranges when it grants none (the caller then
// runs its serial entry, and owes nothing back).
Ranges span_ranges(int64_t blocks, int64_t block_numel, int64_t* lent) {
    *lent = 0;
    // (a cheap test before asking Python: _threads.lend grants no helper to a call of
    // one thread, one block or less than two grains of work)
    if (at::get_num_threads() < 2 || blocks < 2 || blocks * block_numel < 2 * state.grain)
        return {};
    Ranges ranges;
    std::tie(*lent, ranges) =
        call_python<std::tuple<int64_t, Ranges>>(state.lend, blocks, block_numel);
    return ranges;
}

// Runs the job's spans on the calling thread and `lent` C++ helpers; returns when every
// span has returned.
void run_on_helpers(const std::shared_ptr<Job>& job, int64_t lent) {
    Helpers* pool = helpers;
    pool->ensure(lent);
    for (int64_t k = 0; k < lent; ++k) pool->post([job] { job->work(); });
    job->work();
    // (a helper that wakes late finds no span left and touches nothing of this call;
    // a helper descheduled mid-span gets the CPU back after SPIN)
    const auto until = std::chrono::steady_clock::now() + SPIN;
    while (job->done.load(std::memory_order_acquire) < job->ranges.size()) {
        if (std::chrono::steady_clock::now() < until)
            relax();
        else
            std::this_thread::yield();
    }
}

// The entry of torch's OpenMP runtime that starts a parallel region: libgomp's
// GOMP_parallel(fn, data, threads, flags), what GCC compiles `#pragma omp parallel` to
// (Intel's and LLVM's runtimes export it too), found among libtorch_cpu's own
// dependencies, so it is the runtime torch's kernels run on and never a second one;
// null where torch has none. (Called, not compiled in: the build needs no OpenMP flags.)
using ParallelRegion = void (*)(void (*)(void*), void*, unsigned, unsigned);

ParallelRegion torch_parallel_region() {
    static const ParallelRegion region = [] {
        Dl_info torch_cpu{};
        if (dladdr(reinterpret_cast<void*>(&at::get_num_threads), &torch_cpu) == 0)
            return ParallelRegion{};
        void* library = dlopen(torch_cpu.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
        if (library == nullptr) return ParallelRegion{};
        return reinterpret_cast<ParallelRegion>(dlsym(library, "GOMP_parallel"));
    }();
    return region;
}

// Runs the job's spans on a team of the calling thread and `lent` of torch's OpenMP
// workers, unless that pool is not there to use (see "Threaded calls"); returns whether
// it ran them. (Inside another OpenMP region the team is the calling thread alone.)
bool run_on_torch_pool(Job& job, int64_t lent) {
    const ParallelRegion region = torch_parallel_region();
    if (forked || region == nullptr) return false;
    region([](void* data) { static_cast<Job*>(data)->work(); }, &job,
           static_cast<unsigned>(lent + 1), 0);
    return true;
}

// Runs span over the ranges on the calling thread and `lent` more threads, without the
// GIL, returns when every span has returned, and gives the threads back.
void run_spans(const Ranges& ranges, int64_t lent, std::function<void(int64_t, int64_t)> span) {
    auto job = std::make_shared<Job>();
    job->ranges = ranges;
    job->span = std::move(span);
    {
        std::optional<pybind11::gil_scoped_release> unlocked;
        if (PyGILState_Check()) unlocked.emplace();
        if (!run_on_torch_pool(*job, lent)) run_on_helpers(job, lent);
    }
    call_python(state.give_back, lent);
}

// Room for m + 1 fallback flags (the kernels' flags argument), reused by the thread's
// calls; a tensor over it only when a row is flagged.
uint8_t* flag_buffer(int64_t m) {
    thread_local std::vector<uint8_t> buffer;
    if (buffer.size() < static_cast<size_t>(m + 1)) buffer.resize(m + 1);
    return buffer.data();
}

Tensor flag_tensor(uint8_t* flags, int64_t m) {
    return at::from_blob(flags, {m + 1}, at::TensorOptions().dtype(at::kByte));
}

struct Forward {
    Tensor y, residual_out, mean, rstd;
};

// The caller's m + 1 flags (as one kernel call over the m rows would write them) from
// the spans' stretches of scratch: the span from block `start`, from row i, wrote its
// `count` flags and its any-flag at scratch[i + start ...] (disjoint stretches).
void gather_flags(const Ranges& ranges, const std::vector<uint8_t>& scratch, int64_t rows,
                  int64_t m, uint8_t* flags) {
    flags[m] = 0;
    for (const auto& [start, stop] : ranges) {
        const int64_t i = start * rows, count = std::min(m, stop * rows) - i;
        std::copy_n(scratch.data() + i + start, count, flags + i);
        flags[m] |= scratch[i + start + count];
    }
}

// The forward kernel on kernel-ready tensors; statistics only when store_stats. Over the
// threads (the forward_parallel entry, one span of rows a call) when _threads lends
// helpers, else in the calling thread (serial_address): the same bits.
// `y_into`, `residual_out_into`: where y and residual_out go when defined (contiguous, x's
// shape, y's and x's dtype, sharing no memory with an argument or each other), else fresh
// tensors. `yd`: y's dtype index when it is another than x's (narrower, or float32 from a
// 16-bit x: the entries of their pair, which serial_address is one of), else -1.
Forward run_forward(const Tensor& x, const Tensor& residual, const Tensor& weight,
                    const Tensor& bias, double eps, bool rms, bool store_stats,
                    int64_t serial_address, const Tensor& y_into = Tensor(),
                    const Tensor& residual_out_into = Tensor(), int yd = -1) {
    const int d = dtype_index(x.scalar_type());
    const int64_t n = x.size(-1), m = x.numel() / n;
    const auto acc = acc_dtype(d);
    const auto y_dtype = yd < 0 ? x.scalar_type() : state.dtypes[yd];
    Forward out;
    out.y = y_into.defined() ? y_into : empty(x.sizes(), y_dtype);
    const bool params_x_dtype = params_in_x_dtype(x.scalar_type(), acc, weight, bias);
    const auto param_dtype = params_x_dtype ? x.scalar_type() : acc;
    const Tensor w = kernel_param(weight, n, param_dtype, 1.0);
    const Tensor b = kernel_param(bias, n, param_dtype, -0.0);
    const bool has_residual = residual.defined();
    if (has_residual)
        out.residual_out = residual_out_into.defined() ? residual_out_into
                                                       : empty(x.sizes(), x.scalar_type());
    const int64_t x_address = address(x);
    int64_t mean_address = x_address, rstd_address = x_address;  // unused: any valid one
    if (store_stats) {
        out.rstd = empty({m}, acc);
        rstd_address = address(out.rstd);
        if (!rms) {
            out.mean = empty({m}, acc);
            mean_address = address(out.mean);
        }
    }
    // bytes from one row to the next of each argument (0: not read)
    const int64_t size = x.element_size(), acc_size = c10::elementSize(acc);
    const int64_t y_size = c10::elementSize(y_dtype);
    const int64_t x_stride = row_stride(x, n);
    const int64_t residual_stride = has_residual ? row_stride(residual, n) : 0;
    const int64_t mean_step = store_stats && !rms ? acc_size : 0;
    const int64_t rstd_step = store_stats ? acc_size : 0;
    const int64_t residual_address = has_residual ? address(residual) : x_address;
    const int64_t residual_out_address = has_residual ? address(out.residual_out) : x_address;
    const int64_t residual_out_step = has_residual ? n * size : 0;
    const int64_t w_address = address(w), b_address = address(b), y_address = address(out.y);
    // rows [i, i + count) by `kernel`, their flags at flags_address
    auto rows = [&](int64_t kernel_address, int64_t i, int64_t count, int64_t flags_address) {
        reinterpret_cast<ForwardKernel>(kernel_address)(
            x_address + i * x_stride * size, x_stride,
            residual_address + i * residual_stride * size, residual_stride, has_residual,
            residual_out_address + i * residual_out_step, w_address, b_address,
            params_x_dtype, y_address + i * n * y_size, mean_address + i * mean_step,
            rstd_address + i * rstd_step, count, n, eps, rms,
            false /* stream: inputs of max_bytes or more are Python's */, store_stats,
            flags_address);
    };
    uint8_t* flags = flag_buffer(m);
    const int64_t block = state.row_block, blocks = (m + block - 1) / block;
    int64_t lent = 0;
    const Ranges ranges = span_ranges(blocks, block * n, &lent);
    if (ranges.empty()) {
        rows(serial_address, 0, m, reinterpret_cast<int64_t>(flags));
    } else {
        const int64_t span_address = forward_kernel(d, yd, FORWARD_PARALLEL);
        std::vector<uint8_t> scratch(blocks * (block + 1));
        const int64_t scratch_address = reinterpret_cast<int64_t>(scratch.data());
        run_spans(ranges, lent, [&](int64_t start, int64_t stop) {
            const int64_t i = start * block;
            rows(span_address, i, std::min(m, stop * block) - i, scratch_address + i + start);
        });
        gather_flags(ranges, scratch, block, m, flags);
    }
    if (flags[m] != 0)  // rare: rewrite the flagged rows exactly
        call_python(state.fix_forward, out.y, has_residual ? out.residual_out : x, w, b, eps,
                    rms, flag_tensor(flags, m));
    return out;
}

// layernorm::forward on CPU; without a residual, residual_out is the schema's empty
// tensor, or undefined where `schema_outputs` is false (record_forward's direct call,
// which never reads it).
// yd: y's dtype index when another than x's (the front door's forward_to calls, which
// it makes only where the kernel runs them), else -1.
Outputs forward_cpu_outputs(const Tensor& x, const OptionalTensor& residual,
                            const OptionalTensor& weight, const OptionalTensor& bias, double eps,
                            bool rms, c10::string_view backend, bool schema_outputs,
                            int yd = -1) {
    const Tensor r = value(residual), w = value(weight), b = value(bias);
    const int64_t n = x.dim() > 0 ? x.size(-1) : 0;
    int64_t kernel_address = -1;
    if ((!r.defined() || (r.sizes() == x.sizes() && r.scalar_type() == x.scalar_type() &&
                          kernel_rows_of(r, n > 0 ? r.numel() / n : 0, n))) &&
        kernel_ready_param(w, n) && kernel_ready_param(b, n))
        kernel_address = entry_for(x, backend, FORWARD_SERIAL, yd);
    if (kernel_address < 0) {
        TORCH_CHECK(yd < 0, "layernorm: forward_to's C++ call without its kernel");
        return call_python<Outputs>(state.python_forward, x, residual, weight, bias, eps, rms,
                                    std::string(backend));
    }
    Forward out = run_forward(x, r, w, b, eps, rms, true, kernel_address, Tensor(), Tensor(), yd);
    // the schema has no optional outputs: an absent one is empty
    if (!r.defined() && schema_outputs) out.residual_out = empty({0}, x.scalar_type());
    return {out.y, out.residual_out, rms ? empty({0}, out.rstd.scalar_type()) : out.mean,
            out.rstd};
}

// layernorm::forward on CPU.
Outputs forward_cpu(const Tensor& x, const OptionalTensor& residual, const OptionalTensor& weight,
                    const OptionalTensor& bias, double eps, bool rms, c10::string_view backend) {
    return forward_cpu_outputs(x, residual, weight, bias, eps, rms, backend, true);
}

// layernorm::backward on CPU.
Gradients backward_cpu(const Tensor& dy, const Tensor& x, const OptionalTensor& weight,
                       const Tensor& mean, const Tensor& rstd, const OptionalTensor& dresidual_out,
                       bool rms, bool need_dweight, bool need_dbias, c10::string_view backend,
                       double eps) {
    const Tensor w = value(weight), dres = value(dresidual_out);
    const int64_t n = x.dim() > 0 ? x.size(-1) : 0, m = n > 0 ? x.numel() / n : 0;
    const int d = dtype_index(x.scalar_type());
    int64_t kernel_address = -1;
    if (d >= 0 && kernel_ready_param(w, n) && dy.scalar_type() == x.scalar_type() &&
        kernel_rows_of(dy, m, n) &&
        (!dres.defined() || (dres.scalar_type() == x.scalar_type() && kernel_rows_of(dres, m, n))) &&
        rstd.is_contiguous() && rstd.numel() == m && rstd.scalar_type() == acc_dtype(d) &&
        (rms || (mean.is_contiguous() && mean.numel() == m && mean.scalar_type() == acc_dtype(d))))
        kernel_address = entry_for(x, backend, BACKWARD_SERIAL);
    if (kernel_address < 0)
        return call_python<Gradients>(state.python_backward, dy, x, weight, mean, rstd,
                                      dresidual_out, rms, need_dweight, need_dbias,
                                      std::string(backend), eps);
    const auto acc = acc_dtype(d);
    const bool params_x_dtype = params_in_x_dtype(x.scalar_type(), acc, w, Tensor());
    const Tensor wk = kernel_param(w, n, params_x_dtype ? x.scalar_type() : acc, 1.0);
    // no residual gradient: one row of -0.0 with a stride of 0 (v + -0.0 == v bitwise)
    const Tensor dres_k = dres.defined() ? dres : constant(n, x.scalar_type(), -0.0);
    const Tensor dx = empty(x.sizes(), x.scalar_type());
    const Tensor dweight = empty({need_dweight ? n : 0}, acc);
    const Tensor dbias = empty({need_dbias ? n : 0}, acc);
    // bytes from one row to the next of each argument (0: not read)
    const int64_t size = x.element_size(), acc_size = c10::elementSize(acc);
    const int64_t dy_stride = row_stride(dy, n), x_stride = row_stride(x, n);
    const int64_t dres_stride = dres.defined() ? row_stride(dres, n) : 0;
    const int64_t mean_step = rms ? 0 : acc_size;
    const int64_t dy_address = address(dy), x_address = address(x), dx_address = address(dx);
    const int64_t dres_address = address(dres_k), w_address = address(wk);
    const int64_t mean_address = address(rms ? rstd : mean), rstd_address = address(rstd);
    // rows [i, i + count) by `kernel`, dweight/dbias (or their partial sums) at the given
    // addresses, their flags at flags_address
    auto rows = [&](int64_t kernel_address, int64_t i, int64_t count, int64_t dweight_address,
                    int64_t dbias_address, int64_t flags_address) {
        reinterpret_cast<BackwardKernel>(kernel_address)(
            dy_address + i * dy_stride * size, dy_stride, x_address + i * x_stride * size,
            x_stride, dres_address + i * dres_stride * size, dres_stride, w_address,
            params_x_dtype, mean_address + i * mean_step, rstd_address + i * acc_size,
            dx_address + i * n * size, dweight_address, dbias_address, count, n, rms, false,
            eps, flags_address);
    };
    uint8_t* flags = flag_buffer(m);
    const int64_t block = state.row_block, blocks = (m + block - 1) / block;
    int64_t lent = 0;
    const Ranges ranges = span_ranges(blocks, block * n, &lent);
    if (ranges.empty()) {
        rows(kernel_address, 0, m, need_dweight ? address(dweight) : 0,
             need_dbias ? address(dbias) : 0, reinterpret_cast<int64_t>(flags));
    } else {
        // each span writes its blocks' float64 partial sums (both required), then their
        // column sums by halving, as the serial entry adds them: the same bits
        const int64_t span_address = kernel(d, BACKWARD_PARALLEL);
        const Tensor partial = empty({2, blocks, n}, at::kDouble);
        const int64_t dweight_partial = address(partial[0]), dbias_partial = address(partial[1]);
        std::vector<uint8_t> scratch(blocks * (block + 1));
        const int64_t scratch_address = reinterpret_cast<int64_t>(scratch.data());
        run_spans(ranges, lent, [&](int64_t start, int64_t stop) {
            const int64_t i = start * block;
            rows(span_address, i, std::min(m, stop * block) - i, dweight_partial + start * n * 8,
                 dbias_partial + start * n * 8, scratch_address + i + start);
        });
        gather_flags(ranges, scratch, block, m, flags);
        const auto sums = reinterpret_cast<ColumnSums>(kernel(d, COLUMN_SUMS));
        if (need_dweight) sums(dweight_partial, blocks, n, address(dweight));
        if (need_dbias) sums(dbias_partial, blocks, n, address(dbias));
    }
    if (flags[m] != 0)  // rare: rewrite the flagged rows exactly
        call_python(state.fix_backward, dx, dweight, dy, x, wk, mean, dresidual_out, eps, rms,
                    flag_tensor(flags, m));
    return {dx, dweight, dbias};
}

const c10::TypedOperatorHandle<Outputs(const Tensor&, const OptionalTensor&, const OptionalTensor&,
                                       const OptionalTensor&, double, bool, c10::string_view)>&
forward_op() {
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("layernorm::forward", "")
                               .typed<Outputs(const Tensor&, const OptionalTensor&,
                                              const OptionalTensor&, const OptionalTensor&,
                                              double, bool, c10::string_view)>();
    return op;
}

const c10::TypedOperatorHandle<Gradients(const Tensor&, const Tensor&, const OptionalTensor&,
                                         const Tensor&, const Tensor&, const OptionalTensor&,
                                         bool, bool, bool, c10::string_view, double)>&
backward_op() {
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("layernorm::backward", "")
                               .typed<Gradients(const Tensor&, const Tensor&,
                                                const OptionalTensor&, const Tensor&,
                                                const Tensor&, const OptionalTensor&, bool,
                                                bool, bool, c10::string_view, double)>();
    return op;
}


// Whether a PyTorch mechanism would see or change this call: a functorch transform, a
// dispatch or function mode (FakeTensorMode, TorchDispatchMode, torch.device), jit
// tracing, CPU autocast, or a tensor that is not a plain dense CPU one (functorch
// wrappers, subclasses' Python key, dual tensors' tangents: forward AD is Python's).
bool mechanism_active(std::initializer_list<const Tensor*> tensors) {
    static const c10::DispatchKeySet plain_tls(
        {c10::DispatchKey::BackendSelect, c10::DispatchKey::ADInplaceOrView});
    static const c10::DispatchKeySet plain_tensor(
        {c10::DispatchKey::CPU, c10::DispatchKey::ADInplaceOrView,
         c10::DispatchKey::AutogradCPU, c10::DispatchKey::AutocastCPU});
    // (a set difference keeps backend bits: compare functionalities)
    auto beyond = [](c10::DispatchKeySet keys, c10::DispatchKeySet plain) {
        return (keys - plain).highestFunctionalityKey() != c10::DispatchKey::Undefined;
    };
    if (beyond(c10::impl::tls_local_dispatch_key_set().included_, plain_tls) ||
        c10::impl::TorchDispatchModeTLS::stack_len() > 0 ||
        at::impl::PythonTorchFunctionTLS::stack_len() > 0 ||
        torch::jit::tracer::isTracing() || at::autocast::is_autocast_enabled(at::kCPU))
        return true;
    for (const Tensor* t : tensors) {
        if (!t->defined()) continue;
        if (beyond(t->key_set(), plain_tensor) || t->_fw_grad(0).defined()) return true;
    }
    return false;
}

// The autograd of layernorm::forward on CPU: Python's _op._setup_context and _op._backward
// (which the Python autograd of the op runs), with the same saved tensors and outputs,
// as a node of torch's own kind (a torch::autograd::Function costs a small call more).
// Its inputs are (x, residual, weight, bias), an absent one without an edge; its
// outputs y and, with a residual, residual_out (mean and rstd are not differentiable).
struct NormBackward : public torch::autograd::Node {
    torch::autograd::SavedVariable z, weight, mean, rstd;
    bool has_residual = false, rms = false;
    at::ScalarType weight_dtype = at::kFloat;
    std::optional<at::ScalarType> bias_dtype;
    double eps = 0;
    std::string backend;

    std::string name() const override { return "layernorm::NormBackward"; }

    void release_variables() override {
        z.reset_data();
        weight.reset_data();
        mean.reset_data();
        rstd.reset_data();
    }

    variable_list apply(variable_list&& grads) override {
        const Tensor zt = z.unpack(getptr()), w = weight.unpack(), m = mean.unpack(),
                     r = rstd.unpack();
        const bool need_x = task_should_compute_output(0);
        const bool need_residual = has_residual && task_should_compute_output(1);
        const bool need_dweight = w.defined() && task_should_compute_output(2);
        const bool need_dbias = bias_dtype.has_value() && task_should_compute_output(3);
        variable_list out(4);
        if (!(need_x || need_residual || need_dweight || need_dbias)) return out;
        // (symbolic sizes: torch.compile traces this backward with fake tensors)
        const c10::SymInt n = zt.sym_size(-1);
        auto rows = [&n](const Tensor& t) {
            if (!t.defined() || (t.is_contiguous() && t.sym_size(-1) == n)) return t;
            return call_python<Tensor>(state.kernel_rows, t, n);
        };
        // an unused output's gradient is undefined: zeros for y, nothing for residual_out
        Tensor dy = grads[0].defined() ? grads[0] : at::zeros_like(zt);
        // y in a narrower dtype (forward_to): widened exactly to z's, as _op._backward does
        if (dy.scalar_type() != zt.scalar_type()) dy = as_dtype(dy, zt.scalar_type());
        Tensor dres;
        if (has_residual && grads.size() > 1 && grads[1].defined()) dres = grads[1];
        dy = rows(dy);
        dres = rows(dres);
        const OptionalTensor dres_arg = dres.defined() ? OptionalTensor(dres) : std::nullopt;
        const OptionalTensor weight_arg = w.defined() ? OptionalTensor(w) : std::nullopt;
        Gradients g;
        if (torch::GradMode::is_enabled()) {  // a graph of the backward: differentiable ops
            g = call_python<Gradients>(state.composite_backward, dy, zt, weight_arg, eps, rms,
                                       dres_arg);
        } else {
            // (below autograd: nothing differentiates it; a batched gradient's keys remain)
            at::AutoDispatchBelowADInplaceOrView guard;
            if (at::hasCallbacks() || mechanism_active({&dy, &zt, &w, &m, &r, &dres}))
                g = backward_op().call(dy, zt, weight_arg, m, r, dres_arg, rms, need_dweight,
                                       need_dbias, backend, eps);
            else  // the CPU kernel the dispatcher would pick, without its lookups
                g = backward_cpu(dy, zt, weight_arg, m, r, dres_arg, rms, need_dweight,
                                 need_dbias, backend, eps);
        }
        auto& [dz, dweight, dbias] = g;
        if (need_x) out[0] = dz;
        // x and residual get the same gradient; never hand one tensor to two leaves
        if (need_residual) out[1] = need_x ? dz.clone() : dz;
        if (need_dweight) out[2] = as_dtype(dweight, weight_dtype);
        if (need_dbias) out[3] = as_dtype(dbias, *bias_dtype);
        return out;
    }
};

// The forward recorded by autograd (when an input requires grad), its kernel run below
// autograd by the dispatcher or, for the front door's call that no mechanism would see,
// called directly (the CPU kernel the dispatcher would pick, without the lookups). yd:
// y's dtype index when narrower than x's (layernorm::forward_to's values and autograd;
// the front door's calls only, never dispatched), else -1. (A wider y comes without a
// gradient only: options._rounds_into.)
Outputs record_forward(const Tensor& x, const OptionalTensor& residual,
                       const OptionalTensor& weight, const OptionalTensor& bias, double eps,
                       bool rms, c10::string_view backend, bool dispatch, int yd = -1) {
    using namespace torch::autograd;
    const bool grad = compute_requires_grad(x, residual, weight, bias);
    Outputs out;
    {
        at::AutoDispatchBelowADInplaceOrView guard;  // (the kernel is below autograd)
        out = dispatch ? forward_op().call(x, residual, weight, bias, eps, rms, backend)
                       : forward_cpu_outputs(x, residual, weight, bias, eps, rms, backend,
                                             false, yd);
    }
    if (!grad) return out;
    auto& [y, residual_out, mean, rstd] = out;
    const Tensor w = value(weight), b = value(bias);
    auto node = c10::make_intrusive<NormBackward>();
    node->set_next_edges(collect_next_edges(x, residual, weight, bias));
    node->has_residual = residual.has_value() && residual->defined();
    node->rms = rms;
    node->eps = eps;
    node->backend = std::string(backend);
    if (w.defined()) node->weight_dtype = w.scalar_type();
    if (b.defined()) node->bias_dtype = b.scalar_type();
    set_history(y, node);
    if (node->has_residual) set_history(residual_out, node);
    node->z = SavedVariable(node->has_residual ? residual_out : x, node->has_residual);
    if (w.defined()) node->weight = SavedVariable(w, false);
    node->mean = SavedVariable(mean, false);
    node->rstd = SavedVariable(rstd, false);
    return out;
}

// layernorm::forward's AutogradCPU kernel.
Outputs forward_autograd(const Tensor& x, const OptionalTensor& residual,
                         const OptionalTensor& weight, const OptionalTensor& bias, double eps,
                         bool rms, c10::string_view backend) {
    using torch::autograd::isFwGradDefined;
    // (inside an autograd.Function's forward, grad mode is off: its own jvp runs)
    TORCH_CHECK(!(torch::GradMode::is_enabled() &&
                  (isFwGradDefined(x) || isFwGradDefined(residual) ||
                   isFwGradDefined(weight) || isFwGradDefined(bias))),
                "layernorm::forward has no forward-mode derivative (a custom op cannot carry "
                "one): call layernorm's functions, which use their own (docs/contract.md §6)");
    return record_forward(x, residual, weight, bias, eps, rms, backend, true);
}

// The autograd of the front door's memory_efficient=True call, in the place of
// layernorm.recompute's MemoryEfficientNorm: it saves y (an output), the parameters and
// rstd, not x. Its inputs are (x, weight, bias), an absent one without an edge. The
// backward is the numba entry of backends._numba_recompute (the kernel that
// _numba_recompute.backward runs, over the same blocks of rows, their partials added by
// the column_sums entry as there: the same bits), or recompute.gradients' torch
// operations where a mechanism would see it or the entry was not built for it. Once
// differentiable, as MemoryEfficientNorm: a backward that builds a graph computes
// without one.
struct MemoryEfficientBackward : public torch::autograd::Node {
    torch::autograd::SavedVariable y, weight, bias, rstd;
    bool rms = false;
    int d = 0;  // x's dtype index
    at::ScalarType weight_dtype = at::kFloat, bias_dtype = at::kFloat;

    std::string name() const override { return "layernorm::MemoryEfficientBackward"; }

    void release_variables() override {
        y.reset_data();
        weight.reset_data();
        bias.reset_data();
        rstd.reset_data();
    }

    variable_list apply(variable_list&& grads) override {
        const Tensor yt = y.unpack(getptr()), w = weight.unpack(), b = bias.unpack(),
                     r = rstd.unpack();
        const bool need_x = task_should_compute_output(0);
        const bool need_dweight = w.defined() && task_should_compute_output(1);
        const bool need_dbias = b.defined() && task_should_compute_output(2);
        variable_list out(3);
        if (!(need_x || need_dweight || need_dbias)) return out;
        torch::NoGradGuard once_differentiable;
        const Tensor dy = grads[0].defined() ? grads[0] : at::zeros_like(yt);
        const int64_t n = yt.size(-1), m = yt.numel() / n;
        const int64_t entry = kernel(d, MEMORY_EFFICIENT_BACKWARD);
        const int64_t sums = kernel(d, COLUMN_SUMS);
        Tensor dx, dweight, dbias;
        const bool python = entry < 0 || sums < 0 || at::hasCallbacks() ||
                            !(dy.is_cpu() && dy.scalar_type() == yt.scalar_type() &&
                              dy.sizes() == yt.sizes()) ||
                            mechanism_active({&dy});
        if (python) {
            const auto [gx, gw, gb] =
                call_python<std::tuple<OptionalTensor, OptionalTensor, OptionalTensor>>(
                    state.memory_efficient_gradients, dy, yt, as_optional(w), as_optional(b), r,
                    n, rms, need_x, need_dweight, need_dbias);
            dx = value(gx);
            dweight = value(gw);
            dbias = value(gb);
        } else {
            const Tensor g = dy.contiguous();
            dx = empty(yt.sizes(), yt.scalar_type());
            const int64_t block = state.recompute_block, blocks = (m + block - 1) / block;
            // the partials of dweight and dbias, zeros (one double when not wanted)
            const int64_t stretch = need_dweight || need_dbias ? blocks * n : 1;
            const Tensor part = empty({2 * stretch}, at::kDouble);
            std::fill_n(part.data_ptr<double>(), 2 * stretch, 0.0);
            const int64_t dw_part = address(part), db_part = dw_part + stretch * 8;
            const Tensor gamma = w.defined() ? converted(w, at::kDouble)
                                             : constant(n, at::kDouble, 1.0);
            const Tensor beta = b.defined() ? converted(b, at::kDouble)
                                            : constant(n, at::kDouble, 0.0);
            auto rows = [&](int64_t start, int64_t stop) {  // blocks [start, stop)
                reinterpret_cast<MemoryEfficientBackwardKernel>(entry)(
                    address(g), n, address(yt), address(gamma), address(beta), address(r),
                    address(dx), dw_part, db_part, m, n, rms, need_dweight, need_dbias,
                    start * block, std::min(m, stop * block));
            };
            int64_t lent = 0;
            const Ranges ranges = span_ranges(blocks, block * n, &lent);
            if (ranges.empty())
                rows(0, blocks);
            else
                run_spans(ranges, lent, rows);
            for (auto [need, partial, sum] :
                 {std::make_tuple(need_dweight, dw_part, &dweight),
                  std::make_tuple(need_dbias, db_part, &dbias)}) {
                if (!need) continue;
                *sum = empty({n}, at::kFloat);
                reinterpret_cast<ColumnSums>(sums)(partial, blocks, n, address(*sum));
            }
        }
        // (the torch operations' sums may be a mechanism's tensors: converted by .to)
        auto in_dtype = [python](const Tensor& t, at::ScalarType dtype) {
            return python ? t.to(dtype) : as_dtype(t, dtype);
        };
        if (need_x) out[0] = dx;
        if (need_dweight) out[1] = in_dtype(dweight, weight_dtype);
        if (need_dbias) out[2] = in_dtype(dbias, bias_dtype);
        return out;
    }
};

// Whether a plain contiguous floating tensor (or an undefined one) holds no zero (NaN is
// not one): recompute.applies' test of gamma, without the dispatcher.
bool no_zero(const Tensor& t) {
    if (!t.defined()) return true;
    bool none = true;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, t.scalar_type(), "no_zero", [&] {
        const scalar_t* p = t.const_data_ptr<scalar_t>();
        for (int64_t i = 0, k = t.numel(); i < k; ++i) none &= static_cast<double>(p[i]) != 0.0;
    });
    return none;
}

// The front door's memory_efficient=True call with a gradient: the forward kernel (its
// statistics kept), recorded by a MemoryEfficientBackward node; an undefined y where the
// entries are not there to run it (the Python path then runs the call).
Tensor record_memory_efficient(const Tensor& x, const Tensor& weight, const Tensor& bias,
                               double eps, bool rms) {
    const int d = dtype_index(x.scalar_type());
    const int64_t forward_address = entry_for(x, "", FORWARD_SERIAL);
    if (forward_address < 0 || kernel(d, MEMORY_EFFICIENT_BACKWARD) < 0 ||
        kernel(d, COLUMN_SUMS) < 0)
        return Tensor();
    Forward forward;
    {
        at::AutoDispatchBelowADInplaceOrView guard;
        forward = run_forward(x, Tensor(), weight, bias, eps, rms, true, forward_address);
    }
    auto node = c10::make_intrusive<MemoryEfficientBackward>();
    node->set_next_edges(torch::autograd::collect_next_edges(x, weight, bias));
    node->rms = rms;
    node->d = d;
    if (weight.defined()) node->weight_dtype = weight.scalar_type();
    if (bias.defined()) node->bias_dtype = bias.scalar_type();
    torch::autograd::set_history(forward.y, node);
    node->y = torch::autograd::SavedVariable(forward.y, true);
    if (weight.defined()) node->weight = torch::autograd::SavedVariable(weight, false);
    if (bias.defined()) node->bias = torch::autograd::SavedVariable(bias, false);
    node->rstd = torch::autograd::SavedVariable(forward.rstd, false);
    return forward.y;
}

// n when normalized_shape is an int, or a tuple (torch.Size too) or list of one int
// (exactly an int: not a bool, a SymInt or a tracer's proxy).
int64_t last_dim(PyObject* shape) {
    if (PyTuple_Check(shape) && PyTuple_GET_SIZE(shape) == 1)
        shape = PyTuple_GET_ITEM(shape, 0);
    else if (PyList_Check(shape) && PyList_GET_SIZE(shape) == 1)
        shape = PyList_GET_ITEM(shape, 0);
    if (!PyLong_CheckExact(shape)) return 0;
    int overflow = 0;
    const long long n = PyLong_AsLongLongAndOverflow(shape, &overflow);
    return overflow != 0 ? 0 : n;
}

// The input every front door of the norm takes: x a plain contiguous CPU tensor of a
// kernel dtype (exactly torch.Tensor), normalized_shape its last dim (last_dim), eps a
// float or None (x's default), no backend named, and the extension set up.
struct Input {
    Tensor x;
    int64_t n = 0;
    int d = -1;  // x's dtype index
    double eps = 0;
};

bool plain_input(PyObject* x_object, PyObject* shape, PyObject* eps_object,
                 PyObject* backend, Input* in) {
    if (state.resolve == nullptr || backend != Py_None ||
        !(eps_object == Py_None || PyFloat_CheckExact(eps_object)) ||
        Py_TYPE(x_object) != reinterpret_cast<PyTypeObject*>(state.tensor_type))
        return false;
    in->n = last_dim(shape);
    if (in->n <= 0) return false;
    in->x = THPVariable_Unpack(x_object);
    const Tensor& x = in->x;
    if (!(x.is_cpu() && x.dim() > 0 && x.size(-1) == in->n && x.is_contiguous())) return false;
    in->d = dtype_index(x.scalar_type());
    if (in->d < 0) return false;
    in->eps = eps_object != Py_None ? PyFloat_AS_DOUBLE(eps_object) : state.default_eps[in->d];
    return in->eps >= 0;
}

// A plain contiguous (N,) floating CPU tensor (or Parameter), or None (undefined).
// Whether o is exactly a torch.Tensor or a torch.nn.Parameter (no subclass).
bool tensor_or_parameter(PyObject* o) {
    return Py_TYPE(o) == reinterpret_cast<PyTypeObject*>(state.tensor_type) ||
           Py_TYPE(o) == reinterpret_cast<PyTypeObject*>(state.parameter_type);
}

bool plain_param(PyObject* p, int64_t n, Tensor* out) {
    if (p == Py_None) return true;
    if (!tensor_or_parameter(p)) return false;
    const Tensor& t = THPVariable_Unpack(p);
    if (!(t.is_cpu() && t.dim() == 1 && t.size(0) == n && t.is_floating_point() &&
          t.is_contiguous()))
        return false;
    *out = t;
    return true;
}

// A plain contiguous CPU tensor of x's shape and of `dtype` (x's when not given), or
// None (undefined).
bool plain_like(PyObject* o, const Tensor& x, Tensor* out,
                std::optional<at::ScalarType> dtype = std::nullopt) {
    if (o == Py_None) return true;
    if (Py_TYPE(o) != reinterpret_cast<PyTypeObject*>(state.tensor_type)) return false;
    const Tensor& t = THPVariable_Unpack(o);
    if (!(t.is_cpu() && t.scalar_type() == dtype.value_or(x.scalar_type()) &&
          t.sizes() == x.sizes() && t.is_contiguous()))
        return false;
    *out = t;
    return true;
}

// A rowscale fused_norm takes for the rows of x (n its last dim): a plain CPU tensor
// (or Parameter) of a floating dtype and of shape (m,) or x's leading shape, or None
// (undefined).
bool plain_rowscale(PyObject* o, const Tensor& x, Tensor* out) {
    if (o == Py_None) return true;
    if (!tensor_or_parameter(o)) return false;
    const Tensor& t = THPVariable_Unpack(o);
    const int64_t m = x.numel() / x.size(-1);
    if (!(t.is_cpu() && t.is_floating_point() &&
          (t.sizes() == x.sizes().slice(0, x.dim() - 1) || (t.dim() == 1 && t.size(0) == m))))
        return false;
    *out = t;
    return true;
}

PyObject* wrap_or_none(const Tensor& t) {
    if (!t.defined()) Py_RETURN_NONE;
    return THPVariable_Wrap(t);
}

// Liger's casting orders the front door takes (layernorm.options.cast_rms_norm): none
// (this library's one rounding), "gemma", "llama".
enum Mode : long { ONE_ROUNDING = 0, GEMMA = 1, LLAMA = 2 };

// Whether v is a float32 value (so it converts to each float dtype of a gain exactly:
// options._is_single says the same in Python).
bool float32_value(double v) {
    return std::fabs(v) <= std::numeric_limits<float>::max() &&
           static_cast<double>(static_cast<float>(v)) == v;
}

// Whether every value of dtype t is a float32 value (options._SINGLE_VALUED).
bool single_valued(at::ScalarType t) {
    return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

// `weight` converted to `dtype` (exactly) plus `offset` (a float32 value): one IEEE
// addition in `dtype`, the exact sum rounded once (options.offset_gain, options._gain).
Tensor gain_of(const Tensor& weight, at::ScalarType dtype, double offset) {
    Tensor g = weight.scalar_type() == dtype ? weight : weight.to(dtype);
    return offset != 0 ? g + offset : g;
}

// A preallocated output the kernels may write (options.write_into's rule): a plain
// contiguous CPU tensor of x's shape and of `dtype` that does not require grad, not an
// inference tensor outside inference mode, sharing no memory with `others`; None is
// undefined. False for any other (options.norm then checks, resizes or copies).
bool writable_out(PyObject* o, const Tensor& x, at::ScalarType dtype,
                  std::initializer_list<const Tensor*> others, Tensor* out) {
    if (o == Py_None) return true;
    if (Py_TYPE(o) != reinterpret_cast<PyTypeObject*>(state.tensor_type)) return false;
    const Tensor& t = THPVariable_Unpack(o);
    if (!(t.is_cpu() && t.scalar_type() == dtype && t.sizes() == x.sizes() &&
          t.is_contiguous() && !t.requires_grad()) ||
        (t.is_inference() && !c10::InferenceMode::is_enabled()))
        return false;
    for (const Tensor* a : others)
        if (a->defined() && at::get_overlap_status(t, *a) != at::MemOverlapStatus::No)
            return false;
    *out = t;
    return true;
}

PyObject* norm(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
    HANDLE_TH_ERRORS
    if (nargs != 8 && nargs != 14) {
        PyErr_SetString(PyExc_TypeError, "norm takes 8 or 14 arguments");
        return nullptr;
    }
    double offset = 0;
    long mode = ONE_ROUNDING;
    if (nargs == 14) {  // the options' front door: a float32 value and a known mode
        if (!PyFloat_CheckExact(args[8]) || !PyLong_CheckExact(args[9])) Py_RETURN_NONE;
        offset = PyFloat_AS_DOUBLE(args[8]);
        mode = PyLong_AsLong(args[9]);
        if (!float32_value(offset) || mode < ONE_ROUNDING || mode > LLAMA ||
            (mode != ONE_ROUNDING && args[6] != Py_True))
            Py_RETURN_NONE;
    }
    PyObject* out_object = nargs == 14 ? args[10] : Py_None;
    PyObject* residual_out_object = nargs == 14 ? args[11] : Py_None;
    // y's dtype when another than x's (narrower, or float32 from a 16-bit x without a
    // gradient: options._front_door says so), else None
    PyObject* y_dtype_object = nargs == 14 ? args[12] : Py_None;
    // memory_efficient=True, alone (options._front_door says so)
    const bool memory_efficient = nargs == 14 && args[13] == Py_True;
    if (y_dtype_object != Py_None && (!THPDtype_Check(y_dtype_object) || mode != ONE_ROUNDING))
        Py_RETURN_NONE;
    Input in;
    if (!plain_input(args[0], args[2], args[5], args[7], &in)) Py_RETURN_NONE;
    const Tensor& x = in.x;
    const int64_t n = in.n;
    const int d = in.d;
    const double eps = in.eps;
    const int yd = y_dtype_object == Py_None
                       ? -1
                       : dtype_index(reinterpret_cast<THPDtype*>(y_dtype_object)->scalar_type);
    if (y_dtype_object != Py_None && (yd < 0 || yd == d)) Py_RETURN_NONE;
    const auto y_dtype = yd < 0 ? x.scalar_type() : state.dtypes[yd];
    Tensor residual, weight, bias;
    if (!plain_like(args[1], x, &residual) || !plain_param(args[3], n, &weight) ||
        !plain_param(args[4], n, &bias))
        Py_RETURN_NONE;
    Tensor out, residual_out_given;  // preallocated outputs
    // whether autograd records a call on the arguments (as they are when it is asked)
    auto grad_asked = [&]() {
        return torch::GradMode::is_enabled() &&
               (x.requires_grad() || requires_grad(residual) || requires_grad(weight) ||
                requires_grad(bias));
    };
    if (out_object != Py_None || residual_out_object != Py_None) {
        if (mode == LLAMA || (residual_out_object != Py_None && !residual.defined()) ||
            grad_asked() ||  // options.norm raises
            !writable_out(out_object, x, y_dtype, {&x, &residual, &weight, &bias}, &out) ||
            !writable_out(residual_out_object, x, x.scalar_type(),
                          {&x, &residual, &weight, &bias, &out}, &residual_out_given))
            Py_RETURN_NONE;
    }
    // forward_to with a gradient: recorded here where the kernel of the pair runs it and no
    // profiler would look for the op
    if (yd >= 0 && grad_asked() &&
        (at::hasCallbacks() || entry_for(x, "", FORWARD_SERIAL, yd) < 0))
        Py_RETURN_NONE;
    if (mechanism_active({&x, &residual, &weight, &bias, &out, &residual_out_given}))
        Py_RETURN_NONE;
    const bool rms = args[6] == Py_True;
    Tensor gain;  // the llama product's
    if (offset != 0 && !weight.defined()) Py_RETURN_NONE;  // options.norm raises
    if (mode == LLAMA) {  // the kernel's u = RN_x(h * rstd), then RN_x(RN_q(u * g))
        if (weight.defined()) {
            const auto wide = at::promote_types(x.scalar_type(), at::kFloat);
            gain = gain_of(weight, at::promote_types(weight.scalar_type(), wide), offset);
        }
        weight = Tensor();
    } else if (weight.defined() && (offset != 0 || mode == GEMMA)) {
        const auto acc = acc_dtype(d);  // the gain in it: options.offset_gain's first case
        if (acc != at::kDouble && !single_valued(weight.scalar_type())) Py_RETURN_NONE;
        weight = gain_of(weight, acc, offset);
    }
    Tensor y, residual_out;
    if (memory_efficient && grad_asked() && no_zero(weight)) {  // (recompute.applies)
        if (mode != ONE_ROUNDING || offset != 0 || residual.defined() || yd >= 0 ||
            out.defined() || residual_out_given.defined() || at::hasCallbacks())
            Py_RETURN_NONE;  // (options.norm raises, or Python's recompute runs it)
        y = record_memory_efficient(x, weight, bias, eps, rms);
        if (!y.defined()) Py_RETURN_NONE;
    } else if (grad_asked()) {  // (of the kernel's arguments: a llama gain's is the product's)
        // the op's autograd kernel and CPU kernel, which the dispatcher would pick here
        // (no mechanism is active): autograd records NormBackward
        // (through the dispatcher when a profiler listens, so it sees layernorm::forward)
        Outputs out = record_forward(x, as_optional(residual), as_optional(weight),
                                     as_optional(bias), eps, rms, "", at::hasCallbacks(), yd);
        y = std::get<0>(out);
        if (residual.defined()) residual_out = std::get<1>(out);
    } else {
        // inference: the CPU kernel's own function, without statistics
        const int64_t kernel_address = entry_for(x, "", FORWARD_SERIAL, yd);
        if (kernel_address < 0) Py_RETURN_NONE;  // the Python kernel's call
        Forward forward = run_forward(x, residual, weight, bias, eps, rms, false,
                                      kernel_address, out, residual_out_given, yd);
        y = forward.y;
        residual_out = forward.residual_out;
        for (const Tensor* t : {&out, &residual_out_given})  // written in place
            if (t->defined()) torch::autograd::impl::bump_version(*t);
        if (gain.defined() && !(torch::GradMode::is_enabled() && gain.requires_grad())) {
            // the product below, into y (a fresh tensor no graph holds): computed in q,
            // converted to y's dtype, the same two roundings without the copies
            at::mul_out(y, y, gain);
            gain = Tensor();
        }
    }
    if (gain.defined()) {
        const auto q = at::promote_types(x.scalar_type(), gain.scalar_type());
        y = (y.to(q) * gain).to(x.scalar_type());
    }
    PyObject* result = PyTuple_New(2);
    if (result == nullptr) return nullptr;
    PyTuple_SET_ITEM(result, 0, THPVariable_Wrap(y));
    PyTuple_SET_ITEM(result, 1, wrap_or_none(residual_out));
    return result;
    END_HANDLE_TH_ERRORS
}

// (s, p32) of dropout probability p (compiled._dropout_constants), asked of Python once
// per thread and p.
std::pair<double, double> dropout_constants(double p) {
    thread_local double last_p = -1, s = 0, p32 = 0;
    if (p != last_p) {
        std::tie(s, p32) = call_python<std::tuple<double, double>>(state.dropout_constants, p);
        last_p = p;
    }
    return {s, p32};
}

// Runs rows(lo, hi) over the m rows of n (a dropout-add kernel's spans): in spans over
// the threads _threads lends, else in the calling thread.
void run_rows(int64_t m, int64_t n, const std::function<void(int64_t, int64_t)>& rows) {
    int64_t lent = 0;
    const Ranges ranges = span_ranges(m, n, &lent);  // (rows are _threads.run's blocks)
    if (ranges.empty())
        rows(0, m);
    else
        run_spans(ranges, lent, rows);
}

// A rowscale as the dropout-add's kernels read it: (m,) float64 values, contiguous (the
// conversion is exact: _numba_dropout._rowscale); undefined stays undefined.
Tensor rows_as_float64(const Tensor& rowscale) {
    if (!rowscale.defined()) return rowscale;
    return rowscale.reshape({-1}).to(at::kDouble).contiguous();
}

// The autograd of fused's dropout-add h = RN(k0·s·x·rowscale + k1·s·x1 + residual), x
// and x1 of one dtype, residual and h of it or of a float32 stream: fused.gradients'
// formula (EagerDropoutAdd's backward), the masks regenerated from the key, the rowscale
// saved as EagerDropoutAdd saves it (an in-place change of it raises here as there). Its
// inputs are (x, x1, residual), an absent one without an edge. The numba entry computes
// dx and dx1, the residual's gradient is dh itself; a backward that builds a graph
// (create_graph), that a mechanism would see, or that the entry was not built for goes
// to Python's fused.gradients.
struct DropoutAddBackward : public torch::autograd::Node {
    int64_t seed = 0, k0 = 0, k1 = 0;
    double p = 0, s = 1, p32 = 0;
    bool has_x1 = false, has_residual = false;
    int d = 0;   // the terms' dtype index (x, x1)
    int hd = 0;  // the stream's (residual, h): d, or float32's for 16-bit terms
    std::vector<int64_t> sizes;
    torch::autograd::SavedVariable rowscale;  // (m,) or x's leading shape; none: undefined

    std::string name() const override { return "layernorm::DropoutAddBackward"; }

    void release_variables() override { rowscale.reset_data(); }

    variable_list apply(variable_list&& grads) override {
        variable_list out(3);
        const Tensor& dh = grads[0];
        if (!dh.defined()) return out;
        const Tensor rs = rowscale.unpack();
        const int64_t entry = dropout_kernel(d, hd, DROPOUT_ADD_BACKWARD);
        Tensor dx, dx1;
        if (torch::GradMode::is_enabled() || at::hasCallbacks() || entry < 0 ||
            !(dh.is_cpu() && dh.scalar_type() == state.dtypes[hd] && dh.sizes() == sizes) ||
            mechanism_active({&dh})) {
            const auto [gx, gx1, gresidual] =
                call_python<std::tuple<Tensor, OptionalTensor, OptionalTensor>>(
                    state.dropout_gradients, dh, as_optional(rs), seed, p, d, has_x1,
                    has_residual, hd);
            dx = gx;
            dx1 = value(gx1);
            out[2] = value(gresidual);
        } else if (p == 0 && hd == d && !rs.defined()) {
            // every element kept with s = 1 (fused.gradients' rule): dx = RN(dh) and
            // dx1 = RN(dh) are dh, passed on as torch's add passes its gradient
            dx = dh;
            if (has_x1) dx1 = dh;
            if (has_residual) out[2] = dh;
        } else {
            const Tensor g = dh.contiguous();
            const int64_t n = sizes.back(), m = g.numel() / n;
            const Tensor scale = rows_as_float64(rs);
            dx = empty(g.sizes(), state.dtypes[d]);
            if (has_x1) dx1 = empty(g.sizes(), state.dtypes[d]);
            run_rows(m, n, [&](int64_t lo, int64_t hi) {
                reinterpret_cast<DropoutAddBackwardKernel>(entry)(
                    address(g), n, address(scale.defined() ? scale : g), address(dx),
                    address(has_x1 ? dx1 : dx), address(dx) /* dresidual: dh itself */, m, n,
                    k0, k1, p32, s, scale.defined(), has_x1, false, lo, hi);
            });
            if (has_residual) out[2] = dh;  // (RN to dh's own dtype: dh, as Python passes it)
        }
        if (task_should_compute_output(0)) out[0] = dx;
        if (has_x1 && task_should_compute_output(1)) out[1] = dx1;
        if (!(has_residual && task_should_compute_output(2))) out[2] = Tensor();
        return out;
    }
};

// Whether out_dtype y is narrower than x (options._NARROWER, handed over by set_up).
bool narrower(at::ScalarType x, at::ScalarType y) {
    const int d = dtype_index(x), yd = dtype_index(y);
    return d >= 0 && yd >= 0 && state.narrower[d][yd];
}

using PyRef = std::unique_ptr<PyObject, decltype(&Py_DecRef)>;

// fused_norm's norm of h with an offset or y in another dtype than x's (fused._norm: the
// public function with those options), as (y, h), h the add's residual_out with a
// residual (the parameters, shape and rms as fused_norm's arguments): through the norm's
// front door where options._front_door would hand the call to it (an offset that is a
// float32 value, y in h's dtype or a narrower one: the same arguments), else, or where
// that door declines, compiled._norm_of_h (fused._norm itself).
std::tuple<Tensor, Tensor> norm_with_options(const Tensor& h, const Tensor& residual,
                                             PyObject* shape, int64_t n, PyObject* weight,
                                             PyObject* bias, double eps, PyObject* rms,
                                             double offset, PyObject* out_dtype_object) {
    const auto out_dtype = reinterpret_cast<THPDtype*>(out_dtype_object)->scalar_type;
    if (float32_value(offset) &&
        (out_dtype == h.scalar_type() || narrower(h.scalar_type(), out_dtype))) {
        PyRef h_object(THPVariable_Wrap(h), Py_DecRef);
        PyRef residual_object(wrap_or_none(residual), Py_DecRef);
        PyRef eps_object(PyFloat_FromDouble(eps), Py_DecRef);
        PyRef offset_object(PyFloat_FromDouble(offset), Py_DecRef);
        PyRef mode(PyLong_FromLong(ONE_ROUNDING), Py_DecRef);
        if (!h_object || !residual_object || !eps_object || !offset_object || !mode)
            throw python_error();
        PyObject* y_dtype = out_dtype == h.scalar_type() ? Py_None : out_dtype_object;
        PyObject* norm_args[14] = {h_object.get(), residual_object.get(), shape, weight, bias,
                                   eps_object.get(), rms, Py_None, offset_object.get(),
                                   mode.get(), Py_None, Py_None, y_dtype, Py_False};
        // (no option: the plain call's 8 arguments, the same path without its checks)
        const bool plain = offset == 0 && y_dtype == Py_None;
        PyRef done(norm(nullptr, norm_args, plain ? 8 : 14), Py_DecRef);
        if (!done) throw python_error();
        if (done.get() != Py_None) {
            PyObject* residual_out = PyTuple_GET_ITEM(done.get(), 1);
            return {THPVariable_Unpack(PyTuple_GET_ITEM(done.get(), 0)),
                    residual_out == Py_None ? h : THPVariable_Unpack(residual_out)};
        }
    }
    return call_python<std::tuple<Tensor, Tensor>>(
        state.norm_of_h, h, n, pybind11::handle(weight), pybind11::handle(bias), eps,
        rms == Py_True, offset, pybind11::handle(out_dtype_object), as_optional(residual));
}

// fused's result, FusedNorm's fields: (y, y1, residual_out, dropout_mask, dropout_mask1),
// an undefined tensor None.
PyObject* fused_result(const Tensor& y, const Tensor& y1, const Tensor& residual_out,
                       const Tensor& mask0, const Tensor& mask1) {
    PyObject* result = PyTuple_New(5);
    if (result == nullptr) return nullptr;
    PyTuple_SET_ITEM(result, 0, THPVariable_Wrap(y));
    PyTuple_SET_ITEM(result, 1, wrap_or_none(y1));
    PyTuple_SET_ITEM(result, 2, wrap_or_none(residual_out));
    PyTuple_SET_ITEM(result, 3, wrap_or_none(mask0));
    PyTuple_SET_ITEM(result, 4, wrap_or_none(mask1));
    return result;
}

// fused_norm's call without a dropout-add (dropout_p 0, no x1 or rowscale) and one weight
// set, as fused_norm makes it: h = x + residual by add_*, or x itself (residual_out
// None), in x's dtype; in a float32 stream of 16-bit x (options.residual_stream), h = x +
// residual, one IEEE addition of exact terms (autograd records it), or x converted, and
// y the norm of h rounded into x's dtype (or out_dtype), with a -0.0 residual where
// autograd records the call (h + -0.0 = h: the stream's gradient inside the kernel's
// rounding); the norm by norm_with_options, the offset and out_dtype included; the masks
// all True where asked.
PyObject* fused_as_norm(PyObject* const* args, const Tensor& x, const Tensor& residual,
                        const Tensor& weight, const Tensor& bias, at::ScalarType stream,
                        double eps, bool want_masks, double offset, PyObject* out_dtype_object) {
    Tensor h = x, added = residual;
    if (stream != x.scalar_type()) {
        h = residual.defined() ? at::add(x, residual) : x.to(stream);
        added = Tensor();
        if (residual.defined() && torch::GradMode::is_enabled() &&
            (x.requires_grad() || residual.requires_grad() || requires_grad(weight) ||
             requires_grad(bias)))  // (_op.records_gradient)
            added = at::full_like(h, -0.0);
    }
    const auto [y, residual_out] =
        norm_with_options(h, added, args[1], x.size(-1), args[2], args[3], eps, args[5],
                          offset, out_dtype_object);
    Tensor mask0;  // p = 0 keeps every element
    if (want_masks) mask0 = at::ones(x.sizes(), at::TensorOptions().dtype(at::kBool));
    const bool is_x = stream == x.scalar_type() && !residual.defined();  // (fused_norm's)
    return fused_result(y, Tensor(), is_x ? Tensor() : residual_out, mask0, Tensor());
}

// fused(x, normalized_shape, weight, bias, eps, rms, residual, x1, weight1, bias1,
// dropout_p, rowscale, seed, generator, residual_dtype, out_dtype, offset,
// return_dropout_mask, backend), layernorm.fused_norm's arguments in its order, is its
// front door for the call with dropout, x1 or a rowscale (and, by fused_as_norm, for the
// call without them): plain contiguous CPU tensors of x's dtype and shape (x1,
// residual) and plain (N,) parameters, an int or 1-tuple normalized_shape, a float
// dropout_p in [0, 1), an int64 seed or None, a float or None eps, bools rms and
// return_dropout_mask, residual_dtype None or x's own or, for 16-bit x, float32 (then a
// residual is float32: the stream's dtype; the dropout-add's entries of that pair, y and
// y1 by the kernels of the (float32, x) pair), a rowscale of (m,) or x's leading shape
// (a plain CPU tensor of a floating dtype, not requiring grad where grad mode is on:
// fused_norm raises) or None, a CPU torch.Generator or None, a float offset and a
// floating out_dtype or None, no backend, and no mechanism that would see the call
// (forward AD and the transforms are Python's). It runs what fused_norm runs, in its
// order: the seed drawn (one torch.randint of the generator, by default torch's default
// CPU generator: fused.py's _seed_tensor), the numba backend's dropout-add entry on h
// (the same kernel as _numba_dropout.dropout_add, in spans over the threads as _threads
// lends them), recorded by a DropoutAddBackward node when x, x1 or residual requires
// grad (EagerDropoutAdd's place), then the norm of h once per weight set, as the norm's
// front door runs it (NormBackward recorded with a gradient), or with an offset or
// another out_dtype than x's as fused_norm's own _norm does it (norm_with_options: the
// norm's front door with those options, else the public functions' options in Python,
// which check and may raise there, after the dropout-add, as in fused_norm); so the
// bits, the masks, the gradients and the generator's state are the same. Any other call
// gets None before any work.
PyObject* fused(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
    HANDLE_TH_ERRORS
    if (nargs != 19) {
        PyErr_SetString(PyExc_TypeError, "fused takes fused_norm's 19 arguments");
        return nullptr;
    }
    PyObject *x_object = args[0], *eps_object = args[4], *rms_object = args[5];
    PyObject *p_object = args[10], *seed_object = args[12], *offset_object = args[16];
    PyObject *masks_object = args[17], *generator_object = args[13];
    // a backend is Python's
    if (state.resolve == nullptr || args[18] != Py_None ||
        !PyFloat_CheckExact(offset_object) ||
        !PyFloat_CheckExact(p_object) || !PyBool_Check(rms_object) ||
        !PyBool_Check(masks_object) ||
        !(eps_object == Py_None || PyFloat_CheckExact(eps_object)) ||
        Py_TYPE(x_object) != reinterpret_cast<PyTypeObject*>(state.tensor_type))
        Py_RETURN_NONE;
    const double p = PyFloat_AS_DOUBLE(p_object);
    if (!(p >= 0 && p < 1)) Py_RETURN_NONE;  // (NaN and p outside [0, 1]: check_p raises)
    int64_t seed = 0;                         // (no seed and p = 0: no draw, key 0)
    if (seed_object != Py_None) {  // a seed of [2^63, 2^64) (or a bool) is Python's
        int overflow = 0;
        if (!PyLong_CheckExact(seed_object)) Py_RETURN_NONE;
        seed = PyLong_AsLongLongAndOverflow(seed_object, &overflow);
        if (overflow != 0) Py_RETURN_NONE;
    }
    std::optional<at::Generator> generator;  // (None: torch's default CPU generator)
    if (generator_object != Py_None) {
        if (!THPGenerator_Check(generator_object)) Py_RETURN_NONE;
        generator = THPGenerator_Unwrap(generator_object);
        if (!generator->device().is_cpu()) Py_RETURN_NONE;
    }
    const int64_t n = last_dim(args[1]);
    if (n <= 0) Py_RETURN_NONE;
    const Tensor& x = THPVariable_Unpack(x_object);
    if (!(x.is_cpu() && x.dim() > 0 && x.size(-1) == n && x.is_contiguous())) Py_RETURN_NONE;
    const int d = dtype_index(x.scalar_type());
    if (d < 0) Py_RETURN_NONE;
    // out_dtype: None (x's), or a floating dtype (fused_norm raises for another)
    PyObject* out_dtype_object = args[15];
    if (out_dtype_object == Py_None)
        out_dtype_object = reinterpret_cast<PyObject*>(torch::getTHPDtype(x.scalar_type()));
    else if (!THPDtype_Check(out_dtype_object) ||
             !c10::isFloatingType(reinterpret_cast<THPDtype*>(out_dtype_object)->scalar_type))
        Py_RETURN_NONE;
    const auto out_dtype = reinterpret_cast<THPDtype*>(out_dtype_object)->scalar_type;
    const double offset = PyFloat_AS_DOUBLE(offset_object);
    // an offset, or y in another dtype than x's: the norm of h by norm_with_options
    const bool options = offset != 0 || out_dtype != x.scalar_type();
    // the stream's dtype (residual_dtype, else the residual's, else x's): x's own, or
    // float32 for 16-bit terms (flash-attn's residual_in_fp32), a residual of it
    at::ScalarType stream = x.scalar_type();
    if (THPDtype_Check(args[14]))
        stream = reinterpret_cast<THPDtype*>(args[14])->scalar_type;
    else if (args[14] != Py_None)
        Py_RETURN_NONE;
    else if (Py_TYPE(args[6]) == reinterpret_cast<PyTypeObject*>(state.tensor_type))
        stream = THPVariable_Unpack(args[6]).scalar_type();
    const bool half = x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf;
    if (!(stream == x.scalar_type() || (half && stream == at::kFloat))) Py_RETURN_NONE;
    const int hd = dtype_index(stream);
    Tensor residual, x1, weight, bias, weight1, bias1, rowscale;
    if (!plain_like(args[6], x, &residual, stream) || !plain_like(args[7], x, &x1) ||
        !plain_param(args[2], n, &weight) || !plain_param(args[3], n, &bias) ||
        !plain_param(args[8], n, &weight1) || !plain_param(args[9], n, &bias1) ||
        !plain_rowscale(args[11], x, &rowscale))
        Py_RETURN_NONE;
    const bool rms = rms_object == Py_True, want_masks = masks_object == Py_True;
    const bool grad_mode = torch::GradMode::is_enabled();
    if ((rms && (bias.defined() || bias1.defined())) ||  // fused_norm raises
        (bias1.defined() && !weight1.defined()) || (grad_mode && requires_grad(rowscale)))
        Py_RETURN_NONE;
    const double eps = eps_object != Py_None ? PyFloat_AS_DOUBLE(eps_object)
                       : rms                 ? state.default_eps[d]
                                             : state.layer_norm_eps;
    if (!(eps >= 0)) Py_RETURN_NONE;
    if (p == 0 && !x1.defined() && !rowscale.defined()) {
        // no dropout-add: h is x + residual (or x itself), as add_* (the norm) makes it
        if (weight1.defined() || mechanism_active({&x, &residual, &weight, &bias}))
            Py_RETURN_NONE;  // (y1: Python's)
        return fused_as_norm(args, x, residual, weight, bias, stream, eps, want_masks, offset,
                             out_dtype_object);
    }
    if (mechanism_active({&x, &residual, &x1, &weight, &bias, &weight1, &bias1, &rowscale}))
        Py_RETURN_NONE;
    // whether autograd records the dropout-add (fused's _op.records_gradient(x, x1, residual))
    const bool record_h =
        grad_mode && (x.requires_grad() || requires_grad(residual) || requires_grad(x1));
    const Tensor h = empty(x.sizes(), stream);
    // y (and y1) in x's dtype: of another stream, by the kernels of the (stream, x) pair,
    // with a gradient recorded here where no profiler would look for the op (as norm)
    // (with options Python's: its entry says whether numba is the automatic backend)
    const int yd = hd == d || options ? -1 : d;
    if (yd >= 0 && grad_mode && at::hasCallbacks()) Py_RETURN_NONE;
    const int64_t norm_address = entry_for(h, "", FORWARD_SERIAL, yd);
    if (norm_address < 0) Py_RETURN_NONE;
    const auto [s, p32] = dropout_constants(p);
    // every element kept, s = 1 and no rowscale: the exact three-term sum
    // (_numba_dropout's rule; of another stream, with a residual: _numba_dropout._sum3's
    // choice of kernel)
    const bool sum3 = x1.defined() && !rowscale.defined() && p32 == 0 && s == 1;
    if (sum3 && yd >= 0 && !residual.defined()) Py_RETURN_NONE;
    const int64_t add_address = dropout_kernel(d, hd, sum3 ? SUM3 : DROPOUT_ADD);
    if (add_address < 0) Py_RETURN_NONE;
    if (seed_object == Py_None && p != 0)  // fused._seed_tensor's draw
        seed = at::randint(state.seed_draw_high, {}, generator,
                           at::TensorOptions().dtype(at::kLong))
                   .item<int64_t>();
    const auto key = static_cast<uint64_t>(seed);  // _philox.seed_key
    const auto k0 = static_cast<int64_t>(key & 0xFFFFFFFFu), k1 = static_cast<int64_t>(key >> 32);

    const int64_t m = x.numel() / n;
    Tensor mask0, mask1;
    std::function<void(int64_t, int64_t)> rows;
    if (sum3) {
        if (want_masks) {  // p = 0 keeps every element
            mask0 = at::ones(x.sizes(), at::TensorOptions().dtype(at::kBool));
            mask1 = at::ones(x.sizes(), at::TensorOptions().dtype(at::kBool));
        }
        // no residual: IEEE's neutral zero, one row read for every row
        const Tensor r = residual.defined() ? residual : constant(n, x.scalar_type(), -0.0);
        const int64_t r_stride = residual.defined() ? n : 0;
        rows = [&, r, r_stride](int64_t lo, int64_t hi) {
            reinterpret_cast<Sum3Kernel>(add_address)(address(x), n, address(x1), n, address(r),
                                                      r_stride, address(h), m, n, lo, hi);
        };
    } else {
        if (want_masks) {
            mask0 = empty(x.sizes(), at::kBool);
            if (x1.defined()) mask1 = empty(x.sizes(), at::kBool);
        }
        // (an absent tensor is not read: any valid address)
        auto address_or_h = [&](const Tensor& t) { return address(t.defined() ? t : h); };
        const Tensor scale = rows_as_float64(rowscale);
        rows = [&, scale](int64_t lo, int64_t hi) {
            reinterpret_cast<DropoutAddKernel>(add_address)(
                address(x), n, address_or_h(x1), n, address_or_h(residual), n,
                address_or_h(scale), address(h), address_or_h(mask0), address_or_h(mask1), m,
                n, k0, k1, p32, s, x1.defined(), residual.defined(), scale.defined(),
                want_masks, lo, hi);
        };
    }
    run_rows(m, n, rows);
    if (record_h) {  // EagerDropoutAdd's autograd, as a node of torch's own kind
        auto node = c10::make_intrusive<DropoutAddBackward>();
        node->set_next_edges(torch::autograd::collect_next_edges(x, x1, residual));
        node->seed = seed;
        node->k0 = k0;
        node->k1 = k1;
        node->p = p;
        node->s = s;
        node->p32 = p32;
        node->has_x1 = x1.defined();
        node->has_residual = residual.defined();
        node->d = d;
        node->hd = hd;
        node->sizes = x.sizes().vec();
        if (rowscale.defined()) node->rowscale = torch::autograd::SavedVariable(rowscale, false);
        torch::autograd::set_history(h, node);
    }
    // the norm of h per weight set: with a gradient the norm's front door records
    // NormBackward (record_forward), without one it runs the kernel alone
    auto norm_of_h = [&](const Tensor& w, const Tensor& b, PyObject* w_object,
                         PyObject* b_object) {
        if (options)  // fused_norm's own norm of h
            return std::get<0>(norm_with_options(h, Tensor(), args[1], n, w_object, b_object,
                                                 eps, rms_object, offset, out_dtype_object));
        if (grad_mode && (h.requires_grad() || requires_grad(w) || requires_grad(b)))
            return std::get<0>(record_forward(h, OptionalTensor(), as_optional(w),
                                              as_optional(b), eps, rms, "", at::hasCallbacks(),
                                              yd));
        return run_forward(h, Tensor(), w, b, eps, rms, false, norm_address, Tensor(), Tensor(),
                           yd)
            .y;
    };
    const Tensor y = norm_of_h(weight, bias, args[2], args[3]);
    Tensor y1;
    if (weight1.defined()) y1 = norm_of_h(weight1, bias1, args[8], args[9]);
    return fused_result(y, y1, h, mask0, mask1);
    END_HANDLE_TH_ERRORS
}

// The autograd of the front door's layer_norm_linear call, in the place of
// layernorm.recompute's NormLinear: out = F.linear(norm(x), linear_weight, linear_bias),
// saving x, the norm's parameters, mean, rstd and linear_weight, not the norm's output.
// Its inputs are (x, weight, bias, linear_weight, linear_bias), an absent one without an
// edge. The backward runs what NormLinear's does: dy = dout · linear_weight and the
// norm's backward kernel on it (backward_cpu, the plain call's), y again (the forward
// kernel, the same bits) for linear_weight's gradient only; recompute's
// norm_linear_gradients where a mechanism would see it. Once differentiable.
struct NormLinearBackward : public torch::autograd::Node {
    torch::autograd::SavedVariable x, weight, bias, linear_weight, mean, rstd;
    bool rms = false, has_linear_bias = false;
    double eps = 0;
    at::ScalarType weight_dtype = at::kFloat, bias_dtype = at::kFloat;

    std::string name() const override { return "layernorm::NormLinearBackward"; }

    void release_variables() override {
        for (auto* v : {&x, &weight, &bias, &linear_weight, &mean, &rstd}) v->reset_data();
    }

    variable_list apply(variable_list&& grads) override {
        const Tensor xt = x.unpack(), w = weight.unpack(), b = bias.unpack(),
                     lw = linear_weight.unpack(), mu = mean.unpack(), r = rstd.unpack();
        bool need[5];
        for (int k = 0; k < 5; ++k) need[k] = task_should_compute_output(k);
        need[1] = need[1] && w.defined();
        need[2] = need[2] && b.defined();
        need[4] = need[4] && has_linear_bias;
        variable_list out(5);
        torch::NoGradGuard once_differentiable;
        const int64_t n = xt.size(-1), out_features = lw.size(0);
        Tensor dout = grads[0];
        if (!dout.defined()) {
            std::vector<int64_t> sizes = xt.sizes().vec();
            sizes.back() = out_features;
            dout = at::zeros(sizes, xt.options());
        }
        const int64_t entry = entry_for(xt, "", FORWARD_SERIAL);
        Tensor dx, dweight, dbias, dlinear_weight, dlinear_bias;
        const bool python = entry < 0 || at::hasCallbacks() || mechanism_active({&dout}) ||
                            !(dout.is_cpu() && dout.scalar_type() == xt.scalar_type());
        if (python) {
            const auto [gx, gw, gb, glw, glb] =
                call_python<std::tuple<OptionalTensor, OptionalTensor, OptionalTensor,
                                       OptionalTensor, OptionalTensor>>(
                    state.norm_linear_gradients, dout, xt.view({-1, n}), as_optional(w),
                    as_optional(b), lw, as_optional(mu), r, xt.sizes().vec(),
                    std::make_tuple(std::vector<int64_t>{n}, eps, rms, std::string()), false,
                    std::make_tuple(need[0], need[1], need[2], need[3], need[4]));
            dx = value(gx);
            dweight = value(gw);
            dbias = value(gb);
            dlinear_weight = value(glw);
            dlinear_bias = value(glb);
        } else {
            const Tensor d2 = dout.reshape({-1, out_features});
            if (need[3]) {
                const Tensor y = run_forward(xt, Tensor(), w, b, eps, rms, false, entry).y;
                dlinear_weight = d2.t().mm(y.view({-1, n}));
            }
            if (need[4]) dlinear_bias = d2.sum(0);
            if (need[0] || need[1] || need[2]) {
                const Tensor dy = at::matmul(dout, lw).contiguous();
                const Tensor m_arg = mu.defined() ? mu : empty({0}, r.scalar_type());
                auto [dz, dw, db] = backward_cpu(dy, xt, as_optional(w), m_arg, r, std::nullopt,
                                                 rms, need[1], need[2], "", eps);
                dx = dz;
                dweight = dw;
                dbias = db;
            }
        }
        auto in_dtype = [python](const Tensor& t, at::ScalarType dtype) {
            return python ? t.to(dtype) : as_dtype(t, dtype);
        };
        if (need[0]) out[0] = dx;
        if (need[1]) out[1] = in_dtype(dweight, weight_dtype);
        if (need[2]) out[2] = in_dtype(dbias, bias_dtype);
        if (need[3]) out[3] = dlinear_weight;
        if (need[4]) out[4] = dlinear_bias;
        return out;
    }
};

// A plain contiguous CPU tensor of `dtype` and `dims` dimensions (or Parameter), or None
// (undefined) where `optional`.
bool plain_tensor(PyObject* o, at::ScalarType dtype, int64_t dims, bool optional, Tensor* out) {
    if (o == Py_None) return optional;
    if (!tensor_or_parameter(o)) return false;
    const Tensor& t = THPVariable_Unpack(o);
    if (!(t.is_cpu() && t.dim() == dims && t.scalar_type() == dtype && t.is_contiguous()))
        return false;
    *out = t;
    return true;
}

// norm_linear(x, normalized_shape, weight, bias, linear_weight, linear_bias, eps, rms,
// backend), the arguments of recompute.layer_norm_linear after its checks (eps None only
// for rms_norm), is its front door: plain contiguous CPU tensors (x of a kernel dtype, the
// linear's of x's dtype, linear_weight (out_features, n)), an int or 1-tuple
// normalized_shape, plain (N,) norm parameters, no backend and no mechanism that would see
// the call. With a gradient it runs the forward kernel (statistics kept) and at::linear,
// and records a NormLinearBackward node; without one, the composition itself (the kernel
// without statistics, then at::linear, as F.linear(layer_norm(...)) in Python); any other
// call gets None before any work.
PyObject* norm_linear(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
    HANDLE_TH_ERRORS
    if (nargs != 9) {
        PyErr_SetString(PyExc_TypeError, "norm_linear takes 9 arguments");
        return nullptr;
    }
    Input in;
    if (!plain_input(args[0], args[1], args[6], args[8], &in)) Py_RETURN_NONE;
    const Tensor& x = in.x;
    const int64_t n = in.n;
    const double eps = in.eps;
    const bool rms = args[7] == Py_True;
    Tensor weight, bias, linear_weight, linear_bias;
    if (!plain_param(args[2], n, &weight) || !plain_param(args[3], n, &bias) ||
        (rms && bias.defined()) ||
        !plain_tensor(args[4], x.scalar_type(), 2, false, &linear_weight) ||
        linear_weight.size(1) != n ||
        !plain_tensor(args[5], x.scalar_type(), 1, true, &linear_bias) ||
        (linear_bias.defined() && linear_bias.size(0) != linear_weight.size(0)))
        Py_RETURN_NONE;
    const bool grad = torch::GradMode::is_enabled() &&
                      (x.requires_grad() || requires_grad(weight) || requires_grad(bias) ||
                       linear_weight.requires_grad() || requires_grad(linear_bias));
    if (at::hasCallbacks() || mechanism_active({&x, &weight, &bias, &linear_weight, &linear_bias}))
        Py_RETURN_NONE;
    const int64_t entry = entry_for(x, "", FORWARD_SERIAL);
    if (entry < 0) Py_RETURN_NONE;
    Forward forward;
    Tensor out;
    {
        torch::NoGradGuard no_graph;  // (the node below records the whole call)
        // statistics only for the node
        forward = run_forward(x, Tensor(), weight, bias, eps, rms, grad, entry);
        out = at::linear(forward.y, linear_weight, as_optional(linear_bias));
    }
    if (!grad) return THPVariable_Wrap(out);  // the composition: nothing is saved
    using torch::autograd::SavedVariable;
    auto node = c10::make_intrusive<NormLinearBackward>();
    node->set_next_edges(
        torch::autograd::collect_next_edges(x, weight, bias, linear_weight, linear_bias));
    node->rms = rms;
    node->eps = eps;
    node->has_linear_bias = linear_bias.defined();
    if (weight.defined()) node->weight_dtype = weight.scalar_type();
    if (bias.defined()) node->bias_dtype = bias.scalar_type();
    torch::autograd::set_history(out, node);
    node->x = SavedVariable(x, false);
    if (weight.defined()) node->weight = SavedVariable(weight, false);
    if (bias.defined()) node->bias = SavedVariable(bias, false);
    node->linear_weight = SavedVariable(linear_weight, false);
    if (forward.mean.defined()) node->mean = SavedVariable(forward.mean, false);
    node->rstd = SavedVariable(forward.rstd, false);
    return THPVariable_Wrap(out);
    END_HANDLE_TH_ERRORS
}

// The kernels, registered in torch's dispatcher by the first set_up that succeeds (not
// when the library loads: a build that refuses the kernels' signatures registers none).
void register_kernels() {
    static std::unique_ptr<torch::Library> cpu, autograd;
    if (cpu) return;
    cpu = std::make_unique<torch::Library>(torch::Library::IMPL, "layernorm",
                                           c10::DispatchKey::CPU, __FILE__, __LINE__);
    cpu->impl("forward", forward_cpu);
    cpu->impl("backward", backward_cpu);
    autograd = std::make_unique<torch::Library>(torch::Library::IMPL, "layernorm",
                                                c10::DispatchKey::AutogradCPU, __FILE__, __LINE__);
    autograd->impl("forward", forward_autograd);
    // the backward is not differentiated (a graph of it is composite_backward's)
    autograd->impl("backward", torch::autograd::autogradNotImplementedFallback());
}

void replace(PyObject** slot, pybind11::object value) {
    Py_XDECREF(*slot);
    *slot = value.release().ptr();
}

// set_up(rules): a dict from compiled._use with everything C++ takes from Python (the
// names are State's fields); the kernel signatures must be this file's.
void set_up(pybind11::dict rules) {
    const auto signatures = rules["signatures"].cast<std::map<std::string, std::string>>();
    const std::map<std::string, std::string> own = {{"forward", FORWARD_SIGNATURE},
                                                    {"backward", BACKWARD_SIGNATURE},
                                                    {"dropout_add", DROPOUT_ADD_SIGNATURE},
                                                    {"sum3", SUM3_SIGNATURE},
                                                    {"dropout_add_backward",
                                                     DROPOUT_ADD_BACKWARD_SIGNATURE},
                                                    {"memory_efficient_backward",
                                                     MEMORY_EFFICIENT_BACKWARD_SIGNATURE}};
    for (const auto& [name, signature] : own) {
        const auto found = signatures.find(name);
        TORCH_CHECK(found != signatures.end() && found->second == signature,
                    "layernorm's compiled kernels were built for the ", name,
                    " entry signature ", signature, " but the numba kernels have ",
                    found == signatures.end() ? std::string("none") : found->second,
                    ": rebuild it (layernorm build)");
    }
    const auto default_eps = rules["default_eps"].cast<std::vector<double>>();
    const auto dtypes = rules["dtypes"].cast<std::vector<pybind11::object>>();
    const auto acc_dtypes = rules["acc_dtypes"].cast<std::vector<pybind11::object>>();
    TORCH_CHECK(default_eps.size() == DTYPES && dtypes.size() == DTYPES &&
                    acc_dtypes.size() == DTYPES,
                "set_up: ", DTYPES, " dtypes, their accumulation dtypes and default eps");
    std::copy(default_eps.begin(), default_eps.end(), state.default_eps);
    const auto narrower = rules["narrower"].cast<std::vector<std::vector<bool>>>();
    TORCH_CHECK(narrower.size() == DTYPES, "set_up: narrower is ", DTYPES, " x ", DTYPES);
    for (int d = 0; d < DTYPES; ++d) {
        TORCH_CHECK(narrower[d].size() == DTYPES, "set_up: narrower is ", DTYPES, " x ", DTYPES);
        std::copy(narrower[d].begin(), narrower[d].end(), state.narrower[d]);
    }
    for (int d = 0; d < DTYPES; ++d) {
        TORCH_CHECK(THPDtype_Check(dtypes[d].ptr()) && THPDtype_Check(acc_dtypes[d].ptr()),
                    "set_up: dtypes must be torch.dtype");
        state.dtypes[d] = reinterpret_cast<THPDtype*>(dtypes[d].ptr())->scalar_type;
        state.acc_dtypes[d] = reinterpret_cast<THPDtype*>(acc_dtypes[d].ptr())->scalar_type;
    }
    replace(&state.tensor_type, rules["tensor_type"]);
    replace(&state.parameter_type, rules["parameter_type"]);
    replace(&state.resolve, rules["resolve"]);
    replace(&state.python_forward, rules["python_forward"]);
    replace(&state.python_backward, rules["python_backward"]);
    replace(&state.fix_forward, rules["fix_forward"]);
    replace(&state.fix_backward, rules["fix_backward"]);
    replace(&state.composite_backward, rules["composite_backward"]);
    replace(&state.kernel_rows, rules["kernel_rows"]);
    replace(&state.backend_named, rules["backend_named"]);
    replace(&constant_python, rules["constant"]);
    replace(&state.lend, rules["lend"]);
    replace(&state.give_back, rules["give_back"]);
    state.grain = rules["grain"].cast<int64_t>();
    state.row_block = rules["row_block"].cast<int64_t>();
    state.max_bytes = rules["max_bytes"].cast<int64_t>();
    state.seed_draw_high = rules["seed_draw_high"].cast<int64_t>();
    replace(&state.dropout_constants, rules["dropout_constants"]);
    replace(&state.dropout_gradients, rules["dropout_gradients"]);
    replace(&state.norm_of_h, rules["norm_of_h"]);
    state.layer_norm_eps = rules["layer_norm_eps"].cast<double>();
    replace(&state.memory_efficient_gradients, rules["memory_efficient_gradients"]);
    replace(&state.norm_linear_gradients, rules["norm_linear_gradients"]);
    state.recompute_block = rules["recompute_block"].cast<int64_t>();
    forget_kernels();
    register_kernels();
}

// Forgets the kernel addresses, so the next call asks again (backends.forget).
void forget() { forget_kernels(); }

PyMethodDef NORM_DEF = {"norm", reinterpret_cast<PyCFunction>(reinterpret_cast<void*>(norm)),
                        METH_FASTCALL,
                        "norm(x, residual, normalized_shape, weight, bias, eps, rms, backend)"};

}  // namespace

PyMethodDef FUSED_DEF = {"fused", reinterpret_cast<PyCFunction>(reinterpret_cast<void*>(fused)),
                         METH_FASTCALL, "fused(...): layernorm.fused_norm's arguments"};

PyMethodDef NORM_LINEAR_DEF = {
    "norm_linear", reinterpret_cast<PyCFunction>(reinterpret_cast<void*>(norm_linear)),
    METH_FASTCALL, "norm_linear(...): layernorm.layer_norm_linear's arguments"};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    static const int at_fork = pthread_atfork(nullptr, nullptr, after_fork_in_child);
    (void)at_fork;
    m.def("set_up", &set_up);
    m.def("forget", &forget);
    m.add_object("norm", pybind11::reinterpret_steal<pybind11::object>(
                             PyCFunction_NewEx(&NORM_DEF, nullptr, m.ptr())));
    m.add_object("fused", pybind11::reinterpret_steal<pybind11::object>(
                              PyCFunction_NewEx(&FUSED_DEF, nullptr, m.ptr())));
    m.add_object("norm_linear", pybind11::reinterpret_steal<pybind11::object>(
                                    PyCFunction_NewEx(&NORM_LINEAR_DEF, nullptr, m.ptr())));
}
