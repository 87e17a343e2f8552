"""The command run in this process, as the tests of tests/cli/ drive it: the one helper module that imports the
command line (no test outside tests/cli/ drives the command: tests/project/test_layout.py)."""

from __future__ import annotations

import io

from transformer_cli.main import main


def cli(capture, *args: str, stdin: str | None = None, monkeypatch=None) -> tuple[int, str, str]:
    """``main(args)`` in this process, reading ``stdin`` (set with ``monkeypatch``) when given: (exit status,
    standard output, standard error) as ``capture`` read them (pytest's ``capsys``; ``capfd`` for what native code
    writes to the file descriptors)."""
    if stdin is not None:
        monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    status = main(list(args))
    out, err = capture.readouterr()
    return status, out, err


def one_error_line(err: str, *words: str) -> str:
    """The single line of a command's refusal, checked to be its error line (no traceback) and to name ``words``."""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err and lines[0].startswith("transformer-reference: error:"), err
    assert all(word in lines[0] for word in words), err
    return lines[0]
