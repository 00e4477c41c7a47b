"""`python -m tests.frontend.exported_programs export DIR` exports models whose classes exist only in that
process (an inference classifier, and a regressor for training) and saves eager results beside them; `... load
DIR` loads them in a process that has no such class, checks them against eager (the regressor: two SGD steps on
the program's own parameters, against the model's) and prints what it captured and generated
(tests/frontend/test_exported.py)."""
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

    class Regressor(torch.nn.Module):   # trained after the load: forward and backward
        def __init__(self):
            super().__init__()
            self.hidden, self.norm, self.out = torch.nn.Linear(12, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 2)

        def forward(self, x):
            return self.out(torch.tanh(self.norm(self.hidden(x))))

    regressor = Regressor()
    example = torch.randn(6, 12, requires_grad=True)   # (the input gets a gradient too)
    program = ember.export(regressor, (example,), training=True, dynamic_shapes=({0: "batch"},))
    program.save(d / "regressor.ember")
    state = {k: v.clone() for k, v in regressor.state_dict().items()}   # (before training changes them)
    torch.save({"state": state, "steps": train(regressor, dict(regressor.named_parameters()))}, d / "regressor.pt")


def train(model, parameters: dict, n: int = 2) -> list:
    """n SGD steps of `model` on fresh batches (seeded): each step's loss, gradients and input gradient."""
    opt = torch.optim.SGD(list(parameters.values()), lr=0.1)
    torch.manual_seed(3)
    steps = []
    for batch in (4, 9)[:n]:
        x, y = torch.randn(batch, 12, requires_grad=True), torch.randn(batch, 2)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        steps.append((loss.detach(), {k: p.grad.clone() for k, p in parameters.items()}, x.grad))
        opt.step()
    return steps


def load(d: pathlib.Path) -> dict:
    from ember.backends import cpp_backend
    from ember.frontend import convert
    program = ember.load_exported(d / "classifier.ember")
    for x, t, want in torch.load(d / "cases.pt"):
        torch.testing.assert_close(program(x, temperature=t), want)
    regressor = ember.load_exported(d / "regressor.ember")
    expected = torch.load(d / "regressor.pt")
    parameters = regressor.named_parameters()
    assert {k: p.detach() for k, p in parameters.items()}.keys() == expected["state"].keys()
    for k, p in parameters.items():   # (saved with the program: the model's weights at export)
        torch.testing.assert_close(p.detach(), expected["state"][k])
    for got, want in zip(train(regressor, parameters), expected["steps"]):
        torch.testing.assert_close(got, want)
    return {"captures": convert.STATS["captures"], "graphs": cpp_backend.STATS["graphs"],
            "classifier_importable": hasattr(sys.modules["__main__"], "Classifier")}


if __name__ == "__main__":
    mode, d = sys.argv[1], pathlib.Path(sys.argv[2])
    print(json.dumps(load(d) if mode == "load" else export(d)))
