"""Run the numerical tests under each family of CPU kernels a user's machine may select.

Every framework picks its float kernels by the CPU it finds: PyTorch's ATen by ``ATEN_CPU_CAPABILITY`` (default,
avx2, avx512), oneDNN -- PyTorch's linear maps and TensorFlow's oneDNN ops -- by ``ONEDNN_MAX_CPU_ISA``, MKL by
``MKL_ENABLE_INSTRUCTIONS``, XLA:CPU (JAX, and TensorFlow's compiled functions) by ``--xla_cpu_max_isa``, NumPy's own
loops by ``NPY_DISABLE_CPU_FEATURES``; TensorFlow runs its oneDNN ops or Eigen's by ``TF_ENABLE_ONEDNN_OPTS``. Each
family below caps them all at one instruction set, so that one machine runs what an older (or differently built) CPU
would: the suite's claims -- agreement within bounds derived from the float32 reference's own error, identical tokens
wherever the bound decides them -- must hold under every family, since none of them is asserted of one CPU's
roundings. (OpenBLAS, the reference's products, is pinned to one kernel on every machine by ``tests/conftest.py``.)

    python scripts/kernel_families.py                      # every family, every numerical test (--full)
    python scripts/kernel_families.py --family avx2        # one family
    python scripts/kernel_families.py --family below-native -- -m "not slow"   # CI: the default tier, below this CPU
    python scripts/kernel_families.py --list               # the families and their environments
    python scripts/kernel_families.py --family sse -- -k torch    # more pytest arguments after --

Before its tests, each family's run prints what the frameworks report they selected (PyTorch's capability, NumPy's
SIMD extensions, oneDNN's instruction set), and after them the slowest tests. Prints one line per family,
``family: N passed, N failed``; exits 1 unless every family passes.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from slow_tests import durations

ROOT = Path(__file__).resolve().parent.parent
SLOWEST = 25                        # the slowest tests a passing family's run prints

# The agreement matrix, gradients, low precision, decoding and the fuzzer: every test whose outcome rests on the
# frameworks' float kernels.
NUMERICAL_TESTS = ("tests/equivalence/test_agreement.py", "tests/equivalence/test_agreement_low_precision.py",
                   "tests/equivalence/test_gradients.py", "tests/reference/test_decoding.py",
                   "tests/equivalence/test_decoding_oracle.py", "tests/ports/test_beam_cache.py",
                   "tests/equivalence/test_fuzz.py")

_NUMPY_AVX512 = "X86_V4 AVX512_ICL AVX512_SPR"

FAMILIES: dict[str, tuple[str, dict[str, str]]] = {
    # XLA_FLAGS set (empty) keeps tests/conftest.py's faster-compiling XLA:CPU code generation off: XLA's defaults.
    "native": ("what each framework selects on this CPU (nothing capped), XLA:CPU's default code generation",
               {"XLA_FLAGS": ""}),
    "avx2": ("AVX2 and FMA, as on a CPU without AVX-512 (most AMD Zen 1-3, Intel client parts)", {
        "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "XLA_FLAGS": "--xla_cpu_max_isa=AVX2", "NPY_DISABLE_CPU_FEATURES": _NUMPY_AVX512,
        "TF_ENABLE_ONEDNN_OPTS": "1"}),
    # XLA:CPU is capped at AVX, not SSE4.2: below AVX, jaxlib 0.10.2 compiles no float16 conversion (LLVM reports
    # the symbol __truncsfhf2 missing), a failure to run, not a rounding.
    "sse": ("SSE4 only, no vector FMA: ATen's default kernels, oneDNN SSE4.1, NumPy's baseline loops, XLA:CPU AVX, "
            "and TensorFlow with oneDNN off (Eigen's kernels)", {
                "ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
                "XLA_FLAGS": "--xla_cpu_max_isa=AVX", "NPY_DISABLE_CPU_FEATURES": f"X86_V3 {_NUMPY_AVX512}",
                "TF_ENABLE_ONEDNN_OPTS": "0"}),
}

# Run in the family's environment: what the frameworks say they selected.
PROBE = """
import torch
from numpy._core._multiarray_umath import __cpu_dispatch__, __cpu_features__
found = [name for name in __cpu_dispatch__ if __cpu_features__.get(name)]
print("  torch capability:", torch.backends.cpu.get_cpu_capability(), "| numpy SIMD:", " ".join(found) or "baseline")
x = torch.ones(64, 512)
torch.ops.mkldnn._linear_pointwise(x, torch.ones(512, 512), None, "none", [], "")
"""


def below_native() -> str:
    """The widest family below what this CPU selects: "avx2" on a CPU with AVX-512 (there it caps every framework's
    choice), "sse" on one without (where "avx2" is what the frameworks select anyway)."""
    from numpy._core._multiarray_umath import __cpu_features__

    return "avx2" if __cpu_features__.get("AVX512F") else "sse"


def family_environment(name: str) -> dict[str, str]:
    """This process's environment with the family's variables set (a variable the user set is overridden)."""
    return {**os.environ, **FAMILIES[name][1]}


def probe(name: str) -> str:
    """What the frameworks select under family ``name``: ATen's capability, NumPy's SIMD levels, oneDNN's ISA."""
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, cwd=ROOT,
                          env={**family_environment(name), "ONEDNN_VERBOSE": "1"})
    isa = re.search(r"onednn_verbose,.*?isa:(.*)", done.stdout + done.stderr)
    lines = [line for line in done.stdout.splitlines() if line.startswith("  torch")]
    return "\n".join([*lines, f"  oneDNN: {isa.group(1).strip() if isa else 'not reported'}"])


def run_family(name: str, pytest_args: list[str]) -> tuple[bool, str]:
    """The numerical tests under family ``name``; (passed, pytest's closing line)."""
    description, variables = FAMILIES[name]
    print(f"== {name}: {description}", flush=True)
    for key, value in variables.items():
        print(f"  {key}={value}")
    print(probe(name), flush=True)
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=0", "--full",
                           *NUMERICAL_TESTS, *pytest_args], cwd=ROOT, env=family_environment(name),
                          capture_output=True, text=True)
    closing = next((line for line in reversed(done.stdout.splitlines()) if line.strip()), "(no output)")
    if done.returncode != 0:
        print(done.stdout[-20000:], done.stderr[-4000:], sep="\n")
    else:
        print(slowest(done.stdout, SLOWEST))
    print(f"  {closing.strip('= ')} [{time.monotonic() - start:.0f} s]", flush=True)
    return done.returncode == 0, closing


def slowest(report: str, count: int) -> str:
    """The ``count`` slowest tests of pytest's ``--durations`` report (set-up, call and teardown summed by
    ``slow_tests.durations``), slowest first, indented."""
    seconds = sorted(durations(report).items(), key=lambda item: -item[1])
    return "\n".join(f"  {took:.2f}s {test}" for test, took in seconds[:count])


def counts(closing: str) -> str:
    """'N passed, N failed' from pytest's closing line."""
    found = {word: int(number) for number, word in re.findall(r"(\d+) (passed|failed|error)", closing)}
    return f"{found.get('passed', 0)} passed, {found.get('failed', 0) + found.get('error', 0)} failed"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", action="append", choices=[*FAMILIES, "below-native"],
                        help="a family to run (repeatable); below-native: the widest family below this CPU's own "
                        "(avx2 on a CPU with AVX-512, sse on one without); default: every one")
    parser.add_argument("--list", action="store_true", help="print the families and their environments, exit")
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments, after --")
    args = parser.parse_args(argv)
    if args.list:
        for name, (description, variables) in FAMILIES.items():
            print(f"{name}: {description}\n  " + (" ".join(f"{k}={v!r}" for k, v in variables.items()) or "-"))
        return 0
    names = [below_native() if name == "below-native" else name for name in args.family or FAMILIES]
    results = {name: run_family(name, args.pytest_args) for name in dict.fromkeys(names)}
    for name, (_, closing) in results.items():
        print(f"{name}: {counts(closing)}")
    return 0 if all(ok for ok, _ in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
