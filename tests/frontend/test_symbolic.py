"""ember.frontend.symbolic: the capture's ShapeEnv. Compile-time costs a symbolic capture must not pay."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# compiled against eager at three sizes (the second and third through one symbolic graph), then which of torch's
# compiler modules the process imported
_PROGRAM = r"""
import sys
import torch
import ember

def f(x, w):
    return torch.relu(x @ w).sum(-1) * x.shape[0]

cf = ember.compile(f)
w = torch.randn(8, 4)
for n in (5, 7, 9):
    x = torch.randn(n, 8)
    torch.testing.assert_close(cf(x, w), f(x, w))
print("IMPORTED", sorted(m for m in ("torch.export._trace", "torch._inductor.sizevars", "torch._functorch.aot_autograd")
                         if m in sys.modules))
"""


def test_symbolic_capture_imports_no_torch_compiler():
    """torch's ShapeEnv finds a new symbol's source line through a file set whose building imports torch.export
    and inductor; the capture's ShapeEnv (CaptureShapeEnv) does not ask for it."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    p = subprocess.run([sys.executable, "-c", _PROGRAM], env=env, capture_output=True, text=True, timeout=300,
                       cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "IMPORTED []" in p.stdout, p.stdout
