"""Frontend: capture torch.fx graphs from running Python bytecode (interpreter, guards, cache, breaks)."""
