"""picker(positions): `lambda xs: tuple(xs[i] for i in positions)` as one C call (operator.itemgetter), a tuple
also for one position or none. The hot path's way to pick many values at once (a graph's mutated inputs, a CUDA
graph's static inputs, the inputs that require grad)."""
from __future__ import annotations

import operator
from typing import Any, Callable, Sequence


def picker(positions: Sequence[int]) -> Callable[[Any], tuple]:
    if len(positions) > 1:
        return operator.itemgetter(*positions)
    if positions:
        i = positions[0]
        return lambda xs: (xs[i],)
    return lambda xs: ()
