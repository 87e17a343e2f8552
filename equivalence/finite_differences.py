"""Gradients by central finite differences, entry by entry, for a backend without a backward pass (the reference).

Each entry's derivative is the Richardson extrapolation (4 fd(h/2) - fd(h)) / 3 of two central differences
fd(h) = (L(+h) - L(-h)) / 2h along that entry's unit direction, with the error bound of
:func:`equivalence.tolerance.finite_difference_bound`. Four loss evaluations per entry: meant for small models.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .tolerance import finite_difference_bound

STEP = 1e-3   # h, along a unit direction (the scale of tests/equivalence/test_gradients.py's directional check)


def finite_difference_gradients(loss: Callable[[dict[str, np.ndarray]], float], params: dict[str, np.ndarray],
                                step: float = STEP) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """``(grads, bounds)``: d loss / d params[name] for every entry of every tensor (float64, in ``params``'
    layout), and each entry's error bound. ``loss`` maps a parameter dict to a float; ``params`` is not changed."""
    center = loss(params)
    grads, bounds = {}, {}
    for name, value in params.items():
        work = np.array(value, dtype=np.float64)                 # the one tensor being shifted, a private copy
        shifted = {**params, name: work}
        grad, bound = np.empty_like(work), np.empty_like(work)

        def at(index: int, offset: float) -> float:
            work.flat[index] = value.flat[index] + offset
            result = loss(shifted)
            work.flat[index] = value.flat[index]
            return result

        for index in range(work.size):
            fd_h = (at(index, step) - at(index, -step)) / (2 * step)
            fd_half = (at(index, step / 2) - at(index, -step / 2)) / step
            grad.flat[index] = (4 * fd_half - fd_h) / 3
            bound.flat[index] = finite_difference_bound(fd_h, fd_half, center, step)
        grads[name], bounds[name] = grad, bound
    return grads, bounds
