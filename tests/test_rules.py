"""ember's compiler is its own: ember/ must not use torch.compile's machinery (DEVELOPERS.md)."""
import ast
import pathlib

BANNED = ("torch._dynamo", "torch._inductor", "torch._functorch", "torch._export", "torch.export", "torch._decomp",
          "torch._refs", "torch._prims", "torch.jit", "torch.fx.experimental.proxy_tensor", "torch.compile")
ROOT = pathlib.Path(__file__).resolve().parents[1] / "ember"


def _dotted(node):
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return ""


def _banned(name):
    return any(name == b or name.startswith(b + ".") for b in BANNED)


def find_violations(root=ROOT):
    hits = []
    for f in sorted(root.rglob("*.py")):
        tree = ast.parse(f.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Attribute):
                names = [_dotted(node)]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "__import__":
                names = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            hits += [f"{f.relative_to(root.parent)}:{node.lineno}: {n}" for n in names if _banned(n)]
    return hits


def test_ember_uses_none_of_torch_compile_internals():
    assert find_violations() == []


def test_the_rule_catches_a_banned_import(tmp_path):
    pkg = tmp_path / "ember"
    pkg.mkdir()
    (pkg / "bad.py").write_text("import torch._dynamo\nfrom torch._inductor import config\nx = torch.jit.trace\n")
    assert {h.split(":")[1] for h in find_violations(pkg)} == {"1", "2", "3"}


# ------------------------------------------------------------------------------------------------ layering
# Rooms from the top down: a module imports only from its own room or a room of a lower layer, so each stage can
# be read and changed with only what is below it in mind. A room is a package under ember/ or a top-level module.
LAYERS = [("__main__",), ("demo",), ("__init__",), ("explain",), ("api",), ("frontend", "backends"),
          ("autograd", "codegen"), ("decomp",), ("ir",), ("runtime",), ("errors", "config", "tools")]
LAYER_OF = {room: i for i, rooms in enumerate(LAYERS) for room in rooms}
MAX_LINES = 1000


def _room_of_file(f: pathlib.Path, root: pathlib.Path) -> str:
    rel = f.relative_to(root).with_suffix("").parts
    return rel[0]


def _room_of_module(name: str) -> str | None:
    parts = name.split(".")
    if parts[0] != "ember":
        return None
    return parts[1] if len(parts) > 1 else "__init__"


def _imported(tree: ast.AST, f: pathlib.Path, root: pathlib.Path):
    """(line, module) of every import of an ember module in the file, those inside functions included."""
    package = ("ember",) + f.relative_to(root).parts[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package[:len(package) - node.level + 1]
                base = ".".join(up + ((node.module,) if node.module else ()))
            if base == "ember":   # `from ember import x`: the room is x
                yield from ((node.lineno, f"ember.{a.name}") for a in node.names)
            else:
                yield node.lineno, base


def layering_violations(root: pathlib.Path = ROOT) -> list[str]:
    hits = []
    for f in sorted(root.rglob("*.py")):
        room = _room_of_file(f, root)
        if room not in LAYER_OF:
            hits.append(f"{f.relative_to(root.parent)}: room {room!r} has no layer in tests/test_rules.py LAYERS")
            continue
        for line, name in _imported(ast.parse(f.read_text()), f, root):
            target = _room_of_module(name)
            if target is None or target == room:
                continue
            if target not in LAYER_OF or LAYER_OF[target] <= LAYER_OF[room]:
                hits.append(f"{f.relative_to(root.parent)}:{line}: {room} imports {name} (room {target}: not below)")
    return hits


def import_counts(root: pathlib.Path = ROOT) -> dict[tuple[str, str], int]:
    """Imports between rooms, (from, to) -> count: the picture of the layering docs/architecture.md shows."""
    counts: dict = {}
    for f in sorted(root.rglob("*.py")):
        room = _room_of_file(f, root)
        for _, name in _imported(ast.parse(f.read_text()), f, root):
            target = _room_of_module(name)
            if target is not None and target != room:
                counts[(room, target)] = counts.get((room, target), 0) + 1
    return counts


def test_rooms_import_only_rooms_below_them():
    assert layering_violations() == []


def test_the_layering_rule_catches_an_upward_and_a_sideways_import(tmp_path):
    pkg = tmp_path / "ember"
    (pkg / "decomp").mkdir(parents=True)
    (pkg / "autograd").mkdir()
    (pkg / "decomp" / "table.py").write_text("def f():\n    from ember.codegen import lower\n")
    (pkg / "autograd" / "trace.py").write_text("from ember import codegen\nfrom ember.ir import Expr\n")
    (pkg / "ir.py").write_text("from . import decomp\n")
    hits = layering_violations(pkg)
    assert len(hits) == 3 and {h.split(":")[0] for h in hits} == {"ember/decomp/table.py", "ember/autograd/trace.py",
                                                                  "ember/ir.py"}, hits


def test_files_stay_under_a_thousand_lines():
    long = [f"{f.relative_to(ROOT.parent)}: {n} lines" for f in sorted(ROOT.rglob("*.py"))
            if (n := len(f.read_text().splitlines())) > MAX_LINES]
    assert long == []


if __name__ == "__main__":   # the import counts between rooms, for the notes and docs
    for (a, b), n in sorted(import_counts().items(), key=lambda kv: (LAYER_OF.get(kv[0][0], 99), kv[0])):
        print(f"{a:10s} -> {b:10s} {n}")
