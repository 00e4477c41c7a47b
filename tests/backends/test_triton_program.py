"""ember/backends/triton_program.py: a Triton kernel's binary as a saved program ships it (its Triton cache entry),
loaded in a process with an empty Triton cache without compiling. Without a GPU the kernel is compiled for one
(Triton compiles for a target it is given; the driver's load needs the GPU: tests/frontend/test_saved.py runs
the whole round trip there)."""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton", reason="the Triton backend needs the triton package")

SCRIPT = r'''
import json, os, sys
from ember.runtime import triton_launch
mod = triton_launch.load_module("""
import triton
import triton.language as tl

@triton.jit
def scaled_add(x, y, out, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out + i, tl.load(x + i) * 2.0 + tl.load(y + i))
""")
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from ember.backends.triton_program import TritonBinary
from ember.runtime import artifacts, cuda_launch

def source():
    aligned = [["tt.divisibility", 16]]
    return ASTSource(mod.scaled_add, {"x": "*fp32", "y": "*fp32", "out": "*fp32", "BLOCK": "constexpr"},
                     {(3,): 128}, {(0,): aligned, (1,): aligned, (2,): aligned})
target = GPUTarget("cuda", 90, 32)
compiled = triton.compile(source(), target=target)
class Launcher:   # what a launcher keeps of the kernel it launches
    pass
launcher = Launcher()
launcher.compiled = compiled
data, _ = artifacts.dumps(TritonBinary.of(launcher))
os.environ["TRITON_CACHE_DIR"] = sys.argv[1]   # another, empty, Triton cache
binary = artifacts.loads(data)
events = []
knobs.compilation.listener = lambda cache_hit=False, **_: events.append(cache_hit)
kernel = binary.load()
again = triton.compile(source(), target=target)   # Triton's own path (a kernel ember's launcher does not fit)
params = cuda_launch._entry_params(kernel.asm["ptx"], kernel.name)
launcher.compiled = kernel
print(json.dumps({"same_binary": kernel.kernel == compiled.kernel, "name": kernel.name,
                  "metadata": kernel.metadata._asdict() == compiled.metadata._asdict(), "events": events,
                  "hit_is_ours": again.metadata_group == kernel.metadata_group,
                  "params": params, "resaved": TritonBinary.of(launcher).files == binary.files}))
'''


def test_a_kernel_binary_loads_from_its_saved_cache_entry_without_a_compile(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "empty triton cache")], capture_output=True,
                       text=True, timeout=300, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
                       env={**env, "TRITON_CACHE_DIR": str(tmp_path / "triton cache"),
                            "EMBER_CACHE_DIR": str(tmp_path / "ember cache"),
                            "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.dirname(__file__)))})
    if r.returncode != 0 and "ptxas" in r.stderr:
        pytest.skip(f"Triton cannot compile for a GPU here (no ptxas): {r.stderr[-300:]}")
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["same_binary"] and got["metadata"] and got["name"] == "scaled_add", got
    # loading compiled nothing; Triton compiling the same kernel afterwards finds it in its cache: a hit
    assert got["events"] == [True] and got["hit_is_ours"], got
    # ember's launcher fits it (all its parameters 64-bit) and a loaded program saves the same binary again
    assert len(got["params"]) >= 3 and all(p.startswith(".param .u64") for p in got["params"]), got
    assert got["resaved"], got
