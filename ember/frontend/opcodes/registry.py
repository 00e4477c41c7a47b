"""The opcode registry: `@opcode("NAME", ...)` registers a handler(frame, inst) for CPython opcode names, and the
frame loop (ember.frontend.interpreter) finds the handler of each instruction in OPCODES."""
from __future__ import annotations

import dis
import sys
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from ember.frontend.interpreter import Frame

PY312 = sys.version_info >= (3, 12)

# Opcodes with a handler that only one of the supported CPython versions (3.11, 3.12) has: a handler is
# registered only under the names the running version's dis.opmap has (dis never yields the others), and a
# name that is in neither dis.opmap nor these sets is a typo, which fails at import.
OPCODES_ONLY_IN_311 = frozenset({
    "PRECALL", "UNARY_POSITIVE", "LIST_TO_TUPLE", "JUMP_IF_TRUE_OR_POP", "JUMP_IF_FALSE_OR_POP",
    "POP_JUMP_FORWARD_IF_TRUE", "POP_JUMP_BACKWARD_IF_TRUE", "POP_JUMP_FORWARD_IF_FALSE", "POP_JUMP_BACKWARD_IF_FALSE",
    "POP_JUMP_FORWARD_IF_NONE", "POP_JUMP_BACKWARD_IF_NONE", "POP_JUMP_FORWARD_IF_NOT_NONE",
    "POP_JUMP_BACKWARD_IF_NOT_NONE",
})
OPCODES_ONLY_IN_312 = frozenset({
    "LOAD_FAST_CHECK", "LOAD_FAST_AND_CLEAR", "RETURN_CONST", "END_FOR", "END_SEND", "LOAD_SUPER_ATTR",
    "CALL_INTRINSIC_1", "BINARY_SLICE", "STORE_SLICE", "POP_JUMP_IF_TRUE", "POP_JUMP_IF_FALSE", "POP_JUMP_IF_NONE",
    "POP_JUMP_IF_NOT_NONE", "JUMP",
})

Handler = Callable[["Frame", dis.Instruction], None]
OPCODES: dict[str, Handler] = {}


def opcode(*names: str) -> Callable[[Handler], Handler]:
    """Register the decorated function as the handler of each named opcode of the running CPython version."""
    for name in names:
        if name not in dis.opmap and name not in OPCODES_ONLY_IN_311 | OPCODES_ONLY_IN_312:
            raise ValueError(f"{name!r} is not an opcode of CPython 3.11 or 3.12")

    def register(handler: Handler) -> Handler:
        for name in names:
            if name in dis.opmap:
                if name in OPCODES:
                    raise ValueError(f"two handlers for opcode {name}: {OPCODES[name].__name__}, {handler.__name__}")
                OPCODES[name] = handler
        return handler
    return register
