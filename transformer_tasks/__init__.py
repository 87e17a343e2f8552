"""The training tasks (``train`` runs them; the tests and scripts build their batches too): the copy task, the
numbers task (English number words to French) and a user's parallel corpus, each making batches, held-out sets and
scores; and how every command reads a text file (:mod:`transformer_tasks.textfiles`)."""

from reference_numpy import __version__ as __version__
