"""The command line's cache of compiled programs (equivalence/compile_cache.py, docs/cli.md): where it lives,
what ``--no-cache`` does, that a second process reads back what the first wrote, that a checkpoint of the same
shapes with other weights runs its own weights from the cached programs, and that ``translate --backend B`` imports
no other backend's framework. The commands run as fresh processes: the frameworks read the cache's settings when
they are imported, once a process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from equivalence import backends, compile_cache, runtime
from reference_numpy import save_checkpoint
from reference_numpy.checkpoint import load_tokenizer_json
from transformer_cli.main import EXIT_OK, main
from transformer_tasks.translation import SHIPPED, load_translator

ROOT = Path(__file__).resolve().parents[2]
SENTENCE = "three hundred and twelve"
# the frameworks' own cache settings, which the command line keeps when a user has set them
SETTINGS = ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "JAX_ENABLE_COMPILATION_CACHE",
            "TF_XLA_FLAGS", "TORCHINDUCTOR_CACHE_DIR")
# run one command in a fresh process; print its output, then the framework modules it imported as one JSON line
DRIVER = """import json, sys
from transformer_cli.main import main
status = main(sys.argv[1:])
print(json.dumps(sorted({name.split(".")[0] for name in sys.modules} & {"torch", "jax", "tensorflow", "keras"})))
sys.exit(status)"""


def run(cache: Path, *args: str) -> tuple[list[str], list[str]]:
    """A command run in a fresh process with ``cache`` as its cache and no framework cache set by the user: its
    output lines and the frameworks it imported (a failure, or anything on standard error, fails the test)."""
    env = {name: value for name, value in os.environ.items() if name not in SETTINGS}
    env |= {compile_cache.ENVIRONMENT: str(cache), "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", DRIVER, *args], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=600)
    assert done.returncode == EXIT_OK and not done.stderr, done.stderr
    *lines, imported = done.stdout.splitlines()
    return lines, json.loads(imported)


def files(directory: Path) -> dict[str, int]:
    """Every file under ``directory`` and its modification time."""
    return {str(path.relative_to(directory)): path.stat().st_mtime_ns
            for path in directory.rglob("*") if path.is_file()}


def test_the_cache_lives_where_documented(monkeypatch, tmp_path):
    for name in (*SETTINGS, compile_cache.ENVIRONMENT, "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert compile_cache.root() == tmp_path / "home" / ".cache" / "transformer-reference"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache.root() == tmp_path / "xdg" / "transformer-reference"
    monkeypatch.setenv(compile_cache.ENVIRONMENT, str(tmp_path / "mine"))
    assert compile_cache.root() == tmp_path / "mine"
    cpu = compile_cache.cpu_fingerprint()
    for framework in compile_cache.FRAMEWORKS:
        version = compile_cache.framework_version(framework)
        assert compile_cache.directory(framework) == (None if version is None
                                                      else tmp_path / "mine" / f"{framework}-{version}-{cpu}")
    if (jax := compile_cache.directory("jax")) is None or (tf := compile_cache.directory("tf")) is None:
        pytest.skip("JAX and TensorFlow are not both installed")
    compile_cache.use()
    assert os.environ["JAX_COMPILATION_CACHE_DIR"] == str(jax)
    assert os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] == "0"
    assert os.environ["TF_XLA_FLAGS"] == f"--tf_xla_persistent_cache_directory={tf}"


def test_a_user_s_own_framework_cache_is_kept_and_no_cache_sets_none(monkeypatch, tmp_path):
    for name in SETTINGS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(compile_cache.ENVIRONMENT, str(tmp_path))
    own = {"JAX_COMPILATION_CACHE_DIR": "/elsewhere/jax", "TF_XLA_FLAGS": "--tf_xla_persistent_cache_directory=/x",
           "TORCHINDUCTOR_CACHE_DIR": "/elsewhere/inductor"}
    for name, value in own.items():
        monkeypatch.setenv(name, value)
    compile_cache.use()
    assert {name: os.environ[name] for name in own} == own
    for name in SETTINGS:
        monkeypatch.delenv(name, raising=False)
    compile_cache.use(enabled=False)
    assert {name: os.environ[name] for name in SETTINGS if name in os.environ} == {"JAX_ENABLE_COMPILATION_CACHE":
                                                                                     "false"}
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def test_tensorflow_s_notices_of_a_program_read_back_are_dropped(capfd, monkeypatch):
    """Every other line written to file descriptor 2 passes, in order, a partial one (a progress bar's) at once."""
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "2")
    notice = (b"E0000 00:00:1795886969.930124    9338 text_format.cc:378] Error parsing text-format "
              b"tensorflow.XlaSerializedCacheEntry: 2:1: Expected identifier, got: 4\n")
    with runtime.cache_notices_dropped():
        os.write(2, b"first\n" + notice + b"E0000 a real error\nprogress 10%\r")
        os.write(2, notice[:20])
        os.write(2, notice[20:] + b"progress 20%")
    assert capfd.readouterr().err == "first\nE0000 a real error\nprogress 10%\rprogress 20%"


def swapped_checkpoint(path: Path) -> Path:
    """The shipped model with two French words' rows of its shared embedding (and so of its output projection)
    swapped: the same shapes, so the same programs, and each of the two words where the other was."""
    config, params, tokenizer = load_translator(None)
    (first, *_), (second, *_) = tokenizer.source("trois", "x"), tokenizer.source("cent", "x")
    table = params["shared_embed.weight"]
    table[[first, second]] = table[[second, first]]
    save_checkpoint(path, config, params, tokenizer=load_tokenizer_json(SHIPPED))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["jax", "tf"])
def test_a_second_process_reads_back_what_the_first_compiled(backend, tmp_path, capsys):
    if not backends.installed(backend):
        pytest.skip(f"{backend} is not installed")
    cache = tmp_path / "cache"
    frameworks = ["jax"] if backend == "jax" else ["keras", "tensorflow"]               # no other backend's
    assert run(cache, "translate", "--no-cache", "--backend", backend, SENTENCE) == (["trois cent douze"], frameworks)
    assert not cache.exists()                                                       # --no-cache: nothing written
    cold, imported = run(cache, "translate", "--backend", backend, SENTENCE)
    (directory,) = cache.iterdir()
    assert directory.name.startswith(f"{backend}-{compile_cache.framework_version(backend)}-")
    written = files(directory)
    assert written and cold == ["trois cent douze"]
    assert run(cache, "translate", "--backend", backend, SENTENCE) == (cold, imported)
    assert files(directory) == written                                              # read back, nothing compiled

    swapped = swapped_checkpoint(tmp_path / "swapped.safetensors")
    assert main(["translate", "--checkpoint", str(swapped), SENTENCE]) == EXIT_OK   # the NumPy reference
    expected = capsys.readouterr().out.splitlines()
    assert expected != cold
    assert run(cache, "translate", "--checkpoint", str(swapped), "--backend", backend, SENTENCE)[0] == expected
    assert files(directory) == written                                              # the same programs, its weights


def test_swapping_two_words_rows_swaps_them_in_the_translation(tmp_path, capsys):
    """The swapped checkpoint of the test above translates as the shipped model with the two words exchanged (a
    check of the checkpoint itself, so that the test above compares against a translation that differs)."""
    swapped = swapped_checkpoint(tmp_path / "swapped.safetensors")
    assert main(["translate", "--checkpoint", str(swapped), SENTENCE]) == EXIT_OK
    assert capsys.readouterr().out == "cent trois douze\n"
