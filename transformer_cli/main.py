"""Entry point of ``transformer-reference``.

    transformer-reference compare [CHECKPOINT | --preset base] [--backends torch,jax,tf] [--json] [--plot FILE.png]
    transformer-reference bench [CHECKPOINT | --preset base] [--peers] [--compiled] [--json] [--plot FILE.png]
    transformer-reference export --to ctranslate2|hf|savedmodel|jax-export|torch-export|onnx CKPT OUT [--force]
                                 [--check]
    transformer-reference plot pe [--length 100] [--d-model 512] [--out pe.png]
    transformer-reference plot attention [CHECKPOINT] [--text "..."] [--layer L] [--head 0] [--kind decoder_cross]
                                         [--source-lang en --target-lang fr] [--out attention.png]
    transformer-reference init OUT.safetensors [--preset tiny] [--seed 0] [--force]
    transformer-reference train [--task copy|numbers] [--backends numpy] [--steps N] [--out RUN.safetensors]
                                [--resume RUN.safetensors] [--plot FILE.png] [--json]
    transformer-reference train --source SRC.txt --target TGT.txt [--tokens-per-batch N] [--save-every N]
                                [--average K] [--out RUN.safetensors]
    transformer-reference train --init CHECKPOINT --source SRC.txt --target TGT.txt [--source-lang en]
                                [--target-lang fr] [--warmup-steps N] [--out RUN.safetensors]
    transformer-reference average OUT.safetensors RUN1.safetensors RUN2.safetensors ... [--force]
    transformer-reference import HF_MODEL_DIR OUT.safetensors [--force]
    transformer-reference translate ["three hundred and twelve" ...] [--backend numpy] [--beam 4] [--checkpoint PATH]
                                    [--input FILE] [--output FILE] [--batch-size N] [--batches-at-once N]
    transformer-reference evaluate CHECKPOINT --source FILE --reference FILE [--backend numpy] [--beam 4] [--json]
    transformer-reference side-by-side --out DIR
    transformer-reference --version

Every command that writes a file takes ``--force`` (an existing output is kept otherwise) and declares its inputs
and outputs (:func:`add_outputs`): an output that is an input -- by path, link or hard link, a shipped model by name
-- is refused before any work, even with ``--force`` (:func:`transformer_export.outputs.refuse_input`). Every
command that runs a model takes ``--threads N`` (:mod:`equivalence.runtime`) and ``--no-cache`` (the cache of
compiled programs skipped: :mod:`equivalence.compile_cache`). Ctrl-C or SIGTERM ends any command
with one line and status 130, ``train`` after saving its run (:mod:`.interrupts`).

Each subcommand is one ``add_*`` function in :data:`COMMANDS` that registers its parser and
sets ``run``, the function that carries it out and returns the exit status (:data:`EXIT_STATUS`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import traceback
from collections.abc import Iterable
from types import ModuleType
from typing import TYPE_CHECKING, NoReturn

import numpy as np

from equivalence import backends, compile_cache, runtime
from reference_numpy import TransformerConfig, __version__, init_params, save_checkpoint
from reference_numpy.config import PRESETS
from reference_numpy.decoding import BEAM_SIZE, EXTRA_OUTPUT_LENGTH, LENGTH_PENALTY_ALPHA
from reference_numpy.precision import DTYPE_NAMES
from transformer_cli.arguments import (
    PRECISION_NAMES,
    add_number,
    backend_names,
    device_name,
    dtype_names,
    image_file,
    output_file,
    refuse_existing,
)
from transformer_cli.commands import side_by_side
from transformer_cli.interrupts import StopRequest, terminate_as_interrupt
from transformer_export.outputs import refuse_input
from transformer_tasks.copy import DEFAULTS as COPY
from transformer_tasks.corpus import DEFAULTS as CORPUS
from transformer_tasks.corpus import FILES as CORPUS_FILES
from transformer_tasks.corpus import VOCAB_SIZE
from transformer_tasks.numbers import DEFAULTS as NUMBERS
from transformer_tasks.progress import progress_bar
from transformer_tasks.translation import BATCH_SIZE as TRANSLATE_BATCH
from transformer_tasks.translation import DEFAULT_MODEL

if TYPE_CHECKING:
    from equivalence.contract import Model
    from reference_numpy.checkpoint import TrainingState
    from transformer_cli.commands.train import Plan, Progress, Result, Snapshots

Commands = argparse._SubParsersAction     # what ArgumentParser.add_subparsers returns

PROG = "transformer-reference"
EXIT_OK, EXIT_DISAGREEMENT, EXIT_USAGE, EXIT_INTERNAL, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
EXIT_STATUS = f"""exit status:
  {EXIT_OK}  success (compare: every backend agrees with the reference)
  {EXIT_DISAGREEMENT}  compare: a backend breaks a bound, gives NaN/inf or fails to run
  {EXIT_USAGE}  usage or input error: bad flag (a number outside its range: see --help), bad
     checkpoint, nothing to compare, an output that exists (without --force) or is an input,
     more memory than the machine holds; one line on stderr, no traceback
  {EXIT_INTERNAL}  internal error: a bug, reported with its traceback
  {EXIT_INTERRUPTED}  interrupted (Ctrl-C, SIGTERM): one line; train saves its --out run at the
     last step every replica completed first"""


class Parser(argparse.ArgumentParser):
    """argparse with a usage error in one line (naming the command, the flag and ``--help``), not the usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message.splitlines()[0]} (see {self.prog} --help)\n")

    def parse_args(self, args=None, namespace=None):
        """argparse's, with arguments no command knows reported by the command given (its ``--help``)."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            command: argparse.ArgumentParser = self
            while chosen := next((action.choices[getattr(parsed, action.dest)] for action in command._actions
                                  if isinstance(action, Commands)
                                  and getattr(parsed, action.dest, None) in action.choices), None):
                command = chosen                            # the innermost command given (plot pe)
            command.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed


def subcommand(commands: Commands, name: str, summary: str) -> argparse.ArgumentParser:
    """Register one subcommand; its ``--help`` ends with the exit status table."""
    return commands.add_parser(name, help=summary, description=summary, epilog=EXIT_STATUS,
                               formatter_class=argparse.RawDescriptionHelpFormatter)


def add_runtime_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of a command that runs a model: ``--threads N``, each framework's intra-op threads
    (``runtime.configure``), and ``--no-cache``, the cache of compiled programs skipped (``compile_cache.use``)."""
    add_number(parser, "--threads", metavar="N", default=runtime.visible_cores(),
               help="intra-op threads of each framework (PyTorch, TensorFlow, XLA) (default: the cores this "
                    f"process may use, here {runtime.visible_cores()})")
    parser.add_argument("--no-cache", action="store_true",
                        help="neither read nor write the cache of compiled programs (default: kept in "
                             f"${compile_cache.ENVIRONMENT}, else $XDG_CACHE_HOME/{compile_cache.NAME}, else "
                             f"~/.cache/{compile_cache.NAME}; safe to delete)")


def add_outputs(parser: argparse.ArgumentParser, *outputs: str, inputs: tuple[str, ...] = (),
                default_model: str | None = None) -> None:
    """``--force``, and what the command writes and reads, for :func:`check_outputs`: ``outputs``, the arguments
    naming the files (or directories) it writes, each replaced only with ``--force``; ``inputs``, those naming the
    files it reads (each a path or a shipped model's name, or a list of them), never replaced; ``default_model``,
    the input that is the shipped model when it is not given (nor ``--preset``). Called once the arguments are
    added: each output is named in messages as the command line names it (``--plot``, ``OUT``)."""
    names = {action.dest: action.option_strings[0] if action.option_strings else action.metavar or action.dest
             for action in parser._actions}
    parser.add_argument("--force", action="store_true",
                        help=f"replace {' or '.join(str(names[name]) for name in outputs)} if it exists (kept "
                             "otherwise); an input of the command is never replaced, even with --force")
    parser.set_defaults(outputs={name: str(names[name]) for name in outputs}, inputs=inputs,
                        default_model=default_model)


def declared_inputs(args: argparse.Namespace) -> list[str]:
    """The files the command reads, as the command line gives them (paths, shipped models' names), with the
    shipped model if it is the command's default input (:func:`add_outputs`)."""
    given: list[str] = []
    for name in args.inputs:
        value = getattr(args, name, None)
        if value is None and name == args.default_model and not getattr(args, "preset", None):
            value = DEFAULT_MODEL
        given.extend([value] if isinstance(value, str) else value or [])
    return given


def check_outputs(args: argparse.Namespace) -> None:
    """Before any work: no output replaces an input (the same file through any link, or a directory holding it;
    never, even with ``--force``), nor an existing file without ``--force``."""
    inputs = declared_inputs(args)
    for name, flag in args.outputs.items():
        if path := getattr(args, name):
            refuse_input(path, inputs, flag)
            refuse_existing(path, flag, args.force)


def add_compare(commands: Commands) -> None:
    compare = subcommand(commands, "compare", "every installed backend vs the NumPy reference, stage by stage")
    compare.add_argument("checkpoint", nargs="?", help="a shared safetensors checkpoint (default: the shipped English-"
                                                       "to-French numbers model; its translations side by side)")
    compare.add_argument("--preset", choices=sorted(PRESETS), help="a preset with seeded random weights instead "
                                                                   "(e.g. base: Table 3's base model)")
    compare.add_argument("--backends", type=backend_names, default=backends.PORTS,
                         help=f"comma-separated subset of {','.join(backends.BACKENDS)} (default: every port; "
                              "the float32 NumPy reference always runs)")
    compare.add_argument("--dtype", type=dtype_names, help="comma-separated precisions to run, of "
                         "float64,float32,bfloat16,float16 (default: float64,float32; with --precision-report: "
                         "float32,bfloat16,float16)")
    compare.add_argument("--device", type=device_name,
                         help="run the ports on this device only: cpu or gpu:N (default: every device each has; the "
                              "NumPy reference runs on the CPU)")
    compare.add_argument("--json", action="store_true", help="print the report as JSON")
    compare.add_argument("--plot", metavar="FILE.png", type=image_file, help="draw the error per stage per backend")
    compare.add_argument("--precision-report", metavar="FILE.png", type=image_file,
                         help="draw, per precision, how far each backend drifts from float64 stage by stage, beside "
                              "the reference's own drift in that precision")
    compare.add_argument("--perturb", metavar="BACKEND:TENSOR",
                         help="change one tensor of one backend by 1e-6 to see where the comparison catches it")
    add_languages(compare)
    add_runtime_flags(compare)
    add_outputs(compare, "plot", "precision_report", inputs=("checkpoint",), default_model="checkpoint")
    compare.set_defaults(run=run_compare)


def run_compare(args: argparse.Namespace) -> int:
    from transformer_bench.compare import DTYPES, PRECISION_REPORT_DTYPES, compare
    from transformer_cli.commands.report import format_table, plot_errors, plot_precision

    dtypes = args.dtype or (PRECISION_REPORT_DTYPES if args.precision_report else DTYPES)
    if args.precision_report and set(dtypes) == {"float64"}:
        raise ValueError("--precision-report draws the precisions below float64: add one to --dtype")
    report = compare(args.checkpoint, args.backends, args.perturb,
                     progress=progress_bar("compare", "run", quiet=args.json or not args.terminal),
                     preset=args.preset, dtypes=dtypes, device=args.device,
                     languages=(args.source_lang, args.target_lang))
    print(json.dumps({**report.to_json(), "runtime": runtime.settings()}, indent=2, allow_nan=False) if args.json
          else format_table(report))
    if args.plot:
        plot_errors(report, args.plot)
    if args.precision_report:
        plot_precision(report, args.precision_report)
    return EXIT_OK if report.ok else EXIT_DISAGREEMENT


def add_bench(commands: Commands) -> None:
    bench = subcommand(commands, "bench", "time forward and greedy decoding of every installed backend")
    bench.add_argument("checkpoint", nargs="?", help="a safetensors checkpoint to time, with its own config, decoding "
                                                     "conventions and weights (e.g. an imported opus-mt model; "
                                                     "default: --preset's seeded random weights)")
    bench.add_argument("--preset", choices=sorted(PRESETS), help="a preset with seeded random weights (default: base)")
    add_number(bench, "--batch", default=8)
    add_number(bench, "--src-len", default=128)
    add_number(bench, "--tgt-len", default=128)
    add_number(bench, "--decode-tokens", default=128,
               help=f"greedy decoding budget N (batch 1): a source of N - {EXTRA_OUTPUT_LENGTH} tokens "
                    f"(section 6.1's budget is source length + {EXTRA_OUTPUT_LENGTH}; also a checkpoint's, whatever "
                    "output budget it holds; --peers emit exactly N tokens)")
    add_number(bench, "--repeats", default=3, help="timed repeats after the warm-up (median)")
    bench.add_argument("--no-uncached", action="store_true", help="skip the (slow) uncached decoding")
    bench.add_argument("--backends", type=backend_names, default=tuple(backends.BACKENDS))
    bench.add_argument("--peers", action="store_true",
                       help="also time the installed peers on the same weights (CTranslate2, torch.nn.Transformer, "
                            "HF Marian; the 'peers' extra): forward, greedy batch 1 and 8, beam 4 batch 1, "
                            "without the uncached decoding (docs/peers.md)")
    bench.add_argument("--dtype", choices=PRECISION_NAMES, default="float32",
                       help="the precision the backends run in (default: float32; mixed-bfloat16 and mixed-float16: "
                            "each framework's own mixed precision, the autocast recipe; --peers times float32 only)")
    bench.add_argument("--compiled", action="store_true",
                       help="also time the PyTorch port's cached decoding with each step compiled by torch.compile "
                            "(transformer_torch.compile_decoding; float32; tens of seconds to compile each shape)")
    bench.add_argument("--device", type=device_name, default="cpu",
                       help="where the ports run: cpu or gpu:N (default: cpu; the NumPy reference runs on the CPU)")
    bench.add_argument("--json", action="store_true", help="print the report as JSON")
    bench.add_argument("--plot", metavar="FILE.png", type=image_file, help="bar chart of achieved GFLOP/s")
    add_runtime_flags(bench)
    add_outputs(bench, "plot", inputs=("checkpoint",))
    bench.set_defaults(run=run_bench)


def run_bench(args: argparse.Namespace) -> int:
    from transformer_bench.bench import bench, format_bench
    from transformer_cli.plots import plot_bench

    report = bench(args.preset, args.batch, args.src_len, args.tgt_len, args.decode_tokens,
                   args.backends, args.repeats, not args.no_uncached,
                   progress=progress_bar("bench", "call", quiet=args.json or not args.terminal),
                   peers=args.peers, dtype=args.dtype, device=args.device, compiled=args.compiled,
                   checkpoint=args.checkpoint)
    print(json.dumps(report.to_json(), indent=2) if args.json else format_bench(report))
    if report.busy:
        print(f"{PROG} bench: warning: {report.busy}", file=sys.stderr)
    if args.plot:
        plot_bench(report, args.plot)
    return EXIT_OK


def add_plot(commands: Commands) -> None:
    plot = subcommand(commands, "plot", "draw the positional encoding or attention weights")
    pictures = plot.add_subparsers(dest="picture", required=True)
    pe = pictures.add_parser("pe", help="heat map of the sinusoidal positional-encoding table (section 3.5)")
    add_number(pe, "--length", default=100)
    add_number(pe, "--d-model", default=512)
    pe.add_argument("--out", type=image_file, default="pe.png")
    add_outputs(pe, "out")
    attention = pictures.add_parser("attention", help="attention weights of one layer and head, per backend")
    attention.add_argument("checkpoint", nargs="?", help="a shared checkpoint (default: the shipped numbers model)")
    attention.add_argument("--preset", choices=sorted(PRESETS), help="a preset with seeded random weights instead")
    add_number(attention, "--layer", help="the layer, from 0 (default: the last)")
    add_number(attention, "--head", default=0, help="the head, from 0 (default: 0)")
    attention.add_argument("--kind", default="decoder_cross", choices=["encoder", "decoder_self", "decoder_cross"],
                           help="which attention (default: decoder_cross, the source-target alignment)")
    attention.add_argument("--text", help="a source sentence, with a checkpoint that holds a tokenizer; the target is "
                                          "its float64 reference translation (default: a fixed sentence)")
    attention.add_argument("--src", help="source token ids, space-separated (default: a fixed sentence)")
    attention.add_argument("--tgt", help="target token ids starting with bos (default: the source's translation)")
    attention.add_argument("--backends", type=backend_names, default=tuple(backends.BACKENDS),
                           help="one backend, or several side by side (default: every installed one)")
    attention.add_argument("--device", type=device_name, default="cpu",
                           help="where the ports run: cpu or gpu:N (default: cpu; the NumPy reference runs on the CPU)")
    attention.add_argument("--out", type=image_file, default="attention.png")
    add_languages(attention)
    add_runtime_flags(attention)
    add_outputs(attention, "out", inputs=("checkpoint",), default_model="checkpoint")
    plot.set_defaults(run=run_plot)


def run_plot(args: argparse.Namespace) -> int:
    from transformer_cli import plots

    if args.picture == "attention" and args.text is not None and (args.src is not None or args.tgt is not None):
        raise ValueError("--text: give either a sentence (--text) or token ids (--src, --tgt), not both")
    if args.picture == "pe":
        plots.plot_positional_encoding(args.length, args.d_model, args.out)
    else:
        from transformer_cli.commands.attention import attention_by_backend
        weights, query_tokens, key_tokens, title = attention_by_backend(
            args.checkpoint, args.layer, args.head, args.kind, args.src, args.tgt, args.backends, args.text,
            args.preset, args.device, (args.source_lang, args.target_lang))
        plots.plot_attention(weights, query_tokens, key_tokens, title, args.out)
    print(f"wrote {args.out}")
    return EXIT_OK


def add_init(commands: Commands) -> None:
    init = subcommand(commands, "init", "write a seeded checkpoint (docs/checkpoint-format.md)")
    init.add_argument("out", metavar="OUT", type=output_file, help="output .safetensors path")
    init.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    add_number(init, "--seed", default=0)
    init.add_argument("--dtype", choices=DTYPE_NAMES, default="float32", help="the format the file stores "
                      "(default: float32; bfloat16 and float16 are safetensors' BF16 and F16)")
    add_outputs(init, "out")
    init.set_defaults(run=run_init)


def run_init(args: argparse.Namespace) -> int:
    config = TransformerConfig.preset(args.preset)
    save_checkpoint(args.out, config, init_params(config, seed=args.seed, dtype=np.dtype(args.dtype)))
    print(f"wrote {args.out}: {args.preset} preset, seed {args.seed}, {args.dtype}")
    return EXIT_OK


def add_export(commands: Commands) -> None:
    from transformer_export.export import TARGETS

    export = subcommand(commands, "export", "write a shared checkpoint as an artefact a runtime loads without this "
                                            "project: CTranslate2, Hugging Face transformers, a SavedModel, "
                                            "jax.export, torch.export, ONNX")
    export.add_argument("checkpoint", metavar="CHECKPOINT", help="a shared safetensors checkpoint, or a shipped "
                                                                 "model's name")
    export.add_argument("output_dir", metavar="OUTPUT_DIR", help="the directory to write")
    export.add_argument("--to", required=True, choices=list(TARGETS),
                        help="ctranslate2 (the 'peers' extra), hf (a transformers Marian or M2M100 model "
                             "directory, docs/huggingface.md), savedmodel (tf), jax-export (jax), torch-export "
                             "(torch), onnx (export): a float32 artefact of the forward pass, and CTranslate2's "
                             "decoder (docs/deploy.md)")
    export.add_argument("--check", action="store_true",
                        help="then run the artefact in a process without this project (its runtime alone) and compare "
                             "its log-probabilities and greedy tokens with the reference's (float32 policy; exit 1 "
                             "if they disagree); the forward-pass targets")
    add_outputs(export, "output_dir", inputs=("checkpoint",))
    export.set_defaults(run=run_export)


def run_export(args: argparse.Namespace) -> int:
    from transformer_export.check import check_export, check_target
    from transformer_export.export import describe, export

    if args.check:
        check_target(args.to)                                              # before any work
    output = export(args.to, args.checkpoint, args.output_dir, args.force,
                    progress_bar(f"export {args.to}", "program", quiet=not args.terminal, leave=False))
    print(f"wrote {output}: {describe(args.to, output)}; docs/deploy.md")
    if not args.check:
        return EXIT_OK
    checked = check_export(args.to, output, args.checkpoint)
    print(checked)
    return EXIT_OK if checked.ok else EXIT_DISAGREEMENT


def add_train(commands: Commands) -> None:
    train = subcommand(commands, "train", "learn a task with the recipe of section 5 in one or more backends: "
                                          "the copy task, English to French number words, or your own corpus")
    train.add_argument("--task", choices=["copy", "numbers", "corpus"],
                       help="copy: write back a random sequence; numbers: translate English number words to French; "
                            "corpus: your parallel text, --source/--target or --corpus (default: corpus with those "
                            "flags, else copy)")
    train.add_argument("--source", metavar="SRC.txt", help="corpus: source sentences, one per line, UTF-8")
    train.add_argument("--target", metavar="TGT.txt", help="corpus: their translations, line by line")
    train.add_argument("--corpus", metavar="PAIRS.tsv", help="corpus: source and target sentences in two "
                                                             "tab-separated columns, instead of --source/--target")
    train.add_argument("--valid-source", metavar="SRC.txt", help="corpus: validation sentences (default: pairs held "
                                                                 "out of the corpus, see --valid-size)")
    train.add_argument("--valid-target", metavar="TGT.txt", help="corpus: the validation sentences' translations")
    add_number(train, "--valid-size", metavar="N",
               help="corpus: pairs held out for validation by a seeded shuffle (default: min(1000, 5%%)); copy and "
                    "numbers: validation pairs decoded at each check (default: 500)")
    add_number(train, "--vocab-size", metavar="N",
               help=f"corpus: ids of the shared BPE vocabulary at most, learned from the training side (section 5.1; "
                    f"default: {VOCAB_SIZE})")
    train.add_argument("--preset", choices=sorted(PRESETS),
                       help="corpus: a preset's model over the corpus's vocabulary (default: the numbers task's "
                            "model, max_len 256)")
    train.add_argument("--backends", type=backend_names,
                       help="comma-separated backends, each trained from the same weights on the same batches "
                            "(default: numpy, the reference, for copy; the fastest installed for numbers and a "
                            "corpus, named on stderr)")
    defaults = lambda name: "(default: " + ", ".join(f"{task} {recipe[name]}" for task, recipe in
                                                     (("copy", COPY), ("numbers", NUMBERS), ("corpus", CORPUS))
                                                     if name in recipe) + ")"
    add_number(train, "--steps", help=f"optimizer steps at most (more, with --resume) {defaults('steps')}")
    add_number(train, "--batch-size", help=f"sentences per batch {defaults('batch_size')}")
    add_number(train, "--tokens-per-batch", metavar="N",
               help="corpus: positions of the source (and of the target) tensor per batch, padding included, "
                    "sentences grouped by length (section 5.1; every sentence once an epoch) "
                    f"{defaults('tokens_per_batch')}")
    add_number(train, "--symbols", help="copy task: distinct symbols (default: 10)")
    add_number(train, "--max-length", help="copy task: longest sequence, lengths 1 to this (default: 10)")
    add_number(train, "--warmup-steps", help=f"Eq. (3)'s warmup_steps {defaults('warmup_steps')}")
    add_number(train, "--learning-rate-scale",
               help=f"a factor on Eq. (3)'s learning rate, 1 = the paper {defaults('learning_rate_scale')}")
    add_number(train, "--dropout",
               help="P_drop of section 5.4, 0.1 in the paper (the reference has no dropout; default 0 for every "
                    "backend)")
    add_number(train, "--layer-norm-eps",
               help="a new run's LayerNorm epsilon (default: the task's model, 1e-6 as in tensor2tensor; 1e-5, "
                    "nn.LayerNorm's, for a model `export --to hf` ships to transformers)")
    add_number(train, "--label-smoothing", default=0.1, help="epsilon_ls, section 5.4")
    add_number(train, "--seed", default=0, help="initial weights and batches")
    train.add_argument("--dtype", choices=PRECISION_NAMES, default="float32",
                       help="the precision of each step: float32 or float64 weights; bfloat16 or float16 compute in "
                            "that precision over float32 master weights and moments (mixed precision; float16 "
                            "scales the loss), and save float32; mixed-bfloat16 and mixed-float16: each framework's "
                            "own mixed precision (torch.autocast with a GradScaler, Flax's dtype/param_dtype, "
                            "Keras' mixed policy: docs/equivalence.md)")
    train.add_argument("--device", type=device_name, default="cpu",
                       help="where the ports train: cpu or gpu:N (default: cpu; the NumPy reference runs on the CPU; "
                            "--data-parallel places its replicas itself)")
    add_number(train, "--eval-size",
               help="held-out pairs scored at the end: greedy exact match, BLEU for text (default: 1000, or a "
                    "corpus's validation set, its only held-out set; 0: none)")
    add_number(train, "--eval-every", metavar="N",
               help="steps between validation checks: loss, greedy exact match, BLEU for text, shown in the progress "
                    f"bar and --json (0: none) {defaults('eval_every')}")
    add_number(train, "--stop-at",
               help="stop once greedy decoding gets this share of the validation set exactly right, checked every "
                    f"--eval-every steps; 0: run all --steps {defaults('stop_at')}")
    add_number(train, "--data-parallel", metavar="N", default=1,
               help="replicas of data-parallel training on each framework's own engine: PyTorch DDP over N "
                    "processes, a JAX mesh of N devices, a TensorFlow MirroredStrategy over N devices (on a CPU: N "
                    "processes, host devices, logical devices); the batch splits into N equal shards (a corpus's "
                    "gets rows of padding to fit); Ctrl-C stops every replica after the step they are in and saves "
                    "the run there (default: 1)")
    train.add_argument("--resume", metavar="RUN.safetensors",
                       help="continue a saved run (from any backend) for --steps more steps: the model, optimizer "
                            "settings and tokenizer are the run's; pass the run's --task, --seed and task flags "
                            "(a corpus: its files; an imported tokenizer: its --source-lang/--target-lang) to see its "
                            "batches")
    train.add_argument("--init", metavar="CHECKPOINT",
                       help="fine-tune: a new run (step 0, a new optimizer, Eq. (3)'s warm-up again) starting from "
                            "the checkpoint's weights, model and tokenizer (a run, a model, or an imported Hugging "
                            "Face Marian/M2M100/NLLB model) on a corpus (--source/--target or --corpus); no BPE is "
                            "learned (docs/huggingface.md, Fine-tune)")
    train.add_argument("--source-lang", metavar="CODE",
                       help="--init or --resume with an imported M2M100/NLLB tokenizer: the corpus's source language, "
                            "as translate takes it")
    train.add_argument("--target-lang", metavar="CODE",
                       help="--init or --resume with an imported tokenizer that needs it (M2M100/NLLB, a "
                            "multilingual Marian): the corpus's target language")
    train.add_argument("--out", metavar="RUN.safetensors",
                       help="save each run with its training state (and tokenizer); with several backends, the path "
                            "must contain {backend}")
    add_number(train, "--save-every", metavar="N",
               help="also save the run every N steps and at its last, beside --out as RUN-step{N}.safetensors (an "
                    "existing one replaced only with --force)")
    add_number(train, "--keep", metavar="K",
               help="the --save-every checkpoints kept, the latest; older ones this run wrote are removed (default: "
                    f"{KEEP}, or --average's K if more)")
    add_number(train, "--average", metavar="K",
               help="write into --out the element-wise average of the weights of the last K --save-every checkpoints "
                    "(section 6.1 averages the last 5), with the tokenizer and no training state; the final scores "
                    "are the average's")
    train.add_argument("--weights-only", action="store_true",
                       help="save the weights (and tokenizer) without the training state: a model to ship, a third "
                            "of the size, not a run to resume")
    train.add_argument("--plot", metavar="FILE.png", type=image_file, help="the loss curves, backends side by side")
    train.add_argument("--json", action="store_true", help="print the results (with every step's loss and every "
                                                           "validation check) as JSON")
    add_runtime_flags(train)
    add_outputs(train, "plot", inputs=("resume", "init", *CORPUS_FILES))
    train.set_defaults(run=run_train)


KEEP = 5                                            # --keep's default: section 6.1 averages the last 5 checkpoints


def run_train(args: argparse.Namespace) -> int:
    from transformer_cli.commands import train

    task = train.task_name(args)
    chosen = args.backends is None
    args.backends = args.backends or train.default_backends(task)
    _check_snapshot_flags(args)
    outputs = _train_outputs(args)
    plan = train.plan_from(args)
    train.check_average(args.average, args.save_every, plan)
    snapshots = _snapshots(args, outputs, plan)
    if chosen and task != "copy":
        print(f"{PROG} train: --backends {args.backends[0]}, the fastest backend installed here "
              "(docs/training.md)", file=sys.stderr)
    if args.data_parallel > 1 and "jax" in args.backends:
        runtime.jax_host_devices(args.data_parallel)          # read by JAX once, when it starts: before it is imported
    adapters = train.load_adapters(args.backends)
    for adapter in adapters.values():
        backends.device_for(adapter, args.device)           # every backend's device checked before any trains
    results = []
    for name, adapter in adapters.items():
        progress = _progress(name, quiet=args.json or not args.terminal)
        with StopRequest() as stop:                         # Ctrl-C: stop after the current step, then save
            result, model, state = train.train(adapter, plan, progress, lambda: stop.requested, snapshots.get(name))
            if args.average and not result.interrupted:
                model = train.average_run(adapter, plan, snapshots[name], args.average, outputs[name], result)
                saved = f"saved {outputs[name]}: the average of {len(result.averaged)} checkpoints"
                print(f"wrote {outputs[name]}: {name}, the average of the weights at steps "
                      f"{', '.join(path.rsplit('-step', 1)[1].split('.')[0] for path in result.averaged)} "
                      "(and the tokenizer; no training state)", file=sys.stderr)
            else:
                saved = _save_run(adapter, model, None if args.weights_only else state, plan.tokenizer_json,
                                  outputs.get(name), result)
        if stop.requested:
            print(f"{PROG}: interrupted: {name} {saved}", file=sys.stderr)
            return EXIT_INTERRUPTED
        if plan.eval_size:
            scores = train.evaluate(adapter, model, plan, plan.eval_size, progress=progress)
            result.accuracy, result.bleu = scores["exact"], scores.get("bleu")
        results.append(result)
    print(json.dumps([{**r.to_json(), "runtime": runtime.settings()} for r in results], indent=2) if args.json
          else train.format_results(results))
    if args.plot:
        train.plot_losses(results, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return EXIT_OK


def _progress(name: str, quiet: bool) -> Progress:
    """Backend ``name``'s progress bars: its steps (``train``, kept on screen) and its evaluations' batches
    (``validate``, ``evaluate``, erased once done)."""
    return lambda items, what, unit: progress_bar(f"{what} {name}", unit, quiet, leave=what == "train")(items)


def _save_run(adapter: ModuleType, model: Model, state: TrainingState | None, tokenizer: str | None, path: str | None,
              result: Result) -> str:
    """Save one backend's run (``state`` None: its weights only) to ``path``, if any, at its last completed step;
    returns what was done, in words."""
    if path is None or not result.losses:
        return f"stopped at step {result.last_step}; nothing saved ({'no --out' if path is None else 'no step done'})"
    adapter.save(model, path, state, tokenizer)
    if not result.interrupted:
        print(f"wrote {path}: {adapter.NAME}, step {result.last_step}", file=sys.stderr)
    resume = "" if state is None else f" (continue with --resume {path})"
    return f"saved {path} at step {result.last_step}{resume}"


def _train_outputs(args: argparse.Namespace) -> dict[str, str]:
    """Where each backend's run is saved, checked before any work: one path per backend, none replaced
    without --force, never an input (the one exception: ``--resume RUN --out RUN --force``, the run replaced by its
    continuation); nor the ``--save-every`` files beside it."""
    from transformer_cli.commands.train import check_step_files, planned_steps

    if not args.out:
        return {}
    if len(args.backends) > 1 and "{backend}" not in args.out:
        raise ValueError("--out: with several backends the path must contain {backend}, e.g. run-{backend}.safetensors")
    outputs = {name: args.out.replace("{backend}", name) for name in args.backends}
    inputs = declared_inputs(args)
    corpus = [file for name in (*CORPUS_FILES, "init") if (file := getattr(args, name))]
    steps = planned_steps(args) if args.save_every else range(0)
    for path in outputs.values():
        try:
            output_file(path)
        except argparse.ArgumentTypeError as err:
            raise ValueError(f"--out: {err}") from None
        refuse_input(path, corpus, "--out")
        refuse_existing(path, "--out", args.force)     # --resume RUN --out RUN --force: the run's continuation
        check_step_files(path, steps, inputs, args.force)
    return outputs


def _check_snapshot_flags(args: argparse.Namespace) -> None:
    """``--save-every``, ``--keep`` and ``--average`` make sense together, checked before any work."""
    if args.save_every and not args.out:
        raise ValueError("--save-every: the checkpoints are saved beside --out; give --out RUN.safetensors")
    for flag, value in (("--keep", args.keep), ("--average", args.average)):
        if value and not args.save_every:
            raise ValueError(f"{flag} {value}: it works on the checkpoints --save-every N saves; give --save-every")
    if args.average and args.keep and args.average > args.keep:
        raise ValueError(f"--average {args.average}: --keep {args.keep} keeps only the last {args.keep} checkpoints")


def _snapshots(args: argparse.Namespace, outputs: dict[str, str], plan: Plan) -> dict[str, Snapshots]:
    """Each backend's ``--save-every`` checkpoints (:class:`train.Snapshots`); the files they may write are checked
    before any work (:func:`_train_outputs`)."""
    from transformer_cli.commands.train import Snapshots

    if not args.save_every:
        return {}
    return {name: Snapshots(path, args.save_every, args.keep or max(KEEP, args.average or 0), plan.tokenizer_json,
                            args.weights_only) for name, path in outputs.items()}


def add_average(commands: Commands) -> None:
    average = subcommand(commands, "average", "write the element-wise average of checkpoints' weights "
                                              "(section 6.1: the last 5 checkpoints of a run)")
    average.add_argument("out", metavar="OUT", type=output_file, help="the averaged checkpoint to write")
    average.add_argument("checkpoints", metavar="RUN", nargs="+",
                         help="two or more checkpoints of one model (one config), e.g. a run's --save-every files")
    add_outputs(average, "out", inputs=("checkpoints",))
    average.set_defaults(run=run_average)


def run_average(args: argparse.Namespace) -> int:
    """The average of the weights, with the checkpoints' tokenizer; Adam's moments are not averaged (the file
    holds no training state: a model to use or ship, not a run to resume)."""
    from transformer_cli.commands.train import average_checkpoints

    if len(args.checkpoints) < 2:
        raise ValueError("RUN: give two or more checkpoints to average")
    config, params, tokenizer = average_checkpoints(args.checkpoints)
    save_checkpoint(args.out, config, params, tokenizer=tokenizer)
    print(f"wrote {args.out}: the average of {len(args.checkpoints)} checkpoints' weights"
          f"{' and their tokenizer' if tokenizer else ''}; no training state (a model, not a run to resume)")
    return EXIT_OK


def add_import(commands: Commands) -> None:
    hf = subcommand(commands, "import", "write a Hugging Face Marian (opus-mt) or M2M100/NLLB model directory as a "
                                        "shared checkpoint (docs/huggingface.md)")
    hf.add_argument("directory", metavar="DIR", help="the model directory: config.json and model.safetensors (or "
                                                     "pytorch_model.bin, read by torch's weights-only loader, or "
                                                     "the shards of either's index), and "
                                                     "its tokenizer (tokenizer_config.json with Marian's source.spm, "
                                                     "target.spm and vocab.json, M2M100's sentencepiece.bpe.model "
                                                     "and vocab.json, or NLLB's tokenizer.json)")
    hf.add_argument("out", metavar="OUT", type=output_file, help="the shared checkpoint to write")
    add_outputs(hf, "out")      # the files of DIR it reads (config, weights, tokenizer) are refused as OUT by import_hf
    hf.set_defaults(run=run_import)


def run_import(args: argparse.Namespace) -> int:
    from transformer_hf.importer import import_hf

    config = import_hf(args.directory, args.out, args.force)
    print(f"wrote {args.out}: {'pre-LN' if config.norm_first else 'post-LN'}, d_model {config.d_model}, "
          f"{config.n_encoder_layers}+{config.n_decoder_layers} layers, {config.activation}, sinusoid "
          f"{config.sinusoidal_layout}, vocabulary {config.src_vocab_size}"
          f"{'' if config.share_embeddings else '/' + str(config.tgt_vocab_size)}; {describe_tokenizer(args.out)}; "
          f"{describe_decoding(config)}")
    return EXIT_OK


def describe_decoding(config: TransformerConfig) -> str:
    """How ``translate`` searches with an imported checkpoint when given no --beam: as ``generate`` does without
    arguments (its beam, its budget of tokens: ``transformer_hf.generation.generate_budget``, which an import's
    ``max_output_length`` sets), for ``import``'s last line."""
    from transformer_hf.generation import generate_budget

    search = "greedy" if config.decoding.beam_size == 1 else f"beam {config.decoding.beam_size}"
    return f"decoding as generate: {search}, at most {generate_budget(config)} tokens a sentence (docs/huggingface.md)"


def describe_tokenizer(path: str) -> str:
    """What an imported checkpoint's tokenizer is, for ``import``'s last line."""
    from transformer_hf.tokenizers import FamilyTokenizer, load_tokenizer

    tokenizer = load_tokenizer(path)
    if not isinstance(tokenizer, FamilyTokenizer):
        return "no tokenizer (the directory has no tokenizer_config.json)"
    languages = tokenizer.languages
    return f"its {tokenizer.family} tokenizer" + (f", {len(languages)} languages (--source-lang, --target-lang)"
                                                  if languages else "")


def add_translate(commands: Commands) -> None:
    translate = subcommand(commands, "translate", "translate text with a checkpoint that holds a tokenizer (default: "
                                                  "the shipped English-to-French numbers model)")
    translate.add_argument("text", nargs="*", help="sentences to translate, one output line each (default: read "
                                                   "standard input line by line)")
    translate.add_argument("--checkpoint", metavar="PATH", help="a checkpoint with a tokenizer, or a shipped model's "
                                                                "name (default: the shipped model, numbers-en-fr)")
    add_decoding(translate)
    translate.add_argument("--input", metavar="FILE", help="translate this file, one sentence a line (default: the "
                           "sentences given, else standard input: read whole when it is a file, `< FILE`, line by "
                           "line from a terminal or a pipe)")
    translate.add_argument("--output", metavar="FILE", type=output_file,
                           help="write the translations to this file, one line per input line (default: standard "
                                "output)")
    add_runtime_flags(translate)
    add_outputs(translate, "output", inputs=("input", "checkpoint"), default_model="checkpoint")
    translate.set_defaults(run=run_translate)


def add_decoding(parser: argparse.ArgumentParser) -> None:
    """The flags of a command that decodes text (translate, evaluate): backend, decoding, precision, device,
    batch size."""
    parser.add_argument("--backend", choices=tuple(backends.BACKENDS), default="numpy",
                        help="the framework that runs the model (default: numpy, the reference)")
    add_number(parser, "--beam", default=None,
               help=f"beam size; 1 is greedy decoding (default: the checkpoint's beam_size: 1, or an imported "
                    f"model's num_beams), section 6.1 uses {BEAM_SIZE}")
    add_number(parser, "--alpha", default=None,
               help=f"beam search's length penalty alpha (default: the checkpoint's length_penalty: "
                    f"{LENGTH_PENALTY_ALPHA}, section 6.1's, or an imported model's own)")
    add_number(parser, "--max-output-length", metavar="N", default=None,
               help="the output budget of every sentence, eos included (transformers' max_new_tokens; default: the "
                    "checkpoint's max_output_length: an imported model's max_length - 1, else the sentence's length "
                    "+ 50, section 6.1)")
    parser.add_argument("--dtype", choices=PRECISION_NAMES, default="float32",
                        help="the precision the model runs in (default: float32; bfloat16 and float16 by the recipe "
                             "of docs/equivalence.md; mixed-bfloat16 and mixed-float16 by its autocast recipe, each "
                             "framework's own mixed precision)")
    parser.add_argument("--device", type=device_name, default="cpu",
                        help="where the ports run: cpu or gpu:N (default: cpu; the NumPy reference runs on the CPU)")
    add_number(parser, "--batch-size", metavar="N", default=TRANSLATE_BATCH,
               help=f"sentences decoded together, of similar length (default: {TRANSLATE_BATCH})")
    add_number(parser, "--batches-at-once", metavar="N", default=1,
               help="batches decoded at the same time, each on --threads / N of the threads (CTranslate2's "
                    "inter_threads; default: 1, one batch at a time on every thread)")
    add_languages(parser)


def add_languages(parser: argparse.ArgumentParser) -> None:
    """--source-lang and --target-lang: the languages of an imported M2M100/NLLB/mBART-50 (or multilingual Marian)
    model."""
    parser.add_argument("--source-lang", metavar="CODE", help="the source language of an imported M2M100 (en), NLLB "
                        "(eng_Latn) or mBART-50 (en_XX) model: its code starts the source (docs/huggingface.md)")
    parser.add_argument("--target-lang", metavar="CODE", help="the target language of an imported M2M100 (fr), NLLB "
                        "(fra_Latn), mBART-50 (fr_XX) or multilingual Marian model (fr: its >>fr<< token starts the "
                        "source)")


def run_translate(args: argparse.Namespace) -> int:
    """A line that cannot be translated is one line on stderr naming it, an empty output line, and exit status 2
    once the rest is translated; sentences given as arguments are all checked before any is translated."""
    from transformer_cli.commands.train import load_adapters
    from transformer_cli.commands.translate import open_input, read_lines, refuse_stdin_as_output, write_translations
    from transformer_tasks.translation import Translation, translator

    if args.text and args.input:
        raise ValueError("--input: give sentences as arguments or --input FILE, not both")
    if args.output and not (args.text or args.input):
        refuse_stdin_as_output(sys.stdin, args.output)
    source, where, whole = open_input(args.input, sys.stdin)
    with source as stream:
        adapter = load_adapters((args.backend,), "--backend")[args.backend]
        translate = translator(adapter, args.checkpoint, args.dtype, args.beam, args.alpha, args.device,
                               args.batch_size, args.source_lang, args.target_lang, args.max_output_length,
                               args.batches_at_once)
        results: Iterable[Translation]
        if args.text:
            results = map(Translation, translate(args.text))
        elif whole:
            results = translate.lines(list(read_lines(stream)), where,
                                      progress_bar("translate", "batch", quiet=not args.terminal))
        else:
            results = translate.stream(read_lines(stream), where)
        problems = write_translations(results, args.output, sys.stdout,
                                      lambda problem: print(f"{PROG}: error: {problem}", file=sys.stderr))
    return EXIT_USAGE if problems else EXIT_OK


def add_evaluate(commands: Commands) -> None:
    evaluate = subcommand(commands, "evaluate", "translate a test file and score it against its references: sacreBLEU "
                                                "BLEU and chrF with their signatures, exact match, speed")
    evaluate.add_argument("checkpoint", metavar="CHECKPOINT",
                          help="a checkpoint with a tokenizer, or a shipped model's name (numbers-en-fr)")
    evaluate.add_argument("--source", metavar="FILE", required=True, help="the sentences to translate, one a line")
    evaluate.add_argument("--reference", metavar="FILE", required=True,
                          help="their reference translations, line for line")
    add_decoding(evaluate)
    evaluate.add_argument("--json", action="store_true", help="print the scores as one JSON object")
    add_runtime_flags(evaluate)
    evaluate.set_defaults(run=run_evaluate)


def run_evaluate(args: argparse.Namespace) -> int:
    from transformer_cli.commands.evaluate import evaluate, format_evaluation, parallel_lines
    from transformer_cli.commands.train import load_adapters
    from transformer_tasks.translation import translator

    sources, references = parallel_lines(args.source, args.reference)
    adapter = load_adapters((args.backend,), "--backend")[args.backend]
    translate = translator(adapter, args.checkpoint, args.dtype, args.beam, args.alpha, args.device, args.batch_size,
                           args.source_lang, args.target_lang, args.max_output_length, args.batches_at_once)
    result = evaluate(translate, sources, references, f"--source {args.source!r}",
                      progress_bar("evaluate", "batch", quiet=args.json or not args.terminal),
                      checkpoint=args.checkpoint, backend=args.backend, device=args.device, dtype=args.dtype)
    print(json.dumps({**result.to_json(), "runtime": runtime.settings()}, indent=2) if args.json
          else format_evaluation(result))
    return EXIT_OK


COMMANDS = (add_compare, add_bench, add_export, add_plot, add_init, add_train, add_average, add_import, add_translate,
            add_evaluate, side_by_side.add_parser)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog=PROG, epilog=EXIT_STATUS,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     description="The Transformer of 'Attention Is All You Need' in NumPy, PyTorch, "
                                                 "JAX/Flax and TensorFlow/Keras, checked against one reference.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    for add in COMMANDS:
        add(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; returns its exit status (:data:`EXIT_STATUS`)."""
    runtime.quiet()
    try:
        with terminate_as_interrupt():
            args = build_parser().parse_args(argv)
            args.terminal = sys.stderr.isatty()     # progress bars: read before the notices' filter puts a pipe there
            if hasattr(args, "outputs"):
                check_outputs(args)
            if not hasattr(args, "threads"):
                return args.run(args)
            compile_cache.use(not args.no_cache)            # before any framework is imported
            runtime.configure(args.threads)
            with runtime.cache_notices_dropped() if not args.no_cache else contextlib.nullcontext():
                return args.run(args)
    except SystemExit as stop:                          # --help, or a usage error argparse has printed
        return stop.code if isinstance(stop.code, int) else int(stop.code is not None)   # as Python exits with it
    except KeyboardInterrupt:                           # Ctrl-C or SIGTERM
        print(f"{PROG}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (ValueError, OSError) as err:                # a user's mistake: bad value, file or path
        print(f"{PROG}: error: {(str(err) or type(err).__name__).splitlines()[0]}", file=sys.stderr)
        return EXIT_USAGE
    except MemoryError:                                 # flags within their ranges, more than this machine holds
        print(f"{PROG}: error: out of memory: the flags ask for more than this machine holds (lower the batch, "
              "lengths, vocabulary or model)", file=sys.stderr)
        return EXIT_USAGE
    except Exception:  # noqa: BLE001 - anything else is a bug: keep its traceback
        traceback.print_exc()
        print(f"{PROG}: internal error (a bug; the traceback above says where)", file=sys.stderr)
        return EXIT_INTERNAL
