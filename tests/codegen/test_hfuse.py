"""Optimizer steps: torch._foreach_* graphs that update their inputs in place (params, exp_avg, exp_avg_sq, step,
momentum buffers). Checked against eager (torch.optim's own foreach functions where they run eagerly) on fresh
random inputs: every mutated input and every output, dtypes included. Also checked: the update is one kernel
for all parameters (horizontal fusion), the kernels write the inputs in place (no copy back), and in-place
writes are refused where a later read needs the old value.

The Triton tests run the printed kernels in Triton's interpreter when there is no GPU (TRITON_INTERPRET=1)."""
import importlib.util
import os
import sys

import pytest
import torch
import torch.fx
from torch.optim.adam import adam as eager_adam
from torch.optim.sgd import sgd as eager_sgd

from ember.autograd import aot_module
from ember.backends import cpp_backend, ember_backend
from tests.optim_steps import step_both

CUDA = torch.cuda.is_available()
if not CUDA and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"   # read by Triton when it is imported
TRITON = importlib.util.find_spec("triton") is not None and (CUDA or os.environ.get("TRITON_INTERPRET") == "1")
# the Triton tests print and run Triton kernels: on a GPU, or on the CPU through Triton's interpreter
needs_triton = pytest.mark.skipif(not TRITON, reason="needs triton, and a GPU or TRITON_INTERPRET=1 set before "
                                                     "triton's import")
SHAPES = [(48, 32), (32,), (16, 48), (5, 7, 3), (7,)]


# --------------------------------------------------------------------------------------------- the updates
def adam_compiled_path(params, grads, exp_avgs, exp_avg_sqs, steps, lr=0.01, beta1=0.9, beta2=0.999, eps=1e-8,
                       weight_decay=0.0, decoupled=False):
    """torch.optim.adam._multi_tensor_adam as it runs under a compiler (capturable=False): bias corrections
    from the step tensors, the step sizes stacked into one tensor (`_foreach_addcdiv.Tensor`)."""
    torch._foreach_add_(steps, 1)
    if weight_decay != 0:
        if decoupled:
            torch._foreach_mul_(params, 1 - lr * weight_decay)
        else:
            grads = torch._foreach_add(grads, params, alpha=weight_decay)
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
    bc1 = [1 - beta1 ** s for s in steps]
    bc2 = [1 - beta2 ** s for s in steps]
    step_size = torch.stack([(lr / bc) * -1 for bc in bc1])
    bc2_sqrt = [bc ** 0.5 for bc in bc2]
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, bc2_sqrt)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denom, step_size)


def adam_scalar_path(params, grads, exp_avgs, exp_avg_sqs, steps, lr=0.01):
    """Adam with python-float bias corrections (as eager foreach Adam computes them): Scalar overloads only."""
    torch._foreach_add_(steps, 1)
    torch._foreach_lerp_(exp_avgs, grads, 0.1)
    torch._foreach_mul_(exp_avg_sqs, 0.999)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 0.001)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, 0.7)
    torch._foreach_add_(denom, 1e-8)
    torch._foreach_addcdiv_(params, exp_avgs, denom, [-lr / 0.3] * len(params))


def adam_per_parameter(params, grads, exp_avgs, exp_avg_sqs, lr=0.01, b1=0.9, b2=0.999, eps=1e-8, t=3):
    """Adam written per parameter with in-place tensor methods (bench/cpu.py's adam_by_hand): the new
    exp_avg_sq is read again by the parameter update, so it is a buffer the update reads (not recomputed)."""
    bc1, bc2 = 1 - b1 ** t, 1 - b2 ** t
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs):
        m.lerp_(g, 1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        p.addcdiv_(m, (v.sqrt() / (bc2 ** 0.5)).add_(eps), value=-lr / bc1)


def sgd_momentum(params, grads, bufs, lr=0.01, momentum=0.9, dampening=0.0, weight_decay=0.0):
    """torch.optim.sgd._multi_tensor_sgd with existing momentum buffers."""
    if weight_decay != 0:
        grads = torch._foreach_add(grads, params, alpha=weight_decay)
    torch._foreach_mul_(bufs, momentum)
    torch._foreach_add_(bufs, grads, alpha=1 - dampening)
    torch._foreach_add_(params, bufs, alpha=-lr)


def flat_graph(fn, n_lists: int, n: int, **kw) -> torch.fx.GraphModule:
    """fn(list_0, ..., list_{n_lists-1}, **kw) as an fx graph over n_lists * n tensor arguments."""
    names = [f"a{i}" for i in range(n_lists * n)]
    src = (f"def f({', '.join(names)}):\n    L = [{', '.join(names)}]\n"
           f"    return fn(*[L[k * {n}:(k + 1) * {n}] for k in range({n_lists})], **kw)\n")
    ns = {"fn": fn, "kw": kw}
    exec(src, ns)
    return torch.fx.symbolic_trace(ns["f"])


def adam_state(shapes, device="cpu", dtype=torch.float32):
    p = [torch.randn(s, device=device, dtype=dtype) for s in shapes]
    g = [torch.randn(s, device=device, dtype=dtype) for s in shapes]
    m = [torch.randn(s, device=device, dtype=dtype) * 0.1 for s in shapes]
    v = [torch.rand(s, device=device, dtype=dtype) * 0.01 for s in shapes]
    st = [torch.tensor(float(torch.randint(1, 9, ())), device=device) for _ in shapes]
    return [*p, *g, *m, *v, *st]


def split(flat, n_lists):
    n = len(flat) // n_lists
    return [flat[k * n:(k + 1) * n] for k in range(n_lists)]


def clones(ts):
    return [t.clone() for t in ts]


def forward_of(run):
    """The compiled forward graph (C++: CompiledGraph, Triton: the host program) of an aot_module callable."""
    art = next(a for a in run.artifacts.values() if a is not None)
    return art.forward.compiled


def assert_all_close(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


# ------------------------------------------------------------------------------------------------------ C++
@pytest.mark.parametrize("weight_decay,decoupled", [(0.0, False), (0.05, False), (0.05, True)],
                         ids=["adam", "adam_l2", "adamw"])
def test_adam_against_torch_foreach_adam(weight_decay, decoupled):
    n = len(SHAPES)
    state = adam_state(SHAPES)
    gm = flat_graph(adam_compiled_path, 5, n, weight_decay=weight_decay, decoupled=decoupled)
    run = ember_backend.compile_graph(gm, clones(state))
    for _ in range(2):  # twice: the second step starts from what the first wrote in place
        mine, ref = clones(state), clones(state)
        assert run(*mine) is None
        p, g, m, v, st = split(ref, 5)
        eager_adam(p, g, m, v, [], st, foreach=True, capturable=False, differentiable=False, fused=None,
                   grad_scale=None, found_inf=None, has_complex=False, amsgrad=False, beta1=0.9, beta2=0.999,
                   lr=0.01, weight_decay=weight_decay, eps=1e-8, maximize=False, decoupled_weight_decay=decoupled)
        assert_all_close(mine, ref)
        state = mine
    compiled = forward_of(run)
    assert len(compiled.kernels) == 1, "one kernel for every parameter's update"
    # params, exp_avg, exp_avg_sq are written by the kernel itself (the steps are read by every update)
    assert len(compiled.sched.inplace) == 3 * n
    # the bias corrections (powf of the step) are computed once per parameter, before its loop
    pows = [line for line in compiled.source.splitlines() if "ember_powf(" in line and "__asm__" not in line]
    assert pows and all(line.lstrip().startswith("float h") for line in pows), pows


def test_adam_updates_in_place_without_copies():
    n = len(SHAPES)
    state = adam_state(SHAPES)
    gm = flat_graph(adam_scalar_path, 5, n)
    run = ember_backend.compile_graph(gm, clones(state))
    mine, ref = clones(state), clones(state)
    ptrs = [t.data_ptr() for t in mine]
    run(*mine)
    adam_scalar_path(*split(ref, 5))
    assert_all_close(mine, ref)
    assert [t.data_ptr() for t in mine] == ptrs
    compiled = forward_of(run)
    assert len(compiled.kernels) == 1
    assert len(compiled.sched.inplace) == 4 * n      # steps too: nothing else reads them
    assert "_empty(" not in compiled.call.source     # no buffer allocated: every new value went into its input


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_sgd_momentum_against_torch_foreach_sgd(weight_decay):
    shapes = [(64, 16), (16,), (3, 4, 5)]
    n = len(shapes)
    state = [torch.randn(s) for s in shapes] + [torch.randn(s) for s in shapes] + [torch.randn(s) for s in shapes]
    gm = flat_graph(sgd_momentum, 3, n, weight_decay=weight_decay)
    run = ember_backend.compile_graph(gm, clones(state))
    mine, ref = clones(state), clones(state)
    run(*mine)
    p, g, b = split(ref, 3)
    eager_sgd(p, g, b, foreach=True, weight_decay=weight_decay, momentum=0.9, lr=0.01, dampening=0.0,
              nesterov=False, maximize=False, has_sparse_grad=False, fused=None, grad_scale=None, found_inf=None)
    assert_all_close(mine, ref)
    compiled = forward_of(run)
    assert len(compiled.kernels) == 1
    assert len(compiled.sched.inplace) == 2 * n


def test_ten_same_size_parameters_one_kernel_one_loop_each():
    """One kernel; per parameter one loop computing its new param, exp_avg and exp_avg_sq from shared loads
    (not one loop over all 70 streams, nor 30 loops that reload the gradient)."""
    shapes = [(32, 32)] * 10
    n = len(shapes)
    state = adam_state(shapes)
    gm = flat_graph(adam_scalar_path, 5, n)
    run = ember_backend.compile_graph(gm, clones(state))
    mine, ref = clones(state), clones(state)
    run(*mine)
    adam_scalar_path(*split(ref, 5))
    assert_all_close(mine, ref)
    compiled = forward_of(run)
    assert len(compiled.kernels) == 1
    loops = compiled.source.split("for (int64_t r0 = 0; r0 < 1024; r0++)")[1:]
    assert len(loops) == 10, f"the 30 updates of 1024 elements run in {len(loops)} loops"
    for loop in loops:
        body = loop.split("}")[0]
        assert body.count("[r0] = ") == 3 and body.count("arg") == 4 + 3, body  # 4 loads, 3 in-place stores


def test_adam_per_parameter_methods_in_place_one_parallel_region():
    """Members reading each other's element (the realized new exp_avg_sq) still form one block per parameter;
    all three updates are written in place, and the blocks share one OpenMP region with no barrier between."""
    shapes = [(128, 256)] * 4 + [(256,)] * 2
    n = len(shapes)
    state = adam_state(shapes)[:4 * n]
    gm = flat_graph(adam_per_parameter, 4, n)
    run = ember_backend.compile_graph(gm, clones(state))
    for _ in range(2):
        mine, ref = clones(state), clones(state)
        run(*mine)
        adam_per_parameter(*split(ref, 4))
        assert_all_close(mine, ref)
        state = mine
    compiled = forward_of(run)
    assert len(compiled.kernels) == 1
    assert len(compiled.sched.inplace) == 3 * n
    assert compiled.source.count("#pragma omp parallel\n") == 1
    assert compiled.source.count("#pragma omp for simd nowait") == n


def test_old_value_read_at_another_index_is_not_overwritten():
    """x is updated in place, but the graph also needs x's old value flipped: the same kernel reads other
    elements of x than it writes, so the new value must go to a fresh buffer (and be copied back). (Not x.t():
    its result has eager's transposed strides, and loops walk memory order, so it reads the element written.)"""
    def f(x, y):
        old_t = x.flip(0) * 2
        x.mul_(3).add_(y)
        return old_t

    x, y = torch.randn(24, 24), torch.randn(24, 24)
    run = ember_backend.compile_graph(torch.fx.symbolic_trace(f), [x.clone(), y])
    mine, ref = x.clone(), x.clone()
    out = run(mine, y)
    want = f(ref, y)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(mine, ref)
    assert not forward_of(run).sched.inplace


def test_old_value_read_by_a_later_kernel_is_not_overwritten():
    """The old x is read by a reduction scheduled after the kernel computing the new x."""
    def f(x, w):
        s = x.sum(0)          # old x, in a reduction
        x.add_(w)
        return s * x          # new x, broadcast against the old column sums

    x, w = torch.randn(40, 30), torch.randn(40, 30)
    run = ember_backend.compile_graph(torch.fx.symbolic_trace(f), [x.clone(), w])
    mine, ref = x.clone(), x.clone()
    torch.testing.assert_close(run(mine, w), f(ref, w))
    torch.testing.assert_close(mine, ref)


def test_new_value_read_by_an_extern_after_the_in_place_write():
    def f(x, y, w):
        x.mul_(0.5).add_(y)
        return x @ w, x * 2

    x, y, w = torch.randn(16, 8), torch.randn(16, 8), torch.randn(8, 4)
    run = ember_backend.compile_graph(torch.fx.symbolic_trace(f), [x.clone(), y, w])
    mine, ref = x.clone(), x.clone()
    got, want = run(mine, y, w), f(ref, y, w)
    assert_all_close(list(got), list(want))
    torch.testing.assert_close(mine, ref)
    assert forward_of(run).sched.inplace     # nothing needs the old x after its update


@pytest.mark.parametrize("on_triton", [False, pytest.param(True, marks=needs_triton)], ids=["cpp", "triton"])
def test_row_epilogues_write_moments_in_place_and_read_the_new_ones(on_triton, monkeypatch, tmp_path):
    """An optimizer's update of a per-channel parameter in the kernel of the sums giving its gradient (a batch
    norm's backward): the moments' new values are written over the old ones and the parameter's update, later in
    the same row, reads the new moments at the element its row wrote; every input updated in place, as eager."""
    def f(x, p, m, v):
        g = x.sum(1)
        m.lerp_(g, 0.1)
        v.mul_(0.999).addcmul_(g, g, value=0.001)
        p.add_(m / (v.sqrt() + 1e-8), alpha=-0.01)
        return g

    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    dev = "cuda" if CUDA and on_triton else "cpu"
    x, p, m, v = (torch.randn(24, 2000, device=dev), torch.randn(24, device=dev), torch.randn(24, device=dev),
                  torch.rand(24, device=dev) + 0.5)
    args = [x, p, m, v]
    run = (triton_compile if on_triton else ember_backend.compile_graph)(torch.fx.symbolic_trace(f),
                                                                         [a.clone() for a in args])
    mine, ref = [a.clone() for a in args], [a.clone() for a in args]
    torch.testing.assert_close(run(*mine), f(*ref), rtol=1e-5, atol=1e-4)   # sums of 2000 in another order
    for a, b in zip(mine[1:], ref[1:]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert len(forward_of(run).sched.inplace) == 3     # p, m and v: no copies back


def test_overlapping_inputs_run_the_functional_graph():
    """Two arguments sharing memory at run time (not at compile time): the kernels would read values already
    overwritten, so the call runs the functional graph instead and copies back, as before in-place writes."""
    def f(p, g):
        p.add_(g, alpha=-0.5)

    p, g = torch.randn(64), torch.randn(64)
    run = ember_backend.compile_graph(torch.fx.symbolic_trace(f), [p.clone(), g.clone()])
    assert forward_of(run).sched.inplace
    buf = torch.randn(96)
    a, b = buf[:64], buf[32:]            # overlapping views
    ref = buf.clone()
    ra, rb = ref[:64], ref[32:]
    want = ra - 0.5 * rb                 # what the functional graph computes from the values before the call
    run(a, b)
    torch.testing.assert_close(a, want)


def test_ember_compile_of_foreach_update_on_lists():
    """Through the frontend: lists of tensors passed as arguments (whatever it captures must stay exact)."""
    import ember
    state = adam_state(SHAPES)
    before = dict(cpp_backend.STATS)
    f = ember.compile(adam_scalar_path)
    for _ in range(2):
        mine, ref = clones(state), clones(state)
        f(*split(mine, 5))
        adam_scalar_path(*split(ref, 5))
        assert_all_close(mine, ref)
        state = mine
    assert cpp_backend.STATS["graphs"] - before["graphs"] == 1
    assert cpp_backend.STATS["kernels"] - before["kernels"] == 1


# --------------------------------------------------------------------------------------------------- Triton
def triton_compile(gm, inputs):
    from ember.backends import triton_backend
    return aot_module(gm, inputs, fw_compiler=triton_backend.compile_aten)


@needs_triton
@pytest.mark.parametrize("path", ["compiled_path", "scalar_path"])
def test_triton_adam_is_one_launch_in_place(path, monkeypatch, tmp_path):
    if CUDA and path == "compiled_path":
        pytest.skip("eager _foreach_addcdiv_ takes its step-size tensor on the CPU only, a 1-d CPU tensor, and "
                    "graphs with CPU tensors other than 0-d ones run eagerly on the Triton backend (Adam with CPU "
                    "step counters is tested in test_triton)")
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    dev = "cuda" if CUDA else "cpu"
    shapes = [(40, 24), (24,), (9, 40), (3, 5, 7)]
    n = len(shapes)
    fn = adam_compiled_path if path == "compiled_path" else adam_scalar_path
    state = adam_state(shapes, device=dev)
    gm = flat_graph(fn, 5, n)
    run = triton_compile(gm, clones(state))
    mine, ref = clones(state), clones(state)
    run(*mine)
    fn(*split(ref, 5))
    assert_all_close(mine, ref)
    call = forward_of(run)
    assert len(call.kernels) == 1, "one launch for every parameter's update"
    assert "if (pid >= " in call.kernel_source     # program ids split over the sizes
    assert len(call.sched.inplace) >= 3 * n


@needs_triton
@pytest.mark.parametrize("variant", ["adam", "adamw_tensor_lr"])
def test_triton_capturable_adam_writes_step_counters_in_place(variant, monkeypatch, tmp_path):
    """torch.optim.Adam(capturable=True) through ember.compile: the first kernel stores each step + 1, and the
    parameters' kernel reads that stored value. It recomputed step + 1 from the old counter inside the bias
    correction, which kept the counters from being written in place: a fresh tensor per counter and a copy
    back, each call. The step sizes `-(lr / (1 - beta1 ** step))` are computed by the parameters' kernel from
    the stored counter (schedule.recompute_scalars), not stored by the first kernel into a zero-dim tensor a
    parameter. Three steps with fresh gradients, every parameter and state tensor checked against eager after
    each; AdamW with a tensor learning rate (a graph input the recomputed step size reads) too."""
    import ember
    import torch.optim.adam as adam_module
    from ember.backends import triton_backend
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    if not CUDA:   # torch allows capturable=True on accelerators only; the Triton interpreter runs on the CPU
        supported = adam_module._get_capturable_supported_devices
        monkeypatch.setattr(adam_module, "_get_capturable_supported_devices",
                            lambda supports_xla=True: [*supported(supports_xla), "cpu"])
    dev = "cuda" if CUDA else "cpu"
    shapes = [(40, 24), (24,), (9, 40)]
    programs = []

    def graph(gm, ex):
        run = triton_backend.compile_aten(gm, ex)
        programs.append(run)
        return run

    def optimizer():
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s, device=dev)) for s in shapes]
        if variant == "adam":
            return params, torch.optim.Adam(params, lr=0.01, capturable=True)
        return params, torch.optim.AdamW(params, lr=torch.tensor(0.01, device=dev), weight_decay=0.05,
                                         capturable=True)

    (mine, opt), (ref, ref_opt) = optimizer(), optimizer()
    ember.reset()
    step = ember.compile(lambda: opt.step(), backend=lambda gm, ex: aot_module(gm, ex, graph, graph))
    for _ in range(3):
        step_both(step, ref_opt.step, mine, ref)
        for p, q in zip(mine, ref):
            torch.testing.assert_close(p, q)
            for k in ("exp_avg", "exp_avg_sq", "step"):
                torch.testing.assert_close(opt.state[p][k], ref_opt.state[q][k])
    steady = programs[-1].compiled
    assert len(steady.kernels) == 2
    # nothing allocated: the counters are written in place, the step sizes never stored (before: a zero-dim
    # tensor a parameter for its step size, and before that one more a counter, and a copy back)
    assert "_empty(" not in steady.source, steady.source
    assert "pow(0.9, " in steady.kernel_source.split("@triton.jit")[-1]   # beta1 ** step: the parameters' kernel


def counter_scalars(c, p, g, q, h, dtype=torch.float32):
    """A counter updated in place and two one-element values that the two updates below both read: `old`, of
    the old counter (its kernel overwrites the counter: a later kernel recomputing it would read the new one),
    and `new`, of the new counter (`c + 1`, which a later kernel can read back where it is stored)."""
    old = torch.exp(c * 0.5) * 3 - c
    c.add_(1)
    new = (torch.exp(c * 0.25) * 2 + c.sqrt()).to(dtype)
    p.add_(g * old * new * c)
    q.add_(h / old - new)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_triton_scalar_recomputed_only_from_unchanged_inputs(dtype, monkeypatch, tmp_path):
    """schedule.recompute_scalars: `new` (float32/float64) is computed by the updates' kernel from the stored
    counter, not stored in a zero-dim buffer; `old` reads the counter its own kernel overwrites in place, so it
    stays stored (recomputed later it would see the new counter: wrong by exp(0.5)); a float16 `new` stays
    stored too (the kernel computes it in float32 and rounds where it stores it). Three calls, the counter
    carried over, fresh random tensors each time."""
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    dev = "cuda" if CUDA else "cpu"
    c = torch.tensor(3.0, device=dev)
    fresh = lambda: [torch.randn(s, device=dev) for s in [(40, 24), (40, 24), (9, 40), (9, 40)]]   # noqa: E731
    gm = flat_graph(lambda cs, ps, gs, qs, hs: counter_scalars(*cs, *ps, *gs, *qs, *hs, dtype=dtype), 5, 1)
    run = triton_compile(gm, [c.clone(), *fresh()])
    mine, ref = c.clone(), c.clone()
    for _ in range(3):
        state = fresh()
        got, want = clones(state), clones(state)
        run(mine, *got)
        counter_scalars(ref, *want, dtype=dtype)
        assert_all_close([mine, *got], [ref, *want])
    call = forward_of(run)
    assert len(call.kernels) == 2
    assert call.sched.inplace   # the counter: in place, so `old` must not be recomputed after its kernel
    stored = 1 if dtype != torch.float16 else 2   # `old`, and a float16 `new`
    assert call.source.count("_empty((), ()") == stored, call.source
    second = call.kernel_source.split("@triton.jit")[-1]
    assert ("0.25" in second) == (dtype != torch.float16), second   # exp(c * 0.25): `new` recomputed there


def triton_adam_against_eager(shapes, steps: int = 1):
    """adam_per_parameter over `shapes` through the Triton backend: `steps` calls, each on fresh state and
    compared with eager's; returns the compiled host program."""
    dev = "cuda" if CUDA else "cpu"
    n = len(shapes)
    state = adam_state(shapes, device=dev)[:4 * n]
    run = triton_compile(flat_graph(adam_per_parameter, 4, n), clones(state))
    for _ in range(steps):
        mine, ref = clones(state), clones(state)
        run(*mine)
        adam_per_parameter(*split(ref, 4))
        assert_all_close(mine, ref)
        state = [torch.randn_like(t).abs() for t in state]   # (fresh values; moments must stay >= 0)
    return forward_of(run)


@needs_triton
def test_triton_parameters_of_one_shape_share_one_printed_body(monkeypatch, tmp_path):
    """Parameters of the same shape get one body in the horizontally fused kernel: each program picks its
    parameter's pointers (Triton compiles 2 bodies here, not 5); values as eager's."""
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    call = triton_adam_against_eager([(24, 40), (40,), (24, 40), (24, 40), (40,)], steps=2)
    src = call.kernel_source.split("def k_", 1)[1]
    assert len(call.kernels) == 1 and src.count("if ") == 2 and "tl.where(seg == 2, " in src
    assert src.count("tl.sqrt(") == 2


@needs_triton
def test_triton_shared_bodies_split_at_the_most_ranges_a_body_takes(monkeypatch, tmp_path):
    """More parameters of one shape than FOREACH_SHARED_MAX: several bodies of the same code, one after the
    other (here 5 parameters, at most 2 a body: 3 bodies); values as eager's."""
    from ember.codegen.triton import kernels
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(kernels, "FOREACH_SHARED_MAX", 2)
    src = triton_adam_against_eager([(24, 40)] * 5).kernel_source.split("def k_", 1)[1]
    assert src.count("if ") == 3 and src.count("tl.sqrt(") == 3 and src.count("tl.where(seg == 1, ") >= 2


def scaled_by_own_scalar(params, grads, scales):
    """Each parameter scaled by its own element of one vector (the host-scalar pack's layout: `select(pack, 0,
    i)` per parameter)."""
    for i, (p, g) in enumerate(zip(params, grads)):
        p.add_(g * scales[0][i] + 1.0)


@needs_triton
def test_triton_ranges_reading_their_own_element_of_one_vector_share_a_body(monkeypatch, tmp_path):
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    dev = "cuda" if CUDA else "cpu"
    n = 4
    gm = flat_graph(scaled_by_own_scalar, 3, n)   # (the third list: the vector, then unused tensors)
    make = lambda: [*(torch.randn(24, 40, device=dev) for _ in range(2 * n)),  # noqa: E731
                    *(torch.randn(n, device=dev) for _ in range(n))]
    run = triton_compile(gm, make())
    for _ in range(2):
        state = make()
        mine, ref = clones(state), clones(state)
        run(*mine)
        scaled_by_own_scalar(*split(ref, 3))
        assert_all_close(mine, ref)
    src = forward_of(run).kernel_source.split("def k_", 1)[1]
    assert src.count("if ") == 1 and "tl.where(seg == 3, " in src, src


@needs_triton
def test_triton_adam_per_parameter_forwards_values(monkeypatch, tmp_path):
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    call = triton_adam_against_eager([(24, 40), (40,), (24, 40)])
    assert len(call.kernels) == 1 and "if (pid >= " in call.kernel_source
    assert len(call.sched.inplace) == 3 * 3


@needs_triton
def test_triton_sgd_momentum(monkeypatch, tmp_path):
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    dev = "cuda" if CUDA else "cpu"
    shapes = [(33, 17), (17,), (64,)]
    n = len(shapes)
    state = [torch.randn(s, device=dev) for s in shapes * 3]
    gm = flat_graph(sgd_momentum, 3, n, weight_decay=0.01)
    run = triton_compile(gm, clones(state))
    mine, ref = clones(state), clones(state)
    run(*mine)
    sgd_momentum(*split(ref, 3), weight_decay=0.01)
    assert_all_close(mine, ref)
    call = forward_of(run)
    assert len(call.kernels) == 1
    assert len(call.sched.inplace) == 2 * n


@needs_triton
def test_triton_a_loss_and_many_counters_updated_in_place_split_into_kernels(monkeypatch, tmp_path):
    """densenet121's training step computed its loss (a reduction to one element) and each batch norm's
    num_batches_tracked + 1 in one group of one row: one program over all of it, a kernel of 1,873 lines that
    Triton took 11 s to compile. The counters are written in place; each writer stays with its input's readers,
    the loss gets its own kernel and the counters kernels of at most MAX_BLOCKS_PER_KERNEL."""
    from ember.codegen.schedule import FusedGroup
    from ember.codegen.triton import passes
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    dev = "cuda" if CUDA else "cpu"
    n = 70

    def step(logits, target, counters, scales):
        for c in counters:
            c.add_(1)
        scales[0].mul_(counters[0])      # reads a counter written in place: stays with its writer, after it
        return torch.nn.functional.cross_entropy(logits, target) * scales[0]

    logits, target = torch.randn(16, 100, device=dev), torch.randint(0, 100, (16,), device=dev)
    state = [logits, target] + [torch.randint(0, 5, (), device=dev) for _ in range(n)] + [torch.rand((), device=dev)]
    src = (f"def f({', '.join(f'a{i}' for i in range(n + 3))}):\n"
           f"    return step(a0, a1, [{', '.join(f'a{i + 2}' for i in range(n))}], [a{n + 2}])\n")
    ns = {"step": step}
    exec(src, ns)
    gm = torch.fx.symbolic_trace(ns["f"])
    run = triton_compile(gm, clones(state))
    for _ in range(2):
        state = [torch.randn(16, 100, device=dev), torch.randint(0, 100, (16,), device=dev)] + \
            [torch.randint(0, 5, (), device=dev) for _ in range(n)] + [torch.rand((), device=dev)]
        mine, ref = clones(state), clones(state)
        got = run(*mine)
        want = ns["f"](*ref)
        torch.testing.assert_close(got[0] if isinstance(got, (tuple, list)) else got, want)
        assert_all_close(mine, ref)
    call = forward_of(run)
    groups = [g for g in call.sched.items if isinstance(g, FusedGroup)]
    sizes = sorted(len(g.members) for g in groups)
    assert len(groups) >= 3 and sizes[-1] <= passes.MAX_BLOCKS_PER_KERNEL + 8, sizes


def test_training_step_in_one_graph_updates_batch_norm_moments_in_place(monkeypatch):
    """Adam over a conv/batch-norm network, its backward inside the step's graph (the GPU's default; forced on the
    CPU here): each batch norm's weight and bias moments are updated in the kernel of the backward's sums, written
    over the old moments (read by nothing after), and the moments and parameters match eager's."""
    import copy

    import ember
    from ember.codegen import schedule
    from ember.frontend import policy as interpreter
    from tests.codegen.test_layout import Block
    monkeypatch.setattr(interpreter, "BACKWARD_IN_GRAPH_DEVICES", {"cpu", "cuda"})
    scheds = []
    real = schedule.schedule

    def spy(*args, **kwargs):
        scheds.append(real(*args, **kwargs))
        return scheds[-1]
    monkeypatch.setattr(schedule, "schedule", spy)
    torch.manual_seed(0)
    m = Block().train()
    ref = copy.deepcopy(m)
    opt, ref_opt = torch.optim.Adam(m.parameters(), lr=1e-3), torch.optim.Adam(ref.parameters(), lr=1e-3)

    def step(model, o, x):
        o.zero_grad(set_to_none=True)
        out, y = model(x)
        (out.square().mean() + y.mean()).backward()
        o.step()
    compiled = ember.compile(step)
    for _ in range(4):
        x = torch.randn(4, 3, 40, 36)
        step(ref, ref_opt, x)
        compiled(m, opt, x)
    for (n, p), q in zip(ref.named_parameters(), m.parameters()):
        want, got = ref_opt.state[p], opt.state[q]
        torch.testing.assert_close(got["exp_avg"], want["exp_avg"], rtol=1e-4, atol=1e-6, msg=lambda s: f"{n}: {s}")
        torch.testing.assert_close(got["exp_avg_sq"], want["exp_avg_sq"], rtol=1e-4, atol=1e-9)
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-6)
    # a moment written in place inside a group of rows (a reduction's kernel), where a later member reads it
    rows_writes = [it for s in scheds for it in s.items if not getattr(it, "elementwise", True)
                   for mb in it.members if mb.dest and any(mb.buf.name in x.reads for x in it.members)]
    assert rows_writes
