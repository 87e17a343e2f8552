"""The equivalence harness: what proves the PyTorch, JAX/Flax and TensorFlow/Keras ports agree with the reference.

It owns the one tolerance policy (:mod:`equivalence.tolerance`), the shared agreement cases
(:mod:`equivalence.cases`), the adapter contract every backend implements (:mod:`equivalence.contract`), the four
adapters that implement it (:mod:`equivalence.backends`), which the agreement suite and the command line drive, and
the reference's answers a run is judged against (:mod:`equivalence.oracle`).
The user-facing packages (``reference_numpy`` and the ports) import nothing from here, and nothing here imports the
command line: the fuzzer and the training runs call the reference itself.
"""

from reference_numpy import __version__ as __version__
