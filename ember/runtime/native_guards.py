"""Guards in C++: the checks a cached call makes most, each over many values in one call.

- `check(tensors, types, specs)`: tensor metadata. A tensor guard checks type, dtype, requires_grad, shape,
  stride and device. Written as Python (Guards.tensor) that is six attribute reads, each a trip through torch's
  Python bindings (`t.shape` and `t.stride()` build a tuple): most of a cached call's frontend for a model with
  hundreds of tensors; batched as `list(map(attrgetter(...), tensors)) == [...]` it is no faster: the getters
  cost, not the bytecode. Read from each tensor's C++ TensorImpl it costs a small fraction of that.
- `check_consts(values, expected)`: each value is its expected int, float, str, bytes, complex, bool or None
  (or a tuple of such, item by item), of exactly its type (the Python guard `type(S) is int and S == 1` each; a
  CNN has hundreds, conv strides and paddings mostly).
- `check_falsy(values)`: `not S` for each (a module's hook dicts are empty).
- `check_dicts(values, keys)`: each is exactly a dict with these keys in this order (an optimizer's state
  dicts: `tuple(S) == keys` builds a tuple per parameter and call).
- `dict_get(d, key)`: `d.get(key)`, an optimizer's `state[p]`, with a tensor key's hash computed here as
  torch's Tensor.__hash__ (a Python function returning id(self)) would.
- `data_ptrs(tensors)`: each tensor's data_ptr() (ember.runtime.cudagraphs compares a replay's inputs' addresses
  with the recording's); `aligned_data_ptrs(tensors)` the same, or None when one is not 16-byte aligned (a
  Triton launch's pointers: codegen.triton.Launcher).

`spec(t)` packs a tensor's metadata at capture (int64s: scalar type, requires_grad, device type and index, ndim,
sizes, strides); `check(tensors, types, specs)` is true iff every tensor's exact Python type is its entry of
`types` and its packed metadata equals its part of `specs` (one bytes object for the batch); a size or stride
ANY in a spec (`with_any`: a symbolic one, ember.frontend.symbolic) matches any value. Tensors whose
type is not plain torch.Tensor or nn.Parameter (subclasses may override the metadata in Python), or that are
not dense strided tensors with concrete sizes, keep the Python checks (spec returns None).

The extension includes torch's headers and links against its libraries, so it is built for this torch and
Python: a long g++ run, in the background (ember.runtime.cache's pool), cached on disk under
$EMBER_CACHE_DIR/guards by a hash of the source, flags, torch version and Python version. Entries made before
it is loaded (Guards.condition asks, after the backend's compile), and all if it cannot be built (no compiler)
or EMBER_NATIVE_GUARDS=0, use the Python checks, which prove the same.
"""
from __future__ import annotations

import pathlib
import struct
import sysconfig
import types

import torch

from ember.runtime.cache import Extension

NAME = "ember_native_guards"
# the types whose metadata the C++ side may read: a Python subclass can override `shape` & co. in Python
BATCH_TYPES = (torch.Tensor, torch.nn.Parameter)

SOURCE = r"""
#include <Python.h>
#include <torch/csrc/autograd/python_variable.h>
#include <vector>

// The packed metadata of a dense strided tensor with concrete sizes, or None.
static PyObject* spec(PyObject*, PyObject* o) {
  if (!THPVariable_Check(o)) Py_RETURN_NONE;
  try {
    const at::Tensor& t = THPVariable_Unpack(o);
    c10::TensorImpl* impl = t.unsafeGetTensorImpl();
    if (t.layout() != c10::kStrided || t.is_nested() || impl->has_symbolic_sizes_strides() ||
        impl->is_python_dispatch())
      Py_RETURN_NONE;
    std::vector<int64_t> v = {int64_t(t.scalar_type()), int64_t(t.requires_grad()), int64_t(t.device().type()),
                              int64_t(t.device().index()), int64_t(t.dim())};
    for (int64_t s : t.sizes()) v.push_back(s);
    for (int64_t s : t.strides()) v.push_back(s);
    return PyBytes_FromStringAndSize(reinterpret_cast<const char*>(v.data()), Py_ssize_t(v.size() * 8));
  } catch (...) {
    Py_RETURN_NONE;
  }
}

static const int64_t ANY = INT64_MIN;

// check(tensors: tuple, types: tuple, specs: bytes) -> bool
static PyObject* check(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3 || !PyTuple_CheckExact(args[0]) || !PyTuple_CheckExact(args[1]) || !PyBytes_CheckExact(args[2])) {
    PyErr_SetString(PyExc_TypeError, "check(tensors: tuple, types: tuple, specs: bytes)");
    return nullptr;
  }
  PyObject *ts = args[0], *types = args[1];
  Py_ssize_t n = PyTuple_GET_SIZE(ts);
  if (PyTuple_GET_SIZE(types) != n) Py_RETURN_FALSE;
  const int64_t* p = reinterpret_cast<const int64_t*>(PyBytes_AS_STRING(args[2]));
  const int64_t* end = p + PyBytes_GET_SIZE(args[2]) / 8;
  try {
    for (Py_ssize_t i = 0; i < n; i++) {
      PyObject* o = PyTuple_GET_ITEM(ts, i);
      // exact type first: only then is `o` known to be a tensor whose metadata C++ may read
      if (reinterpret_cast<PyObject*>(Py_TYPE(o)) != PyTuple_GET_ITEM(types, i) || !THPVariable_Check(o) ||
          end - p < 5)
        Py_RETURN_FALSE;
      const at::Tensor& t = THPVariable_Unpack(o);
      c10::TensorImpl* impl = t.unsafeGetTensorImpl();
      if (impl->layout() != c10::kStrided || impl->is_nested() || impl->has_symbolic_sizes_strides() ||
          impl->is_python_dispatch())
        Py_RETURN_FALSE;
      int64_t dim = impl->dim();
      c10::Device d = impl->device();
      if (p[0] != int64_t(t.scalar_type()) || p[1] != int64_t(t.requires_grad()) ||
          p[2] != int64_t(d.type()) || p[3] != int64_t(d.index()) || p[4] != dim || end - p < 5 + 2 * dim)
        Py_RETURN_FALSE;
      p += 5;
      c10::IntArrayRef sizes = impl->sizes(), strides = impl->strides();
      // ANY (INT64_MIN) in a spec: a symbolic size or stride, whose relations the entry checks in Python
      for (int64_t k = 0; k < dim; k++)
        if ((p[k] != ANY && p[k] != sizes[k]) || (p[dim + k] != ANY && p[dim + k] != strides[k])) Py_RETURN_FALSE;
      p += 2 * dim;
    }
  } catch (...) {
    Py_RETURN_FALSE;
  }
  if (p != end) Py_RETURN_FALSE;
  Py_RETURN_TRUE;
}

// check_consts(values: tuple, expected: tuple) -> bool: each value is its expected constant (an int, float,
// str, bytes, complex, bool or None, or a tuple of such), of exactly its type: the Python guard `type(S) is int
// and S == 1` (or `S is None`; a tuple: `type(S) is tuple and len(S) == 2` and its items') for many S at once.
// v is e: the same object, or of exactly its type and equal; a tuple item by item so.
static bool same_const(PyObject* v, PyObject* e) {
  if (v == e) return true;
  if (Py_TYPE(v) != Py_TYPE(e)) return false;
  if (PyTuple_CheckExact(e)) {
    Py_ssize_t n = PyTuple_GET_SIZE(e);
    if (PyTuple_GET_SIZE(v) != n) return false;
    for (Py_ssize_t i = 0; i < n; i++)
      if (!same_const(PyTuple_GET_ITEM(v, i), PyTuple_GET_ITEM(e, i))) return false;
    return true;
  }
  int eq = PyObject_RichCompareBool(v, e, Py_EQ);
  if (eq < 0) PyErr_Clear();
  return eq == 1;
}

// f(values: tuple, expected: tuple) -> bool: ok(value, its expected) for every pair (the checks below)
template <bool (*ok)(PyObject*, PyObject*)>
static PyObject* each_pair(PyObject* const* args, Py_ssize_t nargs, const char* usage) {
  if (nargs != 2 || !PyTuple_CheckExact(args[0]) || !PyTuple_CheckExact(args[1])) {
    PyErr_SetString(PyExc_TypeError, usage);
    return nullptr;
  }
  Py_ssize_t n = PyTuple_GET_SIZE(args[0]);
  if (PyTuple_GET_SIZE(args[1]) != n) Py_RETURN_FALSE;
  for (Py_ssize_t i = 0; i < n; i++)
    if (!ok(PyTuple_GET_ITEM(args[0], i), PyTuple_GET_ITEM(args[1], i))) Py_RETURN_FALSE;
  Py_RETURN_TRUE;
}

static PyObject* check_consts(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return each_pair<same_const>(args, nargs, "check_consts(values: tuple, expected: tuple)");
}

// dict_get(d, key) -> d.get(key), the lookup of an optimizer's `state[p]` (guards.DICT_GET). Tensor.__hash__ is
// a Python function returning id(self) (~0.2 us a call); for a key whose type's __hash__ is that function, the
// hash is computed here as Python would from id(key): the same lookup, no Python call.
static PyObject* tensor_hash = nullptr;   // torch.Tensor.__dict__['__hash__'] (set by init)
static PyObject* hash_name = nullptr;

static PyObject* init(PyObject*, PyObject* fn) {
  Py_XDECREF(tensor_hash);
  Py_INCREF(fn);
  tensor_hash = fn;
  if (hash_name == nullptr) hash_name = PyUnicode_InternFromString("__hash__");
  Py_RETURN_NONE;
}

static PyObject* dict_get(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2 || !PyDict_Check(args[0])) {
    PyErr_SetString(PyExc_TypeError, "dict_get(d: dict, key)");
    return nullptr;
  }
  PyObject *d = args[0], *key = args[1];
  Py_hash_t h;
  if (tensor_hash != nullptr && hash_name != nullptr && _PyType_Lookup(Py_TYPE(key), hash_name) == tensor_hash) {
    h = Py_hash_t(uintptr_t(key) % ((uint64_t(1) << 61) - 1));   // hash(int): n mod 2**61 - 1 (64-bit builds)
  } else {
    h = PyObject_Hash(key);
    if (h == -1) return nullptr;
  }
  PyObject* v = _PyDict_GetItem_KnownHash(d, key, h);
  if (v == nullptr) {
    if (PyErr_Occurred()) return nullptr;
    Py_RETURN_NONE;
  }
  Py_INCREF(v);
  return v;
}

// check_dicts(values: tuple, keys: tuple of tuples) -> bool: each value is exactly a dict whose keys, in order,
// are its keys (`type(S) is dict and tuple(S) == keys`, without building the tuple).
static bool dict_with_keys(PyObject* d, PyObject* keys) {
  if (!PyDict_CheckExact(d) || !PyTuple_CheckExact(keys) || PyDict_GET_SIZE(d) != PyTuple_GET_SIZE(keys))
    return false;
  Py_ssize_t pos = 0, k = 0;
  PyObject *key, *value;
  while (PyDict_Next(d, &pos, &key, &value)) {
    PyObject* want = PyTuple_GET_ITEM(keys, k++);
    if (key == want) continue;
    Py_INCREF(key);   // (an __eq__ may change the dict)
    int eq = PyObject_RichCompareBool(key, want, Py_EQ);
    Py_DECREF(key);
    if (eq < 0) PyErr_Clear();
    if (eq != 1 || PyDict_GET_SIZE(d) != PyTuple_GET_SIZE(keys)) return false;
  }
  return true;
}

static PyObject* check_dicts(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return each_pair<dict_with_keys>(args, nargs, "check_dicts(values: tuple, keys: tuple)");
}

// check_falsy(values: tuple) -> bool: `not S` for each S (a module's hook dicts: empty).
static PyObject* check_falsy(PyObject*, PyObject* values) {
  if (!PyTuple_CheckExact(values)) {
    PyErr_SetString(PyExc_TypeError, "check_falsy(values: tuple)");
    return nullptr;
  }
  for (Py_ssize_t i = 0, n = PyTuple_GET_SIZE(values); i < n; i++) {
    int r = PyObject_IsTrue(PyTuple_GET_ITEM(values, i));
    if (r < 0) PyErr_Clear();
    if (r != 0) Py_RETURN_FALSE;
  }
  Py_RETURN_TRUE;
}

// Each tensor's data_ptr(), as Tensor.data_ptr() gives it (~0.15 us a tensor from Python; a CUDA graph's replay
// compares hundreds, a Triton launch passes its arguments'), in a tuple; None when one is not a plain tensor or
// its address is not a multiple of `align` (the caller then asks Python).
static PyObject* pointers(PyObject* ts, uintptr_t align, const char* usage) {
  if (!PyTuple_CheckExact(ts)) {
    PyErr_SetString(PyExc_TypeError, usage);
    return nullptr;
  }
  Py_ssize_t n = PyTuple_GET_SIZE(ts);
  PyObject* out = PyTuple_New(n);
  if (out == nullptr) return nullptr;
  try {
    for (Py_ssize_t i = 0; i < n; i++) {
      PyObject* o = PyTuple_GET_ITEM(ts, i);
      if (!THPVariable_Check(o) || THPVariable_Unpack(o).unsafeGetTensorImpl()->is_python_dispatch()) {
        Py_DECREF(out);
        Py_RETURN_NONE;
      }
      void* ptr = THPVariable_Unpack(o).data_ptr();
      PyObject* p = reinterpret_cast<uintptr_t>(ptr) % align ? nullptr : PyLong_FromVoidPtr(ptr);
      if (p == nullptr) {
        Py_DECREF(out);
        if (PyErr_Occurred()) return nullptr;
        Py_RETURN_NONE;
      }
      PyTuple_SET_ITEM(out, i, p);
    }
  } catch (...) {
    Py_DECREF(out);
    Py_RETURN_NONE;
  }
  return out;
}

// data_ptrs(tensors: tuple) -> tuple of int, or None (pointers above)
static PyObject* data_ptrs(PyObject*, PyObject* ts) { return pointers(ts, 1, "data_ptrs(tensors: tuple)"); }

// aligned_data_ptrs(tensors: tuple) -> the same, or None when one is not 16-byte aligned: a Triton kernel
// launch's pointer arguments, compiled for 16-byte alignment
static PyObject* aligned_data_ptrs(PyObject*, PyObject* ts) {
  return pointers(ts, 16, "aligned_data_ptrs(tensors: tuple)");
}

static PyMethodDef methods[] = {
    {"data_ptrs", data_ptrs, METH_O, "data_ptrs(tensors) -> tuple of each data_ptr(), or None"},
    {"aligned_data_ptrs", aligned_data_ptrs, METH_O,
     "aligned_data_ptrs(tensors) -> tuple of each data_ptr(), or None when one is not 16-byte aligned"},
    {"spec", spec, METH_O, "packed metadata of a tensor (bytes), or None"},
    {"check", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(check)), METH_FASTCALL,
     "check(tensors, types, specs) -> bool"},
    {"init", init, METH_O, "init(torch.Tensor.__hash__)"},
    {"dict_get", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(dict_get)), METH_FASTCALL,
     "dict_get(d, key) -> d.get(key)"},
    {"check_dicts", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(check_dicts)), METH_FASTCALL,
     "check_dicts(values, keys) -> bool"},
    {"check_falsy", check_falsy, METH_O, "check_falsy(values) -> all(not v for v in values)"},
    {"check_consts", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(check_consts)), METH_FASTCALL,
     "check_consts(values, expected) -> bool"},
    {nullptr, nullptr, 0, nullptr}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "ember_native_guards", nullptr, -1, methods};
PyMODINIT_FUNC PyInit_ember_native_guards(void) { return PyModule_Create(&module); }
"""

def _flags() -> list[str]:
    root = pathlib.Path(torch.__file__).parent
    lib = root / "lib"
    return ["-O2", "-shared", "-fPIC", "-std=c++20", f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            f"-I{sysconfig.get_paths()['include']}", f"-I{root / 'include'}",
            f"-I{root / 'include' / 'torch' / 'csrc' / 'api' / 'include'}", f"-L{lib}", f"-Wl,-rpath,{lib}",
            "-ltorch_python", "-ltorch", "-ltorch_cpu", "-lc10"]


EXTENSION = Extension("guards", NAME, SOURCE, _flags, "EMBER_NATIVE_GUARDS",
                      "the C++ guard checks (guards run as Python: correct, slower per call)", "guards",
                      init=lambda mod: mod.init(torch.Tensor.__dict__["__hash__"]))


ANY = -2 ** 63   # a size or stride `check` does not compare (the C++ ANY)


def with_any(spec: bytes, sizes: list[int], strides: list[int]) -> bytes:
    """A packed spec (`spec(t)`) with the sizes and strides at these dims made ANY."""
    v = list(struct.unpack(f"{len(spec) // 8}q", spec))
    dim = v[4]
    for k in sizes:
        v[5 + k] = ANY
    for k in strides:
        v[5 + dim + k] = ANY
    return struct.pack(f"{len(v)}q", *v)


def checker(wait: bool = False) -> types.ModuleType | None:
    """The loaded extension, or None while it builds (the first call starts the build, in the background) or
    when it cannot be had (EMBER_NATIVE_GUARDS=0: never). `wait`: block until the build has ended."""
    return EXTENSION.get(wait)
