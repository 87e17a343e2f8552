"""A progress bar over a list of work items (training steps, batches of sentences, timed calls): tqdm's on standard
error where the ``cli`` extra installs it, the list itself where it does not or when asked to be quiet."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable


def progress_bar(description: str, unit: str, quiet: bool, leave: bool = True) -> Callable[[Iterable], Iterable]:
    """A wrapper of a list of work items that shows a tqdm progress bar on stderr (erased once done unless
    ``leave``); the list unchanged when ``quiet`` or when tqdm is not installed."""
    if not quiet:
        try:
            from tqdm import tqdm
        except ModuleNotFoundError:
            pass
        else:
            return lambda items: tqdm(items, desc=description, unit=unit, file=sys.stderr, leave=leave)
    return lambda items: items
