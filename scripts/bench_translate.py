"""Translating a file, side by side in one run: output tokens per second of each backend (float32, ``translate``'s
own ``Translator``: beam search, sentences of similar length decoded together), CTranslate2 and, on a Hugging Face
model, transformers' own ``generate``.

``--model numbers`` (the default): the shipped English-to-French model on the sentences of its test split (812),
beam 4, alpha 0.6; CTranslate2 runs ``Translator.translate_batch`` on the model ``export --to ctranslate2`` writes,
with its BPE vocabulary. The table counts the translations that are the same text as CTranslate2's (its beam search
divides by |Y|^alpha, not by GNMT's penalty, so a few may differ: docs/peers.md).

``--model opus-mt``: a random model of Helsinki-NLP's opus-mt shape (:data:`OPUS_MT`: transformers' ``MarianMTModel``
of a ``MarianConfig``, d_model 512, 6 + 6 layers, 8 heads, FFN 2048, SiLU, 58,101 shared ids, its weights
transformers' own seeded initialisation, pad's embedding zero as in opus-mt's files), saved with ``save_pretrained``
beside a ``MarianTokenizer`` (a SentencePiece model trained on the spot: CTranslate2's converter reads the
vocabulary through it), then imported (``transformer_hf.importer``) for the ports and converted by CTranslate2's
own ``TransformersConverter``. The "file" is seeded source id rows (5 to 30 tokens, eos last; a random model has no
text to read). Every engine decodes with the checkpoint's conventions -- beam 4, |Y|^1 length normalisation, pad
never produced, eos forced at the budget -- and the same budget: the model's ``max_position_embeddings``
(:data:`BUDGET`), the generation config's ``max_length`` less the start token (the imported checkpoint's
``max_output_length``), transformers' ``max_new_tokens`` and CTranslate2's ``max_decoding_length``. A random
model rarely emits eos, so nearly every output is the whole budget: the same work in every engine. The table
counts the outputs that are transformers' tokens;
CTranslate2 forces no eos at the budget (and its beam search stops once 4 hypotheses have finished), so an output
that reaches the budget differs from transformers' in at least its last token. ``--tiny``: a model of the same kind
with d_model 16 and 101 ids whose outputs depend on the sources and end at different lengths (:data:`TINY`), for a
smoke test of seconds (tests/benchmarks/test_bench_translate.py).

On the opus-mt model CTranslate2 also runs as ``ctranslate2-parallel`` (:data:`PARALLEL`): its own way to use T cores
on a file, the whole file in one ``translate_batch`` call, T batches decoded at once, one thread each
(``inter_threads``), where ``ctranslate2`` and the other engines decode one batch at a time on all T threads. The
PyTorch port's way of the same is ``torch-parallel`` (:data:`TORCH_PARALLEL`: ``translate --batches-at-once T``, T
batches decoded at once in threads of their own, one intra-op thread each).

Each engine runs in a process of its own (a fresh import, ``--threads`` intra-op threads in every framework and in
the BLAS libraries' environment variables, ``runtime.blas_threads``), one
after the other under /tmp/bench.lock; ``--threads 1,2`` runs every engine at each count, ``--rounds R`` runs the
whole sequence R times (every other round in reverse order) and pools the warm passes. In each process the first
pass over the sentences is timed apart (JAX and TensorFlow compile each new batch shape there, and so does
``torch-compiled``, the PyTorch backend with ``transformer_torch.compile_decoding``, its decoding step), then
``--repeats`` warm passes; the table gives the first pass, the median warm pass, output tokens per second (every
emitted token, eos included) over the warm median, the spread of the warm passes (min-max), its time as a ratio to
CTranslate2's and to transformers', and the 1-minute load average of the machine when the engine finished (other work
on it slows every engine).

``--profile``: after its timed passes, each port runs one more warm pass under its framework's own profiler (JAX's
and TensorFlow's: XLA's trace of the compiled search's kernels, read with ``jax.profiler.ProfileData``, each kernel
classed by its instruction in XLA's optimised HLO, dumped by the worker; PyTorch's: ``torch.profiler``, each
operator's own CPU time), and a second table splits that pass's seconds by kind of work (:data:`PROFILE_KINDS`):
the matrix products (and what XLA fused into them), top-k and sorting, copies/gathers/transposes, the other kernels
(element-wise maps and reductions: log-softmax, the candidates' scores), and the rest of the pass outside any kernel
(Python, dispatch); with the largest single kernel (the output projection over the vocabulary, on opus-mt) and its
share. Meaningful at one thread (at more, kernels overlap and their seconds add up past the pass's). On the opus-mt
model ``--profile`` also measures the machine's anchors for the job at each thread count, in a process of its own
(:func:`anchors`): one decoding step's matrix products (:func:`step_products`, batch x beam rows, a distinct weight
each) in every framework's fastest kernel for them, and the memory bandwidth; every engine's warm pass, and each
port's profiled products, are then given over the job's steps' products at the fastest kernel's rate ("x bound"):
how far an engine is from what the machine's matrix products allow.

    python scripts/bench_translate.py [--model numbers|opus-mt] [--tiny] [--sentences N] [--batch-size B]
                                      [--threads 1,2] [--repeats 3] [--rounds 1] [--engines ...] [--json FILE]
                                      [--profile]
"""

from __future__ import annotations

import argparse
import collections
import fcntl
import importlib.util
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from equivalence import runtime  # noqa: E402
from reference_numpy.decoding import BEAM_SIZE, LENGTH_PENALTY_ALPHA  # noqa: E402
from transformer_tasks.numbers import NumbersTask, english  # noqa: E402
from transformer_tasks.translation import BATCH_SIZE  # noqa: E402

LOCK = "/tmp/bench.lock"
PEER, HF = "ctranslate2", "transformers"
PARALLEL = "ctranslate2-parallel"   # opus-mt: CTranslate2's own way to use T cores on a file (T batches at once)
COMPILED = "torch-compiled"    # the PyTorch backend's Translator with transformer_torch.compile_decoding
TORCH_PARALLEL = "torch-parallel"   # the PyTorch backend's Translator with T batches at once, one thread each
PORTS = ("torch", COMPILED, TORCH_PARALLEL, "jax", "tf")
ENGINES = (*PORTS, PEER, PARALLEL, HF)
MODELS = {"numbers": (*PORTS, PEER), "opus-mt": ENGINES}     # each model's engines
BUDGET = 32                    # opus-mt: max_position_embeddings, every sentence's output budget
SOURCE_LENGTHS = (5, 30)       # opus-mt: the shortest and longest source rows, eos included
# Helsinki-NLP/opus-mt-*'s config.json (e.g. opus-mt-en-de), but for max_position_embeddings (512 there): BUDGET
OPUS_MT = dict(vocab_size=58101, d_model=512, encoder_layers=6, decoder_layers=6, encoder_attention_heads=8,
               decoder_attention_heads=8, encoder_ffn_dim=2048, decoder_ffn_dim=2048, activation_function="swish",
               scale_embedding=True, static_position_embeddings=True, share_encoder_decoder_embeddings=True,
               max_position_embeddings=BUDGET, pad_token_id=58100, eos_token_id=0, decoder_start_token_id=58100,
               forced_eos_token_id=0)
TINY = {**OPUS_MT, "vocab_size": 101, "d_model": 16, "encoder_layers": 2, "decoder_layers": 2,
        "encoder_attention_heads": 2, "decoder_attention_heads": 2, "encoder_ffn_dim": 32, "decoder_ffn_dim": 32,
        "pad_token_id": 100, "decoder_start_token_id": 100, "max_position_embeddings": 16, "init_std": 0.2}
# --tiny: eos's logit raised (``final_logits_bias``), so that with init_std 0.2 the outputs depend on the sources and
# end at different lengths (the length penalty decides between them): a smoke test that can tell wrong conventions
TINY_EOS_BIAS = 1.5
DEFAULTS = {"numbers": {"sentences": None, "batch_size": BATCH_SIZE}, "opus-mt": {"sentences": 64, "batch_size": 16}}
# --profile: the kinds of work a profiled pass is split into, and how each framework's kernels fall into them
PROFILE_KINDS = ("products", "top-k/sort", "copies", "other kernels", "outside kernels")
XLA_PORTS = ("jax", "tf")                      # ports whose search is one XLA program
XLA_PRODUCTS = {"dot", "convolution"}          # HLO opcodes; a fusion holding one is a product
XLA_COPIES = {"copy", "transpose", "gather", "concatenate", "slice", "dynamic-slice", "dynamic-update-slice",
              "reshape", "bitcast", "parameter"}   # a fusion of these alone moves data
XLA_CONTROL = {"while", "conditional", "call"}     # their kernels are counted, not they
TORCH_PRODUCTS = re.compile(r"aten::(mm|addmm|bmm|baddbmm|_scaled_dot_product\w*|_flash_attention\w*)$|mkldnn|"
                            r"mkl::|extern_kernels")
TORCH_TOP_K = re.compile(r"aten::(topk|sort|argsort)$")
TORCH_COPIES = re.compile(r"aten::(copy_|clone|contiguous|index|index_select|gather|cat|stack|_to_copy)$")
ANCHORS = "anchors"            # --profile: the worker that measures the machine's anchors for the job's step
ANCHOR_MIB = 256               # the bandwidth's read: timing.memory_read of this many MiB
ANCHOR_REPEATS = 5             # each anchor: the best of this many calls after a warm-up


# ----------------------------------------------------------------------------- the inputs


def sentences(count: int | None) -> list[str]:
    """``count`` English sentences of the shipped model's test split (all 812 by default), in a seeded order."""
    numbers = NumbersTask().split.held_out("test")
    count = len(numbers) if count is None else count
    if not 1 <= count <= len(numbers):
        raise SystemExit(f"--sentences: the test split holds {len(numbers)} sentences; {count} were asked for")
    return [english(int(n)) for n in np.random.default_rng(0).permutation(numbers)[:count]]


def source_rows(count: int, sizes: dict) -> list[list[int]]:
    """``count`` seeded source rows of :data:`SOURCE_LENGTHS` tokens (at most the budget): ids other than pad and
    eos, then eos, as MarianTokenizer ends a source."""
    rng = np.random.default_rng(0)
    eos, pad = sizes["eos_token_id"], sizes["pad_token_id"]
    words = np.array([i for i in range(sizes["vocab_size"]) if i not in (eos, pad)])
    longest = min(SOURCE_LENGTHS[1], sizes["max_position_embeddings"])
    lengths = rng.integers(min(SOURCE_LENGTHS[0], longest), longest + 1, size=count)
    return [[*map(int, rng.choice(words, size=length - 1)), eos] for length in lengths]


def by_length(lengths: list[int], batch_size: int) -> list[list[int]]:
    """Indices in batches of ``batch_size``, shortest first (as ``Translator.decode_all`` orders them)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


def save_opus_mt(root: Path, sizes: dict, eos_bias: float = 0.0) -> None:
    """The random opus-mt-shaped model of ``sizes`` (``eos_bias`` added to eos's logit) in ``root``: transformers'
    directory (``hf``), its imported checkpoint (``model.safetensors``) and CTranslate2's conversion (``ct2``)."""
    import sentencepiece
    import torch
    import transformers
    from ctranslate2.converters import TransformersConverter

    from transformer_hf.importer import import_hf

    torch.manual_seed(0)
    model = transformers.MarianMTModel(transformers.MarianConfig(**sizes)).eval()
    pad = sizes["pad_token_id"]
    with torch.no_grad():
        model.model.shared.weight[pad] = 0.0
        model.final_logits_bias[0, sizes["eos_token_id"]] += eos_bias
    model.generation_config.bad_words_ids = [[pad]]                       # as opus-mt's files hold it
    model.generation_config.max_length = sizes["max_position_embeddings"] + 1   # and a budget: the start token + BUDGET
    directory = root / "hf"
    model.save_pretrained(directory)
    del model
    (root / "text.txt").write_text("\n".join(["a b c d e f g h i j k l m n o p"] * 20))
    sentencepiece.SentencePieceTrainer.train(input=str(root / "text.txt"), model_prefix=str(root / "sp"),
                                             vocab_size=20, model_type="unigram", minloglevel=2,
                                             hard_vocab_limit=False)
    vocabulary = {"</s>": 0, "<unk>": 1, **{f"t{i}": i for i in range(2, pad)}, "<pad>": pad}
    (directory / "vocab.json").write_text(json.dumps(vocabulary))
    for name in ("source.spm", "target.spm"):
        shutil.copy(root / "sp.model", directory / name)
    transformers.MarianTokenizer(str(directory / "source.spm"), str(directory / "target.spm"),
                                 str(directory / "vocab.json")).save_pretrained(directory)
    import_hf(directory, root / "model.safetensors")
    TransformersConverter(str(directory)).convert(str(root / "ct2"), force=True)


# ----------------------------------------------------------------------------- the engines


def passes(run, repeats: int) -> tuple[list[float], list]:
    """Seconds of the first call of ``run`` and of ``repeats`` more, and what the last returned."""
    seconds, out = [], []
    for _ in range(1 + repeats):
        start = time.perf_counter()
        out = run()
        seconds.append(time.perf_counter() - start)
    return seconds, out


def port_passes(name: str, checkpoint: Path | None, texts: list[str] | None, rows: list[list[int]] | None,
                args: argparse.Namespace) -> tuple[list[float], int, list]:
    """Seconds of each pass of one backend's ``Translator`` over the sentences (``texts``, encoded by its tokenizer;
    or the source ids ``rows``), output tokens, outputs (texts, or ids without pad) (:data:`COMPILED`: PyTorch's,
    its model given to ``compile_decoding``; :data:`TORCH_PARALLEL`: PyTorch's, T batches at once). The numbers model
    decodes with alpha 0.6, an imported one with its checkpoint's length penalty."""
    from equivalence import backends
    from transformer_tasks.translation import translator

    backend = "torch" if name in (COMPILED, TORCH_PARALLEL) else name
    adapters, _ = backends.load((backend,))
    alpha = LENGTH_PENALTY_ALPHA if checkpoint is None else None
    engine = translator(adapters[backend], checkpoint, "float32", BEAM_SIZE, alpha, "cpu", args.batch_size,
                        batches_at_once=args.threads if name == TORCH_PARALLEL else 1)
    if name == COMPILED:
        from transformer_torch import compile_decoding

        compile_decoding(engine.model)
    sources = [engine.encode(text) for text in texts] if rows is None else rows
    seconds, outputs = passes(lambda: engine.decode_all(sources), args.repeats)
    if args.profile:
        args.profiled = profiled_pass(backend, lambda: engine.decode_all(sources), args.hlo_dump)
    pad_id = engine.tokenizer.config.pad_id
    ids = [[int(token) for token in row if token != pad_id] for row in outputs]
    return seconds, sum(map(len, ids)), [engine.tokenizer.decode(row) for row in ids] if rows is None else ids


def ct2_batches(engine, sources: list[list[str]], options: dict, batch_size: int) -> list[list[str]]:
    """CTranslate2's best hypothesis of every source (token names), decoded ``batch_size`` at a time by length."""
    out: list = [None] * len(sources)
    for batch in by_length([len(source) for source in sources], batch_size):
        for i, result in zip(batch, engine.translate_batch([sources[i] for i in batch], **options)):
            out[i] = result.hypotheses[0]
    return out


def peer_passes(texts: list[str], args: argparse.Namespace) -> tuple[list[float], int, list[str]]:
    """The same for CTranslate2's ``translate_batch`` on the shipped model exported, same batches, same budget."""
    import ctranslate2
    import tokenizers

    from transformer_export.ctranslate2 import save_ctranslate2, translate_options
    from transformer_tasks.translation import load_translator

    config, params, tokenizer = load_translator()
    with tempfile.TemporaryDirectory() as directory:
        path = save_ctranslate2(config, params, Path(directory) / "model", tokenizer=tokenizer.to_json())
        engine = ctranslate2.Translator(str(path), device="cpu", compute_type="float32",
                                        intra_threads=runtime.threads())
    library = tokenizers.Tokenizer.from_str(tokenizer.to_json())
    sources = [library.encode(text, add_special_tokens=False).tokens for text in texts]
    options = translate_options(config.max_len, BEAM_SIZE, LENGTH_PENALTY_ALPHA)
    seconds, pieces = passes(lambda: ct2_batches(engine, sources, options, args.batch_size), args.repeats)
    eos = config.eos_id

    def text(row: list[str]) -> str:
        ids = [library.token_to_id(piece) for piece in row]
        return tokenizer.decode(ids[:ids.index(eos)] if eos in ids else ids)

    return seconds, sum(len(row) for row in pieces), [text(row) for row in pieces]


def opus_mt_peer_passes(root: Path, rows: list[list[int]], args: argparse.Namespace
                        ) -> tuple[list[float], int, list[list[int]]]:
    """CTranslate2 on its own conversion of the opus-mt-shaped model: beam 4, the checkpoint's length penalty,
    :data:`BUDGET` tokens at most, eos allowed from the first step and counted. :data:`PEER` decodes the batches one
    after the other, each on all the threads (``intra_threads``); :data:`PARALLEL` gives the whole file to one
    ``translate_batch`` call with ``max_batch_size`` (CTranslate2 sorts it by length and splits it into the same
    batches) and decodes as many batches at once as there are threads, each on one (``inter_threads``)."""
    import ctranslate2

    vocabulary = json.loads((root / "hf" / "vocab.json").read_text())
    names = {index: name for name, index in vocabulary.items()}
    threads = {"inter_threads": runtime.threads(), "intra_threads": 1} if args.worker == PARALLEL else \
        {"intra_threads": runtime.threads()}
    engine = ctranslate2.Translator(str(root / "ct2"), device="cpu", compute_type="float32", **threads)
    generation = json.loads((root / "hf" / "generation_config.json").read_text())
    options = {"beam_size": BEAM_SIZE, "length_penalty": generation.get("length_penalty", 1.0),
               "max_decoding_length": budget(args), "min_decoding_length": 0, "return_end_token": True}
    sources = [[names[token] for token in row] for row in rows]
    whole_file = lambda: [result.hypotheses[0] for result in                               # noqa: E731
                          engine.translate_batch(sources, max_batch_size=args.batch_size, **options)]
    seconds, pieces = passes(whole_file if args.worker == PARALLEL else
                             lambda: ct2_batches(engine, sources, options, args.batch_size), args.repeats)
    ids = [[vocabulary[piece] for piece in row] for row in pieces]
    return seconds, sum(map(len, ids)), ids


def hf_passes(root: Path, rows: list[list[int]], args: argparse.Namespace) -> tuple[list[float], int, list[list[int]]]:
    """transformers' ``generate`` on the saved directory (its generation config: pad never produced, eos forced at
    the budget, |Y|^1), beam 4, ``max_new_tokens`` :data:`BUDGET`, the same batches; its outputs without the
    decoder start token and pad."""
    import torch
    import transformers

    from reference_numpy.tokenizer import pad_rows

    runtime.apply()
    model = transformers.MarianMTModel.from_pretrained(root / "hf").eval()
    pad = model.config.pad_token_id

    def run() -> list:
        out: list = [None] * len(rows)
        for batch in by_length(list(map(len, rows)), args.batch_size):
            src = torch.as_tensor(pad_rows([rows[i] for i in batch], pad))
            with torch.inference_mode():
                tokens = model.generate(input_ids=src, attention_mask=(src != pad).long(), num_beams=BEAM_SIZE,
                                        do_sample=False, max_new_tokens=budget(args))
            for i, row in zip(batch, tokens[:, 1:].tolist()):
                out[i] = [token for token in row if token != pad]
        return out

    seconds, outputs = passes(run, args.repeats)
    return seconds, sum(map(len, outputs)), outputs


# ----------------------------------------------------------------------------- --profile


def profiled_pass(backend: str, run, hlo_dump: str | None) -> dict:
    """One more pass of ``run`` under the framework's profiler: its seconds, the seconds of each of
    :data:`PROFILE_KINDS` and the largest kernel's name and seconds."""
    if backend == "torch":
        import torch.profiler

        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as profiler:
            (seconds,), _ = passes(run, 0)
        kernels = {f"{event.key} {event.input_shapes}": (torch_kind(event.key), event.self_cpu_time_total / 1e6)
                   for event in profiler.key_averages(group_by_input_shape=True)}
    else:
        with tempfile.TemporaryDirectory() as trace:
            start_trace, stop_trace = xla_tracer(backend)
            start_trace(trace)
            (seconds,), _ = passes(run, 0)
            stop_trace()
            kernels = xla_kernels(trace, hlo_kinds(Path(hlo_dump)))
    kinds = dict.fromkeys(PROFILE_KINDS, 0.0)
    for kind, kernel_seconds in kernels.values():
        kinds[kind] += kernel_seconds
    kinds["outside kernels"] = seconds - sum(kinds.values())
    largest = max(kernels, key=lambda name: kernels[name][1])
    return {"seconds": seconds, "kinds": kinds, "largest": [largest, kernels[largest][1]]}


def xla_tracer(backend: str):
    """The framework's own start and stop of a trace into a directory (an XSpace file, XLA's profile)."""
    if backend == "jax":
        import jax.profiler

        return jax.profiler.start_trace, jax.profiler.stop_trace
    import tensorflow as tf

    return tf.profiler.experimental.start, tf.profiler.experimental.stop


def torch_kind(operator: str) -> str:
    """The kind of work of one PyTorch operator (its own time: a composite's parts are counted apart)."""
    for kind, pattern in (("products", TORCH_PRODUCTS), ("top-k/sort", TORCH_TOP_K), ("copies", TORCH_COPIES)):
        if pattern.search(operator):
            return kind
    return "other kernels"


def hlo_kinds(directory: Path) -> dict[tuple[int, str], tuple[str | None, str]]:
    """(program id, instruction) -> (kind of work, the instruction's name and shape), for every instruction of the
    optimised HLO modules XLA dumped (``--xla_dump_to``, files ``module_<id>.<name>.cpu_after_optimizations.txt``):
    a dot or convolution, or a fusion holding one, is a product; a sort or XLA's TopK call top-k; an instruction (or
    fusion) of nothing but data movement a copy; a while, conditional or call ``None`` (its body's kernels count)."""
    kinds = {}
    for path in directory.glob("module_*.cpu_after_optimizations.txt"):
        program = int(path.name.split(".")[0].removeprefix("module_"))
        computations = hlo_computations(path.read_text())
        for instructions in computations.values():
            for name, (opcode, shape, called, line) in instructions.items():
                kinds[program, name] = (hlo_kind(opcode, called, line, computations), f"{name} {shape}")
    return kinds


def hlo_computations(text: str) -> dict[str, dict[str, tuple[str, str, list[str], str]]]:
    """Each computation of an HLO module's text: instruction name -> (opcode, shape, the computations it calls,
    its line)."""
    computations: dict[str, dict] = {}
    current: dict = {}
    for line in text.splitlines():
        if header := re.match(r"(?:ENTRY )?%(\S+) \(.*\{$", line):
            current = computations.setdefault(header.group(1), {})
        elif instruction := re.match(r"\s+(?:ROOT )?%(\S+) = (.*?[\]})]) ([a-z][\w-]*)\(", line):
            called = re.findall(r"(?:calls|to_apply|body|condition)=%([\w.-]+)", line)
            called += re.findall(r"%([\w.-]+)", "".join(re.findall(r"called_computations=\{([^}]*)\}", line)))
            name, shape, opcode = instruction.groups()
            current[name] = (opcode, re.sub(r"\{[\d,]*\}", "", shape), called, line)
    return computations


def hlo_kind(opcode: str, called: list[str], line: str, computations: dict) -> str | None:
    """The kind of work of one instruction (:func:`hlo_kinds`)."""
    if opcode in XLA_CONTROL:
        return None
    opcodes = {opcode} if opcode != "fusion" else {inner for name in called
                                                   for inner, *_ in computations.get(name, {}).values()}
    if opcodes & XLA_PRODUCTS:
        return "products"
    if "sort" in opcodes or (opcode == "custom-call" and 'custom_call_target="TopK"' in line):
        return "top-k/sort"
    return "copies" if opcodes <= XLA_COPIES else "other kernels"


def xla_kernels(trace: str, kinds: dict[tuple[int, str], tuple[str | None, str]]) -> dict[str, tuple[str, float]]:
    """Seconds of each XLA kernel in the trace (the events carrying an ``hlo_op``), by instruction name and shape,
    with its kind (:func:`hlo_kinds`); control flow left out."""
    import jax.profiler

    (path,) = Path(trace).glob("**/*.xplane.pb")
    seconds: collections.Counter = collections.Counter()
    kind_of: dict[str, str] = {}
    for plane in jax.profiler.ProfileData.from_file(str(path)).planes:
        for line in plane.lines:
            for event in line.events:
                stats = dict(event.stats)
                if "hlo_op" in stats:
                    key = (int(stats["program_id"]), str(stats["hlo_op"]))
                    if key not in kinds:
                        raise SystemExit(f"--profile: XLA's program {key[0]} ({stats.get('hlo_module')}) ran without "
                                         "being compiled here (read from a compilation cache?): its HLO was not dumped")
                    kind, label = kinds[key]
                    if kind is not None:
                        seconds[label] += event.duration_ns / 1e9
                        kind_of[label] = kind
    return {label: (kind_of[label], value) for label, value in seconds.items()}


def sizes_of(args: argparse.Namespace) -> dict:
    return TINY if args.tiny else OPUS_MT


def budget(args: argparse.Namespace) -> int:
    return sizes_of(args)["max_position_embeddings"]


def measure(args: argparse.Namespace) -> dict:
    """The passes of the engine ``args.worker`` at ``args.threads`` threads: seconds, output tokens, outputs (the
    ``anchors`` worker: :func:`anchors`)."""
    if args.worker == ANCHORS:
        return anchors(args)
    runtime.configure(args.threads)
    args.profiled, args.hlo_dump = None, None
    if args.profile and args.worker in XLA_PORTS:       # XLA reads its flags when the framework starts
        args.hlo_dump = tempfile.mkdtemp(prefix="hlo-")
        os.environ["XLA_FLAGS"] += f" --xla_dump_to={args.hlo_dump} --xla_dump_hlo_as_text"
        os.environ["JAX_ENABLE_COMPILATION_CACHE"] = "false"   # a program read back from it is compiled (dumped) never
    try:
        if args.model == "numbers":
            texts = sentences(args.sentences)
            result = (peer_passes(texts, args) if args.worker == PEER
                      else port_passes(args.worker, None, texts, None, args))
        else:
            root, rows = Path(args.workdir), source_rows(args.sentences, sizes_of(args))
            result = (opus_mt_peer_passes(root, rows, args) if args.worker in (PEER, PARALLEL)
                      else hf_passes(root, rows, args) if args.worker == HF
                      else port_passes(args.worker, root / "model.safetensors", None, rows, args))
    finally:
        if args.hlo_dump:
            shutil.rmtree(args.hlo_dump)
    seconds, tokens, outputs = result
    return {"seconds": seconds, "tokens": tokens, "outputs": outputs, "profile": args.profiled}


# ----------------------------------------------------------------------------- --profile: the machine's anchors


def step_products(sizes: dict) -> list[tuple[int, int]]:
    """(in, out) of every matrix product of one cached decoding step of the model of ``sizes``: in each decoder layer
    the self-attention's query, key, value and output projections, the cross-attention's query and output projections
    (its keys and values are the memory's, projected once per batch) and the feed-forward network's two; then the
    output projection over the vocabulary."""
    d, f = sizes["d_model"], sizes["decoder_ffn_dim"]
    return [(d, d)] * 6 * sizes["decoder_layers"] + [(d, f), (f, d)] * sizes["decoder_layers"] + \
        [(d, sizes["vocab_size"])]


def step_kernels(shapes: list[tuple[int, int]], rows: int) -> dict[str, object]:
    """One step's products (``rows`` rows, the weights of ``shapes``: a distinct matrix each, as a step reads them
    from memory) in each installed framework's fastest float32 kernel for them: NumPy's BLAS (OpenBLAS) and
    TensorFlow's ``matmul`` (oneDNN) on weights stored (in, out), the PyTorch port's ``speed.linear`` (oneDNN's inner
    product at the model's sizes) on weights stored (out, in), as they are and packed (``speed.pack_weights``, as the
    port's models are), JAX's ``jit`` (XLA:CPU) of the whole step."""
    rng = np.random.default_rng(0)
    weights = [rng.standard_normal(shape, dtype=np.float32) for shape in shapes]
    inputs = {size: rng.standard_normal((rows, size), dtype=np.float32) for size in {shape[0] for shape in shapes}}
    calls: dict[str, object] = {"NumPy (OpenBLAS)": lambda: [inputs[w.shape[0]] @ w for w in weights]}
    if importlib.util.find_spec("torch"):
        import torch

        from transformer_torch.speed import linear, pack_weights

        pairs = [(torch.from_numpy(inputs[w.shape[0]]), torch.from_numpy(np.ascontiguousarray(w.T))) for w in weights]
        calls["PyTorch (oneDNN)"] = lambda: [linear(x, w) for x, w in pairs]
        packed = pack_weights(torch.nn.ParameterList([torch.nn.Parameter(w, requires_grad=False) for _, w in pairs]))
        calls["PyTorch (oneDNN), packed"] = lambda: [linear(x, w) for (x, _), w in zip(pairs, packed)]
    if importlib.util.find_spec("tensorflow"):
        tf = runtime.import_framework("tensorflow")
        tf_pairs = [(tf.constant(inputs[w.shape[0]]), tf.constant(w)) for w in weights]
        calls["TensorFlow (oneDNN)"] = lambda: [tf.linalg.matmul(x, w) for x, w in tf_pairs][-1].numpy()
    if importlib.util.find_spec("jax"):
        import jax

        xs, ws = [jax.device_put(inputs[w.shape[0]]) for w in weights], [jax.device_put(w) for w in weights]
        step = jax.jit(lambda xs, ws: [x @ w for x, w in zip(xs, ws)])
        calls["JAX (XLA:CPU)"] = lambda: jax.block_until_ready(step(xs, ws))
    return calls


def anchors(args: argparse.Namespace) -> dict:
    """The machine's anchors for one decoding step of the job (``batch_size`` x beam rows), measured in this process
    at ``args.threads`` threads: each kernel's best time of the step's products (:func:`step_kernels`, best of
    ``ANCHOR_REPEATS``) and GFLOP/s, and the memory bandwidth (``timing.memory_read``: a NumPy sgemv over
    :data:`ANCHOR_MIB` MiB, best of as many); the step's FLOPs and the bytes of its weights."""
    from transformer_bench import timing

    runtime.configure(args.threads)
    shapes, rows = step_products(sizes_of(args)), args.batch_size * BEAM_SIZE
    flops = sum(2 * rows * inner * outer for inner, outer in shapes)
    kernels = {name: timing.measure(call, ANCHOR_REPEATS).minimum
               for name, call in step_kernels(shapes, rows).items()}
    read, nbytes = timing.memory_read(ANCHOR_MIB)
    bandwidth = nbytes / timing.measure(read, ANCHOR_REPEATS).minimum / 1e9
    return {"rows": rows, "step_gflop": flops / 1e9, "step_weight_mb": 4 * sum(a * b for a, b in shapes) / 1e6,
            "kernels": {name: {"step_s": seconds, "gflop_per_s": flops / seconds / 1e9}
                        for name, seconds in kernels.items()},
            "bandwidth_gb_per_s": bandwidth}


# ----------------------------------------------------------------------------- the run


def run(engine: str, threads: int, args: argparse.Namespace) -> dict:
    """One engine's passes in a process of its own, and the machine's 1-minute load average when it ended."""
    options = ["--model", args.model, "--batch-size", str(args.batch_size), "--threads", str(threads),
               "--repeats", str(args.repeats), *(["--sentences", str(args.sentences)] if args.sentences else []),
               *(["--tiny"] if args.tiny else []), *(["--workdir", args.workdir] if args.workdir else []),
               *(["--profile"] if args.profile else [])]
    done = subprocess.run([sys.executable, __file__, "--worker", engine, *options], capture_output=True, text=True,
                          env=os.environ | runtime.blas_threads(threads))
    if done.returncode:
        raise SystemExit(f"{engine}: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else 'failed'}")
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "load": os.getloadavg()[0]}


def rounds(engines: list[str], threads: list[int], args: argparse.Namespace) -> dict[tuple[str, int], dict]:
    """Every (engine, threads) run ``--rounds`` times, every other round in reverse order: the first pass of the
    first round, the warm passes of all pooled, the highest load seen."""
    order = [(engine, count) for count in threads for engine in engines]
    results: dict[tuple[str, int], dict] = {}
    for number in range(args.rounds):
        for key in order if number % 2 == 0 else order[::-1]:
            result = run(*key, args)
            print(f"{key[0]}, {key[1]} thread(s): passes {', '.join(f'{s:.2f}' for s in result['seconds'])} s, "
                  f"{result['tokens']} tokens, load {result['load']:.2f}", file=sys.stderr, flush=True)
            if key in results:
                results[key]["seconds"] += result["seconds"][1:]
                results[key]["load"] = max(results[key]["load"], result["load"])
            else:
                results[key] = result
    return results


def report(results: dict[tuple[str, int], dict], machine: dict[int, dict], args: argparse.Namespace) -> list[dict]:
    """One row per engine and thread count: first pass, warm median and spread, tokens/s, its time as a ratio to
    CTranslate2's and to transformers' at the same threads, outputs equal to the reference engine's (transformers'
    if it ran, else CTranslate2's); with the anchors of ``machine`` (threads -> :func:`anchors`), the job's step
    products at the machine's best rate (:func:`products_bound`) and the warm pass (and a profile's products) over
    it (each row carries its thread count's anchors, None without them)."""
    reference = HF if any(engine == HF for engine, _ in results) else PEER
    rows = []
    for (engine, threads), result in results.items():
        warm_passes = result["seconds"][1:]
        warm = statistics.median(warm_passes)
        row = {"engine": engine, "threads": threads, "first_s": result["seconds"][0], "warm_s": warm,
               "warm_min_s": min(warm_passes), "warm_max_s": max(warm_passes), "warm_passes": len(warm_passes),
               "tokens": result["tokens"], "tokens_per_s": result["tokens"] / warm, "load": result["load"],
               "profile": result.get("profile")}
        for name in (PEER, PARALLEL, HF):
            other = results.get((name, threads))
            row[f"x_{name}"] = warm / statistics.median(other["seconds"][1:]) if other else None
        other = results.get((reference, threads))
        row["same_as"] = reference
        row["same"] = sum(a == b for a, b in zip(result["outputs"], other["outputs"])) if other else None
        bound = products_bound(machine.get(threads), result["tokens"], args)
        row["anchors"], row["products_bound_s"] = machine.get(threads), bound
        row["x_products_bound"] = warm / bound if bound else None
        if bound and row["profile"]:
            row["profile"]["x_products_bound"] = row["profile"]["kinds"]["products"] / bound
        rows.append(row)
    return rows


def decoding_steps(args: argparse.Namespace) -> int:
    """The job's decoding steps when every output reaches the budget (the random opus-mt-shaped model's): the
    budget's steps in each batch."""
    return -(-args.sentences // args.batch_size) * budget(args)


def products_bound(machine: dict | None, tokens: int, args: argparse.Namespace) -> float | None:
    """Seconds of the job's decoding steps' matrix products at the machine's best rate for them (the fastest kernel
    of ``machine``'s anchors, times :func:`decoding_steps`): ``None`` without anchors, or unless every batch is full
    and every output reaches the budget (then each of the steps has the anchors' rows)."""
    if machine is None or args.sentences % args.batch_size or tokens != args.sentences * budget(args):
        return None
    return decoding_steps(args) * min(kernel["step_s"] for kernel in machine["kernels"].values())


def print_table(rows: list[dict], machine: dict[int, dict], count: int, args: argparse.Namespace) -> None:
    model = f"opus-mt-shaped ({'tiny' if args.tiny else 'random'}) model, budget {budget(args)} tokens" \
        if args.model == "opus-mt" else "numbers model"
    print(f"{count} sentences, {model}, beam {BEAM_SIZE}, batches of {args.batch_size} by length, "
          f"median of {args.repeats * args.rounds} warm passes (spread: their min-max)")
    print(f"{'engine':<20} {'threads':>7} {'first pass':>11} {'warm':>9} {'spread':>13} {'tokens':>7} {'tokens/s':>9} "
          f"{'x CT2':>6} {'x CT2 par':>9} {'x HF':>6} {'x bound':>7} {'same as ' + rows[0]['same_as']:>21} {'load':>5}")
    ratio = lambda value: " " * 6 if value is None else f"{value:>6.2f}"                 # noqa: E731
    for row in rows:
        same = "" if row["same"] is None else f"{row['same']}/{count}"
        spread = f"{row['warm_min_s']:.2f}-{row['warm_max_s']:.2f}s"
        print(f"{row['engine']:<20} {row['threads']:>7} {row['first_s']:>10.2f}s {row['warm_s']:>8.2f}s {spread:>13} "
              f"{row['tokens']:>7} {row['tokens_per_s']:>9.0f} {ratio(row['x_ctranslate2'])} "
              f"{ratio(row[f'x_{PARALLEL}']):>9} {ratio(row['x_transformers'])} {ratio(row['x_products_bound']):>7} "
              f"{same:>21} {row['load']:>5.2f}")
    for threads, anchor in machine.items():
        print(f"\nthe machine at {threads} thread(s), one decoding step's matrix products ({anchor['rows']} rows, "
              f"{anchor['step_gflop']:.2f} GFLOP, {anchor['step_weight_mb']:.0f} MB of weights):")
        for name, kernel in anchor["kernels"].items():
            print(f"  {name:<22} {kernel['step_s'] * 1e3:>8.1f} ms {kernel['gflop_per_s']:>6.0f} GFLOP/s")
        print(f"  memory bandwidth {anchor['bandwidth_gb_per_s']:.1f} GB/s: the step's weights read in "
              f"{anchor['step_weight_mb'] / anchor['bandwidth_gb_per_s']:.1f} ms")
        bound = next(row["products_bound_s"] for row in rows if row["threads"] == threads)
        print(f"  x bound: a warm pass over its {decoding_steps(args)} steps' products at the fastest kernel's rate, "
              + (f"{bound:.2f} s" if bound else "not given (a partial batch, or outputs short of the budget)"))
    profiled = [row for row in rows if row["profile"]]
    if profiled:
        print("\none profiled warm pass of each port, seconds by kind of work (share of the pass); products / bound: "
              "its products over the steps' products at the machine's fastest rate")
        print(f"{'engine':<15} {'threads':>7} {'pass':>8} " + " ".join(f"{kind:>15}" for kind in PROFILE_KINDS)
              + f" {'products/bound':>14}  largest kernel")
    for row in profiled:
        profile = row["profile"]
        share = lambda seconds: f"{seconds:.2f} ({seconds / profile['seconds']:.0%})"      # noqa: E731
        kinds = " ".join(f"{share(seconds):>15}" for seconds in profile["kinds"].values())
        name, seconds = profile["largest"]
        print(f"{row['engine']:<15} {row['threads']:>7} {profile['seconds']:>7.2f}s {kinds} "
              f"{ratio(profile.get('x_products_bound')):>14}  {name}: {share(seconds)}")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=list(MODELS), default="numbers")
    parser.add_argument("--tiny", action="store_true", help="opus-mt: a tiny model of the same kind (a smoke test)")
    parser.add_argument("--sentences", type=int, help="numbers: how many of the test split's sentences (default: "
                                                      "all 812); opus-mt: how many source rows (default 64)")
    parser.add_argument("--batch-size", type=int, help="default: 64 (numbers), 16 (opus-mt)")
    parser.add_argument("--threads", default="1", help="intra-op threads, or a comma-separated list of counts")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--engines", help="comma-separated; default: every engine of the model")
    parser.add_argument("--json", help="also write the rows as JSON to this file")
    parser.add_argument("--profile", action="store_true",
                        help="one more warm pass of each port under its framework's profiler, split by kind of work")
    parser.add_argument("--worker", choices=(*ENGINES, ANCHORS), help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name, value in DEFAULTS[args.model].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.tiny and args.model != "opus-mt":
        parser.error("--tiny: only with --model opus-mt")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.worker:
        args.threads = int(args.threads)
        print(json.dumps(measure(args)))
        return
    engines = args.engines.split(",") if args.engines else list(MODELS[args.model])
    unknown = sorted(set(engines) - set(MODELS[args.model]))
    if unknown:
        raise SystemExit(f"--engines: unknown {unknown} for --model {args.model}; choose from "
                         f"{list(MODELS[args.model])}")
    threads = [int(count) for count in args.threads.split(",")]
    with open(LOCK, "w") as lock, tempfile.TemporaryDirectory() as workdir:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if args.model == "opus-mt":
            args.workdir = workdir
            save_opus_mt(Path(workdir), sizes_of(args), TINY_EOS_BIAS if args.tiny else 0.0)
        results = rounds(engines, threads, args)
        machine = {count: run(ANCHORS, count, args) for count in threads} \
            if args.profile and args.model == "opus-mt" else {}
        rows = report(results, machine, args)
    count = args.sentences or len(sentences(None))
    print_table(rows, machine, count, args)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
