"""Saving never loses a user's file: a failed or killed save leaves the old file complete, a saved
file has the permissions any other new file would have, a symbolic link is written through, and
every error names the path the user asked for (docs/checkpoint-format.md, "Saving")."""

from __future__ import annotations

import errno
import os
import re
import signal
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from equivalence.cases import VARIANTS
from reference_numpy import init_params, load_checkpoint, save_checkpoint

TINY = VARIANTS["tiny"]
ROOT = Path(__file__).resolve().parents[2]
AS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
PARTIAL = r"\.[0-9a-f]{8}\.partial"                                  # docs/checkpoint-format.md's NAME.XXXXXXXX.partial


def saved(path, seed):
    save_checkpoint(path, TINY, init_params(TINY, seed=seed))
    return path.read_bytes()


def holds_seed(path, seed) -> bool:
    _, params = load_checkpoint(path)
    expected = init_params(TINY, seed=seed)
    return all(np.array_equal(params[name], expected[name]) for name in expected)


def save_error(path) -> str:
    with pytest.raises(ValueError) as info:
        save_checkpoint(path, TINY, init_params(TINY, seed=2))
    message = str(info.value)
    assert "\n" not in message and ".partial" not in message, message
    assert message.startswith(f"cannot save checkpoint {str(path)!r}: "), message
    return message


# ----------------------------------------------------------------------------- the existing file is kept

def test_refused_params_leave_the_existing_file_untouched(tmp_path):
    path = tmp_path / "m.safetensors"
    before = saved(path, 1)
    params = init_params(TINY, seed=2)
    params["generator.weight"] = np.full_like(params["generator.weight"], np.nan)
    with pytest.raises(ValueError, match="tensor 'generator.weight' holds non-finite"):
        save_checkpoint(path, TINY, params)
    assert path.read_bytes() == before and list(tmp_path.iterdir()) == [path]


@pytest.mark.parametrize("stage", ["write", "fsync", "replace"])
def test_a_failing_disk_leaves_the_existing_file_and_no_partial(tmp_path, monkeypatch, stage):
    """The disk fills up half-way through the bytes, at the flush, or at the rename."""
    path = tmp_path / "m.safetensors"
    before = saved(path, 1)
    real = getattr(os, stage)

    def fail(*args):
        if stage == "write":
            real(args[0], args[1][:len(args[1]) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, stage, fail)
    assert save_error(path).endswith(": No space left on device")
    monkeypatch.undo()
    assert path.read_bytes() == before and list(tmp_path.iterdir()) == [path]


def test_an_interrupt_mid_write_leaves_the_existing_file_and_no_partial(tmp_path, monkeypatch):
    path = tmp_path / "m.safetensors"
    before = saved(path, 1)
    real = os.write

    def interrupted(fd, data):
        real(fd, data[:len(data) // 2])
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "write", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(path, TINY, init_params(TINY, seed=2))
    monkeypatch.undo()
    assert path.read_bytes() == before and list(tmp_path.iterdir()) == [path]


KILLED_SAVE = """
import os, signal, sys
from reference_numpy import init_params, save_checkpoint
from equivalence.cases import VARIANTS
real_write, real_replace = os.write, os.replace

def stop():
    print("stopped", flush=True)
    signal.pause()

def half_write(fd, data):                 # half the bytes reach the .partial file, then the process stops
    real_write(fd, data[:len(data) // 2])
    stop()

def replace_then_stop(source, target):
    real_replace(source, target)
    stop()

if sys.argv[2] == "mid-write":
    os.write = half_write
else:
    os.replace = replace_then_stop
save_checkpoint(sys.argv[1], VARIANTS["tiny"], init_params(VARIANTS["tiny"], seed=2))
"""


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="SIGKILL is POSIX only")
@pytest.mark.parametrize("moment, seed", [("mid-write", 1), ("after-rename", 2)])
def test_a_killed_save_leaves_a_complete_file_old_or_new(tmp_path, moment, seed):
    """A child process saving over a checkpoint is SIGKILLed half-way through writing (the old
    file is still there, complete, beside a recognisable .partial) or just after the rename (the
    new file is there, complete)."""
    path = tmp_path / "m.safetensors"
    saved(path, 1)
    child = subprocess.Popen([sys.executable, "-c", KILLED_SAVE, str(path), moment], cwd=ROOT, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert child.stdout.readline() == "stopped\n", child.stderr.read()
        leftovers = [p for p in tmp_path.iterdir() if p != path]
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.communicate()
    assert child.returncode == -signal.SIGKILL
    assert holds_seed(path, seed)
    if moment == "mid-write":
        assert len(leftovers) == 1 and re.fullmatch(re.escape(path.name) + PARTIAL, leftovers[0].name), leftovers
        assert 0 < leftovers[0].stat().st_size < path.stat().st_size
        with pytest.raises(ValueError, match="truncated"):
            load_checkpoint(leftovers[0])
        assert "`NAME.XXXXXXXX.partial`" in (ROOT / "docs/checkpoint-format.md").read_text()
    else:
        assert leftovers == []


CONCURRENT_SAVES = """
import sys
from equivalence.cases import VARIANTS
from reference_numpy import init_params, save_checkpoint
seed, params = int(sys.argv[2]), init_params(VARIANTS["tiny"], seed=int(sys.argv[2]))
print("ready", flush=True)
sys.stdin.readline()                                          # every saver starts at once
for _ in range(25):
    save_checkpoint(sys.argv[1], VARIANTS["tiny"], params)
"""


def test_concurrent_saves_to_one_path_leave_one_complete_file(tmp_path):
    """Three processes each save their own checkpoint to one path 25 times, all at once (each save also cleans
    ``.partial`` files it finds, which must never be another living save's): every save succeeds, the file is one
    of the three checkpoints complete, and no ``.partial`` is left."""
    path = tmp_path / "m.safetensors"
    savers = [subprocess.Popen([sys.executable, "-c", CONCURRENT_SAVES, str(path), str(seed)], cwd=ROOT, text=True,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               env={**os.environ, "PYTHONPATH": str(ROOT)}) for seed in (1, 2, 3)]
    try:
        assert [saver.stdout.readline() for saver in savers] == ["ready\n"] * 3
        for saver in savers:
            saver.stdin.write("go\n")
            saver.stdin.flush()
        errors = [saver.communicate(timeout=300)[1] for saver in savers]
    finally:
        for saver in savers:
            saver.kill()
    assert [saver.returncode for saver in savers] == [0, 0, 0], errors
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
    assert sum(holds_seed(path, seed) for seed in (1, 2, 3)) == 1


# ----------------------------------------------------------------------------- permissions

@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o027, 0o640), (0o077, 0o600), (0o002, 0o664)], ids=oct)
def test_a_new_file_follows_the_umask(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        saved(tmp_path / "m.safetensors", 1)
        open(tmp_path / "plain.txt", "w").close()                     # any other file, for comparison
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "plain.txt").stat().st_mode) == mode
    assert stat.S_IMODE((tmp_path / "m.safetensors").stat().st_mode) == mode


@pytest.mark.parametrize("mode", [0o600, 0o640, 0o664], ids=oct)
def test_a_replaced_file_keeps_its_permissions(tmp_path, mode):
    """As when an existing file is opened for writing: never widened, never narrowed."""
    path = tmp_path / "m.safetensors"
    saved(path, 1)
    path.chmod(mode)
    saved(path, 2)
    assert stat.S_IMODE(path.stat().st_mode) == mode and holds_seed(path, 2)


@pytest.mark.skipif(AS_ROOT, reason="root may write a write-protected file")
def test_a_write_protected_file_is_not_replaced(tmp_path):
    path = tmp_path / "m.safetensors"
    before = saved(path, 1)
    path.chmod(0o444)
    assert save_error(path).endswith("the file is write-protected; it was not replaced")
    assert path.read_bytes() == before and list(tmp_path.iterdir()) == [path]


@pytest.mark.skipif(AS_ROOT, reason="root may write into a read-only directory")
def test_a_read_only_directory_is_named_by_the_path_asked_for(tmp_path):
    path = tmp_path / "m.safetensors"
    tmp_path.chmod(0o555)
    try:
        assert save_error(path).endswith(": Permission denied")
    finally:
        tmp_path.chmod(0o755)
    assert list(tmp_path.iterdir()) == []


def test_a_refused_partial_file_is_reported_under_the_path_asked_for(tmp_path, monkeypatch):
    """The operating system's complaint about the hidden-from-the-user .partial file (here a
    simulated read-only directory, which also runs as root) names the path the user gave."""
    real = os.open

    def refuse(file, *args, **kwargs):
        if str(file).endswith(".partial"):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(file))
        return real(file, *args, **kwargs)

    monkeypatch.setattr(os, "open", refuse)
    assert save_error(tmp_path / "m.safetensors").endswith(": Permission denied")


# ----------------------------------------------------------------------------- paths

def test_errors_name_the_path_asked_for(tmp_path):
    assert save_error(tmp_path / "absent" / "m.safetensors").endswith(": No such file or directory")
    (tmp_path / "file").write_text("")
    assert save_error(tmp_path / "file" / "m.safetensors").endswith(": Not a directory")
    (tmp_path / "dir.safetensors").mkdir()
    assert save_error(tmp_path / "dir.safetensors").endswith(": not a regular file")
    (tmp_path / "loop_a").symlink_to("loop_b")
    (tmp_path / "loop_b").symlink_to("loop_a")
    assert save_error(tmp_path / "loop_a").endswith(": Too many levels of symbolic links")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir.safetensors", "file", "loop_a", "loop_b"]


def test_a_symlink_is_written_through_to_its_target(tmp_path):
    """The link keeps pointing at the same file, which now holds the new checkpoint; the
    .partial file was written beside the target, in the target's directory."""
    (tmp_path / "store").mkdir()
    (tmp_path / "work").mkdir()
    target = tmp_path / "store" / "trained.safetensors"
    saved(target, 1)
    link = tmp_path / "work" / "model.safetensors"
    link.symlink_to(Path("..") / "store" / "trained.safetensors")
    chain = tmp_path / "work" / "latest.safetensors"
    chain.symlink_to("model.safetensors")
    saved(chain, 2)
    assert link.is_symlink() and os.readlink(link) == str(Path("..") / "store" / "trained.safetensors")
    assert chain.is_symlink() and os.readlink(chain) == "model.safetensors"
    assert holds_seed(target, 2) and holds_seed(chain, 2)
    assert [p.name for p in (tmp_path / "store").iterdir()] == ["trained.safetensors"]
    assert sorted(p.name for p in (tmp_path / "work").iterdir()) == ["latest.safetensors", "model.safetensors"]


def test_a_dangling_symlink_creates_its_target(tmp_path):
    link = tmp_path / "model.safetensors"
    link.symlink_to("new.safetensors")
    saved(link, 3)
    assert link.is_symlink() and (tmp_path / "new.safetensors").is_file() and holds_seed(link, 3)


def test_ports_save_through_the_reference():
    """Every port's save goes through reference_numpy.checkpoint.save_checkpoint, so all of the
    above holds for every backend; no port writes a file itself."""
    for port, adapter in (("transformer_torch", "torch"), ("transformer_jax", "jax"), ("transformer_tf", "tf")):
        for module in (f"{port}/checkpoint.py", f"equivalence/backends/{adapter}.py"):
            source = (ROOT / module).read_text()
            assert not re.search(r"\bopen\(|write_bytes|safetensors\.\w+ import save|save_file|os\.replace", source), \
                f"{module} writes files itself"
        saves = (r"\breference(_checkpoint)?\.save_checkpoint\(path, model\.config, to_params\(model\), training, "
                 r"tokenizer\)")
        assert re.search(saves, (ROOT / port / "checkpoint.py").read_text()), port
