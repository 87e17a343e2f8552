"""``compare``'s table (``transformer_cli.commands.report``) of a run whose stages the policy judged three ways: within
the bound, over it, and held to the error a stage adds to its inputs' (``tolerance.stage_agreement``; the run of such
a port: tests/equivalence/test_fuzz.py, AMPLIFIED)."""

from __future__ import annotations

from reference_numpy import TransformerConfig
from transformer_bench.compare import Report, Run, StageResult
from transformer_cli.commands.report import format_table

# The stages of a float32 run as compare judges them: the decoder's error over the bound on its total but within it
# on what the stage adds, carried on by the generator, after stages within the bound.
STAGES = [StageResult("src_embed", 1e-7, 1e-7, 1e-6, True), StageResult("encoder", 2e-7, 1e-7, 1e-6, True),
          StageResult("decoder.layers.0", 8e-7, 4e-7, 1e-6, True),
          StageResult("decoder", 3e-6, 2e-6, 1e-6, True, added=True),
          StageResult("log_probs", 4e-6, 3e-6, 1e-6, True, added=True)]


def table_of(stages: list[StageResult]) -> str:
    run = Run("stand-in", "cpu", "float32", stages, greedy_identical=True)
    return format_table(Report("a stand-in port", TransformerConfig.preset("tiny"), [run], []))


def test_the_table_marks_each_stage_held_to_what_it_adds_and_says_why():
    """"+" on the cells of the stages held to what they add, none on the others, the run ok, and a note naming those
    stages and why."""
    table = table_of(STAGES)
    assert [line.split()[0] for line in table.splitlines() if line.rstrip().endswith("+")] == ["decoder", "log_probs"]
    assert "stand-in/cpu/f32: + at decoder, log_probs: the error the stage adds to its inputs'" in table
    assert "FAILED" not in table


def test_a_stage_over_its_bound_is_marked_as_such_not_as_added():
    stages = [*STAGES[:3], StageResult("decoder", 3e-6, 2e-6, 1e-6, False), STAGES[4]]
    marks = {line.split()[0]: line.rstrip()[-1] for line in table_of(stages).splitlines()
             if line.split() and line.split()[0] in {stage.stage for stage in stages}}
    assert marks["decoder"] == "!" and marks["log_probs"] == "+" and marks["encoder"] not in "!+"
