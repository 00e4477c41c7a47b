"""`python -m tests.frontend.exported_programs export DIR` exports a model whose class exists only in that
process and saves eager results beside it; `... load DIR` loads it in a process that has no such class and
prints what it captured and generated (tests/frontend/test_exported.py)."""
import json
import pathlib
import sys

import torch

import ember


def export(d: pathlib.Path) -> None:
    class Classifier(torch.nn.Module):   # defined here only: the loading process cannot import it
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Linear(12, 24)
            self.norm = torch.nn.BatchNorm1d(24)
            self.head = torch.nn.Linear(24, 5)

        def forward(self, x, temperature=None):
            h = torch.nn.functional.gelu(self.norm(self.embed(x)))
            return {"logits": self.head(h) / temperature, "features": h}

    torch.manual_seed(0)
    model = Classifier().eval()
    with torch.no_grad():   # (running statistics that are not the defaults)
        model.norm.running_mean.uniform_(-1, 1)
        model.norm.running_var.uniform_(0.5, 2)
    program = ember.export(model, (torch.randn(6, 12),), {"temperature": torch.rand(1) + 0.5},
                           dynamic_shapes=({0: "batch"},))
    program.save(d / "classifier.ember")
    cases = []
    for n in (3, 9):
        x, t = torch.randn(n, 12), torch.rand(1) + 0.5
        with torch.no_grad():
            cases.append((x, t, model(x, temperature=t)))
    torch.save(cases, d / "cases.pt")


def load(d: pathlib.Path) -> dict:
    from ember.backends import cpp_backend
    from ember.frontend import convert
    program = ember.load_exported(d / "classifier.ember")
    for x, t, want in torch.load(d / "cases.pt"):
        torch.testing.assert_close(program(x, temperature=t), want)
    return {"captures": convert.STATS["captures"], "graphs": cpp_backend.STATS["graphs"],
            "classifier_importable": hasattr(sys.modules["__main__"], "Classifier")}


if __name__ == "__main__":
    mode, d = sys.argv[1], pathlib.Path(sys.argv[2])
    print(json.dumps(load(d) if mode == "load" else export(d)))
