"""The ``transformer-reference`` command: compare backends side by side, benchmark them, draw pictures."""
