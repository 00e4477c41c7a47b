"""ember/runtime/artifacts.py: what is saved by reference, by value, in an object's own form, or refused; the
environment a file is keyed by."""
import functools
import json
import pickle

import pytest
import torch

from ember.runtime import artifacts


def decorated_original(x):
    return x + 1


@functools.wraps(decorated_original)
def decorated(x):
    return decorated_original(x) * 2


decorated_original_object = decorated_original
globals()["decorated_original"] = decorated   # (the module attribute is the wrapper, as a decorator leaves it)


class Config:
    scale = 2


def round_trip(obj):
    data, _ = artifacts.dumps(obj)
    return artifacts.loads(data)


def test_references_stay_the_loading_process_objects():
    ops = (torch.ops.aten.add.Tensor, torch.ops.aten.mm, torch.relu, torch.Tensor.add, torch.float16,
           torch.nn.functional.gelu, torch._C._is_tracing, Config)
    back = round_trip(ops)
    assert all(a is b for a, b in zip(back, ops))
    assert round_trip(torch.nn.modules.module) is torch.nn.modules.module
    assert round_trip(torch.nn.modules.module.__dict__) is torch.nn.modules.module.__dict__
    # the original a functools.wraps decorator holds (guards compare it by identity)
    assert round_trip(decorated_original_object) is decorated_original_object


def test_functions_and_code_by_value():
    k = torch.randn(3)

    def local(x, n=2):
        return x * k * n
    f = round_trip(local)
    x = torch.randn(3)
    torch.testing.assert_close(f(x), local(x))
    code = round_trip(local.__code__)
    assert code.co_code == local.__code__.co_code and code.co_varnames == local.__code__.co_varnames


def test_ember_saved_forms_are_used():
    class Saved:
        def ember_saved(self):
            return (dict, ([("rebuilt", True)],))
    assert round_trip([Saved()]) == [{"rebuilt": True}]


def test_live_objects_are_refused_by_name():
    with pytest.raises(artifacts.CannotSave, match="Config instance"):
        artifacts.dumps({"x": Config()})
    with pytest.raises(artifacts.CannotSave, match="live module"):
        artifacts.dumps(torch.nn.Linear(2, 2))

    class Local:
        pass
    with pytest.raises(artifacts.CannotSave, match="defined inside a function"):
        artifacts.dumps(Local)


def test_a_file_of_another_environment_is_not_read(tmp_path, monkeypatch):
    path = tmp_path / "f.ember"
    artifacts.write(path, {"value": torch.arange(3)}, {})
    torch.testing.assert_close(artifacts.read(path)["value"], torch.arange(3))
    lines = path.read_bytes().split(b"\n", 2)
    env = json.loads(lines[1])
    env["torch"] = "0.1"
    path.write_bytes(b"\n".join([lines[0], json.dumps(env).encode(), lines[2]]))
    with pytest.raises(artifacts.Mismatch, match=r"torch: '0.1' -> '"):
        artifacts.read(path)
    artifacts.write(path, {}, {})
    monkeypatch.setattr(artifacts.config, "CPU_ISA", "portable")
    with pytest.raises(artifacts.Mismatch, match="cpu_isa"):
        artifacts.read(path)
    (tmp_path / "other").write_bytes(pickle.dumps({}))
    with pytest.raises(ValueError, match="not a file"):
        artifacts.read(tmp_path / "other")


def _rewrite_environment(path, **changes) -> None:
    lines = path.read_bytes().split(b"\n", 2)
    env = {**json.loads(lines[1]), **changes}
    path.write_bytes(b"\n".join([lines[0], json.dumps(env).encode(), lines[2]]))


def test_a_file_of_another_gpu_or_triton_is_not_read(tmp_path, monkeypatch):
    # Triton's binaries are for one GPU (name, compute capability) and one Triton: a file built for another is
    # not read (the program compiles as usual)
    path = tmp_path / "f.ember"
    artifacts.write(path, {"value": torch.arange(3)}, {})
    _rewrite_environment(path, triton="0.0.1")
    with pytest.raises(artifacts.Mismatch, match=r"triton: '0.0.1' -> "):
        artifacts.read(path)
    here = ["NVIDIA H200", [9, 0]]
    monkeypatch.setattr(artifacts, "_gpu", lambda query: here if query else None)
    artifacts.write(path, {"value": torch.arange(3)}, {})
    _rewrite_environment(path, gpu=["NVIDIA A100-SXM4-80GB", [8, 0]])
    # (the file names a GPU: this process's is asked for, though it has not used CUDA yet)
    with pytest.raises(artifacts.Mismatch, match=r"gpu: \['NVIDIA A100-SXM4-80GB', \[8, 0\]\] -> \['NVIDIA H200'"):
        artifacts.read(path)
    _rewrite_environment(path, gpu=here)
    torch.testing.assert_close(artifacts.read(path)["value"], torch.arange(3))
    monkeypatch.setattr(artifacts, "_gpu", lambda query: None)   # a machine without one
    with pytest.raises(artifacts.Mismatch, match=r"gpu: .* -> None"):
        artifacts.read(path)


def test_a_cuda_graphed_callable_is_saved_without_its_recordings():
    # its recordings hold this process's addresses: the saved form is the compiled callable and how it is
    # replayed; loaded, it runs eagerly first and records at its next call, as a fresh compile does
    from ember.runtime.cudagraphs import CUDAGraphed, GraphPool
    k = torch.randn(3)

    def step(x, state):
        return (x * k + state, x.sin())
    g = CUDAGraphed(step, pool=GraphPool(0), num_user_outputs=1, copied_back=[(1, 0)], mutations=[(1, 0)])
    g.name = "a step"
    g.recordings[("a signature",)] = "a recording"
    back = round_trip([g, g.pool])
    h, pool = back
    assert type(h) is CUDAGraphed and h.pool is pool and pool is not g.pool and pool.device == g.pool.device
    assert h.recordings == {} and h.name == "a step" and h.auto and h.static is None
    assert (h.num_user_outputs, h.copies_back, h.mutated_inputs) == (1, [(1, 0)], frozenset({1}))
    x, state = torch.randn(3), torch.randn(3)
    out, saved = h(x, state)
    torch.testing.assert_close(out, step(x, state)[0])
    torch.testing.assert_close(saved.take(), [x.sin()])
