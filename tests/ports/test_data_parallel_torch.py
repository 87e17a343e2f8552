"""Data-parallel training in the PyTorch port (``transformer_torch/data_parallel.py``: DistributedDataParallel over
N spawned processes, gloo on the CPU) trains as the whole batch in one process (section 5): float64, dropout 0, the
tiny model, batches whose shards hold different numbers of real labels, against the reference's single-process
steps within ``equivalence.tolerance.TrainingBound`` (the derived gradient bound carried through Adam, as
tests/equivalence/test_training.py uses it); a run moves between one process and several through the shared checkpoint;
bad input is the single-process ``ValueError`` before any process starts; a child's error reaches the caller."""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install '.[torch]')")

from data_parallel_torch_runner import FailingOnRank  # noqa: E402

from equivalence import tolerance  # noqa: E402
from equivalence.cases import seeded_params  # noqa: E402
from reference_numpy import Transformer, TransformerConfig  # noqa: E402
from reference_numpy import training as reference_training  # noqa: E402
from reference_numpy.checkpoint import TrainingState, load_run, save_checkpoint  # noqa: E402
from reference_numpy.config import TrainingConfig  # noqa: E402
from reference_numpy.data_parallel import shard  # noqa: E402
from transformer_torch import checkpoint, data_parallel, training  # noqa: E402

CONFIG = TransformerConfig.preset("tiny", dropout=0.0)
# the paper's Adam and schedule (section 5.3), as tests/equivalence/test_training.py
TRAINING = TrainingConfig()
STEPS, HALF = 10, 5
LENGTHS = (1, 2, 5, 6)                # real labels per row: halves of 3 and 11, quarters of 1, 2, 5 and 6
WORST: dict[str, float] = {}          # check -> worst error / bound, printed with -s


def uneven_batch(step: int) -> dict[str, np.ndarray]:
    """Step ``step``'s batch of 4: rows with ``LENGTHS`` real labels, new tokens at every step."""
    rng = np.random.default_rng(100 + step)
    real = np.arange(6) < np.array(LENGTHS)[:, None]                        # (4, 6)
    tokens = rng.integers(3, CONFIG.tgt_vocab_size, size=real.shape)
    labels = np.where(real, tokens, CONFIG.pad_id)
    shifted = np.concatenate([np.full((len(LENGTHS), 1), CONFIG.bos_id), tokens[:, :-1]], axis=1)
    return {"src": rng.integers(3, CONFIG.src_vocab_size, size=(len(LENGTHS), 5)),
            "tgt": np.where(real, shifted, CONFIG.pad_id), "labels": labels}


BATCHES = [uneven_batch(step) for step in range(STEPS)]
batches = functools.partial(operator.getitem, BATCHES)                     # picklable: the spawned ranks call it


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The tiny model gains nothing from intra-op threads, which only spin on a shared CPU (each rank then runs one
    thread too: ``train`` shares the caller's among the ranks)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    print("\nworst error / bound of each data-parallel check:",
          *(f"  {what}: {ratio:.3g}" for what, ratio in WORST.items()), sep="\n")


@dataclass
class Run:
    params: dict[str, np.ndarray]
    state: TrainingState
    losses: list[float]


@functools.cache
def reference_run(steps: int) -> tuple[Run, tolerance.TrainingBound]:
    """The reference's single-process run of ``steps`` steps on ``BATCHES`` and the TrainingBound that accounts for
    it step by step (gradients at the weights before each step, moments after it)."""
    model = Transformer(CONFIG, seeded_params(CONFIG))
    optimizer = reference_training.optimizer(model, TRAINING)
    bound, losses = tolerance.TrainingBound(seeded_params(CONFIG)), []
    for step in range(1, steps + 1):
        value, grads = reference_training.gradients(model, **BATCHES[step - 1])
        losses.append(reference_training.train_step(model, optimizer, **BATCHES[step - 1]))
        state = reference_training.training_state(model, optimizer)
        bound.step(value, grads, state.first_moments, state.second_moments, step,
                   reference_training.learning_rate(step, CONFIG.d_model, TRAINING), TRAINING.beta1, TRAINING.beta2,
                   TRAINING.epsilon)
    return Run({name: value.copy() for name, value in model.params.items()}, state, losses), bound


def parallel_run(world_size: int, steps: int, start: Run | None = None, progress=None) -> Run:
    """``steps`` data-parallel steps over ``world_size`` processes, from the seeded weights or a saved ``start``."""
    params, state = (seeded_params(CONFIG), None) if start is None else (start.params, start.state)
    first = 0 if state is None else state.step
    return Run(*data_parallel.train(CONFIG, params, TRAINING if state is None else None, state, batches, first,
                                    steps, world_size, "float64", progress=progress))


def single_run(steps: int, start: Run | None = None) -> Run:
    """``steps`` steps of the port's own single-process ``train_step`` on the whole batches."""
    model = checkpoint.from_params(CONFIG, seeded_params(CONFIG) if start is None else start.params, "float64")
    optimizer = training.optimizer(model, TRAINING if start is None else None, None if start is None else start.state)
    first = 0 if start is None else start.state.step
    losses = [training.train_step(model, optimizer, **BATCHES[step]) for step in range(first, first + steps)]
    return Run(checkpoint.to_params(model), training.training_state(model, optimizer), losses)


def assert_within(result: Run, expected: Run, bound: tolerance.TrainingBound, what: str, pair: int = 1) -> None:
    """Losses, weights and both Adam moments within ``pair`` x the bound (2 for two runs each within it of the
    reference: the triangle inequality); the worst error / bound is recorded under ``what``."""
    assert result.state.step == expected.state.step and len(result.losses) == len(expected.losses)
    ratios = [abs(value - other) / limit for value, other, limit in zip(result.losses, expected.losses, bound.losses)]
    for name, weight in expected.params.items():
        pairs = ((result.params[name], weight, bound.weight_bound(name, weight)),
                 (result.state.first_moments[name], expected.state.first_moments[name],
                  bound.first_moment_bound(name, expected.state.first_moments[name])),
                 (result.state.second_moments[name], expected.state.second_moments[name],
                  bound.second_moment_bound(name, expected.state.second_moments[name])))
        ratios += [float(np.max(np.abs(value - other) / limit)) for value, other, limit in pairs]
    WORST[what] = max(ratios) / pair
    assert WORST[what] <= 1.0, f"{what}: worst error / bound {WORST[what]:.3g}"


def test_one_step_is_the_single_process_step():
    """One step over 2 processes = the port's own train_step on the whole batch = the reference's step."""
    expected, bound = reference_run(1)
    parallel, single = parallel_run(2, 1), single_run(1)
    assert_within(parallel, expected, bound, "1 step, N = 2 vs reference")
    assert_within(single, expected, bound, "1 step, single process vs reference")
    assert_within(parallel, single, bound, "1 step, N = 2 vs single process", pair=2)


def test_ten_steps_are_the_references():
    """Ten steps over 2 processes = ten reference steps; ``progress`` sees every step's loss in the caller."""
    expected, bound = reference_run(STEPS)
    seen = []
    result = parallel_run(2, STEPS, progress=lambda step, loss: seen.append((step, loss)))
    assert_within(result, expected, bound, "10 steps, N = 2 vs reference")
    assert seen == list(enumerate(result.losses))


def test_progress_returning_true_ends_the_run_after_that_step_on_every_rank():
    """``progress`` returning true after step HALF - 1 (0-based): every rank stops there (rank 0 broadcasts the
    decision) and the run is HALF reference steps."""
    expected, bound = reference_run(HALF)
    result = parallel_run(2, STEPS, progress=lambda step, loss: step == HALF - 1)
    assert result.state.step == HALF and len(result.losses) == HALF
    assert_within(result, expected, bound, "5 of 10 steps, N = 2 vs reference")


# About 30 s: two process groups (4 ranks, then 2), each rank a process importing PyTorch, and two single-process
# runs: the resumes across a process boundary are what it checks.
def test_a_run_moves_between_one_process_and_several(tmp_path):
    """Five single-process steps saved with the port's ``save_checkpoint``, resumed over 4 processes (shards of
    one row, holding 1, 2, 5 and 6 labels); five steps over 2 processes saved with the reference's
    ``save_checkpoint``, resumed in one process: both end where ten reference steps end."""
    expected, bound = reference_run(STEPS)
    first = single_run(HALF)
    checkpoint.save_checkpoint(checkpoint.from_params(CONFIG, first.params, "float64"), tmp_path / "single.safetensors",
                               training=first.state)
    _, params, state = load_run(tmp_path / "single.safetensors")
    resumed = parallel_run(4, STEPS - HALF, Run(params, state, []))
    assert_within(Run(resumed.params, resumed.state, first.losses + resumed.losses), expected, bound,
                  "5 single-process + 5 N = 4 steps vs reference")
    first = parallel_run(2, HALF)
    save_checkpoint(tmp_path / "parallel.safetensors", CONFIG, first.params, first.state)
    _, params, state = load_run(tmp_path / "parallel.safetensors")
    resumed = single_run(STEPS - HALF, Run(params, state, []))
    assert_within(Run(resumed.params, resumed.state, first.losses + resumed.losses), expected, bound,
                  "5 N = 2 + 5 single-process steps vs reference")


def test_a_shards_loss_divides_by_the_whole_batchs_count():
    """``loss(..., tokens=n)`` of the port: the shards' losses add up to the whole batch's (section 5.4's mean over
    the batch's n labels); a count below the shard's own is the reference's ``ValueError``."""
    model = checkpoint.from_params(CONFIG, seeded_params(CONFIG), "float64")
    as_tensors = lambda batch: {name: torch.as_tensor(values) for name, values in batch.items()}
    whole = training.loss(model, **as_tensors(BATCHES[0])).item()
    parts = [training.loss(model, **as_tensors(shard(BATCHES[0], 2, rank)), tokens=sum(LENGTHS)).item()
             for rank in range(2)]
    assert abs(sum(parts) - whole) <= tolerance.float64_bound(whole)
    with pytest.raises(ValueError, match="^tokens must be an int >= 1 and >= the labels' 3 non-pad tokens, got 2$"):
        training.loss(model, **as_tensors(shard(BATCHES[0], 2, 0)), tokens=2)


@pytest.mark.parametrize("change, message", [
    ({"world_size": 3}, "a batch of 4 sentences does not split into 3 equal shards"),
    ({"world_size": 0}, "world_size must be an int >= 1"),
    ({"steps": -1}, "steps must be an int >= 0"),
    ({"steps": 2.0}, "steps must be an int >= 0"),
    ({"first_step": -1}, "first_step must be an int >= 0"),
    ({"dtype": "float16"}, "training needs float32 or float64 weights, got a float16 model"),
    ({"dtype": "int8"}, "dtype must be one of float64, float32, bfloat16, float16, got int8"),
    ({"device": "tpu"}, "device 'tpu' is not a device name"),
    ({"batches": lambda step: BATCHES[step]}, "batches must be picklable: the ranks are spawned processes"),
])
def test_bad_arguments_are_refused_before_any_process_starts(change, message):
    arguments = {"config": CONFIG, "params": seeded_params(CONFIG), "training": TRAINING, "state": None,
                 "batches": batches, "first_step": 0, "steps": 1, "world_size": 2, "dtype": "float64", **change}
    with pytest.raises(ValueError, match=message):
        data_parallel.train(**arguments)


def test_a_bad_batch_is_the_single_process_error():
    """A token id out of range in the second shard only: every rank checks the whole batch, so rank 0 raises the
    single-process ``ValueError`` itself (not rank 1's failure); a batch without labels likewise."""
    bad = {**BATCHES[0], "src": BATCHES[0]["src"].copy()}
    bad["src"][3, 0] = CONFIG.src_vocab_size
    with pytest.raises(ValueError, match=r"^src holds token ids outside \[0, 19\)$"):
        data_parallel.train(CONFIG, seeded_params(CONFIG), TRAINING, None, functools.partial(operator.getitem, [bad]),
                            0, 1, 2, "float64")
    empty = {**BATCHES[0], "labels": np.full_like(BATCHES[0]["labels"], CONFIG.pad_id)}
    with pytest.raises(ValueError, match="^labels hold no non-pad token; the loss is undefined$"):
        data_parallel.train(CONFIG, seeded_params(CONFIG), TRAINING, None,
                            functools.partial(operator.getitem, [empty]), 0, 1, 1, "float64")


def test_a_childs_error_is_raised_in_the_caller():
    """Rank 1 fails at its second step while rank 0 waits in the all-reduce: the caller gets rank 1's exception and
    message, leaves no process group and no child behind."""
    with pytest.raises(RuntimeError, match=r"(?s)data-parallel rank 1 of 2 failed:.*ArithmeticError: planted "
                                           r"failure on rank 1 at step 1"):
        data_parallel.train(CONFIG, seeded_params(CONFIG), TRAINING, None, FailingOnRank(BATCHES, 1, 1), 0, 3, 2,
                            "float64")
    assert not torch.distributed.is_initialized()
    assert not torch.multiprocessing.active_children()
