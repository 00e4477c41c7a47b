"""The opcode registry (ember/frontend/opcodes/registry.py): names checked against dis.opmap at import."""
import dis

import pytest

import ember.frontend.interpreter  # noqa: F401  (registers every handler)
from ember.frontend.opcodes.registry import OPCODES, OPCODES_ONLY_IN_311, OPCODES_ONLY_IN_312, opcode


def test_a_misspelled_opcode_name_fails_at_import():
    with pytest.raises(ValueError, match="LOAD_FAZT"):
        opcode("LOAD_FAZT")


def test_handlers_are_registered_only_under_opcodes_of_the_running_version():
    assert OPCODES and set(OPCODES) <= set(dis.opmap)
    running = OPCODES_ONLY_IN_312 if "END_FOR" in dis.opmap else OPCODES_ONLY_IN_311
    other = OPCODES_ONLY_IN_311 if running is OPCODES_ONLY_IN_312 else OPCODES_ONLY_IN_312
    assert running <= set(OPCODES)
    assert not other & set(OPCODES)


def test_every_instruction_of_a_plain_function_has_a_handler():
    def f(x, ys):
        total = 0
        for y in ys:
            if y is not None and y > 0:
                total += x * y
        return [total, *ys], {"k": total}

    assert {i.opname for i in dis.get_instructions(f)} <= set(OPCODES)
