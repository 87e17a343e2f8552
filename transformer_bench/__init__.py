"""The benchmarks: the timing of each backend side by side (:mod:`transformer_bench.bench`, which the ``bench``
command prints), the outside engines it is measured against (:mod:`transformer_bench.peers`) and the timing rules
and analytic FLOP counts (:mod:`transformer_bench.timing`) that ``scripts/bench_*.py`` share."""

from reference_numpy import __version__ as __version__
