"""ember.export / ember.load_exported (ember/frontend/exported.py): one whole graph with its input constraints
and parameters, loaded in a process without the model's class, equal to eager; graph breaks and inputs outside
the constraints are errors that say where and what."""
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

import ember
from ember.frontend.exported import ConstraintViolation

ROOT = pathlib.Path(__file__).resolve().parents[2]


def run(mode: str, d: pathlib.Path) -> dict:
    r = subprocess.run([sys.executable, "-m", "tests.frontend.exported_programs", mode, str(d)], cwd=ROOT,
                       capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": str(ROOT), "EMBER_CACHE_DIR": str(d / f"cache {mode}")})
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_an_exported_model_loads_without_its_class_and_runs_with_no_compile(tmp_path):
    run("export", tmp_path)
    report = run("load", tmp_path)   # (asserts equal to eager at two batch sizes, neither the example's)
    assert report == {"captures": 0, "graphs": 0, "classifier_importable": False}


def scale_and_shift(x, w, shift=1.0):
    return torch.tanh(x @ w) * x.shape[0] + shift


def test_a_function_exports_saves_and_loads(tmp_path):
    w = torch.randn(4, 3)
    program = ember.export(scale_and_shift, (torch.randn(5, 4), w), {"shift": 2.0}, dynamic_shapes=({0: "n"}, None))
    program.save(tmp_path / "f.ember")
    loaded = ember.load_exported(tmp_path / "f.ember")
    for n in (2, 11):
        x = torch.randn(n, 4)
        torch.testing.assert_close(loaded(x, w, shift=2.0), scale_and_shift(x, w, shift=2.0))
    with pytest.raises(ConstraintViolation, match=r"shape\[1\] == 4"):
        loaded(torch.randn(5, 6), w, shift=2.0)
    with pytest.raises(ConstraintViolation, match="float32"):
        loaded(torch.randn(5, 4, dtype=torch.float64), w, shift=2.0)
    with pytest.raises(ConstraintViolation, match="== 2.0"):   # (a float argument is a constant of the graph)
        loaded(torch.randn(5, 4), w, shift=3.0)


def branches_on_data(x):
    if x.sum() > 0:   # data-dependent control flow: no one graph
        return x * 2
    return x - 1


def test_data_dependent_control_flow_is_an_error_naming_the_line():
    line = branches_on_data.__code__.co_firstlineno + 1
    with pytest.raises(ember.GraphBreakError, match=f"{__file__}:{line}"):
        ember.export(branches_on_data, (torch.randn(3),))


def test_dynamic_shapes_by_name_and_every_dim():
    w = torch.randn(4, 3)
    by_name = ember.export(scale_and_shift, (torch.randn(5, 4), w), dynamic_shapes={"x": [0]})
    every = ember.export(scale_and_shift, (torch.randn(5, 4), w), dynamic_shapes=True)
    for n in (3, 8):
        x = torch.randn(n, 4)
        torch.testing.assert_close(by_name(x, w), scale_and_shift(x, w))
        torch.testing.assert_close(every(x, w), scale_and_shift(x, w))
    with pytest.raises(ValueError, match="'y'"):
        ember.export(scale_and_shift, (torch.randn(5, 4), w), dynamic_shapes={"y": [0]})


def tanh_step(x, w):
    loss = torch.tanh(x @ w).square().sum()
    loss.backward()
    return loss


def test_a_training_export_computes_gradients_with_the_backward_compiled_at_export():
    from ember.backends import cpp_backend
    w = torch.randn(4, 3, requires_grad=True)
    program = ember.export(scale_and_shift, (torch.randn(5, 4, requires_grad=True), w), training=True)
    assert program.training and program.parameters() == []   # (w is an argument: it gets its gradient as one)
    graphs = cpp_backend.STATS["graphs"]
    x, w2 = torch.randn(5, 4, requires_grad=True), torch.randn(4, 3, requires_grad=True)
    out = program(x, w2)
    out.square().sum().backward()
    x_ref, w_ref = x.detach().requires_grad_(), w2.detach().requires_grad_()
    ref = scale_and_shift(x_ref, w_ref)
    ref.square().sum().backward()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close((x.grad, w2.grad), (x_ref.grad, w_ref.grad))
    assert cpp_backend.STATS["graphs"] == graphs   # (forward and backward compiled at export)
    with pytest.raises(ConstraintViolation, match="is_grad_enabled"), torch.no_grad():
        program(x, w2)   # a training program is called with grad enabled (an inference one under no_grad)
    # a step that calls backward itself is no one forward graph: the error says what to export instead
    with pytest.raises(ember.GraphBreakError, match="training=True"):
        ember.export(tanh_step, (torch.randn(5, 4), w), training=True)
