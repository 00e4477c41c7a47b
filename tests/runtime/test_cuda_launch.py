"""ember's kernel launcher (ember/runtime/cuda_launch.py): its C source builds here; on a GPU, the Triton
backend's kernels launch through it and give eager's values, and a kernel it does not take (a misaligned
pointer) goes through Triton's."""
import pytest
import torch

from ember.runtime import cuda_launch

CUDA = torch.cuda.is_available()


def test_entry_params_are_read_from_ptx():
    ptx = """
.visible .entry k_0123(
	.param .u64 .ptr .global .align 1 k_0123_param_0,
	.param .u64 .ptr .global .align 1 k_0123_param_1,
	.param .u64 .ptr .global .align 1 k_0123_param_2
)
.reqntid 128, 1, 1
{"""
    params = cuda_launch._entry_params(ptx, "k_0123")
    assert len(params) == 3 and all(p.startswith(".param .u64") for p in params)
    assert cuda_launch._entry_params(ptx, "k_other") is None


def test_launcher_source_builds(tmp_path):
    """The C source compiles with the system compiler (CI has no GPU: it cannot load, for want of libcuda)."""
    ext = cuda_launch.EXTENSION
    so = tmp_path / "ember_cuda_launch.so"
    assert ext._build(so) == so and so.stat().st_size > 0


@pytest.mark.skipif(not CUDA, reason="launching kernels needs an NVIDIA GPU; none is visible to torch here")
def test_triton_kernels_launch_through_embers_launcher(monkeypatch, tmp_path):
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    import torch.fx as fx

    from ember.autograd.trace import trace_forward
    from ember.backends import triton_backend as tr

    def f(x, y):
        return (torch.sin(x) * y + 1.0).sum(1), torch.relu(x - y)

    x, y = torch.randn(64, 300, device="cuda"), torch.randn(64, 300, device="cuda")
    gm, _ = trace_forward(fx.symbolic_trace(f), [x, y])
    run = tr.compile_aten(gm, [x, y])
    launchers = [v for k, v in run.compiled.namespace.items() if k.startswith("_launch_")]
    assert launchers and all(la.native is not None for la in launchers)
    for _ in range(3):
        x, y = torch.randn(64, 300, device="cuda"), torch.randn(64, 300, device="cuda")
        for got, want in zip(run(x, y), f(x, y)):
            torch.testing.assert_close(got, want)
    # a view at an odd offset: the kernel was specialized for 16-byte aligned pointers, Triton's binder runs it
    big = torch.randn(64 * 300 + 1, device="cuda")
    xo = big[1:].view(64, 300)
    for got, want in zip(run(xo, y), f(xo, y)):
        torch.testing.assert_close(got, want)
