"""The ``transformer-reference`` command: compare backends side by side, benchmark them, draw pictures."""

from reference_numpy import __version__ as __version__
