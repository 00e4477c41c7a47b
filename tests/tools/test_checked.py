"""Checked mode (EMBER_CHECK=1) and repros: a backend slightly wrong in one node is caught, with the node and the
user's file:line; a backend that raises on some graphs leaves a repro; the minifier shrinks a graph of more than
100 nodes to at most 5, into a script that fails on its own and passes once the fault is removed."""
import logging
import os
import pathlib
import subprocess
import sys

import pytest
import torch

import ember
from ember.tools import checked, repro
from tests.tools.faulty_backends import refuses_cumsum, slightly_wrong_tanh

ROOT = pathlib.Path(__file__).resolve().parents[2]
TANH_LINE = 28    # the line of `torch.tanh` in long_program (checked below)
STEPS = 26        # 4 nodes each: with the faulty node, 105 nodes besides the inputs and the output


def long_program(x, w, fault: str):
    h = x @ w
    for k in range(STEPS):
        h = (h + torch.sin(h) * 0.1) * 0.99
        if k == STEPS // 2:
            if fault == "tanh":
                h = torch.tanh(h)
            else:
                h = h.cumsum(dim=-1)
    return h.sum(dim=0)


@pytest.fixture(autouse=True)
def _fresh(monkeypatch, tmp_path):
    ember.reset()
    monkeypatch.setenv("EMBER_REPRO_DIR", str(tmp_path / "repros"))
    monkeypatch.delenv("EMBER_TEST_FAULT", raising=False)
    yield
    ember.reset()


def _inputs():
    return torch.randn(8, 16), torch.randn(16, 16) / 4


def _only_repro(tmp_path) -> pathlib.Path:
    saved = sorted((tmp_path / "repros").iterdir())
    assert len(saved) == 1, saved
    return saved[0]


def _check_reports(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "ember.check"]


def test_the_tanh_line_is_where_the_test_says():
    import inspect
    lines, start = inspect.getsourcelines(long_program)
    assert "torch.tanh" in lines[TANH_LINE - start]


@pytest.mark.parametrize("training", [False, True])
def test_checked_mode_finds_the_wrong_node_and_its_line(monkeypatch, caplog, tmp_path, training):
    monkeypatch.setenv("EMBER_CHECK", "1")
    x, w = _inputs()
    w.requires_grad_(training)
    with caplog.at_level(logging.WARNING, logger="ember.check"):
        got = ember.compile(long_program, backend=slightly_wrong_tanh)(x, w, "tanh")
    assert got.shape == long_program(x, w, "tanh").shape and got.requires_grad == training
    reports = _check_reports(caplog)
    assert len(reports) == 1, reports
    assert "first diverging node: tanh = torch.tanh(" in reports[0], reports[0]
    assert f"test_checked.py:{TANH_LINE}" in reports[0], reports[0]
    assert "aten.tanh" in reports[0] and "repro saved in" in reports[0]
    meta = repro.load(_only_repro(tmp_path))[1]
    assert meta["kind"] == "accuracy" and meta["backend"] == "tests.tools.faulty_backends:slightly_wrong_tanh"


def test_checked_mode_passes_a_correct_backend(monkeypatch, caplog, tmp_path):
    monkeypatch.setenv("EMBER_CHECK", "1")
    x, w = _inputs()
    with caplog.at_level(logging.WARNING, logger="ember.check"):
        for backend in ("ember", "aot_eager", slightly_wrong_tanh):
            torch.testing.assert_close(ember.compile(long_program, backend=backend)(x, w, "cumsum"),
                                       long_program(x, w, "cumsum"), rtol=1e-4, atol=1e-4)
    assert _check_reports(caplog) == []
    assert not (tmp_path / "repros").exists()


def test_checks_off_leave_a_user_backend_unwrapped(monkeypatch):
    monkeypatch.delenv("EMBER_CHECK", raising=False)
    seen = []

    def backend(gm, example_inputs):
        seen.append(gm.forward)
        return gm.forward
    compiled = ember.compile(lambda x: x.sin() * 2, backend=backend)
    compiled(torch.randn(3))
    assert compiled._frame.entries[0].fn.__globals__["___graph"] == seen[0]   # (bound methods: equal, not one)


def test_the_rule_allows_eager_sized_errors_only():
    ref = torch.randn(1000, dtype=torch.float64)
    eager = ref.float()
    assert checked.divergence(eager.clone(), eager, ref) is None
    assert checked.divergence(eager * (1 + 1e-6), eager, ref) is None        # a few ulps: as eager rounds
    assert checked.divergence(eager * (1 + 1e-4), eager, ref) is not None
    assert checked.divergence(torch.tensor([1, 2]), torch.tensor([1, 3]), None) is not None


def test_a_backend_raising_on_some_graphs_leaves_a_repro(tmp_path):
    x, w = _inputs()
    torch.testing.assert_close(ember.compile(long_program, backend=refuses_cumsum)(x, w, "tanh"),
                               long_program(x, w, "tanh"))
    with pytest.raises(ember.BackendCompilerFailed):
        ember.compile(long_program, backend=refuses_cumsum)(x, w, "cumsum")
    meta = repro.load(_only_repro(tmp_path))[1]
    assert meta["kind"] == "crash" and meta["error"] == "NotImplementedError"


def _graph_nodes(directory: pathlib.Path) -> int:
    ns, _ = repro.load(directory)
    return len(torch.fx.symbolic_trace(ns["f"]).graph.nodes)


def _run_script(directory: pathlib.Path, fault: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "EMBER_TEST_FAULT": fault}
    env.pop("EMBER_REPRO_DIR", None)
    return subprocess.run([sys.executable, str(directory / "repro.py")], env=env, cwd=str(directory),
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("fault,backend,error", [("tanh", slightly_wrong_tanh, "AccuracyMismatch"),
                                                 ("cumsum", refuses_cumsum, "NotImplementedError")])
def test_the_minifier_shrinks_a_long_graph_to_a_script_that_fails_alone(monkeypatch, tmp_path, fault, backend,
                                                                         error):
    monkeypatch.setenv("EMBER_CHECK", "1")
    x, w = _inputs()
    try:
        ember.compile(long_program, backend=backend)(x, w, fault)
    except ember.BackendCompilerFailed:
        assert fault == "cumsum"
    saved = _only_repro(tmp_path)
    assert _graph_nodes(saved) >= 100
    out = ember.minify(saved)
    assert _graph_nodes(out) <= 5, (out / "repro.py").read_text()
    text = (out / "repro.py").read_text()
    assert "ember.compile(f, backend=BACKEND" in text and fault in text
    assert not (out / "inputs.pt").exists()   # its inputs are generated: the script stands alone
    failing = _run_script(out, "on")
    assert failing.returncode != 0 and error in failing.stderr, failing.stderr[-2000:]
    fixed = _run_script(out, "off")
    assert fixed.returncode == 0, fixed.stderr[-2000:]


def test_python_m_ember_minify(tmp_path):
    x, w = _inputs()
    with pytest.raises(ember.BackendCompilerFailed):
        ember.compile(long_program, backend=refuses_cumsum)(x, w, "cumsum")
    saved = _only_repro(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("EMBER_REPRO_DIR", None)
    done = subprocess.run([sys.executable, "-m", "ember", "minify", str(saved), str(tmp_path / "small")], env=env,
                          cwd=str(ROOT), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "small" / "repro.py").exists() and _graph_nodes(tmp_path / "small") <= 5


def test_the_minifier_shrinks_a_crash_of_embers_own_backend(monkeypatch, tmp_path):
    """A bug in ember's lowering of cumsum: the program runs (eager fallback), the repro saved, and the minifier
    (in this process, where the bug is) shrinks it with ember's backend and the fail-safe off in each candidate."""
    from ember.codegen import lower

    class Choices(dict):   # lowering looks every op up here
        def get(self, op, default=None):
            if op is torch.ops.aten.cumsum.default:
                raise KeyError("injected: lowering cumsum")
            return super().get(op, default)
    monkeypatch.setattr(lower, "CHOICES", Choices(lower.CHOICES))
    monkeypatch.setattr(sys.modules[__name__], "STEPS", 6)
    x, w = _inputs()
    torch.testing.assert_close(ember.compile(long_program)(x, w, "cumsum"), long_program(x, w, "cumsum"))
    saved = _only_repro(tmp_path)
    meta = repro.load(saved)[1]
    assert meta["kind"] == "crash" and meta["error"] == "KeyError" and meta["backend"] == "ember"
    out = ember.minify(saved)
    assert _graph_nodes(out) <= 5, (out / "repro.py").read_text()
    assert "cumsum" in (out / "repro.py").read_text()
    assert os.environ.get("EMBER_FAIL_SAFE") is None   # the candidates' switch did not leak
