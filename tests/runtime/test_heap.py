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
    # glibc's initial threshold held fixed in both runs: its own policy raises the threshold after the first free
    # of a mapped chunk, and whether it then trims the freed tensors depends on what else the heap holds (an
    # allocation-order race); fixed, each tensor is mapped and unmapped unless the policy's mallopt changes it
    env = {**os.environ, "EMBER_CPU_KEEP_FREED_MEMORY": "1" if keep else "0", "MALLOC_MMAP_THRESHOLD_": "131072"}
    out = subprocess.run([sys.executable, "-c", STEPS], capture_output=True, text=True, check=True,
                         env=env).stdout.split()
    return out[0] == "True", int(out[1])


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt only")
def test_tensors_allocated_again_each_step_reuse_touched_pages():
    kept, faults = run_steps(True)
    assert kept and faults < 100, faults          # 6 x 1,024 pages a step were it returned to the kernel
    kept, faults_default = run_steps(False)
    assert not kept and faults_default > 10 * 1024, faults_default   # memory returned: fresh pages
