// Compiled dispatch: the common call of layernorm's four functions, from Python straight
// to the numba backend's compiled kernels, with the checks, the allocations and autograd
// in C++ (layernorm/compiled.py builds and loads it; its docstring says why).
//
// norm(x, residual, normalized_shape, weight, bias, eps, rms, backend) answers the call
// that ops._common_call accepts and the automatic backend runs on numba: (y, residual_out)
// with the bits of the Python path, which calls the same compiled kernels. For any other
// call it answers None, before doing any work, and ops takes the call through Python.

#include <torch/extension.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/saved_variable.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <tuple>

namespace {

using torch::Tensor;
using torch::autograd::variable_list;

// The kernel entries (layernorm.backends._numba_kernels.entry): void functions of
// addresses, sizes and flags.
using ForwardKernel = void (*)(int64_t x, int64_t xs, int64_t r, int64_t rs, bool has_r,
                               int64_t h, int64_t w, int64_t b, int64_t y, int64_t mean,
                               int64_t rstd, int64_t m, int64_t n, double eps, bool rms,
                               bool stream, bool st);
using BackwardKernel = void (*)(int64_t dy, int64_t gs, int64_t x, int64_t xs, int64_t dro,
                                int64_t ds, int64_t w, int64_t mean, int64_t rstd, int64_t dx,
                                int64_t dweight, int64_t dbias, int64_t m, int64_t n, bool rms,
                                bool stream);

enum Entry { FORWARD_SERIAL, FORWARD_PARALLEL, BACKWARD_SERIAL, BACKWARD_PARALLEL };
const char* const ENTRY_NAMES[] = {"forward_serial", "forward_parallel", "backward_serial",
                                   "backward_parallel"};
constexpr int DTYPES = 4;  // float16, bfloat16, float32, float64: compiled.DTYPES' order

struct State {
    PyObject* tensor_type = nullptr;     // torch.Tensor
    PyObject* parameter_type = nullptr;  // torch.nn.Parameter
    PyObject* resolve = nullptr;    // (dtype index, entry name) -> C address, or None
    PyObject* composite = nullptr;  // ops._composite_backward: the differentiable backward
    int64_t serial_numel = 0;       // numba_.SERIAL_NUMEL
    int64_t max_bytes = 0;          // larger inputs go through Python (streaming, host cache)
    int64_t kernels[DTYPES][4] = {};  // C addresses: 0 not asked yet, -1 none
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
// or residual gradient (as numba_._constant).
Tensor constant(int64_t n, at::ScalarType dtype, double value) {
    static std::mutex mutex;  // (backward calls come from the autograd engine's threads)
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
    Tensor y, residual_out, mean, rstd;
};

Forward forward(const Tensor& x, const Tensor& residual, const Tensor& weight,
                const Tensor& bias, double eps, bool rms, int d, int64_t kernel_address,
                bool stats) {
    const int64_t n = x.size(-1), numel = x.numel(), m = numel / n;
    const auto acc = acc_dtype(d);
    const auto stat_options = at::TensorOptions().dtype(acc);
    Forward out;
    out.y = at::empty_like(x);
    const Tensor w = kernel_param(weight, n, acc, 1.0), b = kernel_param(bias, n, acc, -0.0);
    const int64_t x_address = address(x);
    int64_t mean_address = x_address, rstd_address = x_address;  // any valid address
    if (stats) {
        if (!rms) {
            out.mean = at::empty({m}, stat_options);
            mean_address = address(out.mean);
        }
        out.rstd = at::empty({m}, stat_options);
        rstd_address = address(out.rstd);
    }
    const bool has_r = residual.defined();
    if (has_r) out.residual_out = at::empty_like(x);
    reinterpret_cast<ForwardKernel>(kernel_address)(
        x_address, n, has_r ? address(residual) : x_address, has_r ? n : 0, has_r,
        has_r ? address(out.residual_out) : x_address, address(w), address(b), address(out.y),
        mean_address, rstd_address, m, n, eps, rms, false, stats);
    return out;
}

// Gradients of the forward of one Norm node: the numba backward kernel, or the
// differentiable formula (ops._composite_backward) when a graph of the backward itself is
// wanted (double backward). Run by the autograd engine without the GIL.
std::tuple<Tensor, Tensor, Tensor> kernel_backward(const Tensor& dy, const Tensor& z,
                                                   const Tensor& weight, const Tensor& mean,
                                                   const Tensor& rstd, const Tensor& dro, bool rms,
                                                   int d, bool need_dweight, bool need_dbias) {
    const int64_t n = z.size(-1), numel = z.numel(), m = numel / n;
    int64_t kernel_address;
    {
        pybind11::gil_scoped_acquire gil;
        kernel_address =
            kernel(d, numel < state.serial_numel ? BACKWARD_SERIAL : BACKWARD_PARALLEL);
    }
    TORCH_CHECK(kernel_address > 0, "layernorm: the numba backward kernel is not available for ",
                z.dtype());
    const auto acc = acc_dtype(d);
    const Tensor w = kernel_param(weight, n, acc, 1.0);
    const Tensor row = dro.defined() ? dro : constant(n, z.scalar_type(), -0.0);
    Tensor dx = at::empty_like(z), dweight, dbias;
    if (need_dweight) dweight = at::empty({n}, at::TensorOptions().dtype(acc));
    if (need_dbias) dbias = at::empty({n}, at::TensorOptions().dtype(acc));
    reinterpret_cast<BackwardKernel>(kernel_address)(
        address(dy), n, address(z), n, address(row), dro.defined() ? n : 0, address(w),
        address(mean), address(rstd), address(dx), need_dweight ? address(dweight) : 0,
        need_dbias ? address(dbias) : 0, m, n, rms, false);
    return {dx, dweight, dbias};
}

std::tuple<Tensor, Tensor, Tensor> composite_backward(const Tensor& dy, const Tensor& z,
                                                      const Tensor& weight, double eps, bool rms,
                                                      const Tensor& dro) {
    pybind11::gil_scoped_acquire gil;
    auto wrap = [](const Tensor& t) {
        return t.defined() ? pybind11::reinterpret_steal<pybind11::object>(THPVariable_Wrap(t))
                           : pybind11::none();
    };
    auto result = pybind11::reinterpret_borrow<pybind11::object>(state.composite)(
        wrap(dy), wrap(z), wrap(weight), eps, rms, wrap(dro));
    auto items = result.cast<pybind11::tuple>();
    return {THPVariable_Unpack(items[0].ptr()), THPVariable_Unpack(items[1].ptr()),
            THPVariable_Unpack(items[2].ptr())};
}

// The autograd node of a call with grad, made the way torch's generated nodes are (a
// torch::autograd::Function costs ~5 us more a call). Its next edges are x, residual,
// weight and bias (invalid for the absent ones); it saves z (x, or residual_out), the
// weight and the statistics, as ops._Norm does; its inputs are the gradients of y and
// residual_out.
struct NormBackward : public torch::autograd::Node {
    torch::autograd::SavedVariable z, weight, mean, rstd;
    double eps = 0;
    bool rms = false, has_r = false;
    int d = 0;
    std::optional<at::ScalarType> bias_dtype;  // (bias given)

    std::string name() const override { return "layernorm::NormBackward"; }

    void release_variables() override {
        z.reset_data();
        weight.reset_data();
        mean.reset_data();
        rstd.reset_data();
    }

    variable_list apply(variable_list&& grads) override {
        const Tensor z_value = z.unpack(getptr()), w = weight.unpack();
        const Tensor mean_value = mean.unpack(), rstd_value = rstd.unpack();
        const bool need_dx = should_compute_output(0), need_dresidual = should_compute_output(1);
        const bool need_dweight = should_compute_output(2), need_dbias = should_compute_output(3);
        // An unused output's gradient is zeros, as autograd.Function materializes it.
        // Incoming gradients may be expanded (y.sum().backward()): the kernels read rows.
        const Tensor dy = grads[0].defined() ? grads[0].contiguous() : at::zeros_like(z_value);
        Tensor dro;
        if (has_r) dro = grads[1].defined() ? grads[1].contiguous() : at::zeros_like(z_value);
        Tensor dz, dweight, dbias;
        if (torch::GradMode::is_enabled()) {
            std::tie(dz, dweight, dbias) = composite_backward(dy, z_value, w, eps, rms, dro);
        } else {
            std::tie(dz, dweight, dbias) =
                kernel_backward(dy, z_value, w, rms ? rstd_value : mean_value, rstd_value, dro,
                                rms, d, need_dweight, need_dbias);
        }
        variable_list result(4);
        if (need_dweight) result[2] = dweight.to(w.scalar_type());
        if (need_dbias) result[3] = dbias.to(*bias_dtype);
        // x and residual get the same gradient; never hand one tensor to two leaves.
        if (need_dresidual) result[1] = need_dx ? dz.clone() : dz;
        if (need_dx) result[0] = dz;
        return result;
    }
};

// The forward of a call with grad: the kernels' outputs with their node.
Forward forward_with_grad(const Tensor& x, const Tensor& residual, const Tensor& weight,
                          const Tensor& bias, double eps, bool rms, int d,
                          int64_t kernel_address) {
    Forward out;
    {
        torch::NoGradGuard no_grad;  // (a weight converted to float32 needs no history)
        out = forward(x, residual, weight, bias, eps, rms, d, kernel_address, true);
    }
    auto node = c10::make_intrusive<NormBackward>();
    node->set_next_edges(torch::autograd::collect_next_edges(x, residual, weight, bias));
    torch::autograd::set_history(out.y, node);
    const bool has_r = residual.defined();
    if (has_r) torch::autograd::set_history(out.residual_out, node);
    // (after set_history: residual_out is saved as an output of the node)
    node->z = torch::autograd::SavedVariable(has_r ? out.residual_out : x, has_r);
    node->weight = torch::autograd::SavedVariable(weight, false);
    node->mean = torch::autograd::SavedVariable(out.mean, false);
    node->rstd = torch::autograd::SavedVariable(out.rstd, false);
    node->eps = eps;
    node->rms = rms;
    node->has_r = has_r;
    node->d = d;
    if (bias.defined()) node->bias_dtype = bias.scalar_type();
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
    // eps=None: the machine epsilon of the arithmetic's dtype (float32 for half inputs)
    const double eps = eps_object != Py_None ? PyFloat_AS_DOUBLE(eps_object)
                       : d == 3                ? std::numeric_limits<double>::epsilon()
                                               : std::numeric_limits<float>::epsilon();
    if (!(eps >= 0)) Py_RETURN_NONE;
    const int64_t numel = x.numel();
    if (d < 0 || numel == 0 || numel * static_cast<int64_t>(x.element_size()) >= state.max_bytes)
        Py_RETURN_NONE;
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
    const int64_t kernel_address =
        kernel(d, numel < state.serial_numel ? FORWARD_SERIAL : FORWARD_PARALLEL);
    if (kernel_address < 0) Py_RETURN_NONE;  // the automatic backend is not numba
    auto requires_grad = [](const Tensor& t) { return t.defined() && t.requires_grad(); };
    Tensor y, residual_out;
    if (torch::GradMode::is_enabled() &&
        (x.requires_grad() || requires_grad(residual) || requires_grad(weight) ||
         requires_grad(bias))) {
        auto out = forward_with_grad(x, residual, weight, bias, eps, rms, d, kernel_address);
        y = out.y;
        residual_out = out.residual_out;
    } else {
        auto out = forward(x, residual, weight, bias, eps, rms, d, kernel_address, false);
        y = out.y;
        residual_out = out.residual_out;
    }
    PyObject* result = PyTuple_New(2);
    if (result == nullptr) return nullptr;
    PyTuple_SET_ITEM(result, 0, THPVariable_Wrap(y));
    PyTuple_SET_ITEM(result, 1, wrap_or_none(residual_out));
    return result;
    END_HANDLE_TH_ERRORS
}

// set_up(torch.Tensor, torch.nn.Parameter, resolve, composite, serial_numel, max_bytes)
void set_up(pybind11::object tensor_type, pybind11::object parameter_type,
            pybind11::object resolve, pybind11::object composite, int64_t serial_numel,
            int64_t max_bytes) {
    for (PyObject* old : {state.tensor_type, state.parameter_type, state.resolve,
                          state.composite})
        Py_XDECREF(old);
    state.tensor_type = tensor_type.release().ptr();
    state.parameter_type = parameter_type.release().ptr();
    state.resolve = resolve.release().ptr();
    state.composite = composite.release().ptr();
    state.serial_numel = serial_numel;
    state.max_bytes = max_bytes;
    std::fill(&state.kernels[0][0], &state.kernels[0][0] + DTYPES * 4, 0);
}

// Forgets the kernel addresses, so the next call asks again (backends.forget).
void forget() { std::fill(&state.kernels[0][0], &state.kernels[0][0] + DTYPES * 4, 0); }

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
