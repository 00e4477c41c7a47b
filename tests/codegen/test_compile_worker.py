"""Triton compiles in worker processes (ember.codegen.compile_worker): a worker compiles into Triton's cache,
and the parent's own compile of the same kernel is then a cache hit."""
import os

import pytest
import torch

from ember.codegen.compile_worker import Workers

KERNELS = '''import triton
import triton.language as tl


@triton.jit
def k_exp(x, y, N: tl.constexpr, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y + o, tl.exp(tl.load(x + o, mask=o < N)), mask=o < N)
'''
JOB = ([torch.float32, torch.float32], {"N": 1000, "BLOCK": 1024})


def _cache_entries(d) -> set:
    return {e for e in os.listdir(d) if os.path.isdir(os.path.join(d, e))} if os.path.isdir(d) else set()


@pytest.fixture
def kernels(tmp_path, monkeypatch):
    """A module of one kernel, and a fresh Triton cache (workers inherit the environment when they start)."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton_cache"))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)   # (other tests of this process may have set it)
    path = tmp_path / "kernels.py"
    path.write_text(KERNELS)
    workers = Workers(2, ("cuda", 90, 32))
    yield str(path), workers
    workers.close()


def test_worker_compiles_into_triton_cache(kernels, tmp_path):
    path, workers = kernels
    assert workers.compile(path, "k_exp", *JOB).result(timeout=120) is None
    cubins = [f for e in _cache_entries(tmp_path / "triton_cache") for f in os.listdir(tmp_path / "triton_cache" / e)
              if f.endswith(".cubin")]
    assert cubins == ["k_exp.cubin"]


def test_failed_job_raises_and_worker_serves_on(kernels):
    path, workers = kernels
    with pytest.raises(RuntimeError, match="AttributeError"):
        workers.compile(path, "no_such_kernel", *JOB).result(timeout=120)
    with pytest.raises(RuntimeError, match="FileNotFoundError"):
        workers.compile(path[:-3] + "_missing.py", "k_exp", *JOB).result(timeout=120)
    assert workers.compile(path, "k_exp", *JOB).result(timeout=120) is None   # the same worker processes


@pytest.mark.skipif(not torch.cuda.is_available(), reason="loading a compiled kernel needs a GPU")
def test_parent_load_after_worker_is_a_cache_hit(kernels, tmp_path):
    import importlib.util

    from ember.codegen import triton as tr
    from triton.runtime.driver import driver
    path, _ = kernels
    t = driver.active.get_current_target()
    workers = Workers(2, (t.backend, t.arch, t.warp_size))
    try:
        workers.compile(path, "k_exp", *JOB).result(timeout=120)
        before = _cache_entries(tmp_path / "triton_cache")
        spec = importlib.util.spec_from_file_location("ember_test_worker_kernels", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        kernel = tr._compile_and_load(mod.k_exp, *JOB, torch.device("cuda"))
        assert kernel.function is not None
        new = {e for e in _cache_entries(tmp_path / "triton_cache") - before
               if any(f.endswith(".cubin") for f in os.listdir(tmp_path / "triton_cache" / e))}
        assert not new, "the parent compiled the kernel again"
        x = torch.randn(1000, device="cuda")
        y = torch.empty_like(x)
        mod.k_exp[(1,)](x, y, 1000, BLOCK=1024)
        torch.testing.assert_close(y, torch.exp(x))
    finally:
        workers.close()
