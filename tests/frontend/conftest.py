import pytest

from tests.frontend.harness import reset


@pytest.fixture(autouse=True)
def _fresh_caches():
    """Every test starts and ends with empty compile caches (ember.reset() / torch._dynamo.reset())."""
    reset()
    yield
    reset()
