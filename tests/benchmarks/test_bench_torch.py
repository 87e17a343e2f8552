"""``scripts/bench_torch.py``'s kernel table (item 5 of its docstring) on ``tiny``: every kernel it times computes
the step's product (checked against the exact one within float32's GEMM bound), and a kernel that does not is
refused, not timed."""

from __future__ import annotations

import numpy as np
import pytest
from support import script

torch = pytest.importorskip("torch", reason="torch is not installed: the PyTorch port's benchmark needs it")

from reference_numpy import TransformerConfig, init_params  # noqa: E402


@pytest.fixture(scope="module")
def bench():
    return script("bench_torch")


@pytest.fixture(scope="module")
def model(bench):
    config = TransformerConfig.preset("tiny")
    return bench.checkpoint.from_params(config, init_params(config, seed=0, dtype=np.float32), torch.float32, "cpu")


def test_every_kernel_computes_the_product(bench):
    weight, bias, x = torch.randn(7, 5, dtype=torch.float32), torch.randn(7), torch.randn(3, 5)
    exact = x.double() @ weight.double().t() + bias.double()
    bound = 6 * 2.0 ** -24 * (x.double().abs() @ weight.double().abs().t() + bias.double().abs())   # K + 1 roundings
    kernels = bench.product_kernels(weight, bias, 3)
    assert {"the port's _linear", "F.linear, weight (out, in)", "torch.addmm, weight (in, out)"} <= set(kernels)
    for name, kernel in kernels.items():
        assert bool(((kernel(x).double() - exact).abs() <= bound).all()), name


def test_the_table_has_a_rate_per_kernel_and_shape(bench, model):
    lines = bench.kernel_rates(model, "cpu", 4, 1)
    shapes = {tuple(layer.weight.shape) for layer in bench.step_layers(model)} | {bench.output_projection(model).shape}
    rows = [line for line in lines if line.startswith("| ") and not line.startswith("| kernel")]
    assert len(rows) == len(bench.product_kernels(torch.ones(2, 2), torch.ones(2), 4))
    assert all(len(row.strip("|").split("|")) == 1 + len(shapes) for row in rows)
    assert all(float(cell) > 0 for row in rows for cell in row.strip("|").split("|")[1:])


def test_a_kernel_off_the_product_is_refused(bench, model, monkeypatch):
    kernels = bench.product_kernels
    monkeypatch.setattr(bench, "product_kernels",
                        lambda weight, bias, rows: {**kernels(weight, bias, rows), "wrong": lambda x: x @ weight.t()})
    with pytest.raises(AssertionError, match="^wrong: off the exact product"):
        bench.kernel_rates(model, "cpu", 4, 1)
