"""Loading and launching ember's Triton kernels with one launcher for every kernel.

Triton builds a C launcher for each new argument signature at a kernel's first load: a gcc run per signature, a
large part of a cold compile. ember's kernels take only pointers and int64 sizes (a static graph's sizes are
constants of the source; a symbolic graph's, int64 arguments), all 64-bit, so one launcher fits them all: it takes the integer addresses and calls the driver's cuLaunchKernel. It is built once per
machine, like the C++ guard checks, and replaces Triton's for every kernel that fits (`load`): one CTA per program,
no scratch memory, no cooperative or programmatic launch, and a PTX entry whose parameters are all 64-bit (the
pointers, then Triton's own scratch pointers, passed as null). Anything else, and every kernel while the launcher
is not built, goes through Triton's.
"""
from __future__ import annotations

import re
import sysconfig
from dataclasses import dataclass, field

from ember.runtime.cache import Extension

SOURCE = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <stdint.h>

typedef int CUresult;
typedef int CUdevice;
typedef void* CUcontext;
static CUresult (*launch_kernel)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void*,
                                 void**, void**);
static CUresult (*ctx_get_current)(CUcontext*);
static CUresult (*ctx_set_current)(CUcontext);
static CUresult (*device_get)(CUdevice*, int);
static CUresult (*primary_ctx_retain)(CUcontext*, CUdevice);
static CUresult (*error_string)(CUresult, const char**);

static PyObject* cuda_error(const char* what, CUresult r) {
  const char* s = "unknown error";
  if (error_string) error_string(r, &s);
  PyErr_Format(PyExc_RuntimeError, "%s failed: CUDA error %d: %s", what, r, s);
  return NULL;
}

// launch(function, grid, threads, shared, nulls, device, stream, *pointers): the kernel `function` on `grid`
// programs of `threads` threads, its parameters the pointers then `nulls` null pointers
static PyObject* launch(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  enum { HEAD = 7, MAX_PARAMS = 512 };
  if (nargs < HEAD) { PyErr_SetString(PyExc_TypeError, "launch: too few arguments"); return NULL; }
  uint64_t head[HEAD];
  for (int i = 0; i < HEAD; i++) {
    head[i] = PyLong_AsUnsignedLongLong(args[i]);
    if (head[i] == (uint64_t)-1 && PyErr_Occurred()) return NULL;
  }
  Py_ssize_t n = nargs - HEAD, total = n + (Py_ssize_t)head[4];
  if (total > MAX_PARAMS) { PyErr_SetString(PyExc_ValueError, "launch: too many parameters"); return NULL; }
  uint64_t values[MAX_PARAMS];
  void* params[MAX_PARAMS];
  for (Py_ssize_t i = 0; i < total; i++) {
    if (i < n) {
      values[i] = PyLong_AsUnsignedLongLong(args[HEAD + i]);
      if (values[i] == (uint64_t)-1 && PyErr_Occurred()) return NULL;
    } else {
      values[i] = 0;
    }
    params[i] = &values[i];
  }
  CUresult r;
  CUcontext ctx = NULL;
  Py_BEGIN_ALLOW_THREADS
  r = ctx_get_current(&ctx);
  if (r == 0 && ctx == NULL) {   // a thread that has not used CUDA yet: the device's primary context, as torch's
    CUdevice dev;
    r = device_get(&dev, (int)head[5]);
    if (r == 0) r = primary_ctx_retain(&ctx, dev);
    if (r == 0) r = ctx_set_current(ctx);
  }
  if (r == 0)
    r = launch_kernel((void*)head[0], (unsigned)head[1], 1, 1, (unsigned)head[2], 1, 1, (unsigned)head[3],
                      (void*)head[6], params, NULL);
  Py_END_ALLOW_THREADS
  if (r != 0) return cuda_error("cuLaunchKernel", r);
  Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
  {"launch", (PyCFunction)(void (*)(void))launch, METH_FASTCALL,
   "launch(function, grid, threads, shared, nulls, device, stream, *pointers)"},
  {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "ember_cuda_launch", NULL, -1, methods};

PyMODINIT_FUNC PyInit_ember_cuda_launch(void) {
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
  if (!lib) { PyErr_Format(PyExc_ImportError, "libcuda.so.1: %s", dlerror()); return NULL; }
  launch_kernel = (CUresult (*)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void*,
                                void**, void**))dlsym(lib, "cuLaunchKernel");
  ctx_get_current = (CUresult (*)(CUcontext*))dlsym(lib, "cuCtxGetCurrent");
  ctx_set_current = (CUresult (*)(CUcontext))dlsym(lib, "cuCtxSetCurrent");
  device_get = (CUresult (*)(CUdevice*, int))dlsym(lib, "cuDeviceGet");
  primary_ctx_retain = (CUresult (*)(CUcontext*, CUdevice))dlsym(lib, "cuDevicePrimaryCtxRetain");
  error_string = (CUresult (*)(CUresult, const char**))dlsym(lib, "cuGetErrorString");
  if (!launch_kernel || !ctx_get_current || !ctx_set_current || !device_get || !primary_ctx_retain) {
    PyErr_SetString(PyExc_ImportError, "libcuda.so.1 lacks a driver function the launcher calls");
    return NULL;
  }
  return PyModule_Create(&module);
}
"""

EXTENSION = Extension("launch", "ember_cuda_launch", SOURCE,
                      lambda: ["-O2", "-shared", "-fPIC", f"-I{sysconfig.get_paths()['include']}", "-ldl"],
                      "EMBER_NATIVE_LAUNCH", "ember's kernel launcher (kernels launch through Triton's)", "fallbacks")


@dataclass(frozen=True)
class Loaded:
    """A kernel loaded for ember's launcher: `launch(function, grid, threads, shared, nulls, device, stream,
    *pointers)` runs it."""
    function: int
    threads: int
    shared: int
    nulls: int      # Triton's scratch parameters after the pointers
    device: int
    launch: object
    compiled: object = field(default=None, compare=False)   # Triton's compiled kernel (its saved form)


def _entry_params(ptx: str, name: str) -> list[str] | None:
    m = re.search(r"\.entry\s+" + re.escape(name) + r"\s*\(([^)]*)\)", ptx)
    return None if m is None else [p.strip() for p in m.group(1).split(",") if p.strip()]


def load(kernel, n_pointers: int, device) -> Loaded | None:
    """`kernel` (Triton's compiled kernel, not yet loaded) loaded into `device` for ember's launcher, or None
    (built yet? a kernel it does not fit?): the caller then loads it through Triton."""
    ext = EXTENSION.get(wait=True)
    md = kernel.metadata
    if ext is None or getattr(md, "num_ctas", 1) != 1 or getattr(md, "global_scratch_size", 0) or \
            getattr(md, "profile_scratch_size", 0) or getattr(md, "launch_cooperative_grid", False) or \
            getattr(md, "launch_pdl", False) or getattr(md, "tmem_size", None) or \
            tuple(getattr(md, "cluster_dims", (1, 1, 1)) or (1, 1, 1)) not in ((1, 1, 1), (1,), ()):
        return None
    params = _entry_params(kernel.asm.get("ptx", ""), kernel.name)
    if params is None or len(params) < n_pointers or not all(p.startswith(".param .u64") for p in params):
        return None
    import triton
    drv = triton.runtime.driver.active
    index = device.index if device.index is not None else drv.get_current_device()
    if md.shared > drv.utils.get_device_properties(index)["max_shared_mem"]:
        return None   # (Triton's load raises the error it raises)
    _, function, _, _, max_threads = drv.utils.load_binary(kernel.name, kernel.kernel, md.shared, index)
    threads = md.num_warps * drv.get_current_target().warp_size
    if threads > max_threads:
        return None
    return Loaded(function, threads, md.shared, len(params) - n_pointers, index, ext.launch, kernel)
