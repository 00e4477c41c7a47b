"""Programs one process compiles and saves (ember.save_cache) and another loads (ember.load_cache):
`python -m tests.frontend.saved_programs save|load FILE SEED` runs them all, asserts each equal to eager, and
prints what the process captured and generated (tests/frontend/test_saved.py reads it)."""
import json
import sys

import torch

import ember


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = torch.nn.Linear(16, 32), torch.nn.Linear(32, 8)
        self.norm = torch.nn.LayerNorm(32)
        self.conv = torch.nn.Conv1d(4, 4, 3, padding=1)
        self.bn = torch.nn.BatchNorm1d(4)

    def forward(self, x):
        h = self.l2(torch.relu(self.norm(self.l1(x))))
        return h.softmax(-1) + self.bn(self.conv(h.view(-1, 4, 2))).flatten(1)


SCALE = 3.0


def with_break(x, y):
    z = torch.sin(x) + y
    print("", end="")            # a graph break: the rest runs as a resume function
    return (z * 2).cos().sum(0) + SCALE


def scaled(x):
    return torch.tanh(x) * x.shape[0]


def helper_that_breaks(x):
    y = x.exp()
    print("", end="")            # a break inside a called function: compiled as a frame of its own
    return y.log1p()


def calls_a_breaking_helper(x):
    return helper_that_breaks(x * 2) + 1


def closure(seed):
    k = torch.randn(6, generator=torch.Generator().manual_seed(seed))

    def times_k(x):
        return x * k + 1
    return times_k


def programs(seed: int) -> dict:
    """name -> (compiled result, eager result), on inputs and weights drawn from `seed`."""
    torch.manual_seed(seed)
    net = Net()
    cnet = ember.compile(net)
    out = {}
    x = torch.randn(4, 16)
    net.eval()
    with torch.no_grad():
        out["inference"] = (cnet(x), net(x))
    net.train()
    cnet(x).square().sum().backward()
    grads = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    net(x).square().sum().backward()
    out["training"] = (grads, [p.grad.clone() for p in net.parameters()])
    f = ember.compile(with_break)
    a, b = torch.randn(5, 3), torch.randn(5, 3)
    out["graph break"] = (f(a, b), with_break(a, b))
    g = ember.compile(scaled, dynamic=True)
    for n in (3, 7):   # one symbolic program serves both sizes
        t = torch.randn(n, 6)
        out[f"dynamic size {n}"] = (g(t), scaled(t))
    auto = ember.compile(scaled)
    for n in (2, 5, 9):   # automatic dynamic: static for 2, symbolic from 5 on
        t = torch.randn(n, 4)
        out[f"automatic dynamic size {n}"] = (auto(t), scaled(t))
    c = ember.compile(calls_a_breaking_helper)
    t = torch.randn(3, 2)
    out["break in a callee"] = (c(t), calls_a_breaking_helper(t))
    h = closure(seed)
    t = torch.randn(2, 6)
    out["closure"] = (ember.compile(h)(t), h(t))
    return out


def main(mode: str, path: str, seed: int) -> dict:
    from ember.backends import cpp_backend
    from ember.frontend import convert, saved
    loaded = ember.load_cache(path) if mode == "load" else None
    for name, (got, want) in programs(seed).items():
        torch.testing.assert_close(got, want, msg=lambda m: f"{name}: {m}")
    report = {"captures": convert.STATS["captures"], "graphs": cpp_backend.STATS["graphs"],
              "restored": saved.STATS["restored_entries"], "loaded": loaded}
    if mode == "save":
        report.update(ember.save_cache(path))
    return report


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2], int(sys.argv[3]))))
