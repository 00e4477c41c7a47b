"""Frontend: capture torch.fx graphs from running Python bytecode (placeholder until the interpreter lands)."""
from __future__ import annotations


class FrameCompiler:
    def __init__(self, fn, cfg):
        self.fn, self.cfg = fn, cfg

    @classmethod
    def for_callable(cls, fn, cfg):
        return cls(fn, cfg)

    def __call__(self, args, kwargs):
        return self.fn(*args, **kwargs)


def reset_caches() -> None:
    pass
