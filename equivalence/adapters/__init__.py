"""The four backend adapters, one module per backend: ``numpy`` (the reference), ``torch``, ``jax``, ``tf``.

Each module implements :class:`equivalence.contract.Backend` (NumPy in, NumPy out), so the agreement suite and the
``compare`` command drive every backend through one interface. Importing an adapter imports its framework.
"""
