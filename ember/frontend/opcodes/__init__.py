"""One small handler per CPython opcode, grouped by kind; importing the package registers them all in
registry.OPCODES, where the frame loop finds them."""
from ember.frontend.opcodes import calls, containers, control_flow, loads_stores, operators  # noqa: F401
