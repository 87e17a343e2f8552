"""Data-parallel training (section 5.2: the paper trained on one machine with 8 GPUs) on PyTorch's own engine:
``torch.distributed`` process groups and ``DistributedDataParallel`` (DDP), gloo on CPUs and NCCL on GPUs. The
math is ``reference_numpy/data_parallel.py``'s: rank r of N takes the batch's rows r B/N .. (r + 1) B/N - 1, its
loss is its shard's sum over labels divided by the WHOLE batch's n non-pad labels (section 5.4's mean over
tokens, ``label_smoothed_cross_entropy(..., tokens=n)``), and the replicas' gradients are summed. DDP's
all-reduce averages (it divides each gradient by N, then sums over ranks), so each rank back-propagates
N x (shard sum / n). Every rank then takes the same Adam step of section 5.3 (``torch.optim.Adam`` and
``LambdaLR``, exactly ``training.optimizer``) on equal weights, and the replicas stay equal.

:func:`train` runs N processes on one machine: rank 0 in the calling process, ranks 1 .. N - 1 started by
``torch.multiprocessing`` with the "spawn" method, which read the run (weights, optimizer state, ``batches``) from
a pickle in a private temporary directory and meet at a ``TCPStore`` on 127.0.0.1 (a port the system chooses); the
process group is destroyed at the end, also on error, and every child is joined or killed. The children ignore
SIGINT and SIGTERM (a terminal's Ctrl-C reaches every process of its group): the calling process alone decides,
through ``progress``, after which step every rank stops, so that an interrupted run ends at a step all of them
completed.
Under ``torchrun`` (several machines or GPUs) each process calls :func:`train_step` itself (docs/distributed.md).
"""

from __future__ import annotations

import os
import pickle
import signal
import tempfile
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import numpy.typing as npt
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException
from torch.nn.parallel import DistributedDataParallel

from reference_numpy.checkpoint import TrainingState
from reference_numpy.checks import check_forward_inputs, check_tokens
from reference_numpy.config import TrainingConfig, TransformerConfig
from reference_numpy.data_parallel import check_steps, shard, shard_rows, token_count
from reference_numpy.training import LABEL_SMOOTHING, check_labels, check_next_step, check_token_count

from . import checkpoint
from . import training as torch_training
from .device import devices, resolve_device
from .model import Transformer

HOST = "127.0.0.1"
_POLL_SECONDS = 0.05
_SIGNALS = (signal.SIGINT, signal.SIGTERM)                      # the signals that stop a run (rank 0 handles them)


def train(config: TransformerConfig, params: dict[str, np.ndarray], training: TrainingConfig | None,
          state: TrainingState | None, batches: Callable[[int], dict[str, np.ndarray]], first_step: int, steps: int,
          world_size: int, dtype: str = "float32", device: str = "cpu", epsilon: float = LABEL_SMOOTHING,
          progress: Callable[[int, float], object] | None = None) -> tuple[dict[str, np.ndarray], TrainingState,
                                                                            list[float]]:
    """Train ``steps`` steps (``first_step`` .. ``first_step + steps - 1``, 0-based) over ``world_size`` processes with
    DDP and return, in the calling process, the final weights (checkpoint layout, NumPy), the run's
    :class:`TrainingState` (as ``training.training_state`` gives it) and the whole batches' losses.

    ``params``: checkpoint-layout weights; ``training`` a config for a new optimizer, or None with ``state`` to continue
    a saved run (``training.optimizer(model, training, state)``). ``batches(step)`` returns the WHOLE batch ({"src",
    "tgt", "labels"}) of a step; every rank calls it and takes its shard, so it must be deterministic and picklable (the
    children are spawned). ``device`` "cpu" runs every rank on the CPU (gloo); "cuda:k" runs rank r on GPU k + r (NCCL);
    on the CPU each rank runs 1/N of the caller's intra-op threads (the caller's count is restored afterwards).
    ``progress(step, loss)`` is called in the calling process after each step; a true return ends the run after that
    step on every rank. Dropout is as ``config`` says: rank 0 draws its masks from the caller's generator, rank r > 0
    from one seeded with ``torch.initial_seed() + r``. Bad arguments are one-line ``ValueError``s before any process
    starts, a bad batch the single-process ``ValueError`` (every rank checks the whole batch); an error in a child is
    raised here as a ``RuntimeError`` carrying the child's traceback.
    """
    model, optimizer = _replica(config, params, training, state, dtype, _rank_device(device, 0, world_size))
    _check_run(batches, first_step, steps, world_size)
    with tempfile.TemporaryDirectory(prefix="data-parallel-") as directory:
        run = _save_run(os.path.join(directory, "run.pickle"),
                        (config, params, training, state, batches, first_step, steps, dtype, device, epsilon))
        store = dist.TCPStore(HOST, 0, world_size, True, wait_for_workers=False)     # port 0: the system picks one
        threads, caller_threads = _threads(model.device, world_size), torch.get_num_threads()
        with _signals_blocked():                                    # the children start with them blocked
            children = mp.start_processes(_child, (run, store.port, world_size, torch.initial_seed(), threads),
                                          nprocs=world_size - 1, join=False, daemon=True, start_method="spawn")
        try:
            torch.set_num_threads(threads)
            _await_children(store, children, world_size)
            result = _run(model, optimizer, store, 0, world_size, batches, first_step, steps, epsilon, progress)
            while not children.join():
                pass
            return result
        finally:
            torch.set_num_threads(caller_threads)
            _end(children)


def train_step(model: DistributedDataParallel, optimizer: torch_training.Optimizer, src: npt.ArrayLike,
               tgt: npt.ArrayLike, labels: npt.ArrayLike,
               epsilon: float = LABEL_SMOOTHING) -> float:
    """One data-parallel training step of section 5, called by every rank with the same WHOLE batch: this rank's
    shard of B/N consecutive rows, its loss N x (shard sum / n) with dropout on, DDP's averaging all-reduce of
    the gradients inside ``backward`` (their sum over shards: the whole batch's gradient), then Adam's update
    and the schedule's step, as ``training.train_step``. The model is left in eval mode. Returns the whole
    batch's loss before the update (the shards' losses, summed over ranks).

    Framework idiom: ``model`` is the ``DistributedDataParallel`` wrapper of a :class:`Transformer`, the rank
    and N are its process group's, and ``optimizer`` is ``training.optimizer`` of the wrapped model.
    """
    module, group = model.module, model.process_group
    config, world_size, rank = module.config, dist.get_world_size(group), dist.get_rank(group)
    src, tgt = (check_tokens(name, values, vocab, config.max_len)            # every rank refuses the same batch
                for name, values, vocab in (("src", src, config.src_vocab_size), ("tgt", tgt, config.tgt_vocab_size)))
    check_forward_inputs(config, src.shape, tgt.shape, None, None)
    labels = check_labels(labels, tgt.shape, config)
    check_next_step(optimizer.schedule.last_epoch)
    total = check_token_count(token_count(labels, config.pad_id), None)      # n: the whole batch's labels
    part = shard({"src": src, "tgt": tgt, "labels": labels}, world_size, rank)  # (B / N, ...) each
    adam = optimizer.adam
    adam.zero_grad(set_to_none=True)
    model.train()
    try:
        value = torch_training.label_smoothed_cross_entropy(
            model(part["src"], part["tgt"]), torch.as_tensor(part["labels"], device=module.device, dtype=torch.long),
            config.pad_id, epsilon, total)
        (world_size * value).backward()                                      # DDP divides by N: the sum remains
    finally:
        model.eval()
    adam.step()
    optimizer.schedule.step()
    whole = value.detach().clone()
    dist.all_reduce(whole, group=group)                                      # shard sums / n add up to the mean
    return whole.item()


def _stop_after(stop: bool, device: torch.device) -> bool:
    """Rank 0's decision to end the run after this step (its ``progress`` returned true), broadcast so that every
    rank stops after the same step."""
    flag = torch.tensor([stop], dtype=torch.int32, device=device)
    dist.broadcast(flag, src=0)
    return bool(flag.item())


def _replica(config: TransformerConfig, params: dict[str, np.ndarray], training: TrainingConfig | None,
             state: TrainingState | None, dtype: str,
             device: torch.device) -> tuple[Transformer, torch_training.Optimizer]:
    """One replica's model and optimizer (the checks of ``from_params`` and ``optimizer``)."""
    model = checkpoint.from_params(config, params, dtype, device)
    return model, torch_training.optimizer(model, training, state)


def _rank_device(device: str, rank: int, world_size: int) -> torch.device:
    """Rank ``rank``'s device: the CPU, or the GPU ``rank`` places after ``device``'s; every rank's must exist."""
    resolved = resolve_device(device)
    if resolved.type == "cpu":
        return resolved
    last = f"cuda:{resolved.index + world_size - 1}"
    if last not in devices():
        raise ValueError(f"device {device!r}: {world_size} ranks need GPUs {resolved.index} .. {last}, "
                         f"there are {torch.cuda.device_count()}")
    return torch.device("cuda", resolved.index + rank)


def _check_run(batches: Callable[[int], dict[str, np.ndarray]], first_step: int, steps: int, world_size: int) -> None:
    """The checks of the run's arguments that can be made before a process starts, each a one-line
    ``ValueError``."""
    check_steps(first_step, steps)
    shard_rows(len(batches(first_step)["labels"]), world_size, 0)           # N, and B divisible by N
    if dist.is_initialized():
        raise ValueError("this process already has a default process group (torchrun?): call "
                         "data_parallel.train_step in each process instead of train")


def _save_run(path: str, run: tuple) -> str:
    """What every child needs, pickled to ``path`` in a private temporary directory: not through the spawn pipe,
    which a child failing early leaves full (the parent would block writing to it), nor through the store (at most
    8 MiB a value)."""
    try:
        with open(path, "wb") as file:
            pickle.dump(run, file)
    except (pickle.PicklingError, AttributeError, TypeError) as err:
        raise ValueError(f"batches must be picklable: the ranks are spawned processes ({err})") from None
    return path


def _threads(device: torch.device, world_size: int) -> int:
    """Each CPU rank's share of the caller's intra-op threads (at least one; ``torchrun`` gives one), so that the
    N processes do not oversubscribe the cores."""
    threads = torch.get_num_threads()
    return max(1, threads // world_size) if device.type == "cpu" else threads


def _child(index: int, run: str, port: int, world_size: int, seed: int, threads: int) -> None:
    """Rank ``index + 1`` in a spawned process: the run from its file, its own replica and dropout generator."""
    rank = index + 1
    for number in _SIGNALS:
        signal.signal(number, signal.SIG_IGN)                   # rank 0 decides when every rank stops
    torch.manual_seed(seed + rank)
    torch.set_num_threads(threads)
    with open(run, "rb") as file:
        config, params, training, state, batches, first_step, steps, dtype, device, epsilon = pickle.load(file)
    store = dist.TCPStore(HOST, port, world_size, False)
    model, optimizer = _replica(config, params, training, state, dtype, _rank_device(device, rank, world_size))
    store.set(f"ready/{rank}", "1")
    _run(model, optimizer, store, rank, world_size, batches, first_step, steps, epsilon, None)


def _await_children(store: dist.TCPStore, children: mp.ProcessContext, world_size: int) -> None:
    """Wait until every child has built its replica, raising a child's error as soon as it fails (rank 0 then
    never blocks in the process group's rendezvous for a rank that will not come)."""
    ready = [f"ready/{rank}" for rank in range(1, world_size)]
    while ready and not store.check(ready):
        _raise_child_error(children, world_size)


def _raise_child_error(children: mp.ProcessContext, world_size: int) -> None:
    """A child that has failed, as a ``RuntimeError`` naming its rank with its traceback."""
    try:
        children.join(timeout=_POLL_SECONDS, grace_period=_POLL_SECONDS)
    except ProcessException as error:
        raise RuntimeError(f"data-parallel rank {error.error_index + 1} of {world_size} failed: "
                           f"{error.msg.strip()}") from None


def _run(model: Transformer, optimizer: torch_training.Optimizer, store: dist.TCPStore, rank: int, world_size: int,
         batches: Callable[[int], dict[str, np.ndarray]], first_step: int, steps: int, epsilon: float,
         progress: Callable[[int, float], object] | None) -> tuple[dict[str, np.ndarray], TrainingState,
                                                                          list[float]]:
    """Rank ``rank``'s part of the run: join the process group, wrap the model in DDP, step, leave the group.
    A child's error is left in the store before the child leaves the group; rank 0, whose collective then fails
    (a ``RuntimeError``), raises the child's instead."""
    dist.init_process_group("nccl" if model.device.type == "cuda" else "gloo", store=store, rank=rank,
                            world_size=world_size)
    replica = None
    try:
        # the only buffer is the sinusoidal table, derived identically on every rank: no broadcast per step
        replica = DistributedDataParallel(model, device_ids=[model.device] if model.device.type == "cuda" else None,
                                          forward_sync_buffers=False)
        losses = []
        for step in range(first_step, first_step + steps):
            losses.append(train_step(replica, optimizer, **batches(step), epsilon=epsilon))
            if _stop_after(progress is not None and bool(progress(step, losses[-1])), model.device):
                break
        return checkpoint.to_params(model), torch_training.training_state(model, optimizer), losses
    except Exception as error:
        if rank:
            store.set(f"error/{rank}", traceback.format_exc())
        elif isinstance(error, RuntimeError):
            _raise_reported_error(store, world_size)
        raise
    finally:
        # DDP first: its reducer must not hold the group's last reference, or freeing it would join gloo's worker
        # threads with the GIL held while one of them waits for the GIL to free a finished all-reduce's tensor
        del replica
        dist.destroy_process_group()


def _raise_reported_error(store: dist.TCPStore, world_size: int) -> None:
    """The first child error left in the store, as a ``RuntimeError`` naming its rank."""
    for rank in range(1, world_size):
        if store.check([f"error/{rank}"]):
            raise RuntimeError(f"data-parallel rank {rank} of {world_size} failed:\n"
                               f"{store.get(f'error/{rank}').decode()}") from None


@contextmanager
def _signals_blocked() -> Iterator[None]:
    """SIGINT and SIGTERM held back (delivered at the block's end) while the children are started: a child inherits
    the blocked signals, so that none reaches it before :func:`_child` ignores them."""
    if not hasattr(signal, "pthread_sigmask"):                   # no POSIX signal masks (Windows)
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _end(children: mp.ProcessContext) -> None:
    """No orphans: kill the children still running (after an error or a second Ctrl-C; they ignore SIGTERM) and
    reap them all."""
    for process in children.processes:
        if process.is_alive():
            process.kill()
        process.join()

