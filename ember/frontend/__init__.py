"""Frontend: capture torch.fx graphs from running Python bytecode (interpreter, guards, cache, breaks)."""
from ember.frontend.convert import FrameCompiler, reset_caches

__all__ = ["FrameCompiler", "reset_caches"]
