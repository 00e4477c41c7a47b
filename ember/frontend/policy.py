"""Which Python and torch callables ember records, evaluates at capture time, or leaves to Python.

One set per decision, each with the reason for it: a newcomer changing what ember does with one torch function
or builtin starts here.
"""
from __future__ import annotations

import dataclasses
import importlib
import math
import operator
import types
import weakref

import torch

# values ember treats as constants known at capture time (guarded by value, never graph inputs)
CONST_TYPES = (int, float, bool, str, type(None), complex, bytes, torch.dtype, torch.device, torch.memory_format,
               torch.layout, range, slice, type(Ellipsis), type(NotImplemented), torch.Size)
# where torch's callables live: any of these names not in TORCH_IMPURE is a torch op, recorded into the graph
TORCH_NAMESPACES = [torch, torch.nn.functional, torch.linalg, torch.fft, torch.special, torch._C._nn,
                    torch._C._VariableFunctions, torch._C._linalg, torch._C._fft, torch._C._special]
# torch callables that change global state or do I/O: never recorded, never evaluated at capture time.
TORCH_IMPURE = {"manual_seed", "seed", "save", "load", "set_default_dtype", "set_default_device", "set_printoptions",
                "compile", "use_deterministic_algorithms", "set_num_threads", "set_rng_state", "get_rng_state",
                "initial_seed", "set_float32_matmul_precision", "set_anomaly_enabled", "set_autocast_enabled",
                "_assert_async", "set_default_tensor_type", "set_deterministic_debug_mode"}
# torch functions that make tensors: recorded into the graph even without a tensor argument
FACTORIES = {"zeros", "ones", "empty", "full", "arange", "linspace", "logspace", "tensor", "as_tensor", "randn",
             "rand", "randint", "randperm", "normal", "eye", "scalar_tensor", "empty_strided", "zeros_like",
             "ones_like", "empty_like", "full_like", "rand_like", "randn_like", "randint_like", "bernoulli",
             "tril_indices", "triu_indices", "complex", "polar"}
# Device types whose losses' backward() joins the graph (Frame.tensor_backward): on CUDA a training step becomes
# one graph and one CUDA-graph replay, faster; on the CPU one graph measured slower than a separate backward
# (docs/evidence.md). Read as policy.BACKWARD_IN_GRAPH_DEVICES, so tests can widen it.
BACKWARD_IN_GRAPH_DEVICES = {"cuda"}
# Tensor methods that need the tensor's value in Python (or change its storage): a graph break.
TENSOR_METHODS_UNSUPPORTED = {"item", "tolist", "numpy", "backward", "register_hook", "retain_grad", "data_ptr",
                              "storage", "untyped_storage", "__bool__", "__int__", "__float__", "__index__",
                              "__len__", "__iter__", "__array__", "record_stream", "share_memory_", "pin_memory",
                              "register_post_accumulate_grad_hook", "__reduce_ex__", "__setstate__", "cpu_",
                              "set_", "resize_", "resize_as_", "__repr__", "__str__", "__format__", "tolist"}


def _namespace_items(ns):
    return [(name, getattr(ns, name, None)) for name in dir(ns) if not name.startswith("__")]


def _torch_callables() -> dict[int, str]:
    found = {}
    for ns in TORCH_NAMESPACES:
        for name, v in _namespace_items(ns):
            if callable(v) and not isinstance(v, (type, types.ModuleType)) and name not in TORCH_IMPURE:
                found.setdefault(id(v), name)
    return found


# id of each torch op (a callable of TORCH_NAMESPACES, not impure) -> its name, and -> the callable itself (an id
# alone could be a dead object's reused one)
TORCH_OPS = _torch_callables()
TORCH_OP_OBJS = {id(v): v for ns in TORCH_NAMESPACES for _, v in _namespace_items(ns) if id(v) in TORCH_OPS}
# modules whose attributes ember reads without guarding them: their contents are fixed for the process
TRUSTED_MODULE_PREFIXES = ("torch", "math", "operator", "functools", "itertools", "collections", "builtins",
                           "numbers", "typing", "enum", "dataclasses", "warnings", "inspect", "abc", "copy")
# builtins without side effects: evaluated at capture time on constant arguments
PURE_BUILTIN_FUNCS = {abs, round, divmod, pow, hash, chr, ord, hex, oct, bin, repr, ascii, format, callable, id}
# module wrappers (ember.compile's CompiledModule, added by ember.api) that compiled code sees as the module they
# wrap (their `_orig_mod`): the inner compile is inlined into the outer graph, as torch.compile inlines its own
MODULE_WRAPPERS: set[type] = set()
# that class itself (registered by ember.api, which the frontend cannot import): a module a wrapper such as DDP
# wraps is compiled as one for the wrapper's call (break_frames.call_wrapper)
COMPILED_MODULE: list[type] = []
# Calls ember neither records nor inlines: each is answered at capture time, by one of five rules.
#   pure:    a function of its arguments: evaluated (when no argument holds a tensor: with one, it is recorded)
#   mode:    follows the grad or autocast mode, which the entry guards and the capture tracks through the
#            program's own switches (`with torch.no_grad()`): evaluated, no guard of its own
#   guarded: a process setting that programs change outside compiled code: evaluated, and the entry guards its
#            value (a later change recompiles)
#   answer:  answered with a fixed value, as torch.compile answers it
#   skip:    no effect on values or output: not called, None
# Anything in neither this table nor the other sets of this file is recorded (a torch op), inlined (Python) or a
# graph break logged with the user's file:line.
@dataclasses.dataclass(frozen=True)
class AtCapture:
    rule: str
    why: str
    answer: object = None


def _resolve(path: str):
    obj = importlib.import_module(path.split(".")[0])
    for part in path.split(".")[1:]:
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _entries(rule: str, why: str, names: tuple[str, ...], answer: object = None) -> dict:
    return {f: AtCapture(rule, why, answer) for f in map(_resolve, names) if f is not None}


AT_CAPTURE = {
    **_entries("pure", "a function of its arguments", (
        "torch.is_tensor", "torch.is_storage", "torch.is_floating_point", "torch.is_complex", "torch.result_type",
        "torch.promote_types", "torch.can_cast", "torch.numel", "torch.typename", "torch.finfo", "torch.iinfo",
        "torch.broadcast_shapes")),
    **_entries("pure", "on arguments holding no tensor: False for plain Python values (a bool in torch._assert), so "
                       "the library code after the check is captured; torch.compile answers the same", (
        "torch.overrides.has_torch_function", "torch.overrides.has_torch_function_unary",
        "torch.overrides.has_torch_function_variadic")),
    **_entries("mode", "the grad mode: guarded at the entry, tracked through the program's switches", (
        "torch.is_grad_enabled", "torch._C.is_grad_enabled")),
    **_entries("mode", "the autocast state: guarded at the entry, tracked through the program's autocast blocks", (
        "torch.is_autocast_enabled", "torch.is_autocast_cpu_enabled", "torch.get_autocast_gpu_dtype",
        "torch.get_autocast_cpu_dtype", "torch.get_autocast_dtype", "torch._C._is_any_autocast_enabled")),
    **_entries("guarded", "a process setting: its value at capture, guarded", (
        "torch.get_default_dtype", "torch.is_inference_mode_enabled", "torch.is_anomaly_enabled",
        "torch.is_anomaly_check_nan_enabled", "torch.are_deterministic_algorithms_enabled",
        "torch.is_deterministic_algorithms_warn_only_enabled", "torch._C._get_cudnn_enabled",
        "torch._C._get_mkldnn_enabled", "torch.backends.mha.get_fastpath_enabled",
        "torch._C._get_privateuse1_backend_name", "torch._C._is_torch_function_enabled",
        "torch._C._is_torch_function_mode_enabled", "torch._C._len_torch_function_stack")),
    **_entries("guarded", "whether the current CUDA stream is capturing a CUDA graph (libraries skip checks that "
                          "would sync, transformers' is_tracing): False on a plain call, guarded. A graph break "
                          "otherwise, on the GPU only (torch.cuda answers False without CUDA)", (
        "torch._C._cuda_isCurrentStreamCapturing", "torch.cuda.is_current_stream_capturing")),
    **_entries("guarded", "TorchScript tracing (torch.jit.trace of a compiled function): None, guarded", (
        "torch._C._get_tracing_state", "torch._C._is_tracing")),
    **_entries("guarded", "the TorchDispatchMode stack the caller runs the program under (torch's own "
                          "`_get_current_dispatch_mode_stack` reads its length): empty on a plain call, guarded", (
        "torch._C._len_torch_dispatch_stack",)),
    **_entries("pure", "is this object a functionalization wrapper: on a Python value", (
        "torch._C._is_functional_tensor",)),
    **_entries("answer", "True, so libraries take their compile-friendly paths, as under torch.compile", (
        "torch.compiler.is_compiling", "torch.compiler.is_dynamo_compiling", "torch._utils.is_compiling"),
        answer=True),
    **_entries("answer", "ember captures, it does not export (torch.export)", ("torch.compiler.is_exporting",),
               answer=False),
    **_entries("answer", "True, as torch.compile answers it: nn.MultiheadAttention then takes its decomposable path "
                         "(its fused `_native_multi_head_attention` fast path has no decomposition), the graph "
                         "torch.compile captures", ("torch.nn.modules.activation._is_make_fx_tracing",), answer=True),
    **_entries("skip", "torch's API-usage telemetry (torchvision's ops log their use): skipped, as torch.compile "
                       "skips it", ("torch._C._log_api_usage_once", "torch._C._log_api_usage_metadata")),
}


# The programs (their Config, by id) a capture of which gave a compile-only answer (an "answer" above unlike
# eager's: `is_compiling()` True), and those that answer as eager: a capture after such an answer met an op whose
# fake run raises (a library's compile path that eager does not take: FrameCompiler.capture), so never wrong, every
# capture of the program from then on answers as eager does (the "answer" functions called at capture).
COMPILE_ANSWERED: dict[int, weakref.ref] = {}
EAGER_ANSWERS: dict[int, weakref.ref] = {}


def program_in(programs: dict[int, weakref.ref], cfg) -> bool:
    ref = programs.get(id(cfg))
    return ref is not None and ref() is cfg


def add_program(programs: dict[int, weakref.ref], cfg) -> None:
    key = id(cfg)
    programs[key] = weakref.ref(cfg, lambda _ref: programs.pop(key, None))


# Module hooks from these packages run as Python, never inlined: torch.distributed's (FSDP2's pre-forward all-gather,
# post-forward reshard) launch collectives and keep per-step state a graph cannot hold. A module with such a hook is
# a graph break; at the break the module is called as Python with its forward compiled (break_frames.call_with_forward).
PYTHON_HOOK_PACKAGES = ("torch.distributed",)


def python_hook(hook) -> bool:
    """Whether a module hook must run as Python (PYTHON_HOOK_PACKAGES), by the module of the function it runs."""
    fn = getattr(hook, "__func__", hook)
    mod = getattr(fn, "__module__", None) or type(fn).__module__ or ""
    return mod.startswith(PYTHON_HOOK_PACKAGES)


# Library modules whose forward is bookkeeping around the one module they wrap, by class -> the attribute holding
# it. DistributedDataParallel's forward prepares its reducer for the backward and broadcasts buffers (C++ state
# changed on every call, collectives): a call is a graph break, its forward runs as Python and the module it wraps
# runs compiled (break_frames.call_wrapper), as torch.compile skips DDP's frames and compiles the inner module.
PYTHON_WRAPPER_MODULES = {cls: "module" for cls in [_resolve("torch.nn.parallel.DistributedDataParallel")]
                          if cls is not None}


def wrapped_module_attr(mod) -> str | None:
    """The attribute holding the module a PYTHON_WRAPPER_MODULES module wraps, where its forward is the library's."""
    for cls, attr in PYTHON_WRAPPER_MODULES.items():
        if isinstance(mod, cls) and type(mod).forward is cls.forward:
            return attr
    return None


def marked_constant(f) -> bool:
    """A function torch._dynamo.assume_constant_result marked (transformers marks its install and version probes,
    `is_torch_greater_or_equal`, the same way without importing torch): its result is fixed for the process, so
    on constant arguments it is called at capture, unguarded, as torch.compile does."""
    return getattr(f, "_dynamo_marked_constant", False) is True or \
        getattr(getattr(f, "__wrapped__", None), "_dynamo_marked_constant", False) is True


def is_numpy_ufunc(f) -> bool:
    """numpy's elementwise functions (np.sqrt, np.lcm...): on Python numbers or numpy scalars they are pure, so they
    are evaluated at capture (reformer's, ctrl's `np.sqrt(d_model)`); on anything else they are a break."""
    return type(f).__name__ == "ufunc" and type(f).__module__ == "numpy"


def overrides_torch_function(cls: type) -> bool:
    """Whether torch calls on tensors of this class go through Python (`__torch_function__`: a subclass's own, or
    Tensor's default, which makes results of the subclass); nn.Parameter and torch's internal tensors switch it
    off. Such a tensor is not captured (the graph's ops would skip that Python): the call runs in Python."""
    return cls is not torch.Tensor and getattr(cls, "__torch_function__", None) is not \
        torch._C._disabled_torch_function_impl


# The wrapper torch._disable_dynamo puts around torch functions torch.compile must not trace (Optimizer.zero_grad,
# state_dict...): ember runs them as Python too rather than interpreting torch._dynamo's own code.
TORCH_DISABLED_CODE = torch._disable_dynamo(lambda: None).__code__
DYNAMO_WRAPPER_FILE = "/".join(("_dynamo", "eval_frame.py"))
# their calls may write output: graph breaks, as print
OUTPUT_MODULES = {"logging", "warnings"}
# nn.Module methods that walk its children, parameters or buffers: walked at capture time (Frame.module_traversal)
MODULE_TRAVERSALS = {"children", "named_children", "parameters", "named_parameters", "buffers", "named_buffers",
                     "modules", "named_modules"}
# read-only C methods of builtin base classes (dict.get on a dict subclass...): run at capture time, guarded
PURE_METHODS = {"get", "__getitem__", "__contains__", "__len__", "keys", "values", "items", "count", "index",
                "__eq__", "__ne__", "__hash__", "startswith", "endswith", "copy"}
# every function of math and operator: pure, evaluated at capture time on constants
MATH_FUNCS = {id(v) for v in vars(math).values() if callable(v)}
OPERATOR_FUNCS = {id(v): v for v in vars(operator).values() if callable(v)}
