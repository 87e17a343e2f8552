"""The command-line commands of ``transformer-reference``: one module per command (its parser lives in
``transformer_cli/main.py``), and what a command needs alone (``report`` for ``compare``, the exports' writers and
check)."""
