"""The ``cli`` extra (tqdm, matplotlib, Pygments) is optional: ``compare`` and ``bench`` run without
it, with no progress bar; a picture or the side-by-side page without it is an input error (exit
status 2) whose one line names the missing module and the extra to install."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

INSTALL = "pip install 'transformer-reference[cli]'"


def require(module: str, purpose: str) -> ModuleType:
    """Import ``module`` of the ``cli`` extra, needed for ``purpose``; a ``ValueError`` naming it and
    the extra if it (or a module it needs) is not installed."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        raise ValueError(f"{purpose} needs {(err.name or module).partition('.')[0]}: {INSTALL}") from None


def finish(bar: Any, done: int, note: str) -> None:
    """Close a progress bar whose work ended after ``done`` items, before its total: the total becomes ``done``
    (the bar ends full, not frozen short of it) and ``note``, why it ended, joins its postfix. A plain iterable
    (no bar) is left alone."""
    if hasattr(bar, "close"):
        bar.total, bar.n = done, done
        bar.set_postfix_str(f"{bar.postfix}, {note}" if bar.postfix else note, refresh=False)
        bar.close()
