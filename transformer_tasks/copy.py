"""The copy task: the model reads a random sequence of symbols and must write it back (a first test that a
sequence-to-sequence model and its training loop work; no data to download).

A source is ``symbols + [eos]``, the decoder's input ``[bos] + symbols`` and its labels ``symbols + [eos]``
(teacher forcing, section 3.1: the output embeddings are offset by one position), padded with ``pad_id``.
Batch ``s`` of a run is drawn from its own stream ``PCG64([seed, s])``, so a run resumed at step ``s`` sees the
batches the uninterrupted run would have seen; held-out sequences come from a separate stream.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from reference_numpy.config import TransformerConfig

TEST, VALIDATION = "test", "validation"
STREAMS = {TEST: 2 ** 32 - 1, VALIDATION: 2 ** 32 - 2}   # the held-out sets' streams; training batches use 0, 1, 2, ...
# Settings that learn the task to >= 99% exact-sequence accuracy in every backend (docs/training.md); training
# stops once greedy decoding copies STOP_AT of VALIDATION_SIZE validation sequences, checked every EVAL_EVERY steps
DEFAULTS = dict(steps=3000, batch_size=128, warmup_steps=200, learning_rate_scale=0.5, stop_at=0.99, eval_every=100,
                validation_size=500)


@dataclass(frozen=True)
class CopyTask:
    """Sequences of 1 .. ``max_length`` symbols drawn uniformly from ``symbols`` symbols."""

    symbols: int = 10
    max_length: int = 10
    name: str = "copy"

    def __post_init__(self) -> None:
        for name in ("symbols", "max_length"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an int >= 1, got {getattr(self, name)!r}")

    def config(self, **changes: Any) -> TransformerConfig:
        """The ``tiny`` preset sized for the task: source and target vocabularies of the three special ids and the
        symbols (separate embedding matrices, as ``tiny`` has)."""
        vocab = 3 + self.symbols
        changes = {"src_vocab_size": vocab, "tgt_vocab_size": vocab, **changes}
        return TransformerConfig.preset("tiny", **changes)

    def sequences(self, config: TransformerConfig, count: int, stream: int, seed: int) -> np.ndarray:
        """``count`` sequences of symbol ids, right-padded with pad_id. Shape (count, max_length)."""
        rng = np.random.Generator(np.random.PCG64([seed, stream]))
        first = max(config.pad_id, config.bos_id, config.eos_id) + 1
        symbols = rng.integers(first, first + self.symbols, size=(count, self.max_length))
        lengths = rng.integers(1, self.max_length + 1, size=count)
        return np.where(np.arange(self.max_length) < lengths[:, None], symbols, config.pad_id)

    def batch(self, config: TransformerConfig, batch_size: int, step: int, seed: int) -> dict[str, np.ndarray]:
        """The training batch of step ``step`` (0-based): src (B, S), tgt and labels (B, T), S = T = max_length + 1."""
        return teacher_forcing(config, self.sequences(config, batch_size, step, seed))

    def held_out_batch(self, config: TransformerConfig, count: int, split: str,
                       seed: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """Held-out sequences for evaluation (``TEST``) or for deciding when to stop (``VALIDATION``), from streams
        no training batch uses: teacher-forced (src, tgt, labels: (count, max_length + 1)) and as they are
        (count, max_length)."""
        sequences = self.sequences(config, count, STREAMS[split], seed)
        return teacher_forcing(config, sequences), sequences

    def held_out(self, config: TransformerConfig, count: int, split: str, seed: int) -> tuple[np.ndarray, np.ndarray]:
        """Sources (count, max_length + 1) and expected sequences of :meth:`held_out_batch`."""
        batch, sequences = self.held_out_batch(config, count, split, seed)
        return batch["src"], sequences

    def held_out_size(self, split: str) -> None:
        """The pairs a held-out set holds: any number (drawn from its own stream)."""
        return None

    def score(self, config: TransformerConfig, decoded: np.ndarray, sequences: np.ndarray) -> dict[str, float]:
        """``exact``: the share of greedy outputs that copy their sequence exactly."""
        return {"exact": exact_match(config, decoded, sequences)}


def teacher_forcing(config: TransformerConfig, sequences: np.ndarray) -> dict[str, np.ndarray]:
    """src = sequence + eos, tgt = bos + sequence, labels = sequence + eos, all padded to one more position."""
    pad = np.full((len(sequences), 1), config.pad_id)
    lengths = (sequences != config.pad_id).sum(axis=1)
    with_eos = np.concatenate([sequences, pad], axis=1)
    with_eos[np.arange(len(sequences)), lengths] = config.eos_id
    tgt = np.concatenate([np.full((len(sequences), 1), config.bos_id), sequences], axis=1)
    return {"src": with_eos, "tgt": tgt, "labels": with_eos}


def exact_match(config: TransformerConfig, decoded: np.ndarray, sequences: np.ndarray) -> float:
    """The fraction of rows whose greedy output (without bos, pad-filled) is exactly the sequence then eos."""
    expected = teacher_forcing(config, sequences)["labels"]
    width = max(decoded.shape[1], expected.shape[1])
    padded = lambda tokens: np.pad(tokens, ((0, 0), (0, width - tokens.shape[1])), constant_values=config.pad_id)
    return float(np.mean(np.all(padded(decoded) == padded(expected), axis=1)))
