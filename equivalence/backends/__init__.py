"""The four backends the harness and the command line run, one adapter module each: ``numpy`` (the reference),
``torch``, ``jax``, ``tf``; and which of them are installed here (``docs/ports.md``).

Each adapter implements :class:`equivalence.contract.Backend` (NumPy in, NumPy out), so the commands and the
agreement suite drive every backend through one interface. Importing an adapter imports its framework; this module
imports none.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, TypeVar

from equivalence import runtime

# backend name -> (adapter module, every framework module it needs, the pip extra that installs them)
BACKENDS = {
    "numpy": ("equivalence.backends.numpy", ("numpy",), None),
    "torch": ("equivalence.backends.torch", ("torch",), "torch"),
    "jax": ("equivalence.backends.jax", ("jax", "flax", "optax"), "jax"),
    "tf": ("equivalence.backends.tf", ("tensorflow", "keras"), "tf"),
}
PORTS = tuple(name for name in BACKENDS if name != "numpy")
Function = TypeVar("Function", bound=Callable[..., Any])


def in_recipe(recipe: Callable[[Any], contextlib.AbstractContextManager]) -> Callable[[Function], Function]:
    """A decorator running ``function(model, ...)`` inside ``recipe(model)``: an adapter's precision block (the
    autocast of a model built in a mixed precision, nothing for any other)."""
    def decorate(function: Function) -> Function:
        @functools.wraps(function)
        def call(model: Any, *args: Any, **kwargs: Any) -> Any:
            with recipe(model):
                return function(model, *args, **kwargs)
        return call  # type: ignore[return-value]
    return decorate


@dataclass(frozen=True)
class Missing:
    """A backend that cannot run here, and what to install."""

    name: str
    reason: str


def load(names: tuple[str, ...] = PORTS) -> tuple[dict[str, ModuleType], list[Missing]]:
    """Import the adapters of ``names``; a backend one of whose framework modules is not installed
    is reported (naming the modules and the extra), never imported."""
    unknown = [name for name in names if name not in BACKENDS]
    if unknown:
        raise ValueError(f"unknown backend {unknown[0]!r}; choose from {', '.join(BACKENDS)}")
    adapters, missing = {}, []
    for name in names:
        module, _, extra = BACKENDS[name]
        absent = absent_frameworks(name)
        if absent:
            missing.append(Missing(name, f"not installed ({' and '.join(absent)} missing): "
                                         f"pip install 'transformer-reference[{extra}]'"))
            continue
        adapters[name] = runtime.import_framework(module)        # quietly, with --threads
    return adapters, missing


def absent_frameworks(name: str) -> list[str]:
    """The framework modules backend ``name`` needs that are not installed (none imported to find out)."""
    return [framework for framework in BACKENDS[name][1] if importlib.util.find_spec(framework) is None]


def installed(name: str) -> bool:
    return not absent_frameworks(name)


def device_for(adapter: ModuleType, device: str) -> str:
    """The adapter's own name of ``--device`` (``cpu``, ``gpu:N``; PyTorch calls a GPU ``cuda:N``), refused with one
    ValueError where the backend does not have that device here. The NumPy reference runs on the CPU whatever is
    asked (``--device`` places the ports)."""
    if adapter.NAME == "numpy":
        return "cpu"
    names = {name.replace("cuda:", "gpu:"): name for name in adapter.devices()}
    if device not in names:
        raise ValueError(f"--device {device}: {adapter.NAME} has {', '.join(names)} here")
    return names[device]


def require_any(names: tuple[str, ...], adapters: dict[str, ModuleType], missing: list[Missing]) -> None:
    """Refuse a request of which no backend is installed: a run that compares nothing must fail."""
    if not any(name in adapters for name in names):
        reasons = "; ".join(f"{m.name}: {m.reason}" for m in missing if m.name in names) or "none requested"
        raise ValueError(f"--backends: none of the requested backends is installed ({reasons})")
