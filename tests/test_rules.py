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
