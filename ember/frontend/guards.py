"""Guards: every assumption a capture relied on, as Python expressions over the frame's arguments.

They are compiled into one generated function per cache entry, cheapest checks first (identity and type,
then constants and lengths, then tensor metadata), because guard evaluation is most of a compiled call's
overhead. Once the C++ checker (ember.runtime.native_guards) is loaded, plain tensors' metadata, constants
and empty hook dicts are checked by one call of it each (`condition()`); each guard's Python text stays in
`exprs()`, which a failed call's reason is looked up in.
Static shapes are checked exactly; a tensor with symbolic dims gets `symbolic_tensor()` and its symbols the
ShapeEnv's guards (ember.frontend.symbolic).
"""
from __future__ import annotations

import math
import re

import torch

from ember.runtime import native_guards

# The name under which generated code calls `dict.get` (or native_guards' dict_get, the same lookup without a
# Python Tensor.__hash__ call): a tensor-keyed item (an optimizer's `state[p]`) is read
# as `___dict_get(<dict source>, <key source>)` (items.Items.tensor_keyed_item), which share_paths knows as a
# path step, so `opt.state[p]` is looked up once per call however many guards and graph inputs read it.
DICT_GET = "___dict_get"


# The names under which an entry calls the C++ checker's functions (ember.runtime.native_guards), and the
# functions: CHECKER_FUNCTIONS maps each name to its function's name in the checker (DICT_GET: its dict_get).
CHECK_TENSORS, CHECK_CONSTS, CHECK_FALSY, CHECK_DICTS = ("___check_tensors", "___check_consts", "___check_falsy",
                                                         "___check_dicts")
CHECKER_FUNCTIONS = {CHECK_TENSORS: "check", CHECK_CONSTS: "check_consts", CHECK_FALSY: "check_falsy",
                     CHECK_DICTS: "check_dicts", DICT_GET: "dict_get"}


class Guards:
    def __init__(self, consts):
        self.consts = consts
        self.items: list[tuple[int, str]] = []
        self._seen: set[str] = set()
        self._tensors: set[str] = set()   # sources with a tensor guard
        # The guards the C++ checker can prove, by their Python text. The first capture starts the checker's
        # build; whether it is loaded is asked when the entry is made (condition()), so a capture that outlasts
        # the build (a GPU model's, with its kernels compiled in between) gets it too.
        native_guards.checker()   # (starts the build)
        self.checker = None       # the checker the entry uses: set by condition()
        # plain tensors: (source, tensor, its metadata when guarded)
        self.batched: dict[str, tuple[str, torch.Tensor, tuple]] = {}
        # constant guards (`type(S) is int and S == 1`, `S is None`) the checker proves: (source, value)
        self.const_batched: dict[str, tuple[str, object]] = {}
        self.falsy_batched: dict[str, str] = {}   # `not S` guards (a module's hook dicts are empty): S
        self.tuples: dict[str, tuple[str, tuple]] = {}   # `type(S) is tuple and len(S) == n` guards: (S, value)
        self.dicts: dict[str, tuple[str, tuple]] = {}    # `type(S) is dict and tuple(S) == keys` guards: (S, keys)
        # tensors with symbolic dims (symbolic_tensor): their symbolic size and stride dims, and the Python check
        # of their symbolic strides (or None)
        self.wild: dict[str, tuple[list, list, str | None]] = {}

    def add(self, expr: str, cost: int = 1) -> None:
        if expr not in self._seen:
            self._seen.add(expr)
            self.items.append((cost, expr))

    def const(self, source: str, value) -> None:
        batched = True   # a constant the C++ check_consts proves (same type, equal)
        if value is None or isinstance(value, bool):
            expr, cost = f"{source} is {value!r}", 0
        elif isinstance(value, float) and math.isnan(value):
            expr, cost, batched = f"type({source}) is float and {source} != {source}", 1, False
        elif type(value) in (int, float, str, bytes, complex):  # not subclasses (str enums...): no literal
            expr, cost = f"type({source}) is {type(value).__name__} and {source} == {value!r}", 1
        else:
            expr, cost, batched = f"{source} == {self.consts.ref(value)}", 1, False
        self.add(expr, cost)
        if batched:
            self.const_batched[expr] = (source, value)

    def sequence(self, source: str, value: tuple) -> None:
        """The type and length of a tuple (or named tuple, struct sequence) whose items get guards of their own.
        A plain tuple of constants (a conv's stride, padding, dilation) becomes one constant of the C++ check
        in condition()."""
        expr = f"type({source}) is {self.consts.ref(type(value))} and len({source}) == {len(value)}"
        self.add(expr, 0)
        if type(value) is tuple:
            self.tuples[expr] = (source, value)

    def dict_keys(self, source: str, value: dict) -> None:
        """The type and keys (in order) of a dict whose items get guards of their own. A plain dict's (each
        optimizer state `opt.state[p]`: `tuple(S)` builds a tuple per parameter and call) is checked by the C++
        check_dicts in condition()."""
        keys = tuple(value)
        expr = f"type({source}) is {self.consts.ref(type(value))} and tuple({source}) == {self.consts.ref(keys)}"
        self.add(expr, 0)
        if type(value) is dict:
            self.dicts[expr] = (source, keys)

    def falsy(self, source: str) -> None:
        """`not S`: what a module's hook dicts (forward, forward pre, backward...) are on every cached call,
        several per module."""
        expr = f"not {source}"
        self.add(expr, 1)
        self.falsy_batched[expr] = source

    def tensor(self, source: str, t: torch.Tensor) -> None:
        """type, dtype, requires_grad, shape, stride and device of the tensor at `source`, written out inline on a
        local bound at the first check, cheaper than a call of a checking function per tensor (an optimizer step
        guards five tensors per parameter; docs/evidence.md). A CPU tensor's device is
        checked as `is_cpu` (a bool; `t.device` builds a torch.device to compare)."""
        if source in self._tensors:
            return
        self._tensors.add(source)
        c = self.consts.ref
        v = source if source.isidentifier() else f"___g{len(self._tensors)}"   # an argument is a local already
        first = source if v == source else f"({v} := {source})"
        device = f"{v}.is_cpu" if t.device.type == "cpu" else f"{v}.device == {c(t.device)}"
        expr = (f"type({first}) is {c(type(t))} and {v}.dtype is {c(t.dtype)} and {v}.requires_grad is "
                f"{t.requires_grad} and {v}.shape == {tuple(t.shape)} and {v}.stride() == {tuple(t.stride())} "
                f"and {device}")
        self.add(expr, 2)
        if type(t) in native_guards.BATCH_TYPES:
            self.batched[expr] = (source, t, _metadata(t))

    def symbolic_tensor(self, source: str, t: torch.Tensor, sizes: list, strides: list) -> None:
        """A tensor with symbolic dims: as tensor(), but the sizes checked dim by dim, a symbolic dim not at all
        here (its range and relations are the symbols' guards, ember.frontend.symbolic), and each stride against
        its expression over the sizes (`x.stride() == (x.shape[1], 1)`). Written as Python over `source` (the
        C++ checker compares sizes exactly), whose paths share_paths walks once per call."""
        if source in self._tensors:
            return
        self._tensors.add(source)
        c = self.consts.ref
        device = f"{source}.is_cpu" if t.device.type == "cpu" else f"{source}.device == {c(t.device)}"
        dims = "".join(f" and {source}.shape[{d}] == {n}" for d, n in enumerate(sizes) if isinstance(n, int))
        stride = "(" + "".join(f"{s}, " for s in strides) + ")"
        expr = (f"type({source}) is {c(type(t))} and {source}.dtype is {c(t.dtype)} and {source}.requires_grad is "
                f"{t.requires_grad} and {source}.dim() == {t.dim()}{dims} and {source}.stride() == {stride} "
                f"and {device}")
        self.add(expr, 2)
        if type(t) in native_guards.BATCH_TYPES:
            # the C++ check with the symbolic sizes and strides as ANY; the symbolic strides then in Python
            wild_sizes = [d for d, n in enumerate(sizes) if not isinstance(n, int)]
            wild_strides = [d for d, n in enumerate(strides) if not isinstance(n, int)]
            self.batched[expr] = (source, t, _metadata(t))
            self.wild[expr] = (wild_sizes, wild_strides, f"{source}.stride() == {stride}" if wild_strides else None)

    def exprs(self) -> list[str]:
        """Each guard on its own, cheapest first: what a failed call's reason is looked up in."""
        return [e for _, e in sorted(self.items, key=lambda item: item[0])]

    def condition(self) -> list[str]:
        """The guards as the entry evaluates them: exprs(), or once the C++ checker is loaded, with the constant
        guards replaced by one call `___check_consts((S1, S2, ...), <values>)`, the `not S` guards by one
        `___check_falsy((S1, ...))` and plain dicts' type-and-keys guards by one `___check_dicts((S1, ...),
        <keys>)`, all after the other guards of their cost (those that make reading S safe,
        `type(S') is tuple and len(S') == 2`, run first), and the tensor guards by one call
        `___check_tensors((S1, S2, ...), <exact types>, <packed metadata>)` at the place of the first
        (share_paths binds each S, which the graph call then reads). A constant guard costs a few times less in
        the batch than as Python bytecode, and a model has hundreds of them, conv strides and paddings mostly
        (docs/evidence.md)."""
        self.checker = checker = native_guards.checker()
        if checker is None:
            return self.exprs()
        specs = {}
        for e, (source, t, meta) in self.batched.items():
            spec = checker.spec(t) if _metadata(t) == meta else None   # (as guarded: the capture changed nothing)
            if spec is not None and e in self.wild:
                spec = native_guards.with_any(spec, *self.wild[e][:2])
            if spec is not None:
                specs[e] = (source, type(t), spec)
        out: list[str] = []
        tensors: list[tuple[str, type, bytes]] = []
        consts: list[tuple[str, object]] = []
        falsy: list[str] = []
        dicts: list[tuple[str, tuple]] = []
        tensor_at = const_at = -1
        # a tuple whose items are all constants is one constant: its type and length guard and its items' guards
        # become one item of the constant check, which compares tuples item by item, exact types included
        by_source = {src: e for e, (src, _) in self.const_batched.items()}
        whole: dict[str, tuple[str, tuple]] = {}
        folded: set[str] = set()
        for e, (src, value) in self.tuples.items():
            items = [by_source.get(f"{src}[{i}]") for i in range(len(value))]
            if all(items):
                whole[e] = (src, tuple(self.const_batched[i][1] for i in items))
                folded.update(items)
        for cost, e in sorted(self.items, key=lambda item: item[0]):
            if cost >= 2 and const_at < 0:
                const_at = len(out)
            if e in folded:
                continue
            if e in whole:
                consts.append(whole[e])
            elif e in self.const_batched:
                consts.append(self.const_batched[e])
            elif e in self.falsy_batched:
                falsy.append(self.falsy_batched[e])
            elif e in self.dicts:
                dicts.append(self.dicts[e])
            elif e in specs:
                if not tensors:
                    tensor_at = len(out)
                    out.append("")
                tensors.append(specs[e])
            else:
                out.append(e)
        out += [self.wild[e][2] for e in specs if e in self.wild and self.wild[e][2]]   # (after the C++ check)
        c = self.consts.ref
        if tensors:
            sources = "".join(f"{s}, " for s, _, _ in tensors)
            out[tensor_at] = (f"{CHECK_TENSORS}(({sources}), {c(tuple(t for _, t, _ in tensors))}, "
                              f"{c(b''.join(sp for _, _, sp in tensors))})")
        at = const_at if const_at >= 0 else len(out)
        if consts:
            sources = "".join(f"{s}, " for s, _ in consts)
            out.insert(at, f"{CHECK_CONSTS}(({sources}), {c(tuple(v for _, v in consts))})")
        if falsy:
            out.insert(at, f"{CHECK_FALSY}(({''.join(f'{s}, ' for s in falsy)}))")
        if dicts:
            out.insert(at, f"{CHECK_DICTS}(({''.join(f'{s}, ' for s, _ in dicts)}), "
                           f"{c(tuple(k for _, k in dicts))})")
        return out


def _metadata(t: torch.Tensor) -> tuple:
    return type(t), t.dtype, t.requires_grad, tuple(t.shape), t.stride(), t.device


# A Python string literal (skipped: a path-like text inside one is not a path), or a path: an attribute/subscript
# chain rooted at a name (`mod._modules['features']._parameters['weight']`, `___K3['opt'].state`, `x[0]`), or at
# a tensor-keyed lookup of one path by another (`___dict_get(___K3['opt'].state, ___K3['opt'].param_groups[0]
# ['params'][0])['exp_avg']`).
_SEGMENT = r"(?:\.[A-Za-z_]\w*|\[(?:'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"|-?\d+)\])"
_CHAIN = r"[A-Za-z_]\w*" + _SEGMENT + "*"
_KEYED = rf"{DICT_GET}\(({_CHAIN}), ({_CHAIN})\)"
# (not `___g3.dtype`: a tensor guard's local, Guards.tensor, is bound already)
_TOKEN = re.compile(r"""('(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*")|(?<![\w.\])'"])(?!___g\d)(""" + _KEYED + _SEGMENT +
                    "*|" r"[A-Za-z_]\w*" + _SEGMENT + "+)")
_SEGMENTS = re.compile(_SEGMENT)
_ROOT = re.compile(r"[A-Za-z_]\w*")
_KEYED_RE = re.compile(_KEYED)
_CONDITIONAL = re.compile(r"\b(or|if|lambda|for)\b")


def share_paths(guards: list[str], after: list[str]) -> tuple[str, list[str]]:
    """The guards as one condition that evaluates each attribute path once: its first evaluation binds a local
    (`:=`) that later reads use, in the guards and in `after` (statements that run right after the guards
    passed, before any other code could change what the paths lead to). A module's guards read
    `mod._modules[...]...` chains thousands of times; walking each chain once per guard would be most of a
    cached call's cost. A guard whose evaluation may be partial (`or`, `x if c else y`, a lambda or
    comprehension) binds nothing. Works on the text (a regex over paths, string literals skipped): parsing and
    unparsing the guards as a tree cost more than the rest of a capture (docs/evidence.md)."""
    # a path prefix is known by a small int (its parent's int and its last segment), not by its text: hashing
    # ever longer prefix strings was most of the work on a large model's guards. A path is (head, segments,
    # ids): head is the root name, or ("get", dict path, key path, id) for a tensor-keyed lookup.
    prefix_ids: dict[tuple, int] = {}
    counts: list[int] = []
    parsed: dict[str, tuple] = {}   # path text -> path

    def prefix_id(key: tuple) -> int:
        pid = prefix_ids.get(key)
        if pid is None:
            pid = prefix_ids[key] = len(counts)
            counts.append(0)
        return pid

    def parse(text: str) -> tuple:
        p = parsed.get(text)
        if p is not None:
            return p
        if text.startswith(DICT_GET + "("):
            m = _KEYED_RE.match(text)
            inner = parse(m.group(1)), parse(m.group(2))
            pid = prefix_id(("get", *(x[2][-1] if x[2] else x[0] for x in inner)))
            head, parent, rest = ("get", *inner, pid), pid, m.end()
        else:
            head = parent = _ROOT.match(text).group(0)
            rest = len(head)
        segs, ids = _SEGMENTS.findall(text, rest), []
        for seg in segs:
            parent = prefix_id((parent, seg))
            ids.append(parent)
        p = parsed[text] = (head, segs, ids)
        return p

    def count(p: tuple) -> None:
        head, _, ids = p
        if type(head) is tuple:
            count(head[1])
            count(head[2])
            counts[head[3]] += 1
        for pid in ids:
            counts[pid] += 1

    found = []   # per text: [(start, end, path)]
    for text in [*guards, *after]:
        paths = []
        for m in _TOKEN.finditer(text):
            if m.group(2) is None:
                continue
            p = parse(m.group(2))
            count(p)
            paths.append((m.start(2), m.end(2), p))
        found.append(paths)
    bound: dict[int, str] = {}

    def bind(pid: int, expr: str, may_bind: bool) -> str:
        if may_bind and counts[pid] > 1:
            bound[pid] = f"___p{len(bound)}"
            return f"({bound[pid]} := {expr})"
        return expr

    def render(p: tuple, may_bind: bool) -> str:
        head, segs, ids = p
        # start after the longest prefix already bound (its own prefixes were bound with it: they occur at least
        # as often)
        k = len(ids)
        while k and ids[k - 1] not in bound:
            k -= 1
        if k:
            expr = bound[ids[k - 1]]
        elif type(head) is tuple:
            expr = bound.get(head[3]) or bind(
                head[3], f"{DICT_GET}({render(head[1], may_bind)}, {render(head[2], may_bind)})", may_bind)
        else:
            expr = head
        for seg, pid in zip(segs[k:], ids[k:]):
            expr = bind(pid, expr + seg, may_bind)
        return expr

    def rewrite(text: str, paths: list, may_bind: bool) -> str:
        out, pos = [], 0
        for start, end, p in paths:
            out += [text[pos:start], render(p, may_bind)]
            pos = end
        out.append(text[pos:])
        return "".join(out)

    # ("or"/"if"/"lambda" substrings first: the word regex is slow, and most guards contain none of them)
    cond = [rewrite(g, paths, not (("or" in g or "if" in g or "lambda" in g) and _CONDITIONAL.search(g)))
            for g, paths in zip(guards, found)]
    rest = [rewrite(t, paths, False) for t, paths in zip(after, found[len(guards):])]
    return (" and ".join(cond) if cond else "True"), rest
