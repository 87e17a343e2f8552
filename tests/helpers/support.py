"""What more than one test module uses, in one place (``from support import ...``; no test module imports another):
the ports and devices of the agreement matrix, a command run in-process, a scripted stand-in for a Transformer,
each framework's arrays and float64 context, a hand-set model whose logits are known, the ten training steps of
tests/equivalence/test_training.py, the shipped model on held-out sentences, tiny random Hugging Face Marian and M2M100
models beside the reference (tests/families/test_hf_import.py, tests/families/test_hf_export.py,
tests/families/test_hf_generate.py). Fixtures stay in ``conftest.py``."""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import json
import random
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from equivalence import cases
from equivalence.cases import FORWARD_VARIANTS, VARIANTS, training_inputs
from equivalence.training_runs import Run
from reference_numpy import TransformerConfig, init_params
from reference_numpy.checkpoint import FORMAT_VERSION, MOMENTS, TrainingState, parameter_shapes
from reference_numpy.config import TrainingConfig
from reference_numpy.model import causal_mask, sinusoidal_positional_encoding
from transformer_hf.importer import import_hf
from transformer_tasks.numbers import NumbersTask, teacher_forcing
from transformer_tasks.translation import load_translator

FRAMEWORKS = {"torch": "torch", "jax": "jax", "tf": "tensorflow"}
BACKENDS = ("numpy", *FRAMEWORKS)      # the reference and the ports, as the command line names them
LOW_DTYPES = ("bfloat16", "float16")   # their components: test_agreement_low_precision.py
DEVICE_KINDS = ("cpu", "gpu")


def script(name: str):
    """``scripts/<name>.py`` loaded as a module (the scripts are files to run, not a package), registered in
    ``sys.modules`` as its name while it runs (a dataclass of the script looks its module up there)."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[2] / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def require(module: str, extra: str):
    """``module``, or the test skipped: it is not installed (the project's ``extra`` installs it)."""
    return pytest.importorskip(module, reason=f"{module} is not installed (pip install '.[{extra}]')")


def port_backend(port: str):
    framework = FRAMEWORKS[port]
    pytest.importorskip(framework, reason=f"{framework} is not installed (pip install '.[{port}]')")
    return importlib.import_module(f"equivalence.backends.{port}")


def device_for(backend, kind: str) -> str:
    if kind == "cpu":
        return "cpu"
    accelerators = [device for device in backend.devices() if device != "cpu"]
    if not accelerators:
        pytest.skip(f"no GPU visible to {backend.NAME}: GPU agreement needs an accelerator")
    return accelerators[0]


@functools.cache
def port_model(port: str, variant: str, dtype: str, device: str, params: str = "seeded"):
    config = FORWARD_VARIANTS[variant]
    return port_backend(port).build(config, cases.PARAMS[params](config), dtype, device)


def checkpoint_with(path, **metadata: str):
    """A tiny model's checkpoint with Adam's moments and these metadata fields (records as JSON text)."""
    config = TransformerConfig.preset("tiny")
    params = init_params(config, dtype=np.float32)
    moments = {prefix + name: np.zeros_like(value) for prefix in MOMENTS for name, value in params.items()}
    save_file({**params, **moments}, str(path), {"format_version": FORMAT_VERSION, "config": config.to_json(),
                                                 **metadata})
    return path


class ScriptedModel:
    """Stands in for a Transformer: the next-token log-probabilities are a function of the
    generated prefix only (``script(prefix) -> (V,)`` probabilities)."""

    def __init__(self, script, max_len=64, vocab=5):
        self.config = TransformerConfig(src_vocab_size=vocab, tgt_vocab_size=vocab, d_model=2, n_heads=1, d_ff=2,
                                        n_encoder_layers=1, n_decoder_layers=1, max_len=max_len)
        self.dtype = np.dtype(np.float64)
        self.script = script

    def encode(self, src, src_mask=None):
        return np.zeros((len(src), np.shape(src)[1], 1))

    def decode(self, tgt, memory, src_mask=None, tgt_mask=None):
        return np.asarray(tgt)[:, None, :].repeat(np.shape(tgt)[1], axis=1)     # (B, T, T): the prefix

    def generator(self, hidden):
        with np.errstate(divide="ignore"):                                    # log(0) = -inf: impossible tokens
            rows = [np.log(self.script(tuple(int(t) for t in prefix[1:]))) for prefix in hidden[:, -1]]
        return np.stack(rows)[:, None, :]


def adam_moment_memory(port: str, model, optimizer) -> dict[str, tuple[int, int]]:
    """Checkpoint name -> the addresses of the memory holding Adam's m and v of that tensor in the port's optimizer."""
    checkpoint = importlib.import_module(f"transformer_{port}.checkpoint")
    table = checkpoint.name_table(model.config)
    if port == "torch":
        parameters = dict(model.named_parameters())
        slots = {name: optimizer.adam.state[parameters[path]] for name, path in table.items()}
        return {name: (slot["exp_avg"].data_ptr(), slot["exp_avg_sq"].data_ptr()) for name, slot in slots.items()}
    if port == "jax":
        import optax
        from flax import nnx
        adam = optax.tree.get(nnx.as_pure(optimizer.adam.opt_state), "ScaleByAdamState")
        mu, nu = ({".".join(map(str, keys)): value for keys, value in nnx.to_flat_state(moments)}
                  for moments in (adam.mu, adam.nu))
        return {name: (mu[path].unsafe_buffer_pointer(), nu[path].unsafe_buffer_pointer())
                for name, path in table.items()}
    variables = checkpoint._variables(model)
    return {name: tuple(slot.value.value()._numpy().ctypes.data for slot in optimizer.adam.moments(variable))
            for name, variable in variables.items()}


def framework_array(name: str, x: np.ndarray):
    """``x`` as an array of the backend ``name`` ("numpy" or a port; its dtype kept): a tensor of PyTorch, an array
    of JAX (float64 under :func:`float64_inference`), a constant of TensorFlow."""
    if name == "numpy":
        return np.asarray(x)
    module = importlib.import_module(FRAMEWORKS[name])
    if name == "torch":
        return module.as_tensor(x)
    return module.numpy.asarray(x) if name == "jax" else module.constant(x)


def float64_inference(name: str):
    """The backend's context for float64 inference: torch without gradients, JAX with x64 on, nothing else."""
    if name == "torch":
        return importlib.import_module("torch").no_grad()
    return importlib.import_module("jax").enable_x64(True) if name == "jax" else contextlib.nullcontext()


def constant_logits_params(logits, **changes) -> tuple[TransformerConfig, dict[str, np.ndarray]]:
    """A tiny post-LN model, one layer per stack (``changes`` override more of its config, e.g. ``max_len``), whose
    next-token logits are exactly ``logits`` at every position, in every framework and dtype: the decoder's last
    LayerNorm has gain 0 and bias e_0, so it outputs e_0 whatever its input, and row 0 of the output projection holds
    ``logits`` (products by 1 and 0 are exact in any summation order). Returns its config and weights."""
    config = TransformerConfig.preset("tiny", tgt_vocab_size=len(logits), n_encoder_layers=1, n_decoder_layers=1,
                                      **changes)
    params = init_params(config, seed=0, perturb=0.1)
    last_norm = f"decoder.layers.{config.n_decoder_layers - 1}.ffn_norm"
    params[f"{last_norm}.weight"] = np.zeros(config.d_model)
    params[f"{last_norm}.bias"] = np.eye(config.d_model)[0]
    params["generator.weight"] = np.zeros((config.d_model, len(logits)))
    params["generator.weight"][0] = logits
    return config, params


# ----------------------------------------------------------------------------- ten training steps

STEPS = 10
# The paper's schedule and Adam (section 5.3); with warmup_steps = 4000 the first steps' learning rates are small
# (about 7e-6 for d_model = 16), so that the weights' drift between backends stays second order (TrainingBound).
TRAINING = TrainingConfig()


def backend(name: str):
    """The command line's backend ``name``: "numpy" (the reference) or a port (skipped if not installed)."""
    return importlib.import_module("equivalence.backends.numpy") if name == "numpy" else port_backend(name)


def config_of(variant: str):
    return VARIANTS[variant].replace(dropout=0.0)


def batches(variant: str) -> list[dict[str, np.ndarray]]:
    """A different ragged batch for every step."""
    return [training_inputs(config_of(variant), seed=step) for step in range(STEPS)]


def copied(losses: list[float], params: dict[str, np.ndarray], state: TrainingState) -> Run:
    """A run's record that the steps after it leave as it is (a port may export views of its live tensors)."""
    owned = lambda tensors: {tensor: np.array(value) for tensor, value in tensors.items()}   # noqa: E731
    return Run(list(losses), owned(params), state._replace(first_moments=owned(state.first_moments),
                                                           second_moments=owned(state.second_moments)))


# ----------------------------------------------------------------------------- the shipped model

TRAINED_SENTENCES = 16   # from the numbers task's test split: numbers the model never saw in training


@functools.cache
def trained():
    """The shipped English-to-French numbers model (realistic weights: sharp attention, larger activations) and
    a sample of its test split: config, float64 params, tokenizer, inputs (src, tgt = the French references,
    teacher-forced)."""
    config, params, tokenizer = load_translator()
    src, references = NumbersTask(tokenizer).held_out(config, TRAINED_SENTENCES, "test", 0)
    inputs = teacher_forcing(tokenizer, [tokenizer.decode(row) for row in src], references)
    return config, params, tokenizer, {"src": inputs["src"], "tgt": inputs["tgt"]}


# ----------------------------------------------------------------------------- Hugging Face's families

# Every size different, so that a transposed or swapped tensor fails on its shape or its values
MARIAN = dict(vocab_size=29, d_model=16, encoder_layers=2, decoder_layers=3, encoder_attention_heads=4,
              decoder_attention_heads=4, encoder_ffn_dim=24, decoder_ffn_dim=24, max_position_embeddings=40,
              activation_function="swish", scale_embedding=True, pad_token_id=28, eos_token_id=0,
              decoder_start_token_id=28, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
M2M100 = dict(vocab_size=31, d_model=16, encoder_layers=2, decoder_layers=3, encoder_attention_heads=4,
              decoder_attention_heads=4, encoder_ffn_dim=24, decoder_ffn_dim=24, max_position_embeddings=40,
              activation_function="gelu", scale_embedding=True, pad_token_id=1, bos_token_id=0, eos_token_id=2,
              decoder_start_token_id=2, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
              encoder_layerdrop=0.0, decoder_layerdrop=0.0)
# google/pegasus-xsum's choices (ReLU, scaled embeddings, pad 0, eos 1, decoding from pad), the sizes shrunk
PEGASUS = dict(vocab_size=37, d_model=16, encoder_layers=2, decoder_layers=3, encoder_attention_heads=4,
               decoder_attention_heads=4, encoder_ffn_dim=24, decoder_ffn_dim=24, max_position_embeddings=40,
               activation_function="relu", scale_embedding=True, pad_token_id=0, eos_token_id=1,
               decoder_start_token_id=0, forced_eos_token_id=1, dropout=0.0, attention_dropout=0.0,
               activation_dropout=0.0, encoder_layerdrop=0.0, decoder_layerdrop=0.0)
# facebook/bart-large-cnn's choices (GELU, unscaled embeddings, bos 0, pad 1, eos 2, decoding from eos), the sizes
# shrunk
BART = dict(vocab_size=41, d_model=16, encoder_layers=2, decoder_layers=3, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=24, decoder_ffn_dim=24, max_position_embeddings=40,
            activation_function="gelu", scale_embedding=False, pad_token_id=1, bos_token_id=0, eos_token_id=2,
            decoder_start_token_id=2, forced_bos_token_id=0, forced_eos_token_id=2, dropout=0.0,
            attention_dropout=0.0, activation_dropout=0.0, encoder_layerdrop=0.0, decoder_layerdrop=0.0)
# facebook/mbart-large-50-many-to-many-mmt's choices (ReLU, scaled embeddings, bos 0, pad 1, eos 2, decoding from
# eos), the sizes shrunk
MBART = dict(vocab_size=43, d_model=16, encoder_layers=2, decoder_layers=3, encoder_attention_heads=4,
             decoder_attention_heads=4, encoder_ffn_dim=24, decoder_ffn_dim=24, max_position_embeddings=40,
             activation_function="relu", scale_embedding=True, pad_token_id=1, bos_token_id=0, eos_token_id=2,
             decoder_start_token_id=2, forced_eos_token_id=2, dropout=0.0, attention_dropout=0.0,
             activation_dropout=0.0, encoder_layerdrop=0.0, decoder_layerdrop=0.0)
FAMILIES = {"marian": ("MarianConfig", "MarianMTModel", MARIAN),
            "m2m_100": ("M2M100Config", "M2M100ForConditionalGeneration", M2M100),
            "pegasus": ("PegasusConfig", "PegasusForConditionalGeneration", PEGASUS),
            "bart": ("BartConfig", "BartForConditionalGeneration", BART),
            "mbart": ("MBartConfig", "MBartForConditionalGeneration", MBART)}
# The families whose position tables are trained (read from the file, random in the tiny models)
LEARNED_FAMILIES = ("bart", "mbart")
# The families whose sinusoid is Marian's halves table at positions 0, 1, ... (transformers' ``weight`` buffer)
HALVES_FAMILIES = ("marian", "pegasus")


# The checkpoints the Hugging Face export writes (tests/families/test_hf_export.py, the export command's tests): the
# paper's model and each family's choices, every size different, so that a transposed or swapped tensor fails on its
# shape or its values
PAPER = TransformerConfig(src_vocab_size=29, tgt_vocab_size=29, d_model=16, n_heads=4, d_ff=24, n_encoder_layers=2,
                          n_decoder_layers=3, dropout=0.0, layer_norm_eps=1e-5, max_len=40)
EXPORTED = {
    "paper": PAPER,
    # bos (3) not the lowest id beside pad and eos: the import must read it from decoder_start_token_id
    "marian": PAPER.replace(sinusoidal_layout="halves", activation="silu", output_bias=True, share_embeddings=False,
                            tgt_vocab_size=33, pad_id=5, bos_id=3, eos_id=0),
    # a budget of its own: generation_config.json's max_length 10 (9 tokens after the start token)
    "m2m_100": PAPER.replace(norm_first=True, sinusoidal_layout="fairseq", activation="gelu", scale_embeddings=False,
                             pad_id=1, bos_id=0, eos_id=2).with_decoding(max_output_length=9),
    # the paper's model pre-LN, its interleaved table permuted to the halves layout: Pegasus
    "pre_ln": PAPER.replace(norm_first=True),
    # pre-LN with the halves table and a logits bias: Pegasus
    "pegasus": PAPER.replace(norm_first=True, sinusoidal_layout="halves", output_bias=True, pad_id=0, bos_id=2,
                             eos_id=1),
    # post-LN with learned positions from row 2, the embedding LayerNorm and a logits bias: BART
    "bart": PAPER.replace(positional_encoding="learned", position_offset=2, embedding_norm=True, activation="gelu",
                          scale_embeddings=False, output_bias=True, pad_id=1, bos_id=0, eos_id=2),
    # pre-LN with learned positions from row 2, the embedding LayerNorm, final norms and a logits bias: mBART
    "mbart": PAPER.replace(norm_first=True, positional_encoding="learned", position_offset=2, embedding_norm=True,
                           activation="relu", output_bias=True, pad_id=1, bos_id=0, eos_id=2),
    # separate embeddings of one vocabulary: M2M100's tie_word_embeddings false
    "m2m_100-untied": PAPER.replace(norm_first=True, sinusoidal_layout="fairseq", activation="relu",
                                    share_embeddings=False, pad_id=1, bos_id=0, eos_id=2),
}
EXPORTED_FAMILY = {"paper": "marian", "marian": "marian", "m2m_100": "m2m_100", "m2m_100-untied": "m2m_100",
                   "pre_ln": "pegasus", "pegasus": "pegasus", "bart": "bart", "mbart": "mbart"}


def random_params(config: TransformerConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Every tensor random (LayerNorms and biases too), float32."""
    rng = np.random.default_rng(seed)
    return {name: (rng.standard_normal(shape) * 0.5).astype(np.float32)
            for name, shape in parameter_shapes(config).items()}


def imported_family(family: str, root: Path) -> tuple:
    """:func:`build`'s model of ``family`` saved with save_pretrained in a directory of ``root`` and imported beside
    it: (family, transformers' model, its directory, the imported checkpoint)."""
    model = build(family)
    directory, out = root / family, root / f"{family}.safetensors"
    model.save_pretrained(directory)
    import_hf(directory, out)
    return family, model, directory, out


def build(family: str, seed: int = 0, **changes):
    """A transformers model of the family with every parameter and buffer random (LayerNorms and biases included,
    which transformers initialises to constants; Marian's ``final_logits_bias`` nonzero), in eval mode."""
    torch, transformers = importlib.import_module("torch"), importlib.import_module("transformers")
    config_name, model_name, sizes = FAMILIES[family]
    model = getattr(transformers, model_name)(getattr(transformers, config_name)(**{**sizes, **changes})).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if "embed_positions" not in name or family in LEARNED_FAMILIES:
                tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.5)
    return model


def hf_log_probs(model, src, tgt, pad_id: int) -> np.ndarray:
    """A transformers seq2seq model's log-probabilities of ``tgt`` (the decoder's input) given ``src``."""
    import torch

    with torch.no_grad():
        logits = model(input_ids=torch.as_tensor(src), attention_mask=torch.as_tensor(src != pad_id).long(),
                       decoder_input_ids=torch.as_tensor(tgt)).logits
    return torch.log_softmax(logits, dim=-1).numpy()


def masks(config, src, tgt):
    """transformers' masks as the reference takes them: the source's padding, the target's causal mask alone."""
    causal = np.repeat(causal_mask(tgt.shape[1]).reshape(1, 1, tgt.shape[1], tgt.shape[1]), len(tgt), axis=0)
    return (src != config.pad_id)[:, None, None, :], causal


def position_tables(family: str, model):
    """transformers' sinusoid tables (encoder, decoder) as float64 arrays, and where each lives (none for a family
    of learned positions)."""
    if family in LEARNED_FAMILIES:
        return []
    if family in HALVES_FAMILIES:
        modules = [model.model.encoder.embed_positions, model.model.decoder.embed_positions]
        return [(module, "weight", module.weight.detach().double().numpy()) for module in modules]
    modules = [model.model.encoder.embed_positions, model.model.decoder.embed_positions]
    return [(module, "weights", module.weights.detach().double().numpy()) for module in modules]


def reference_table(family: str, config, rows: int) -> tuple[np.ndarray, slice]:
    """The reference's float64 table laid out as transformers' table of ``rows`` rows, and the rows transformers
    reads. Marian: row p is position p. Fairseq: transformers' row pad_id + k is the reference's row k (row pad_id
    the zeros a pad token reads); its rows below pad_id are never read (positions start at pad_id)."""
    if family in HALVES_FAMILIES:
        return sinusoidal_positional_encoding(rows, config.d_model, layout="halves"), slice(0, rows)
    table = sinusoidal_positional_encoding(rows - config.pad_id - 1, config.d_model, layout="fairseq",
                                           pad_id=config.pad_id)
    return np.concatenate([np.zeros((config.pad_id, config.d_model)), table]), slice(config.pad_id, rows)


def exact_tables(family: str, model, config) -> None:
    """Set transformers' sinusoid buffers to the reference's float64 table (checked above against transformers'
    own within its float32 rounding in tests/families/test_hf_import.py), so that the rest of a comparison is float64
    arithmetic alone."""
    import torch

    for module, attribute, table in position_tables(family, model):
        exact, read = reference_table(family, config, len(table))
        exact[:read.start] = table[:read.start]                    # rows never read: transformers' own
        getattr(module, attribute).data = torch.as_tensor(exact, dtype=torch.float64)


# ----------------------------------------------------------------------- tiny Hugging Face models and tokenizers

# Parallel sentences the tiny SentencePiece models are trained on (and fine-tuned with)
SOURCE = ["the cat sat on the mat", "a dog ran in the park", "hello world, how are you?", "numbers 12 and 345",
          "Ünïcödé façade naïve", "the quick brown fox jumps over the lazy dog", "she sells sea shells"]
TARGET = ["le chat est assis sur le tapis", "un chien a couru dans le parc", "bonjour le monde, comment ça va ?",
          "les nombres 12 et 345", "l'été à Noël", "le renard brun saute", "elle vend des coquillages"]

# Texts a tokenizer meets: white space alone, unicode, characters the tiny models never saw, special tokens typed
TEXTS = ["the cat", "Hello   World!", "", "   ", "\t\n", "Жук ел", "naïve façade", "a\tb\nc", "ｆｕｌｌ ｗｉｄｔｈ",
         " leading", "trailing  ", "12 345 67", "l'été à Noël", "ça va ?", "x</s>y", "<unk> <pad>", "日本語", "🙂 ok"]
ALPHABET = "abcdefghijklmnopqrstuvwxyz  ,.?'çéÜ12Ж\t日"


def random_texts(seed: int, count: int = 200) -> list[str]:
    """``count`` texts of up to 30 characters drawn from ALPHABET."""
    rng = random.Random(seed)
    return ["".join(rng.choice(ALPHABET) for _ in range(rng.randrange(30))) for _ in range(count)]


def train_spm(texts: list[str], prefix: Path, model_type: str, size: int) -> Path:
    """A SentencePiece model of ``model_type`` trained on ``texts`` (the trainer of the sentencepiece package)."""
    spm = importlib.import_module("sentencepiece")
    spm.SentencePieceTrainer.train(sentence_iterator=iter(texts), model_prefix=str(prefix), vocab_size=size,
                                   model_type=model_type, character_coverage=1.0, minloglevel=2,
                                   hard_vocab_limit=False)
    return prefix.with_suffix(".model")


def pieces_of(model: Path) -> list[str]:
    processor = importlib.import_module("sentencepiece").SentencePieceProcessor(model_file=str(model))
    return [processor.id_to_piece(i) for i in range(processor.get_piece_size())]


def tiny_marian(root: Path) -> dict:
    """A tiny random MarianMTModel with its MarianTokenizer (unigram source.spm and target.spm, a shared vocab.json
    with </s> 0, <unk> 1, <pad> last), saved with save_pretrained in ``root``, and its imported checkpoint."""
    torch, transformers = importlib.import_module("torch"), importlib.import_module("transformers")
    source = train_spm(SOURCE * 3, root / "src", "unigram", 60)
    target = train_spm(TARGET * 3, root / "tgt", "unigram", 60)
    vocab = {"</s>": 0, "<unk>": 1}
    for piece in pieces_of(source) + pieces_of(target):
        if piece not in vocab and piece not in ("<s>", "</s>", "<unk>"):
            vocab[piece] = len(vocab)
    vocab["<pad>"] = len(vocab)
    (root / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")                       # "Recommended: pip install sacremoses."
        tokenizer = transformers.MarianTokenizer(str(source), str(target), str(root / "vocab.json"))
    directory = root / "tiny-marian"
    torch.manual_seed(0)
    model = transformers.MarianMTModel(transformers.MarianConfig(
        vocab_size=len(vocab), d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=24, decoder_ffn_dim=24, max_position_embeddings=64,
        pad_token_id=vocab["<pad>"], eos_token_id=0, decoder_start_token_id=vocab["<pad>"]))
    out = root / "tiny-marian.safetensors"
    oracle = saved_marian(model, tokenizer, directory, out)
    return {"directory": directory, "checkpoint": out, "oracle": oracle, "vocab": vocab, "root": root}


def saved_marian(model, tokenizer, directory: Path, out: Path):
    """``model`` and its MarianTokenizer saved with save_pretrained in ``directory``, imported as ``out``; returns
    transformers' tokenizer read back from the directory (``split_special_tokens``, as the project tokenizes)."""
    transformers = importlib.import_module("transformers")
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")                       # "Recommended: pip install sacremoses."
        oracle = transformers.MarianTokenizer.from_pretrained(directory, split_special_tokens=True)
    import_hf(directory, out)
    return oracle


def tiny_separate_marian(root: Path) -> dict:
    """A tiny random MarianMTModel with separate vocabularies (``share_encoder_decoder_embeddings`` false): a
    MarianTokenizer with ``separate_vocabs`` (vocab.json of the source model's pieces, target_vocab.json of the
    target's, of another size; </s> 0, <unk> 1, <pad> 2 in both, the model's one pad id), saved with save_pretrained
    in ``root``, and its imported checkpoint."""
    torch, transformers = importlib.import_module("torch"), importlib.import_module("transformers")
    vocabs = []
    for name, texts in (("src", SOURCE), ("tgt", TARGET)):
        vocab = {"</s>": 0, "<unk>": 1, "<pad>": 2}
        for piece in pieces_of(train_spm(texts * 3, root / name, "unigram", 50 if name == "src" else 45)):
            if piece != "<s>":                                # as in opus-mt's vocabularies
                vocab.setdefault(piece, len(vocab))
        vocabs.append(vocab)
    for name, vocab in zip(("vocab.json", "target_vocab.json"), vocabs, strict=True):
        (root / name).write_text(json.dumps(vocab), encoding="utf-8")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")                       # "Recommended: pip install sacremoses."
        tokenizer = transformers.MarianTokenizer(str(root / "src.model"), str(root / "tgt.model"),
                                                 str(root / "vocab.json"), str(root / "target_vocab.json"),
                                                 separate_vocabs=True)
    directory = root / "tiny-separate-marian"
    torch.manual_seed(0)
    model = transformers.MarianMTModel(transformers.MarianConfig(
        vocab_size=len(vocabs[0]), decoder_vocab_size=len(vocabs[1]), share_encoder_decoder_embeddings=False,
        d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
        encoder_ffn_dim=24, decoder_ffn_dim=24, max_position_embeddings=64, pad_token_id=2, eos_token_id=0,
        decoder_start_token_id=2))
    with torch.no_grad():                                     # every weight random: sentences translate apart
        for name, tensor in model.state_dict().items():
            if "layer_norm" in name:
                tensor.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * torch.randn(tensor.shape))
            elif "embed_positions" not in name:
                tensor.copy_(torch.randn(tensor.shape) * 0.3)
    out = root / "tiny-separate-marian.safetensors"
    oracle = saved_marian(model, tokenizer, directory, out)
    return {"directory": directory, "checkpoint": out, "oracle": oracle, "vocabs": vocabs, "model": model.eval()}


def tiny_m2m100(root: Path) -> dict:
    """A tiny M2M100 directory in ``root``: a BPE sentencepiece.bpe.model, vocab.json (<s> 0, <pad> 1, </s> 2,
    <unk> 3) and the 100 language codes after it, from M2M100Tokenizer's save_pretrained, with a tiny random model."""
    transformers = importlib.import_module("transformers")
    model_file = train_spm(SOURCE * 3 + TARGET * 3, root / "m", "bpe", 120)
    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    for piece in pieces_of(model_file):
        vocab.setdefault(piece, len(vocab))
    (root / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    tokenizer = transformers.M2M100Tokenizer(str(root / "vocab.json"), str(model_file), src_lang="en",
                                             tgt_lang="fr")
    directory, out = save_tiny_m2m100(root / "tiny-m2m100", tokenizer, len(vocab) + 108)

    def oracle(src_lang: str, tgt_lang: str):
        return transformers.M2M100Tokenizer.from_pretrained(directory, src_lang=src_lang, tgt_lang=tgt_lang,
                                                            split_special_tokens=True)
    return {"directory": directory, "checkpoint": out, "oracle": oracle, "vocab": vocab}


def tiny_nllb(root: Path, legacy: bool) -> dict:
    """A tiny NLLB directory in ``root``: NllbTokenizer (its tokenizer.json: a BPE model from a SentencePiece model
    trained here, <s> 0, <pad> 1, </s> 2, <unk> 3, then the pieces, the 200+ codes eng_Latn... after them) saved with
    save_pretrained (``legacy_behaviour`` as ``legacy``), with a tiny random M2M100 model."""
    transformers = importlib.import_module("transformers")
    extractor = importlib.import_module("transformers.convert_slow_tokenizer").SentencePieceExtractor
    found = extractor(str(train_spm(SOURCE * 3 + TARGET * 3, root / "m", "bpe", 120))).extract(None)
    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    for piece in found["vocab"]:
        vocab.setdefault(piece, len(vocab))
    tokenizer = transformers.NllbTokenizer(vocab=vocab, merges=found["merges"], legacy_behaviour=legacy,
                                           _spm_precompiled_charsmap=found["_spm_precompiled_charsmap"])
    directory, out = save_tiny_m2m100(root / "tiny-nllb", tokenizer, len(tokenizer))

    def oracle(src_lang: str, tgt_lang: str):
        return transformers.AutoTokenizer.from_pretrained(directory, src_lang=src_lang, tgt_lang=tgt_lang,
                                                          split_special_tokens=True)
    return {"checkpoint": out, "oracle": oracle, "size": len(vocab)}


def save_tiny_m2m100(directory: Path, tokenizer, vocab_size: int) -> tuple[Path, Path]:
    """A tiny random M2M100 model of ``vocab_size`` ids (pad 1, bos 0, eos 2, decoding from eos) saved in
    ``directory`` beside ``tokenizer`` (an M2M100 or NLLB tokenizer), and imported: (directory, checkpoint)."""
    torch, transformers = importlib.import_module("torch"), importlib.import_module("transformers")
    torch.manual_seed(0)
    transformers.M2M100ForConditionalGeneration(transformers.M2M100Config(
        vocab_size=vocab_size, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=24, decoder_ffn_dim=24, max_position_embeddings=64,
        pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    out = directory.with_suffix(".safetensors")
    import_hf(directory, out)
    return directory, out


def tiny_pegasus(root: Path) -> dict:
    """A tiny Pegasus directory in ``root``: PegasusTokenizer (its tokenizer.json: a Unigram model from a
    SentencePiece model trained here, with Pegasus's ids below the pieces -- <pad> 0, </s> 1, <mask_1> 2, <mask_2> 3,
    <unk_2> ... <unk_102>, <unk> 105 -- and the model's normalizer) saved with save_pretrained beside a tiny random
    PegasusForConditionalGeneration of its size, and imported: its directory, checkpoint and transformers' tokenizer
    read back from it (``split_special_tokens``, as the project tokenizes)."""
    torch, transformers = importlib.import_module("torch"), importlib.import_module("transformers")
    model_file = train_spm(SOURCE * 3 + TARGET * 3, root / "m", "unigram", 90)
    processor = importlib.import_module("sentencepiece").SentencePieceProcessor(model_file=str(model_file))
    extractor = importlib.import_module("transformers.convert_slow_tokenizer").SentencePieceExtractor
    charsmap = extractor(str(model_file)).extract(None)["_spm_precompiled_charsmap"]
    offset = 103
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<mask_1>", 0.0), ("<mask_2>", 0.0),
             *[(f"<unk_{i}>", 0.0) for i in range(2, offset)], ("<unk>", 0.0)]
    vocab += [(processor.id_to_piece(i), processor.get_score(i)) for i in range(processor.get_piece_size())
              if processor.id_to_piece(i) not in ("<unk>", "<s>", "</s>")]
    tokenizer = transformers.PegasusTokenizer(vocab=vocab, offset=offset, _spm_precompiled_charsmap=charsmap)
    directory = root / "tiny-pegasus"
    torch.manual_seed(0)
    transformers.PegasusForConditionalGeneration(transformers.PegasusConfig(
        **{**PEGASUS, "vocab_size": len(vocab), "encoder_layers": 1, "decoder_layers": 1,
           "max_position_embeddings": 64})).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    out = root / "tiny-pegasus.safetensors"
    import_hf(directory, out)
    oracle = transformers.AutoTokenizer.from_pretrained(directory, split_special_tokens=True)
    return {"directory": directory, "checkpoint": out, "oracle": oracle, "size": len(vocab)}


# facebook/mbart-large-50-many-to-many-mmt's generation fields (its config.json's: num_beams 5, max_length 200,
# early stopping, decoding from eos with eos forced at the end; the target language forced per call)
MBART50_GENERATION = {"num_beams": 5, "max_length": 200, "early_stopping": True, "bos_token_id": 0, "pad_token_id": 1,
                      "eos_token_id": 2, "decoder_start_token_id": 2, "forced_eos_token_id": 2}


def tiny_mbart50(root: Path) -> dict:
    """A tiny mBART-50 directory in ``root``: MBart50Tokenizer (its tokenizer.json: a Unigram model from a
    SentencePiece model trained here, fairseq's ids -- <s> 0, <pad> 1, </s> 2, <unk> 3, the pieces one above their own
    ids, the 52 language codes en_XX ... and <mask> after them -- and the model's normalizer) saved with
    save_pretrained beside a tiny random MBartForConditionalGeneration of its size (every weight random, eos made
    likely so sentences end at varied lengths) holding mBART-50's generation config, and imported: its directory,
    checkpoint, transformers' model and tokenizer read back (``split_special_tokens``, as the project tokenizes)."""
    torch, transformers = importlib.import_module("torch"), importlib.import_module("transformers")
    model_file = train_spm(SOURCE * 3 + TARGET * 3, root / "m", "unigram", 90)
    processor = importlib.import_module("sentencepiece").SentencePieceProcessor(model_file=str(model_file))
    extractor = importlib.import_module("transformers.convert_slow_tokenizer").SentencePieceExtractor
    charsmap = extractor(str(model_file)).extract(None)["_spm_precompiled_charsmap"]
    pieces = [(processor.id_to_piece(i), processor.get_score(i)) for i in range(processor.get_piece_size())]
    assert [piece for piece, _ in pieces[:3]] == ["<unk>", "<s>", "</s>"]     # the layout the class offsets by one
    tokenizer = transformers.MBart50Tokenizer(vocab=pieces, _spm_precompiled_charsmap=charsmap, src_lang="en_XX",
                                              tgt_lang="fr_XX", bos_token="<s>")   # the published file names it
    directory = root / "tiny-mbart50"
    torch.manual_seed(0)
    model = transformers.MBartForConditionalGeneration(transformers.MBartConfig(
        **{**MBART, "vocab_size": len(tokenizer), "encoder_layers": 1, "decoder_layers": 2,
           "max_position_embeddings": 208})).eval()
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():                                     # every weight random: sentences translate apart
        for name, tensor in model.state_dict().items():
            if "norm" in name:
                tensor.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * torch.randn(tensor.shape,
                                                                                           generator=generator))
            else:
                tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.3)
        model.final_logits_bias[0, 2] += 1.5                  # eos likely: sentences end well before the budget
    model.generation_config = transformers.GenerationConfig(**MBART50_GENERATION)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    out = root / "tiny-mbart50.safetensors"
    import_hf(directory, out)

    def oracle(src_lang: str, tgt_lang: str):
        return transformers.AutoTokenizer.from_pretrained(directory, src_lang=src_lang, tgt_lang=tgt_lang,
                                                          split_special_tokens=True)
    return {"directory": directory, "checkpoint": out, "oracle": oracle, "model": model, "size": len(tokenizer)}


# facebook/bart-large-cnn's generation fields (its config.json's: beam 4, length penalty 2, at least 56 tokens, no
# repeated trigram, bos forced first and eos at the end, decoding from eos)
BART_CNN_GENERATION = {"num_beams": 4, "length_penalty": 2.0, "max_length": 142, "min_length": 56,
                       "no_repeat_ngram_size": 3, "early_stopping": True, "bos_token_id": 0, "pad_token_id": 1,
                       "eos_token_id": 2, "decoder_start_token_id": 2, "forced_bos_token_id": 0,
                       "forced_eos_token_id": 2}


def tiny_bart(root: Path) -> dict:
    """A tiny BART directory in ``root``: BartTokenizer (its tokenizer.json: a byte-level BPE trained here with the
    ``tokenizers`` library, <s> 0, <pad> 1, </s> 2, <unk> 3, the 256 byte pieces and the merges' pieces, <mask> last)
    saved with save_pretrained beside a tiny random BartForConditionalGeneration of its size (every weight random)
    holding bart-large-cnn's generation config, and imported: its directory, checkpoint, transformers' model and its
    tokenizer read back (``split_special_tokens``, as the project tokenizes)."""
    torch, transformers = importlib.import_module("torch"), importlib.import_module("transformers")
    tokenizers = importlib.import_module("tokenizers")
    trained = tokenizers.Tokenizer(tokenizers.models.BPE())
    trained.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    trained.train_from_iterator(SOURCE * 3 + TARGET * 3, tokenizers.trainers.BpeTrainer(
        vocab_size=360, special_tokens=["<s>", "<pad>", "</s>", "<unk>"], show_progress=False,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    vocab = trained.get_vocab()
    vocab["<mask>"] = len(vocab)
    merges = [tuple(pair) for pair in json.loads(trained.to_str())["model"]["merges"]]
    tokenizer = transformers.BartTokenizer(vocab=vocab, merges=merges)
    directory = root / "tiny-bart"
    # generate ranks its beams in float32 even in float64: a random model whose best hypotheses differ by two
    # tokens swapped scores them within float32's resolution (seed 11: 6e-6 apart at -184), and generate's choice
    # between them is its rounding's; this seed's hypotheses stand apart, and end at varied lengths
    model = build("bart", seed=16, vocab_size=len(vocab), encoder_layers=1, decoder_layers=2,
                  max_position_embeddings=150)
    with torch.no_grad():
        model.final_logits_bias[0, 2] += 4.0                  # eos likely once min_length allows it
    model.generation_config = transformers.GenerationConfig(**BART_CNN_GENERATION)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    out = root / "tiny-bart.safetensors"
    import_hf(directory, out)
    oracle = transformers.AutoTokenizer.from_pretrained(directory, split_special_tokens=True)
    return {"directory": directory, "checkpoint": out, "oracle": oracle, "model": model, "size": len(vocab)}

