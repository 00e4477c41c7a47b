"""Triton kernels compiled in worker processes (ember/runtime/triton_workers.py): on a GPU, a graph of several
kernels compiles in the workers, the parent only reads Triton's cache, and the values are eager's; anywhere, a
request a worker cannot serve comes back as a failure (the parent then compiles the kernel itself)."""
import pytest
import torch

from ember.runtime import triton_workers

CUDA = torch.cuda.is_available()


def test_a_request_the_worker_cannot_serve_is_a_failure_not_a_crash(tmp_path):
    triton = pytest.importorskip("triton")   # (the worker imports Triton; torch's CUDA builds ship it)
    assert triton
    bad = tmp_path / "no_such_module.py"
    before = dict(triton_workers.STATS)
    assert triton_workers.compile_in_worker(str(bad), "k", "{}") is False
    assert triton_workers.STATS["sent"] == before["sent"] + 1
    assert triton_workers.STATS["compiled"] == before["compiled"]
    # the worker survived the error and serves the next request
    w = triton_workers._take()
    try:
        assert "FileNotFoundError" in w.compile(str(bad), "k", "{}")
    finally:
        triton_workers._idle.put(w)


@pytest.mark.skipif(not CUDA, reason="compiling for the GPU's target needs an NVIDIA GPU; none is visible here")
def test_a_graph_of_many_kernels_compiles_in_workers(monkeypatch, tmp_path):
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path / "ember"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))   # nothing compiled before
    import torch.fx as fx
    from triton.compiler import compiler

    from ember.autograd.trace import trace_forward
    from ember.backends import triton_backend as tr

    def f(x, y):   # reductions over different axes and shapes: one kernel each
        return x.sum(0), (x * y).amax(1), torch.softmax(x + y, -1), (y.sin() * 2).mean(0, keepdim=True) + x

    built = []
    make_ir = compiler.ASTSource.make_ir
    monkeypatch.setattr(compiler.ASTSource, "make_ir", lambda self, *a, **k: built.append(1) or make_ir(self, *a, **k))
    x, y = torch.randn(96, 333, device="cuda"), torch.randn(96, 333, device="cuda")
    gm, _ = trace_forward(fx.symbolic_trace(f), [x, y])
    monkeypatch.setattr(tr, "WORKERS_FROM", 2)   # however many kernels the fusion leaves
    before = dict(triton_workers.STATS)
    run = tr.compile_aten(gm, [x, y])
    kernels = {name for _, name, *_ in run.compiled.kernels}
    assert len(kernels) >= 2
    sent = triton_workers.STATS["sent"] - before["sent"]
    assert sent == len(kernels) and triton_workers.STATS["compiled"] - before["compiled"] == sent
    assert not built, "the parent compiled a kernel a worker had compiled (the cache keys differ)"
    for _ in range(2):
        x, y = torch.randn(96, 333, device="cuda"), torch.randn(96, 333, device="cuda")
        for got, want in zip(run(x, y), f(x, y)):
            torch.testing.assert_close(got, want)
