// Compiled dispatch: plain eager inference of layernorm's four functions, from Python
// straight to the numba backend's compiled forward kernel, with the checks and the
// allocations in C++ (layernorm/compiled.py builds and loads it and says why).
//
// norm(x, residual, normalized_shape, weight, bias, eps, rms, backend) answers the call
// that ops._common_call accepts, that needs no gradient, that no PyTorch mechanism would
// intercept (see mechanism_active) and that the automatic backend runs on numba:
// (y, residual_out) with the bits of the Python path, which calls the same compiled
// kernel. For any other call it answers None, before doing any work, and ops takes the
// call through Python.

#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/autocast_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/frontend/tracer.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <map>
#include <mutex>
#include <optional>
#include <tuple>
#include <vector>

namespace {

using torch::Tensor;
using torch::autograd::variable_list;

// The forward kernel entry (layernorm.backends._numba_kernels.entry): a void function of
// addresses, sizes and flags. FORWARD_SIGNATURE spells its parameters in the form of
// layernorm.backends._kernel_abi; set_up compares the two, so a mismatch raises.
using ForwardKernel = void (*)(int64_t x, int64_t x_stride, int64_t residual,
                               int64_t residual_stride, bool has_residual, int64_t residual_out,
                               int64_t weight, int64_t bias, int64_t y, int64_t mean,
                               int64_t rstd, int64_t m, int64_t n, double eps, bool rms,
                               bool stream, bool store_stats, int64_t flags);
const char* const FORWARD_SIGNATURE =
    "x:i64,x_stride:i64,residual:i64,residual_stride:i64,has_residual:bool,"
    "residual_out:i64,weight:i64,bias:i64,y:i64,mean:i64,rstd:i64,m:i64,n:i64,eps:f64,"
    "rms:bool,stream:bool,store_stats:bool,flags:i64";

enum Entry { FORWARD_SERIAL, FORWARD_PARALLEL };
const char* const ENTRY_NAMES[] = {"forward_serial", "forward_parallel"};
constexpr int DTYPES = 4;  // float16, bfloat16, float32, float64: compiled.DTYPES' order

struct State {
    PyObject* tensor_type = nullptr;     // torch.Tensor
    PyObject* parameter_type = nullptr;  // torch.nn.Parameter
    PyObject* resolve = nullptr;  // (dtype index, entry name) -> C address, or None
    int64_t serial_numel = 0;     // numba_.SERIAL_NUMEL
    int64_t max_bytes = 0;        // larger inputs go through Python (streaming, host cache)
    int64_t kernels[DTYPES][2] = {};  // C addresses: 0 not asked yet, -1 none
    double default_eps[DTYPES] = {};  // eps=None per dtype: _op.default_eps's values
};
State state;

int dtype_index(at::ScalarType t) {
    switch (t) {
        case at::kHalf: return 0;
        case at::kBFloat16: return 1;
        case at::kFloat: return 2;
        case at::kDouble: return 3;
        default: return -1;
    }
}

at::ScalarType acc_dtype(int d) { return d == 3 ? at::kDouble : at::kFloat; }

int64_t address(const Tensor& t) { return reinterpret_cast<int64_t>(t.data_ptr()); }

// The kernel's C address, asked of Python the first time (the GIL must be held).
int64_t kernel(int d, Entry e) {
    int64_t& a = state.kernels[d][e];
    if (a == 0) {
        PyObject* r = PyObject_CallFunction(state.resolve, "is", d, ENTRY_NAMES[e]);
        if (r == nullptr) throw python_error();
        a = r == Py_None ? -1 : PyLong_AsLongLong(r);
        Py_DECREF(r);
        if (a == -1 && PyErr_Occurred()) throw python_error();
    }
    return a;
}

// A cached (N,) tensor full of value: ones for a missing weight, -0.0 for a missing bias
// (as numba_._constant).
Tensor constant(int64_t n, at::ScalarType dtype, double value) {
    static std::mutex mutex;
    static std::map<std::tuple<int64_t, int, bool, double>, Tensor> cache;
    std::lock_guard<std::mutex> lock(mutex);
    auto key = std::make_tuple(n, static_cast<int>(dtype), std::signbit(value), value);
    auto found = cache.find(key);
    if (found != cache.end()) return found->second;
    if (cache.size() > 64) cache.clear();
    return cache[key] = at::full({n}, value, at::TensorOptions().dtype(dtype));
}

// A parameter as the kernels take it: in the accumulation dtype, or the default row.
Tensor kernel_param(const Tensor& p, int64_t n, at::ScalarType acc, double missing) {
    if (!p.defined()) return constant(n, acc, missing);
    return p.scalar_type() == acc ? p : p.to(acc).contiguous();
}

struct Forward {
    Tensor y, residual_out;
    bool flagged = false;  // a row needs the exact fallback: Python's path does it
};

// The kernel's outputs; it computes no statistics (nothing will differentiate them).
Forward forward(const Tensor& x, const Tensor& residual, const Tensor& weight,
                const Tensor& bias, double eps, bool rms, int d, int64_t kernel_address) {
    const int64_t n = x.size(-1), numel = x.numel(), m = numel / n;
    const auto acc = acc_dtype(d);
    Forward out;
    out.y = at::empty_like(x);
    const Tensor w = kernel_param(weight, n, acc, 1.0), b = kernel_param(bias, n, acc, -0.0);
    const int64_t x_address = address(x);
    const bool has_residual = residual.defined();
    if (has_residual) out.residual_out = at::empty_like(x);
    // the statistics' addresses are never written (store_stats false): any valid one will do
    const Tensor flags = at::empty({m + 1}, at::TensorOptions().dtype(at::kByte));
    reinterpret_cast<ForwardKernel>(kernel_address)(
        x_address, n, has_residual ? address(residual) : x_address, has_residual ? n : 0,
        has_residual, has_residual ? address(out.residual_out) : x_address, address(w),
        address(b), address(out.y), x_address, x_address, m, n, eps, rms, false, false,
        address(flags));
    out.flagged = flags.data_ptr<uint8_t>()[m] != 0;
    return out;
}

// n when normalized_shape is an int or a 1-tuple of one (exactly: not bool, not Size).
int64_t last_dim(PyObject* shape) {
    if (PyTuple_CheckExact(shape) && PyTuple_GET_SIZE(shape) == 1)
        shape = PyTuple_GET_ITEM(shape, 0);
    if (!PyLong_CheckExact(shape)) return 0;
    int overflow = 0;
    const long long n = PyLong_AsLongLongAndOverflow(shape, &overflow);
    return overflow != 0 ? 0 : n;
}

// A plain contiguous (N,) floating CPU tensor (or Parameter), or None (undefined).
bool plain_param(PyObject* p, int64_t n, Tensor* out) {
    if (p == Py_None) return true;
    if (Py_TYPE(p) != reinterpret_cast<PyTypeObject*>(state.tensor_type) &&
        Py_TYPE(p) != reinterpret_cast<PyTypeObject*>(state.parameter_type))
        return false;
    const Tensor& t = THPVariable_Unpack(p);
    if (!(t.is_cpu() && t.dim() == 1 && t.size(0) == n && t.is_floating_point() &&
          t.is_contiguous()))
        return false;
    *out = t;
    return true;
}

// Whether a PyTorch mechanism would see or change this call: a functorch transform, a
// dispatch or function mode (FakeTensorMode, TorchDispatchMode, torch.device), jit
// tracing, CPU autocast, or a tensor that is not a plain dense CPU one (functorch
// wrappers, subclasses' Python key, dual tensors' tangents).
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

bool environment_chooses() {
    const char* name = std::getenv("LAYERNORM_BACKEND");
    return name != nullptr && name[0] != '\0';
}

PyObject* wrap_or_none(const Tensor& t) {
    if (!t.defined()) Py_RETURN_NONE;
    return THPVariable_Wrap(t);
}

PyObject* norm(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
    HANDLE_TH_ERRORS
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "norm takes 8 arguments");
        return nullptr;
    }
    PyObject *x_object = args[0], *residual_object = args[1], *eps_object = args[5];
    if (state.resolve == nullptr || args[7] != Py_None ||
        !(eps_object == Py_None || PyFloat_CheckExact(eps_object)) ||
        Py_TYPE(x_object) != reinterpret_cast<PyTypeObject*>(state.tensor_type))
        Py_RETURN_NONE;
    const int64_t n = last_dim(args[2]);
    if (n <= 0) Py_RETURN_NONE;
    const Tensor& x = THPVariable_Unpack(x_object);
    if (!(x.is_cpu() && x.dim() > 0 && x.size(-1) == n && x.is_contiguous()))
        Py_RETURN_NONE;
    const int d = dtype_index(x.scalar_type());
    const int64_t numel = x.numel();
    if (d < 0 || numel == 0 || numel * static_cast<int64_t>(x.element_size()) >= state.max_bytes)
        Py_RETURN_NONE;
    const double eps =
        eps_object != Py_None ? PyFloat_AS_DOUBLE(eps_object) : state.default_eps[d];
    if (!(eps >= 0)) Py_RETURN_NONE;
    Tensor residual, weight, bias;
    if (residual_object != Py_None) {
        if (Py_TYPE(residual_object) != reinterpret_cast<PyTypeObject*>(state.tensor_type))
            Py_RETURN_NONE;
        residual = THPVariable_Unpack(residual_object);
        if (!(residual.is_cpu() && residual.scalar_type() == x.scalar_type() &&
              residual.sizes() == x.sizes() && residual.is_contiguous()))
            Py_RETURN_NONE;
    }
    if (!plain_param(args[3], n, &weight) || !plain_param(args[4], n, &bias) ||
        environment_chooses())
        Py_RETURN_NONE;
    const bool rms = args[6] == Py_True;
    auto requires_grad = [](const Tensor& t) { return t.defined() && t.requires_grad(); };
    if (torch::GradMode::is_enabled() && (x.requires_grad() || requires_grad(residual) ||
                                          requires_grad(weight) || requires_grad(bias)))
        Py_RETURN_NONE;  // autograd is Python's (layernorm._op.Norm)
    if (mechanism_active({&x, &residual, &weight, &bias})) Py_RETURN_NONE;
    const int64_t kernel_address =
        kernel(d, numel < state.serial_numel ? FORWARD_SERIAL : FORWARD_PARALLEL);
    if (kernel_address < 0) Py_RETURN_NONE;  // the automatic backend is not numba
    auto out = forward(x, residual, weight, bias, eps, rms, d, kernel_address);
    if (out.flagged) Py_RETURN_NONE;  // rare: the Python path runs the exact fallback
    const Tensor y = out.y, residual_out = out.residual_out;
    PyObject* result = PyTuple_New(2);
    if (result == nullptr) return nullptr;
    PyTuple_SET_ITEM(result, 0, THPVariable_Wrap(y));
    PyTuple_SET_ITEM(result, 1, wrap_or_none(residual_out));
    return result;
    END_HANDLE_TH_ERRORS
}

// set_up(torch.Tensor, torch.nn.Parameter, resolve, serial_numel, max_bytes,
// forward_signature, default_eps): forward_signature is _kernel_abi's spelling of the
// forward kernel's parameters, which must be FORWARD_SIGNATURE; default_eps the eps of
// eps=None for each dtype, in compiled.DTYPES' order.
void set_up(pybind11::object tensor_type, pybind11::object parameter_type,
            pybind11::object resolve, int64_t serial_numel, int64_t max_bytes,
            const std::string& forward_signature, const std::vector<double>& default_eps) {
    TORCH_CHECK(forward_signature == FORWARD_SIGNATURE,
                "layernorm's compiled dispatch was built for the forward kernel signature ",
                FORWARD_SIGNATURE, " but the numba kernels have ", forward_signature,
                ": rebuild it (layernorm build)");
    TORCH_CHECK(default_eps.size() == DTYPES, "set_up: one default eps per dtype");
    std::copy(default_eps.begin(), default_eps.end(), state.default_eps);
    for (PyObject* old : {state.tensor_type, state.parameter_type, state.resolve}) Py_XDECREF(old);
    state.tensor_type = tensor_type.release().ptr();
    state.parameter_type = parameter_type.release().ptr();
    state.resolve = resolve.release().ptr();
    state.serial_numel = serial_numel;
    state.max_bytes = max_bytes;
    std::fill(&state.kernels[0][0], &state.kernels[0][0] + DTYPES * 2, 0);
}

// Forgets the kernel addresses, so the next call asks again (backends.forget).
void forget() { std::fill(&state.kernels[0][0], &state.kernels[0][0] + DTYPES * 2, 0); }

PyMethodDef NORM_DEF = {"norm", reinterpret_cast<PyCFunction>(reinterpret_cast<void*>(norm)),
                        METH_FASTCALL,
                        "norm(x, residual, normalized_shape, weight, bias, eps, rms, backend)"};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("set_up", &set_up);
    m.def("forget", &forget);
    m.add_object("norm", pybind11::reinterpret_steal<pybind11::object>(
                             PyCFunction_NewEx(&NORM_DEF, nullptr, m.ptr())));
}
