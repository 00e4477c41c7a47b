"""The global modes a graph records: grad mode and autocast, entered and left inside the captured code."""
from __future__ import annotations

import torch

from ember.frontend.values import AutocastCtxV, AutocastExitV, ConstV, V


def autocast_state() -> dict:
    """{device type: (enabled, dtype)} of autocast, for the guards and to restore it after a capture."""
    return {d: (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")}


def restore_autocast(state: dict) -> None:
    for d, (on, dt) in state.items():
        torch.set_autocast_enabled(d, on)
        torch.set_autocast_dtype(d, dt)


def close_autocast(cap) -> None:
    """A graph that ends inside autocast blocks (a break) leaves them: the process's state is the entry's when the
    graph returns (a backend that runs the graph's torch calls would otherwise leave autocast on), and the resume
    function enters them again (values.AutocastExit)."""
    for node in reversed(cap.open_autocast):
        cap.graph.call_function(torch.amp.autocast_mode._exit_autocast, (node,))


# autocast's context classes -> the device type they fix (None: the device is their first argument)
AUTOCAST_CLASSES = {torch.autocast: None, torch.amp.autocast: None, torch.cpu.amp.autocast: "cpu",
                    torch.cuda.amp.autocast: "cuda"}   # the last two: the deprecated per-device spellings


class GlobalModes:
    """Frame methods that change grad mode or autocast inside the graph."""

    def enter_autocast(self, ctx: AutocastCtxV) -> AutocastExitV:
        """An autocast block inside the graph: _enter_autocast/_exit_autocast nodes around it (the ATen tracer
        runs them, so the casts autocast inserts reach the ATen graph), and the real context entered while
        capturing, so the fake tensors' dtypes are autocast's."""
        node = self.cap.graph.call_function(torch.amp.autocast_mode._enter_autocast, ctx.args)
        real = torch.amp.autocast(*ctx.args)
        real.__enter__()
        self.cap.open_autocast.append(node)
        return AutocastExitV(node, real)

    def exit_autocast(self, v: AutocastExitV) -> V:
        self.cap.graph.call_function(torch.amp.autocast_mode._exit_autocast, (v.node,))
        if v.node in self.cap.open_autocast:
            self.cap.open_autocast.remove(v.node)
        v.ctx.__exit__(None, None, None)
        return ConstV(None)

    def autocast_args(self, device: str | None, args: list[V], kwargs: dict[str, V]) -> AutocastCtxV:
        a = [self.const_value(x) for x in args]
        kw = {k: self.const_value(x) for k, x in kwargs.items()}
        if device is None:
            sig = ("device_type", "dtype", "enabled", "cache_enabled")
        else:   # torch.cuda.amp.autocast(enabled, dtype, cache_enabled)
            sig = ("enabled", "dtype", "cache_enabled")
            kw["device_type"] = device
        kw.update(zip(sig, a))
        dev = kw["device_type"]
        dtype = kw.get("dtype") or torch.get_autocast_dtype(dev)
        cache = kw.get("cache_enabled")
        return AutocastCtxV((dev, dtype, bool(kw.get("enabled", True)),
                             torch.is_autocast_cache_enabled() if cache is None else bool(cache)))

    def set_grad(self, enabled: bool):
        if enabled != self.cap.grad_enabled:
            self.cap.graph.call_function(torch._C._set_grad_enabled, (enabled,))
            torch._C._set_grad_enabled(enabled)
            self.cap.grad_enabled = enabled
