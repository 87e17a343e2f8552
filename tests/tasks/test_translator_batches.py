"""``Translator``'s batches at once (``translate --batches-at-once N``): the batches decoded at the same time in
threads of their own, each on its share of the threads, their outputs in the sources' order; a bad count refused
before any work; an error in one batch, or Ctrl-C, ends the call at once. Driven through a stand-in adapter that
records what each batch's decoding saw, so that the test reads the threads and the overlap directly (the real
backends' outputs are tests/cli/test_translate.py's)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from equivalence import runtime
from transformer_tasks.translation import Translator

PAD = 0


def stand_in(decode) -> Translator:
    """A greedy Translator (batches of 2) whose adapter's ``greedy`` is ``decode(src)``."""
    adapter = SimpleNamespace(NAME="stand-in", greedy=lambda model, src, forced_bos_id=None: decode(src))
    model = SimpleNamespace(config=SimpleNamespace(decoding=SimpleNamespace(beam_size=1, length_penalty=0.6)))
    tokenizer = SimpleNamespace(config=SimpleNamespace(pad_id=PAD, max_len=64))
    return Translator(adapter, model, tokenizer, batch_size=2, batches_at_once=2)


@pytest.fixture
def two_threads():
    """``--threads 2`` for the test, then the threads as they were."""
    held = runtime._requested
    runtime.configure(2)
    yield
    runtime.configure(held or runtime.visible_cores())
    runtime._requested = held


def test_two_batches_run_at_the_same_time_on_a_thread_each_and_keep_their_order(two_threads):
    """Six sources of three lengths in three batches: each batch's decoding waits at a barrier for a second one (it
    would time out were the batches one after the other), sees PyTorch's and the BLAS's threads at 2 // 2 = 1, and
    the outputs come back in the sources' order; afterwards the threads are 2 again."""
    torch = pytest.importorskip("torch", reason="the threads' split is read from PyTorch's setting")
    threadpoolctl = pytest.importorskip("threadpoolctl")
    meeting, entered, seen = threading.Barrier(2, timeout=10), [], []

    def decode(src):
        entered.append(src)
        if len(entered) <= 2:                                       # the first two batches meet
            meeting.wait()
        blas = {info["num_threads"] for info in threadpoolctl.threadpool_info() if info["user_api"] == "blas"}
        seen.append((torch.get_num_threads(), blas, threading.current_thread() is threading.main_thread()))
        return src[:, :1] * 10                                      # each source's first id, times 10

    rows = [[5, 6, 7], [1], [3, 4], [2], [8, 9], [4, 5, 6]]
    outputs = stand_in(decode).decode_all(rows)
    assert [out.tolist() for out in outputs] == [[50], [10], [30], [20], [80], [40]]
    assert len(seen) == 3
    assert all(threads == 1 and blas <= {1} and not in_main for threads, blas, in_main in seen)
    assert torch.get_num_threads() == 2


@pytest.mark.parametrize("count", [0, 3])
def test_a_count_outside_one_to_the_threads_is_refused_naming_the_flag(count, two_threads):
    with pytest.raises(ValueError, match=rf"^--batches-at-once {count}: at most --threads \(2\) batches at once"):
        Translator(SimpleNamespace(), SimpleNamespace(config=SimpleNamespace(
            decoding=SimpleNamespace(beam_size=1, length_penalty=0.6))), SimpleNamespace(), batches_at_once=count)


def test_an_error_in_one_batch_is_raised_and_the_batches_not_started_are_dropped(two_threads):
    """Five batches: the first raises at once, the others take 0.2 s each; the error reaches the caller, and of the
    four others at most the two the threads had started by then run."""
    started = []

    def decode(src):
        started.append(int(src[0, 0]))
        if src[0, 0] == 1:
            raise ValueError("src: the first batch is bad")
        time.sleep(0.2)
        return np.asarray(src)

    with pytest.raises(ValueError, match="the first batch is bad"):
        stand_in(decode).decode_all([[n] for n in range(1, 11)])
    assert 1 in started and len(started) <= 3


def test_ctrl_c_ends_the_call_without_waiting_for_the_batches_running(two_threads):
    """Ctrl-C (a ``KeyboardInterrupt``, here from the progress bar's iterator once the first batch is done) while a
    batch that takes 5 s is running: the call ends at once, the batches not started never run."""
    started = []

    def decode(src):
        started.append(int(src[0, 0]))
        time.sleep(0 if src[0, 0] == 1 else 5)
        return np.asarray(src)

    def progress(batches):
        yield batches[0]
        raise KeyboardInterrupt

    begun = time.perf_counter()
    with pytest.raises(KeyboardInterrupt):
        stand_in(decode).decode_all([[n] for n in range(1, 11)], progress)
    assert time.perf_counter() - begun < 2.5 and len(started) <= 3
