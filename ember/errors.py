"""Errors a user of ember can see. Each names the user's code and what to do, never ember's internals."""


class EmberError(Exception):
    """Base class of every error ember raises on purpose."""


class BackendCompilerFailed(EmberError):
    """A backend raised while compiling a captured graph; the backend's exception is chained (__cause__)."""

    def __init__(self, backend_name: str, exc: BaseException, where: str = ""):
        self.backend_name = backend_name
        self.inner_exception = exc
        at = f" for the graph captured from {where}" if where else ""
        super().__init__(
            f"backend={backend_name!r} raised {type(exc).__name__}: {exc}{at}. "
            f"Fix the backend, or pass backend='eager' to ember.compile to run the graph uncompiled."
        )


class GraphBreakError(EmberError):
    """fullgraph=True, and the program does something ember cannot put into one graph."""


class Unsupported(Exception):
    """Raised inside the frontend when capture meets something it cannot record.

    Never escapes to the user: it becomes a graph break or an eager fallback (or GraphBreakError under fullgraph).
    """

    def __init__(self, reason: str, where: str = "", holds_while: tuple[str, ...] = (), raises: bool = False):
        self.reason = reason
        self.where = where
        # guard expressions under which the reason stands (e.g. "an optimizer's state is not created yet"): the
        # entry that breaks here gets them too, so a later call where they fail captures again
        self.holds_while = holds_while
        # the op itself raises on these inputs (a shape mismatch, not a data-dependent size): run in Python, it will
        self.raises = raises
        super().__init__(f"{reason} ({where})" if where else reason)


class CannotLower(Exception):
    """Raised by code generation for a graph it cannot compile: the whole graph then runs eagerly, logged."""
