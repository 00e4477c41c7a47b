"""The kinds of tracked value (ember/frontend/values.py) and the tables that dispatch on them."""
from ember.frontend.attributes import ATTRIBUTE_READERS
from ember.frontend.calls import CALLERS_BY_KIND
from ember.frontend.methods import METHODS_BY_KIND
from ember.frontend.values import V


def test_value_kinds_are_leaf_classes():
    """The per-kind tables look a value's exact class up: a subclass of a kind would miss its kind's entry."""
    kinds = V.__subclasses__()
    assert kinds and all(not k.__subclasses__() for k in kinds)


def test_the_tables_are_keyed_by_value_kinds():
    kinds = set(V.__subclasses__())
    for table in (ATTRIBUTE_READERS, CALLERS_BY_KIND, METHODS_BY_KIND):
        assert set(table) <= kinds
