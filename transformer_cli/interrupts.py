"""Ctrl-C (SIGINT) and SIGTERM: any command stops at once with one line and exit status 130 (``main``); while
``train`` steps, the first signal only asks the loop to stop after the step it is in, so that the run is saved at
its last completed step (a second signal stops at once)."""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from types import FrameType, TracebackType

SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


@contextmanager
def _handlers(handler):
    """``handler`` for SIGINT and SIGTERM inside the block (the main thread only: elsewhere Python allows none)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {number: signal.signal(number, handler) for number in SIGNALS}
    try:
        yield
    finally:
        for number, old in previous.items():
            signal.signal(number, old)


def terminate_as_interrupt():
    """SIGTERM handled as Ctrl-C (a ``KeyboardInterrupt``) inside the block."""
    return _handlers(_raise_interrupt)


class StopRequest:
    """Inside ``with StopRequest() as stop:``, the first SIGINT or SIGTERM sets ``stop.requested`` (the caller
    stops at its next safe point); a second one raises ``KeyboardInterrupt`` there and then."""

    def __init__(self) -> None:
        self.requested = False
        self._block = _handlers(self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __enter__(self) -> StopRequest:
        self._block.__enter__()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self._block.__exit__(kind, error, traceback)
