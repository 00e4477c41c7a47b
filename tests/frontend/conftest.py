import sys

import pytest

from tests.frontend.harness import BASELINE, reset


@pytest.fixture(autouse=True, scope="session")
def _native_checker_loaded():
    """Captures batch tensor guards into the C++ checker once it is loaded (ember.runtime.native_guards): wait
    for it (on a fresh cache its build takes ~11 s) so every test checks what a warm installation runs, not
    whatever the build's timing gives. test_guards_fast.py runs its cases with the Python checks too."""
    if not BASELINE:
        from ember.runtime import native_guards
        native_guards.checker(wait=True)


@pytest.fixture(autouse=True)
def _fresh_caches():
    """Every test starts and ends with empty compile caches (ember.reset() / torch._dynamo.reset())."""
    reset()
    yield
    reset()


# Programs where ember is correct but does not yet capture what the test asks for. Each is an expected
# failure with its reason (strict: a fix makes the test pass and this entry must go). Listed in the issue notes.
_FLOAT_SPECIALIZED = ("a Python float from .item()/.tolist() reaches the resume function as a guarded "
                      "constant (no unspecialized floats yet), so each new value recompiles")
KNOWN_GAPS = {
    "test_breaks.py::test_data_dependent_both_directions[start-item]": _FLOAT_SPECIALIZED,
    "test_breaks.py::test_data_dependent_both_directions[start-tolist]": _FLOAT_SPECIALIZED,
    "test_breaks.py::test_data_dependent_both_directions[middle-item]": _FLOAT_SPECIALIZED,
    "test_breaks.py::test_data_dependent_both_directions[callee-item]": _FLOAT_SPECIALIZED,
    "test_breaks.py::test_data_dependent_both_directions[callee-tolist]": _FLOAT_SPECIALIZED,
}
if sys.version_info >= (3, 12):   # (break_frames.compilable_generator: generators compile on 3.11 only)
    _GENERATORS_AS_PYTHON = "a generator holding a break runs as Python on 3.12 (its resume code is 3.11's)"
    KNOWN_GAPS.update({f"test_breaks_flow.py::test_generator_program[{name}]": _GENERATORS_AS_PYTHON for name in (
        "g_generator_expression_with_item", "g_zip_generators", "g_next_then_break", "g_consume_printing_generator",
        "g_list_of_generator_with_break")})
NOT_STRICT: set[str] = {k for k in KNOWN_GAPS if "test_generator_program" in k}


def pytest_collection_modifyitems(config, items):
    from tests.frontend.harness import BASELINE
    if BASELINE:
        return
    for item in items:
        for key, reason in KNOWN_GAPS.items():
            if item.nodeid.endswith(key):
                item.add_marker(pytest.mark.xfail(reason=reason, strict=key not in NOT_STRICT))
