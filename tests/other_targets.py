"""The C++ code generator's tests again for every other instruction set this CPU can run: `make test` runs the
suite for the machine's own target (-march=native), then this, so a machine with AVX-512 also checks the code an
AVX2-only machine gets, and the portable code any x86-64 gets. Each run also caps ATen's and oneDNN's kernels at
that instruction set, so eager (what every test compares with) computes as it does on such a machine.

    .venv/bin/python -m tests.other_targets [pytest arguments]
"""
import os
import pathlib
import platform
import subprocess
import sys

# target -> (the CPU flag it needs, ATen's capability, oneDNN's ISA cap)
TARGETS = {"avx512": ("avx512f", "avx512", "AVX512_CORE"), "avx2": ("avx2", "avx2", "AVX2"),
           "portable": ("", "default", "SSE41")}


def cpu_flags() -> set[str]:
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


def other_targets() -> list[str]:
    """Targets below the machine's own that it can run (the native build is the main suite's)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return []
    flags = cpu_flags()
    native = next((t for t, (flag, _, _) in TARGETS.items() if flag and flag in flags), "portable")
    order = list(TARGETS)
    return order[order.index(native) + 1:]


def main(args: list[str]) -> int:
    root = pathlib.Path(__file__).resolve().parents[1]
    status = 0
    for target in other_targets():
        _, aten, onednn = TARGETS[target]
        env = {**os.environ, "EMBER_CPU_ISA": target, "ATEN_CPU_CAPABILITY": aten, "ONEDNN_MAX_CPU_ISA": onednn}
        print(f"== C++ code generator tests built for {target} (ATen {aten}, oneDNN {onednn})", flush=True)
        cmd = [sys.executable, "-m", "pytest", "-q", "-m", "not slow", "tests/codegen", "--ignore=tests/codegen/test_triton.py",
               "--ignore=tests/codegen/test_triton_opinfo.py", *args]
        status = subprocess.run(cmd, cwd=root, env=env).returncode or status
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
