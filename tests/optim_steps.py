"""A compiled optimizer step next to an eager one (tests of optimizers in every backend's folder)."""
import torch


def step_both(step, ref_step, ps, qs) -> None:
    """One compiled `step` and one eager `ref_step`, the parameters ps and their eager twins qs given the same
    fresh random gradients first."""
    for p, q in zip(ps, qs):
        p.grad = torch.randn_like(p)
        q.grad = p.grad.clone()
    step()
    ref_step()
