"""Data parallelism (``reference_numpy/data_parallel.py``): the shards' summed gradients equal the whole
batch's, also when shards hold different numbers of real labels, and bad splits are refused. The ports'
engines (DDP, a JAX mesh, a MirroredStrategy) are checked against this in their own files."""

from __future__ import annotations

import numpy as np
import pytest

from equivalence import tolerance
from equivalence.cases import seeded_params
from reference_numpy import Transformer, TransformerConfig, data_parallel, training

CONFIG = TransformerConfig.preset("tiny", dropout=0.0)


def uneven_batch(config: TransformerConfig = CONFIG, batch: int = 4) -> dict[str, np.ndarray]:
    """A batch whose two halves hold 3 and 11 real labels (rows of 1, 2, 5 and 6 tokens)."""
    rng = np.random.default_rng(5)
    lengths = np.array([1, 2, 5, 6])[:batch]
    tokens = rng.integers(3, config.tgt_vocab_size, size=(batch, 6))
    real = np.arange(6) < lengths[:, None]
    labels = np.where(real, tokens, config.pad_id)
    tgt = np.where(real, np.concatenate([np.full((batch, 1), config.bos_id), tokens[:, :-1]], axis=1), config.pad_id)
    src = rng.integers(3, config.src_vocab_size, size=(batch, 5))
    return {"src": src, "tgt": tgt, "labels": labels}


def test_the_shards_summed_gradients_are_the_whole_batchs():
    """n_r / n-weighted shard gradients summed = the gradient of the mean over all n tokens (section 5.4); the
    unweighted mean of shard means (what averaging per-sentence-mean losses gives) is not."""
    batch = uneven_batch()
    model = Transformer(CONFIG, seeded_params(CONFIG))
    whole_loss, whole = training.gradients(model, **batch)
    for world_size in (1, 2, 4):
        loss, grads = data_parallel.gradients(model, **batch, world_size=world_size)
        assert abs(loss - whole_loss) <= tolerance.float64_bound(np.array(whole_loss))
        for name, grad in grads.items():
            assert tolerance.max_abs(grad, whole[name]) <= tolerance.float64_bound(whole[name]), name
    halves = [data_parallel.shard(batch, 2, rank) for rank in range(2)]
    naive = [training.gradients(model, **half)[1] for half in halves]
    name = "decoder.layers.0.ffn.linear1.weight"
    assert tolerance.max_abs((naive[0][name] + naive[1][name]) / 2, whole[name]) > 1e3 * tolerance.float64_bound(
        whole[name])


def test_a_data_parallel_step_is_the_single_process_step():
    batch = uneven_batch()
    single, parallel = (Transformer(CONFIG, seeded_params(CONFIG)) for _ in range(2))
    optimizers = training.optimizer(single), training.optimizer(parallel)
    for _ in range(3):
        expected = training.train_step(single, optimizers[0], **batch)
        loss = data_parallel.train_step(parallel, optimizers[1], **batch, world_size=2)
        assert abs(loss - expected) <= tolerance.float64_bound(np.array(expected))
    for name, weight in single.params.items():
        assert tolerance.max_abs(parallel.params[name], weight) <= 1e-12 * max(1.0, np.abs(weight).max()), name


def test_a_shard_without_real_labels_adds_nothing():
    batch = uneven_batch()
    batch["labels"][:2] = CONFIG.pad_id                                  # the first shard: no real label
    model = Transformer(CONFIG, seeded_params(CONFIG))
    whole_loss, whole = training.gradients(model, **batch)
    loss, grads = data_parallel.gradients(model, **batch, world_size=2)
    assert abs(loss - whole_loss) <= tolerance.float64_bound(np.array(whole_loss))
    assert all(tolerance.max_abs(grads[name], whole[name]) <= tolerance.float64_bound(whole[name]) for name in grads)


def test_the_loss_with_a_token_count_is_the_shards_share():
    """sum over shards of loss(shard, tokens=n) = loss(batch); tokens below the shard's count is refused."""
    batch = uneven_batch()
    model = Transformer(CONFIG, seeded_params(CONFIG))
    n = data_parallel.token_count(batch["labels"], CONFIG.pad_id)
    parts = [float(training.loss(model, **data_parallel.shard(batch, 2, rank), tokens=n)) for rank in range(2)]
    assert abs(sum(parts) - float(training.loss(model, **batch))) <= 1e-12
    with pytest.raises(ValueError, match="tokens must be an int >= 1 and >= the labels' 3 non-pad tokens"):
        training.loss(model, **data_parallel.shard(batch, 2, 0), tokens=2)


@pytest.mark.parametrize("batch_size, world_size, rank, message", [
    (5, 2, 0, "a batch of 5 sentences does not split into 2 equal shards"),
    (4, 0, 0, "world_size must be an int >= 1"),
    (4, 2, 2, r"rank must be an int in \[0, 2\)"),
    (0, 1, 0, "batch_size must be an int >= 1"),
])
def test_bad_splits_are_refused(batch_size, world_size, rank, message):
    with pytest.raises(ValueError, match=message):
        data_parallel.shard_rows(batch_size, world_size, rank)
    assert data_parallel.shard_rows(6, 3, 1) == slice(2, 4)
