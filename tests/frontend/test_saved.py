"""ember.save_cache / ember.load_cache (ember/frontend/saved.py): saved by one process, loaded by another with no
capture and no code generation, equal to eager; another environment compiles again; what cannot be saved is
named with its file:line."""
import json
import os
import pathlib
import subprocess
import sys
import warnings

import pytest
import torch

import ember
from ember.runtime.artifacts import CannotSave

ROOT = pathlib.Path(__file__).resolve().parents[2]


def run_programs(mode: str, path: pathlib.Path, seed: int, cache: pathlib.Path,
                 programs: str = "tests.frontend.saved_programs", **env) -> dict:
    """tests/frontend/saved_programs.py (or `programs`) in a fresh process (its own cache directories): its
    report."""
    r = subprocess.run([sys.executable, "-m", programs, mode, str(path), str(seed)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": str(ROOT), "EMBER_CACHE_DIR": str(cache),
                            "TRITON_CACHE_DIR": str(cache / "triton-own"), **env})
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def saved_file(tmp_path_factory):
    d = tmp_path_factory.mktemp("saved")
    report = run_programs("save", d / "programs.ember", 1, d / "cache")
    assert report["left_out"] == 0 and report["entries"] >= 10, report
    return d / "programs.ember"


def test_a_loaded_program_runs_with_no_capture_and_no_code_generation(saved_file, tmp_path):
    # other weights and inputs (seed 2), an empty cache directory: the kernels come from the file
    report = run_programs("load", saved_file, 2, tmp_path / "fresh cache")
    assert report["loaded"] is True
    assert report["captures"] == 0 and report["graphs"] == 0, report
    assert report["restored"] >= 10, report


def test_a_file_of_another_environment_compiles_again(saved_file, tmp_path):
    # another C++ target than the saving process's (native): not loaded, compiled as usual, as correct
    report = run_programs("load", saved_file, 3, tmp_path / "cache", EMBER_CPU_ISA="portable")
    assert report["loaded"] is False
    assert report["captures"] > 0 and report["graphs"] > 0 and report["restored"] == 0, report


def test_a_loaded_triton_program_runs_with_no_capture_code_generation_or_triton_compile(tmp_path):
    # the Triton backend's programs (inference, a training step, a symbolic graph at two sizes; on a GPU under
    # mode="reduce-overhead" too): saved with their kernels' sources and host programs, and on a GPU each kernel's
    # binary; loaded by a process with empty ember and Triton caches, other weights and inputs. Without a GPU they
    # run through Triton's interpreter (the sources and host programs: there are no binaries)
    pytest.importorskip("triton", reason="the Triton backend needs the triton package")
    triton_programs = "tests.frontend.saved_triton_programs"
    saved = run_programs("save", tmp_path / "triton.ember", 1, tmp_path / "cache", triton_programs)
    assert saved["left_out"] == 0 and saved["entries"] >= 3 and saved["graphs"] >= 4, saved
    report = run_programs("load", tmp_path / "triton.ember", 2, tmp_path / "fresh cache", triton_programs)
    assert report["loaded"] is True and report["restored"] >= 3, report
    assert report["captures"] == 0 and report["graphs"] == 0 and not report["codegen_imported"], report
    assert report["ember_kernel_compiles"] == [], report
    if report["cuda"]:   # the kernels from their saved binaries
        assert report["restored_kernels"] > 0, report
        # (a CUDA graph's replay copies its outputs with one helper kernel, compiled once per machine at the
        # first recording: a runtime helper, not a kernel of the program)
        assert all(name.endswith("_copy_blocks") for name in report["other_compiles"]), report


class Twice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2


def _local_function_program():
    class LocalTwice(Twice):   # another process cannot import it
        pass

    def uses_local_class(x):
        return LocalTwice.apply(torch.sin(x)) + 1
    return uses_local_class


def test_what_cannot_be_saved_is_named_with_its_file_and_line(tmp_path):
    f = _local_function_program()
    x = torch.randn(5)
    torch.testing.assert_close(ember.compile(f)(x), f(x))
    where = f"{__file__}:{f.__code__.co_firstlineno}"
    with pytest.raises(CannotSave, match="LocalTwice") as err:
        ember.save_cache(tmp_path / "strict.ember", strict=True)
    assert where in str(err.value)
    assert not (tmp_path / "strict.ember").exists()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        counts = ember.save_cache(tmp_path / "lenient.ember")
    assert counts["left_out"] == 1 and counts["entries"] == 0
    assert any(where in str(w.message) for w in caught)


def test_an_entry_loaded_in_this_process_is_checked_by_its_guards(tmp_path):
    # saved, forgotten (ember.reset), loaded: the entry serves calls its guards admit; another dtype captures
    from ember.frontend import convert

    def f(x):
        return Twice.apply(x.cos()) * 3
    x = torch.randn(4, 3)
    torch.testing.assert_close(ember.compile(f)(x), f(x))
    assert ember.save_cache(tmp_path / "f.ember")["entries"] == 1
    ember.reset()
    assert ember.load_cache(tmp_path / "f.ember") is True
    before = convert.STATS["captures"]
    g = ember.compile(f)
    y = torch.randn(4, 3)
    torch.testing.assert_close(g(y), f(y))
    assert convert.STATS["captures"] == before
    z = torch.randn(4, 3, dtype=torch.float64)
    torch.testing.assert_close(g(z), f(z))
    assert convert.STATS["captures"] == before + 1
