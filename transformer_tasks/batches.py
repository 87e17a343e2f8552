"""A task's batches as the training loops draw them: one function of the step, which the data-parallel engines
shard across processes."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from reference_numpy.config import TransformerConfig
from transformer_tasks.copy import CopyTask
from transformer_tasks.corpus import CorpusTask
from transformer_tasks.numbers import NumbersTask

Task = CopyTask | NumbersTask | CorpusTask


@dataclass
class CountedBatches:
    """``task.batch`` of one plan as a picklable function of the step (the engines shard it), counting the
    target tokens of the batches drawn in this process. A batch whose rows do not split into ``world_size`` equal
    shards (a corpus batched by token count) gets rows of padding at its end: their labels are padding, so they add
    nothing to the loss, which counts target tokens (section 5.4), nor to its gradient."""

    task: Task
    config: TransformerConfig
    batch_size: int
    seed: int
    world_size: int = 1
    tokens: dict[int, int] = field(default_factory=dict)

    def __call__(self, step: int) -> dict[str, np.ndarray]:
        batch = self.task.batch(self.config, self.batch_size, step, self.seed)
        self.tokens[step] = int((batch["labels"] != self.config.pad_id).sum())
        missing = -len(batch["src"]) % self.world_size
        return {name: np.pad(rows, ((0, missing), (0, 0)), constant_values=self.config.pad_id)
                for name, rows in batch.items()}
