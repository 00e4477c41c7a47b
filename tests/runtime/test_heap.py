"""ember.runtime.heap: freed memory kept for the next allocation (glibc), so tensors allocated afresh on every call
of a compiled CPU graph reuse touched pages instead of faulting in new ones."""
import os
import platform
import subprocess
import sys

import pytest

# a step allocating six 4 MiB tensors (touched) and freeing them: minor page faults over 10 steps after 3
STEPS = """
import resource, sys, torch
from ember.runtime import heap
print(heap.keep_freed_memory())
def step():
    ts = [torch.ones(1 << 20) for _ in range(6)]
    del ts
for _ in range(3):
    step()
r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0)
"""


def run_steps(keep: bool) -> tuple[bool, int]:
    env_keep = "1" if keep else "0"
    out = subprocess.run([sys.executable, "-c", STEPS], capture_output=True, text=True, check=True,
                         env={**os.environ, "EMBER_CPU_KEEP_FREED_MEMORY": env_keep}).stdout.split()
    return out[0] == "True", int(out[1])


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt only")
def test_tensors_allocated_again_each_step_reuse_touched_pages():
    kept, faults = run_steps(True)
    assert kept and faults < 100, faults          # 6 x 1,024 pages a step were it returned to the kernel
    kept, faults_default = run_steps(False)
    assert not kept and faults_default > 10 * 1024, faults_default   # glibc's own policy here: fresh pages
