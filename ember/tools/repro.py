"""Repros: a captured graph saved as a standalone script of plain PyTorch + ember.compile that shows a fault.

save(...) writes one under EMBER_REPRO_DIR (read at each use) when ember falls back from a crash, a user's backend
raises, or checked mode finds a divergence; minify.py shrinks one. A repro directory holds:
  repro.py    the graph as a function `f`, `make_inputs()`, and `main()`: eager, then ember.compile(f) with the
              same backend, mode and options on the same inputs, with the fail-safe off; main() raises where the
              fault shows (the crash itself, or checked.AccuracyMismatch). `python repro.py` exits 1 on the fault.
  inputs.pt   the values of the inputs the script does not generate (make_inputs loads them)
  meta.json   kind ("crash" or "accuracy"), the error's type, the reason, where the graph was captured
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import pathlib
import re
import time
import types
from typing import Any, Callable

import torch

from ember.tools.logs import get_logger

log = get_logger("fallbacks")
_COUNTER = itertools.count()


@dataclasses.dataclass
class Target:
    """What compiled the graph: the backend as the script names it, and ember.compile's mode and options."""
    backend: Callable | None
    name: str | None           # a registered name ("ember") or "module:qualname"; None: not importable
    mode: str | None
    options: dict | None

    @staticmethod
    def of(cfg: Any) -> "Target":
        fn = cfg.backend
        while getattr(fn, "__wrapped__", None) is not None:
            fn = fn.__wrapped__
        module, qual = getattr(fn, "__module__", "") or "", getattr(fn, "__qualname__", "")
        if getattr(fn, "fail_safe", False) or module.startswith("ember."):
            name = cfg.backend_name
        elif module not in ("", "__main__") and "<locals>" not in qual:
            name = f"{module}:{qual}"
        else:
            name = None
        return Target(cfg.backend, name, cfg.mode, cfg.options)


def directory() -> pathlib.Path | None:
    raw = os.environ.get("EMBER_REPRO_DIR")
    return pathlib.Path(raw) if raw else None


def copies(values) -> list:
    """The values with each tensor copied (same strides, requires_grad kept, no autograd history)."""
    return [v.detach().clone().requires_grad_(v.requires_grad) if isinstance(v, torch.Tensor) else v
            for v in values]


def save(gm: torch.fx.GraphModule, inputs: list | None, kind: str, error: BaseException | None, target: Target,
         reason: str) -> pathlib.Path | None:
    """Write the repro of `gm` on `inputs` into a new directory under EMBER_REPRO_DIR; None when that is unset.
    Never raises: a repro that cannot be written is logged, the program goes on."""
    root = directory()
    if root is None or inputs is None:
        return None
    where = gm.meta.get("ember_where", "") if isinstance(getattr(gm, "meta", None), dict) else ""
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", pathlib.Path(where.split(":")[0]).stem + "_" + where.split(":")[-1]) \
        if where else "graph"
    path = root / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{next(_COUNTER)}-{kind}-{stem}"
    try:
        graph, values = standalone_graph(gm, inputs)
        meta = {"kind": kind, "error": type(error).__name__ if error is not None else None,
                "message": str(error)[:2000] if error is not None else None, "reason": reason, "where": where,
                "backend": target.name, "mode": target.mode, "options": target.options}
        write(path, graph, [saved_spec(v) for v in values], values, meta)
    except Exception as e:   # (an unpicklable input, a target fx cannot print, a full disk)
        log.warning("could not save a repro of the graph captured from %s: %s: %s", where, type(e).__name__, e)
        return None
    return path


def standalone_graph(gm: torch.fx.GraphModule, inputs: list) -> tuple[torch.fx.Graph, list]:
    """gm's graph with its attributes (constants) as inputs after the others, and the values of all inputs."""
    graph = torch.fx.Graph()
    env, values, attrs = {}, list(inputs), []
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            attrs.append(n)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for n in placeholders:
        env[n] = graph.placeholder(_ident(n.name))
    for n in attrs:
        env[n] = graph.placeholder(_ident(n.name))
        v = gm
        for part in n.target.split("."):
            v = getattr(v, part)
        values.append(v.detach().clone() if isinstance(v, torch.Tensor) else v)
    for n in gm.graph.nodes:
        if n.op not in ("placeholder", "get_attr"):
            env[n] = graph.node_copy(n, lambda a: env[a])
    return graph, values


def _ident(name: str) -> str:
    return re.sub(r"\W", "_", name)


# -- inputs in the script ----------------------------------------------------------------------------------------
def saved_spec(v) -> dict:
    """An input whose value comes from inputs.pt (exact); minify.py turns it into a generated one where it can."""
    if isinstance(v, torch.Tensor):
        return {"how": "saved", "shape": list(v.shape), "dtype": str(v.dtype), "device": str(v.device),
                "requires_grad": v.requires_grad}
    if v is None or type(v) in (bool, int, str) or (type(v) is float and math.isfinite(v)):
        return {"how": "literal", "value": v}
    return {"how": "saved"}


def generated_spec(v: torch.Tensor, shape: list | None = None) -> dict | None:
    """A tensor input the script makes from a seed (contiguous; integers in the range the saved value spans)."""
    if not isinstance(v, torch.Tensor) or v.layout != torch.strided or not v.is_contiguous():
        return None
    spec = {"how": "random", "shape": list(v.shape if shape is None else shape), "dtype": str(v.dtype),
            "device": str(v.device), "requires_grad": v.requires_grad}
    if not (v.dtype.is_floating_point or v.dtype.is_complex or v.dtype == torch.bool):
        spec["low"], spec["high"] = (int(v.min()), int(v.max()) + 1) if v.numel() else (0, 1)
    return spec


def _input_expr(spec: dict, k: int) -> str:
    how = spec["how"]
    if how == "literal":
        return repr(spec["value"])
    if how == "saved":   # (a fresh copy per call: the graph may write its inputs)
        if "shape" not in spec:
            return f"saved[{k}]"
        return f"saved[{k}].detach().clone()" + (".requires_grad_()" if spec.get("requires_grad") else "")
    shape, dtype = tuple(spec["shape"]), spec["dtype"]
    if spec["dtype"] == "torch.bool":
        e = f"torch.randint(0, 2, {shape}, generator=g).bool()"
    elif "low" in spec:
        e = f"torch.randint({spec['low']}, {spec['high']}, {shape}, generator=g, dtype={dtype})"
    else:
        e = f"torch.randn({shape}, generator=g, dtype={dtype})"
    if spec["device"] != "cpu":
        e += f".to({spec['device']!r})"
    return e + (".requires_grad_()" if spec.get("requires_grad") else "")


# -- the script --------------------------------------------------------------------------------------------------
_MAIN = '''


def main():
    """Eager, then compiled on the same inputs: raises where the fault shows."""
    os.environ["EMBER_FAIL_SAFE"] = "0"   # an error inside ember raises here instead of running the graph eagerly
    expected = f(*make_inputs())
    compiled = ember.compile(f, backend=BACKEND, mode=MODE, options=OPTIONS)
    got = compiled(*make_inputs())
    assert_as_close_as_eager(got, expected, f, make_inputs)


if __name__ == "__main__":
    main()
'''


def script(graph: torch.fx.Graph, specs: list[dict], meta: dict) -> str:
    """The repro script's text (see the module's docstring)."""
    code = graph.python_code(root_module="self")
    body = code.src.replace("def forward(self, ", "def f(", 1).replace("def forward(self)", "def f()", 1).strip()
    imports = ["import os", "", "import torch", "", "import ember",
               "from ember.tools.checked import assert_as_close_as_eager"]
    imports += [line for name, obj in sorted(code.globals.items()) if re.search(rf"\b{name}\b", body)
                and (line := _import_line(name, obj)) and line not in imports]
    backend = meta.get("backend")
    if backend is None:
        backend_line = "BACKEND = None   # the backend was not importable (defined in __main__ or a function): set it"
    elif ":" in backend:
        module, qual = backend.split(":", 1)
        imports.append(f"from {module} import {qual.split('.')[0]}")
        backend_line = f"BACKEND = {qual}"
    else:
        backend_line = f"BACKEND = {backend!r}"
    # (the first line of the error, inside the script's docstring)
    message = [m.replace('"' * 3, "'" * 3).replace(chr(92), "/")
               for m in (meta.get("message") or "").strip().splitlines()[:1]]
    lines = [f'"""ember repro ({meta["kind"]}): {meta.get("reason", "")}.',
             f"Graph captured from {meta.get('where') or '?'}; written by ember (docs/when_results_differ.md).",
             f"Error: {meta.get('error')}: {message[0][:300] if message else ''}"
             if meta["kind"] == "crash" else "Fault: compiled further from float64 than eager float32 is.",
             'Run: python repro.py (exits 1 while the fault is there)."""', *imports, "",
             backend_line, f"MODE = {meta.get('mode')!r}", f"OPTIONS = {meta.get('options')!r}",
             "SAVED = None   # the values of inputs.pt, loaded on first use", "", "", body, "", "",
             "def make_inputs():"]
    if any(s["how"] == "saved" for s in specs):
        lines += ["    global SAVED", "    if SAVED is None:",
                  "        SAVED = torch.load(os.path.join(os.path.dirname(os.path.abspath(__file__)), 'inputs.pt'),",
                  "                           weights_only=False)"]
    lines += ["    saved, g = SAVED, torch.Generator().manual_seed(0)",
              f"    return [{', '.join(_input_expr(s, k) for k, s in enumerate(specs))}]"]
    return "\n".join(lines) + _MAIN


def _import_line(name: str, obj) -> str | None:
    if name in ("fx_pytree", "pytree") or name.startswith("__"):
        return None   # (fx's own, only for pytree outputs)
    if isinstance(obj, types.ModuleType):
        return f"import {obj.__name__}" if obj.__name__ == name else f"import {obj.__name__} as {name}"
    if name in ("inf", "nan"):
        return f"from math import {name}"
    if obj is type(None):
        return "NoneType = type(None)"
    module, qual = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if module and qual and "<locals>" not in qual:
        head = qual.split(".")[0]
        line = f"from {module} import {head}"
        return line if qual == name else f"{line}\n{name} = {qual}"
    return f"{name} = None   # {obj!r}: not importable, set it"


def write(path: pathlib.Path, graph: torch.fx.Graph, specs: list[dict], values: list, meta: dict) -> pathlib.Path:
    path.mkdir(parents=True, exist_ok=True)
    saved = [v if s["how"] == "saved" else None for s, v in zip(specs, values)]
    if any(s["how"] == "saved" for s in specs):
        torch.save(saved, path / "inputs.pt")
    (path / "repro.py").write_text(script(graph, specs, meta))
    (path / "meta.json").write_text(json.dumps({**meta, "inputs": specs}, indent=1, default=str))
    return path


def load(path: pathlib.Path) -> tuple[dict, dict]:
    """(the script's namespace, meta) of a repro directory; the script is run as a module, not as __main__."""
    path = pathlib.Path(path)
    meta = json.loads((path / "meta.json").read_text())
    text = (path / "repro.py").read_text()
    ns = {"__name__": "ember_repro", "__file__": str(path / "repro.py")}
    exec(compile(text, str(path / "repro.py"), "exec"), ns)
    return ns, meta
