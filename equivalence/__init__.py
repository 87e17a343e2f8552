"""The equivalence harness: what proves the PyTorch, JAX/Flax and TensorFlow/Keras ports agree with the reference.

It owns the one tolerance policy (:mod:`equivalence.tolerance`), the shared agreement cases
(:mod:`equivalence.cases`), the adapter contract every backend implements (:mod:`equivalence.contract`) and the
four adapters (:mod:`equivalence.adapters`). The user-facing packages (``reference_numpy`` and the ports) import
nothing from here.
"""

from reference_numpy import __version__ as __version__
