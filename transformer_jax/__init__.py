"""JAX/Flax NNX port of the Transformer of "Attention Is All You Need" (Vaswani et al., 2017).

A parallel text of ``reference_numpy`` (see ``docs/ports.md`` and ``docs/jax.md``). Importing
the package leaves ``jax_enable_x64`` alone; ``transformer_jax.backend`` turns it on.
"""

from reference_numpy import __version__

from .checkpoint import from_params, load_checkpoint, name_table, save_checkpoint, to_params
from .decoding import beam_search, greedy_decode
from .model import Transformer, compiled_forward, forward
from .training import gradients, label_smoothed_cross_entropy, loss

__all__ = ["Transformer", "beam_search", "compiled_forward", "forward", "from_params", "gradients", "greedy_decode",
           "label_smoothed_cross_entropy", "load_checkpoint", "loss", "name_table", "save_checkpoint", "to_params"]
