"""Which Python and torch callables ember records, evaluates at capture time, or leaves to Python.

One set per decision, each with the reason for it: a newcomer changing what ember does with one torch function
or builtin starts here.
"""
from __future__ import annotations

import math
import operator
import types

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
# torch functions of no tensor argument whose result depends only on their arguments or guarded global state.
TORCH_PURE_CONST = {"is_grad_enabled", "get_default_dtype", "is_tensor", "is_floating_point", "is_complex",
                    "is_autocast_enabled", "is_inference_mode_enabled", "result_type", "promote_types",
                    "can_cast", "is_storage", "numel", "typename", "finfo", "iinfo", "is_nonzero_",
                    "_get_tracing_state", "is_scripting", "is_anomaly_enabled", "is_deterministic_algorithms_warn_only_enabled",
                    "are_deterministic_algorithms_enabled", "broadcast_shapes", "_has_torch_function",
                    "_has_torch_function_unary", "_has_torch_function_variadic", "get_autocast_gpu_dtype",
                    "is_autocast_cpu_enabled",
                    # torch.overrides' checks on arguments that hold no tensor: False for plain Python values (a
                    # bool in torch._assert), so the library code after them is captured
                    "has_torch_function", "has_torch_function_unary", "has_torch_function_variadic"}
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
# bookkeeping calls with no effect on the program's values or output (torch's API-usage telemetry): skipped, as
# torch.compile skips them, so a library op that logs its use (torchvision's stochastic depth) is captured
IGNORED_CALLS = {getattr(torch._C, n) for n in ("_log_api_usage_once", "_log_api_usage_metadata")
                 if hasattr(torch._C, n)}
# module wrappers (ember.compile's CompiledModule, added by ember.api) that compiled code sees as the module they
# wrap (their `_orig_mod`): the inner compile is inlined into the outer graph, as torch.compile inlines its own
MODULE_WRAPPERS: set[type] = set()
# torch.compiler.is_compiling() and friends: True, so libraries take their compile-friendly paths
COMPILING_PROBES = {getattr(torch.compiler, n) for n in ("is_compiling", "is_dynamo_compiling", "is_exporting")
                    if hasattr(torch.compiler, n)} - {getattr(torch.compiler, "is_exporting", None)}
# torch._C queries of global state that is fixed for the capture or guarded: evaluated at capture time
STATE_PROBES = {getattr(torch._C, n) for n in ("_is_tracing", "_get_tracing_state", "_get_cudnn_enabled",
                                               "_get_mkldnn_enabled", "is_grad_enabled", "_is_torch_function_enabled",
                                               "_is_functional_tensor",
                                               # fixed once set (torch.utils.rename_privateuse1_backend): asked by
                                               # torch.optim when it picks the foreach implementation
                                               "_get_privateuse1_backend_name") if hasattr(torch._C, n)}

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
