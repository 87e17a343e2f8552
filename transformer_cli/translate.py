"""``transformer-reference translate``: text in, text out, in any backend, with the tokenizer saved inside the
checkpoint (section 5.1's shared BPE vocabulary) and section 6.1's decoding (greedy, or beam search with a length
penalty). The default checkpoint is the model shipped with the package: English number words to French."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from types import ModuleType

import numpy as np

from reference_numpy import TransformerConfig, load_checkpoint
from reference_numpy.checkpoint import load_tokenizer
from reference_numpy.decoding import LENGTH_PENALTY_ALPHA
from reference_numpy.tokenizer import Tokenizer

from . import backends

SHIPPED = Path(__file__).parent / "models" / "numbers-en-fr.safetensors"
SHIPPED_NAME = "the shipped English-to-French numbers model"


def load_translator(checkpoint: str | Path | None = None,
                    dtype=np.float64) -> tuple[TransformerConfig, dict[str, np.ndarray], Tokenizer]:
    """The config, weights and tokenizer of ``checkpoint`` (default: the shipped model); a checkpoint without a
    tokenizer is refused with a message saying what it can still do."""
    path = SHIPPED if checkpoint is None else checkpoint
    config, params = load_checkpoint(path, dtype=dtype)
    tokenizer = load_tokenizer(path)
    if tokenizer is None:
        raise ValueError(f"checkpoint {str(path)!r} has no tokenizer, so it reads and writes token ids only "
                         "(compare, plot attention --src); `train --task numbers --out` saves one with its "
                         "tokenizer, and the shipped model (the default) has one")
    return config, params, tokenizer


class Translator:
    """Sentences to sentences with one backend's model: encode, decode (greedy, or beam search when
    ``beam_size`` > 1), detokenize."""

    def __init__(self, adapter: ModuleType, model, tokenizer: Tokenizer, beam_size: int = 1,
                 alpha: float = LENGTH_PENALTY_ALPHA) -> None:
        self.adapter, self.model, self.tokenizer = adapter, model, tokenizer
        self.beam_size, self.alpha = beam_size, alpha

    def token_ids(self, texts: list[str]) -> np.ndarray:
        """Output ids (B, L) of ``texts``, without bos, right-padded with pad_id."""
        src = self.tokenizer.batch(texts)
        if self.beam_size == 1:
            return np.asarray(self.adapter.greedy(self.model, src))
        return np.asarray(self.adapter.beam(self.model, src, self.beam_size, self.alpha)[0])

    def __call__(self, texts: list[str]) -> list[str]:
        return [self.tokenizer.decode(row) for row in self.token_ids(texts)]

    def lines(self, lines: Iterable[str]) -> Iterator[str]:
        """One translation per input line, as each line arrives (a blank line gives a blank line)."""
        for line in lines:
            text = line.rstrip("\n")
            yield self([text])[0] if text.strip() else ""


def stdin_lines(stream) -> Iterator[str]:
    """The lines of standard input as text, decoded as UTF-8 whatever the locale; a line that is not UTF-8 is a
    ``ValueError`` naming its number. A stream without a byte buffer (already text) is read as it is."""
    if not hasattr(stream, "buffer"):
        yield from stream
        return
    for number, raw in enumerate(stream.buffer, 1):
        try:
            yield raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise ValueError(f"standard input, line {number}: not UTF-8 text (byte {raw[err.start]:#04x} at offset "
                             f"{err.start})") from None


def translator(adapter: ModuleType, checkpoint: str | Path | None = None, dtype: str = "float32",
               beam_size: int = 1, alpha: float = LENGTH_PENALTY_ALPHA, device: str = "cpu") -> Translator:
    """A :class:`Translator` for ``checkpoint`` (default: the shipped model) in one backend on ``device`` (``cpu``,
    ``gpu:N``)."""
    device = backends.device_for(adapter, device)
    config, params, tokenizer = load_translator(checkpoint)
    return Translator(adapter, adapter.build(config, params, dtype, device), tokenizer, beam_size, alpha)
