"""An exported program (ember.export): one whole-graph entry made standalone, saved with its parameters.

ember.export captures the function with fullgraph=True, so its compiler holds one entry: guards, one graph call
and the rebuilding of the outputs. `ExportedProgram.from_entry` turns that entry into a program over the
call's own arguments:
- the graph's inputs read from anything else (a module's parameters and buffers, a global tensor) are read once,
  at export, and saved with the program;
- the guards over the arguments (types, dtypes, sizes, the symbolic sizes' ranges and relations, grad and
  autocast mode) become its input constraints, checked on every call: a call outside them raises, naming the
  constraint; guards on anything else (the module's structure, its hooks) held at export and are dropped with
  the state they guarded;
- the outputs are rebuilt as the entry rebuilt them (an output class is found by its module and name).
An inference program (the default) runs under no_grad. A training program (`training=True`) was captured with grad
enabled: its graph is compiled as a forward and a backward (the joint graph, partitioned), the saved tensors that
required grad are Parameters of the program's own (`named_parameters()`, by their path in the module), and the
backward is compiled at export by one backward of the example's results, so a loaded program computes gradients
with no trace or compile either.
What the program needs is saved by ember.runtime.artifacts (the graph in its backend's saved form), so a
process that loads it needs neither the model's source nor its class.
"""
from __future__ import annotations

import ast
import builtins
import inspect
import os
import re
from typing import Any

import torch

from ember.frontend.convert import Entry, FrameCompiler, base_namespace, _code_where
from ember.runtime import artifacts

_GRAPH_CALL = re.compile(r"^    ___o = ___graph\(.*\)$")
# constant types a constraint may compare against (a copy is as good as the object)
_VALUE_CONSTS = (type, torch.dtype, torch.device, tuple, bytes, str, int, float, bool, type(None))


class ExportError(Exception):
    """The program cannot be exported (the message names the user's file:line and what to change)."""


class ConstraintViolation(ValueError):
    """A call of an exported program with inputs outside its constraints."""


def _names(text: str) -> set[str]:
    """The free names an expression or statement block reads (walrus-bound names excluded)."""
    tree = ast.parse(text.strip())
    bound = {n.target.id for n in ast.walk(tree) if isinstance(n, ast.NamedExpr)}
    bound |= {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)} - bound


class ExportedProgram:
    """A standalone compiled program: `program(*args, **kwargs)` runs ember's compiled code on inputs its
    constraints admit (under no_grad, unless exported with training=True). `.save(path)`;
    ember.load_exported(path) loads it in any process of the same environment."""

    def __init__(self, name: str, where: str, params: list[str], argnames: list[str],
                 signature: inspect.Signature | None, constraints: list[str], body: list[str], namespace: dict,
                 training: bool = False, state_names: dict[str, str] | None = None):
        self.name, self.where, self.params, self.signature = name, where, params, signature
        self.training = training
        self.state_names = state_names or {}   # saved tensor (___S0...) -> its path in the module (`l1.weight`)
        self.argnames = argnames   # the frame's arguments in the compiler's order (co_varnames')
        self.constraints, self.body, self.namespace = constraints, body, namespace
        checks = []
        if constraints:   # (all at once; the one that failed is looked for after)
            checks = ["    try:", f"        ___ok = {' and '.join(f'({c})' for c in constraints)}",
                      "    except Exception:", "        ___ok = False",
                      "    if not ___ok:", f"        raise ___violated({', '.join(params)})"]
        self.source = "\n".join([f"def ___program({', '.join(params)}):", *checks, *body]) + "\n"
        ns = {**base_namespace(None), **namespace, "___violated": self._violated}
        exec(compile(self.source, f"<ember exported {name}>", "exec"), ns)
        self._run = ns["___program"]

    def _violated(self, *frame) -> ConstraintViolation:
        ns = {**base_namespace(None), **self.namespace}
        failed = "(none)"
        for c in self.constraints:
            try:
                ok = eval(c, ns, dict(zip(self.params, frame)))
            except Exception:
                ok = False
            if not ok:
                failed = re.sub(r"___K\d+", lambda m: _shown(ns[m.group(0)]), c)
                break
        return ConstraintViolation(f"ember exported program {self.name} (exported from {self.where}): the inputs "
                                   f"do not satisfy its constraint `{failed}`. Export again with example "
                                   f"inputs like these, or dynamic_shapes= naming the dims that vary.")

    def __call__(self, *args, **kwargs):
        if self.signature is None:   # a module's: (the module, args, kwargs), the module's state saved within
            frame = (None, args, kwargs)
        else:
            bound = self.signature.bind(*args, **kwargs)
            bound.apply_defaults()
            frame = tuple(bound.arguments[p] for p in self.argnames)
        if self.training:
            return self._run(*frame)
        prev = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            return self._run(*frame)
        finally:
            torch._C._set_grad_enabled(prev)

    def named_parameters(self) -> dict[str, torch.nn.Parameter]:
        """A training program's parameters by their path in the module (for an optimizer; the saved tensors
        that required grad at export)."""
        return {self.state_names.get(k, k): v for k, v in self.namespace.items()
                if isinstance(v, torch.nn.Parameter)}

    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self.named_parameters().values())

    def compile_backward(self, args: list, kwargs: dict) -> None:
        """Run the program and a backward of its results once (ones as their gradients), so that the backward
        is compiled and saved with it; the gradients it leaves are dropped."""
        import torch.utils._pytree as pytree
        with torch.enable_grad():
            outs = [t for t in pytree.tree_leaves(self(*args, **kwargs))
                    if isinstance(t, torch.Tensor) and t.requires_grad]
            if outs:
                torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
        for p in self.parameters():
            p.grad = None

    def save(self, path: str | os.PathLike) -> None:
        state = {"name": self.name, "where": self.where, "params": self.params, "argnames": self.argnames,
                 "signature": self.signature, "training": self.training, "state_names": self.state_names,
                 "constraints": self.constraints, "body": self.body, "namespace": self.namespace}
        try:
            data, files = artifacts.dumps(state, refused=(FrameCompiler,))
        except artifacts.CannotSave as e:
            raise ExportError(f"ember.export: the program exported from {self.where} cannot be saved: {e}") from e
        artifacts.write(path, {"exported": data}, files)

    def __repr__(self) -> str:
        kind = ", training" if self.training else ""
        return f"ExportedProgram({self.name}, {len(self.constraints)} constraints{kind})"

    @classmethod
    def from_entry(cls, fc: FrameCompiler, entry: Entry, frame_args: tuple, signature: inspect.Signature | None,
                   user_params: list[str], name: str, where: str, training: bool = False) -> "ExportedProgram":
        """The entry as a program over `user_params` (the frame's parameters the caller passes), the inputs
        read from anything else taken from `frame_args` (the example call's): in a training program, those
        that require grad as Parameters of its own (sharing the model's storage, as torch.export's state)."""
        ns = entry.fn.__globals__
        lines = entry.source.split("        return ___MISS\n")[-1].splitlines()
        values = {k: v for k, v in ns.items() if k.startswith("___K")}
        allowed = set(user_params) | {"___torch", *dir(builtins)}
        allowed |= {k for k, v in values.items() if isinstance(v, _VALUE_CONSTS)}
        namespace: dict[str, Any] = {}
        state_names: dict[str, str] = {}
        body = []
        if lines and _GRAPH_CALL.match(lines[0]):
            state: dict[int, str] = {}
            inputs = []
            for source in entry.graph_inputs:
                if _names(source) <= allowed:
                    inputs.append(source)
                    continue
                value = entry.check(source, frame_args)   # (a parameter, a buffer: read now, saved)
                if not isinstance(value, torch.Tensor):
                    raise ExportError(f"ember.export: the graph of {where} reads {source}, which is no tensor "
                                      f"and not computed from the arguments")
                saved_as = state.setdefault(id(value), f"___S{len(state)}")
                if saved_as not in namespace:
                    namespace[saved_as] = torch.nn.Parameter(value.detach()) if training and value.requires_grad \
                        else value.detach()
                    state_names[saved_as] = _state_name(source) or saved_as
                inputs.append(saved_as)
            namespace["___graph"] = ns["___graph"]
            body.append(f"    ___o = ___graph({', '.join(inputs)})")
            lines = lines[1:]
        outputs_may_read = allowed | {"___o", *namespace} | set(values) | set(base_namespace(None))
        for line in lines:
            if not _names(line) <= outputs_may_read | _names_assigned(lines):
                raise ExportError(f"ember.export: {where}: the program's results or side effects read or write "
                                  f"state besides its arguments (`{line.strip()}`); export a function of its "
                                  f"inputs only")
            body.append(line)
        used = {n for line in body for n in _names(line)}
        constraints = [g for g in entry.guards if _names(g) <= allowed]
        used |= {n for g in constraints for n in _names(g)}
        namespace.update({k: v for k, v in values.items() if k in used})
        return cls(name, where, fc.entry_params, fc.argnames, signature, constraints, body, namespace, training,
                   state_names)


def _state_name(source: str) -> str:
    """A saved tensor's path from the source that read it: in the module (`mod._modules['l1']._parameters
    ['weight']` -> `l1.weight`), else the names after its root (a global's name)."""
    root = re.match(r"\w+", source)
    keys = re.findall(r"\['(\w+)'\]|\.(\w+)", source[root.end():] if root else source)
    parts = [a or b for a, b in keys if (a or b) not in ("_modules", "_parameters", "_buffers")]
    return ".".join(parts) if parts else (root.group(0) if root else "")


def _shown(v) -> str:
    return f"{v.__module__}.{v.__qualname__}" if isinstance(v, type) else repr(v)


def _names_assigned(lines: list[str]) -> set[str]:
    return {m.group(1) for line in lines for m in [re.match(r"\s*(\w+) = ", line)] if m}


def load(path: str | os.PathLike) -> ExportedProgram:
    """The program ExportedProgram.save wrote (artifacts.Mismatch: built for another environment)."""
    payload = artifacts.read(path)
    if "exported" not in payload:
        raise ValueError(f"{path} holds no exported program (ember.save_cache's files load with ember.load_cache)")
    state = artifacts.loads(payload["exported"])
    return ExportedProgram(**state)


def single_entry(fc: FrameCompiler) -> Entry:
    entries = [e for e in fc.entries if not e.description.startswith("uncompiled")]
    if len(fc.entries) != 1 or not entries:
        why = fc.entries[0].description if fc.entries else "nothing was captured"
        raise ExportError(f"ember.export: {fc.name} ({_code_where(fc.code)}) did not capture as one graph: {why}")
    return entries[0]

