"""Training the PyTorch way: the sentence pairs of a task as a ``torch.utils.data.Dataset`` whose ``collate`` makes
the batches a ``DataLoader`` hands to a user's own loop (or Lightning's), with ``torch.optim.Adam`` and a ``LambdaLR``
of Eq. (3) (:func:`.training.learning_rate_schedule`), the optimizer ``train_step`` steps with (docs/torch.md,
"Train it your framework's way"). The pairs come as token ids, eos included -- the corpus task's
``CorpusTask.encode(pairs, config)``, any tokenizer's ids -- so that the library never reads the command line's
tasks. Each port's ``ecosystem.py`` holds its framework's own training idiom: Keras' ``fit`` in TensorFlow,
``torch.utils.data`` here, optax and orbax in JAX.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.utils.data import Dataset

from reference_numpy.config import TransformerConfig
from reference_numpy.tokenizer import teacher_forcing


class TranslationDataset(Dataset):
    """Sentence pairs ``(source ids, target ids)``, each list ending in eos, for ``config``'s model. Item ``i`` is
    the ``i``-th pair; :meth:`collate` (``DataLoader(dataset, batch_size, collate_fn=dataset.collate)``) pads a list
    of pairs into a batch."""

    def __init__(self, sources: Sequence[Sequence[int]], targets: Sequence[Sequence[int]],
                 config: TransformerConfig) -> None:
        if len(sources) != len(targets):
            raise ValueError(f"targets holds {len(targets)} sentences, sources {len(sources)}: one target per source")
        for name, side in (("sources", sources), ("targets", targets)):
            empty = next((i for i, ids in enumerate(side) if len(ids) == 0), None)
            if empty is not None:
                raise ValueError(f"{name}[{empty}] is empty: every sentence has at least its eos")
        self.sources, self.targets, self.config = sources, targets, config

    def __len__(self) -> int:
        return len(self.sources)

    def __getitem__(self, index: int) -> tuple[list[int], list[int]]:
        return list(self.sources[index]), list(self.targets[index])

    def collate(self, examples: list[tuple[list[int], list[int]]]) -> dict[str, torch.Tensor]:
        """A batch of pairs as the training step takes it (the tasks' teacher forcing): ``src`` (B, S) the sources,
        ``labels`` (B, T) the targets, ``tgt`` (B, T) the targets shifted right after the start token, right-padded
        with pad_id; int64 tensors."""
        batch = teacher_forcing(self.config, [source for source, _ in examples], [target for _, target in examples])
        return {key: torch.from_numpy(value) for key, value in batch.items()}
