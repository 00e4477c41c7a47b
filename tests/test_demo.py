"""ember/demo.py's pieces that `make demo` relies on (the whole demo takes ~20 s: run by `make demo`)."""
import torch

import ember
from ember.backends import lookup_backend
from ember.demo import Recorder


def test_recorder_passes_the_compile_mode_on_to_the_backend():
    """The demo compiles densenet121 with mode="reduce-overhead" through a Recorder; ember.compile passes mode=
    to backends as torch.compile does (a Recorder without it failed both densenet121 rows)."""
    seen = []

    def backend(gm, example_inputs, **kwargs):
        seen.append(kwargs)
        return gm.forward
    rec = Recorder(backend)

    def f(x):
        return torch.sin(x) * 2
    x = torch.randn(8)
    torch.testing.assert_close(ember.compile(f, backend=rec, mode="reduce-overhead")(x), f(x))
    assert len(rec.graphs) == 1 and seen == [{"mode": "reduce-overhead"}]
    ember.reset()
    assert ember.compile(f, backend=Recorder(lookup_backend("eager")))(x).equal(f(x))
