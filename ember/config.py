"""Every switch of ember in one place.

Each is read where it is used (`config.NAME`), so a test or a script may set it for a while; each starts from the
environment variable EMBER_<NAME> when that is set (0/1 for a switch, a number for a limit). The switches exist
for A/B measurement and tests: the defaults are what ember runs.

Read from the environment at each use, not here (a test may set them with monkeypatch.setenv):
  EMBER_LOGS            topics to log: graph,guards,recompiles,graph_breaks,output_code,fallbacks (or all)
  EMBER_CACHE_DIR       where kernels, host programs and C extensions are cached (default ~/.cache/ember)
  EMBER_NATIVE_GUARDS   0: tensor and constant guards stay Python checks (the C++ checker is not built)
  EMBER_NATIVE_LAUNCH   0: Triton kernels launch through Triton's own launcher (ember's is not built)
  EMBER_FAIL_SAFE       0: an error inside ember raises instead of running the graph eagerly (repro scripts, tests)
  EMBER_CHECK           1: the first EMBER_CHECK_CALLS (2) calls of each graph compiled from then on are checked
                        against eager and float64, allowed EMBER_CHECK_FACTOR (10) times eager's error
                        (ember.tools.checked; docs/when_results_differ.md)
  EMBER_REPRO_DIR       a directory: graphs that crash ember or fail the check are saved there as repros
"""
from __future__ import annotations

import os


def _env(name: str, default):
    """EMBER_<name> parsed as the default's type, or the default."""
    raw = os.environ.get(f"EMBER_{name}")
    if raw is None:
        return default
    if isinstance(default, bool):
        return raw.strip().lower() not in ("0", "false", "off", "no", "")
    return type(default)(raw)


# frontend
RECOMPILE_LIMIT = _env("RECOMPILE_LIMIT", 8)        # entries a function gets before it warns once and runs uncompiled
MAX_INLINE_DEPTH = _env("MAX_INLINE_DEPTH", 32)     # nested calls inlined before a call breaks the graph (recursion)
COMPILE_WITHOUT_GC = _env("COMPILE_WITHOUT_GC", True)  # the cyclic GC paused during a capture and its compile

# autograd
MEMO = _env("MEMO", True)   # fake-tensor results of repeated ATen calls reused while tracing (same op, same metadata)

# decompositions
BN_FLOAT64_SUMS_ON_GPU = _env("BN_FLOAT64_SUMS_ON_GPU", False)  # GPU train batch norm sums in float64 (off: as eager)

# codegen: the C++ target
CPU_ISA = _env("CPU_ISA", "native")   # native | avx512 | avx2 | portable: what generated C++ is built for
CPU_KEEP_FREED_MEMORY = _env("CPU_KEEP_FREED_MEMORY", True)  # glibc keeps freed memory for reuse (runtime.heap)

# codegen: lowering
FUSE_CONVOLUTIONS = _env("FUSE_CONVOLUTIONS", True)  # CPU inference: conv absorbs batch norm; oneDNN post-ops
ONEDNN_MATMULS = _env("ONEDNN_MATMULS", "auto")      # CPU float32 products through oneDNN: auto (a CPU not Intel's), 1, 0 (ATen's mm)
FUSE_LINEARS = _env("FUSE_LINEARS", True)            # activations after CPU linear layers inside the oneDNN call
CONV_PRODUCTS = _env("CONV_PRODUCTS", True)          # 1x1 convolutions of channels-last CPU graphs as matrix products
STORE_BROADCASTS = _env("STORE_BROADCASTS", True)    # CPU: a costly value read broadcast is stored once first
SHARE_CAT_BUFFERS = _env("SHARE_CAT_BUFFERS", True)  # a chain of concatenations writes its pieces in place once
SPLIT_REDUCTIONS = _env("SPLIT_REDUCTIONS", True)    # reductions with too few results split into partial ones
ONE_HOT_SUMS = _env("ONE_HOT_SUMS", True)            # a sum over a one-hot row is the element it picks

# codegen: printers
ACCUMULATE_RESIDUALS = _env("ACCUMULATE_RESIDUALS", True)  # CPU conv + residual add accumulates into the residual
ONLINE_SOFTMAX = _env("ONLINE_SOFTMAX", True)  # Triton: a looped max and sum of exp(x - max) in one loop
OWN_SINCOS = _env("OWN_SINCOS", True)          # Triton float32 sin/cos of one value from one range reduction
