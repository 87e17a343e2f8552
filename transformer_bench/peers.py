"""The peers of ``transformer-reference bench --peers``: the engines a user would pick instead of this project's
ports, run on the same weights (docs/peers.md).

* ``ctranslate2``: CTranslate2's ``Translator`` on the model written by :mod:`transformer_export.ctranslate2` (float32);
* ``torch.nn.Transformer``: PyTorch's own encoder-decoder, holding our weights through
  :func:`transformer_torch.interop.to_nn_transformer` (the port's embeddings, positional encodings and
  generator around an ``nn.Transformer``);
* ``marian``: Hugging Face ``transformers``' ``MarianMTModel``, the post-LN Transformer of section 3 with
  sinusoidal positions and sqrt(d_model)-scaled embeddings, built from a ``MarianConfig`` of our shapes
  (ReLU, ``scale_embedding``) and given our weights by :func:`marian_name_table`, our interleaved sinusoid
  table copied into its position embeddings (its own puts sines then cosines) and every LayerNorm's epsilon
  set to ``layer_norm_eps``. Pre-LN configs (``norm_first``) are not Marian's architecture: refused;
* ``transformers``: Hugging Face ``transformers`` on the checkpoint as ``export --to hf`` writes it (``MarianMTModel``
  or ``M2M100ForConditionalGeneration`` through ``AutoModelForSeq2SeqLM``), decoding with the checkpoint's own
  conventions: the engine a user of an imported opus-mt, M2M100 or NLLB model (``bench CHECKPOINT --peers``) has
  in transformers. It refuses what the export refuses, the presets' ``layer_norm_eps`` of 1e-6 among it.

Each peer is built from a config, checkpoint-layout weights and a thread count (CTranslate2's
``intra_threads``; the PyTorch-based peers keep torch's own setting, as the PyTorch backend does). It has
``forward(src, tgt)``, ``greedy(src, steps)`` and ``beam(src, steps, beam_size, alpha)`` (or ``None`` where it
has no such call, with the reason in ``NOT_MEASURED``), the timed calls of the bench, each described in its
``COMPUTES`` (``UNCACHED`` names the calls without a cache, timed once). The decoders emit exactly ``steps``
tokens where the engine can be told to (CTranslate2's ``min_decoding_length``, ``generate``'s
``min_new_tokens``, a fixed loop for ``nn.Transformer``) and return token ids (B, L). ``log_probs`` and
``score`` give what the agreement tests compare (tests/benchmarks/test_peers.py).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import pickle
import subprocess
import sys
import tempfile
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Protocol

import numpy as np
import numpy.typing as npt

from equivalence.backends import Missing
from reference_numpy.config import PAPER_CHOICES, TransformerConfig, refuse_choices
from reference_numpy.decoding import max_output_lengths
from reference_numpy.model import padding_mask, sinusoidal_positional_encoding
from transformer_export.ctranslate2 import (
    is_projection_weight,
    require_ctranslate2,
    save_ctranslate2,
    to_ids,
    to_tokens,
    translate_options,
)

if TYPE_CHECKING:
    import torch


class Peer(Protocol):
    """A built peer, what ``bench`` times (the module docstring): its calls and what each computes."""

    NAME: str
    COMPUTES: dict[str, str]
    NOT_MEASURED: dict[str, str]
    UNCACHED: tuple[str, ...]

    def forward(self, src: np.ndarray, tgt: np.ndarray) -> object: ...

    def greedy(self, src: np.ndarray, steps: int) -> np.ndarray: ...

    @property
    def beam(self) -> Callable[[np.ndarray, int, int, float], np.ndarray] | None: ...


class CTranslate2Peer:
    """CTranslate2 (float32, ``intra_threads`` threads) on the model
    :func:`transformer_export.ctranslate2.save_ctranslate2` writes into a temporary directory, deleted once the
    ``Translator`` has read it."""

    NAME = "ctranslate2"
    COMPUTES = {
        "forward": "Translator.score_batch(source, target): the encoder, the decoder over every target position, the "
                   "output projection and log-softmax, and each target token's log-probability (the forward pass's "
                   "work; CTranslate2's Translator has no call returning the whole distribution); every call in a "
                   "worker process of its own, a pipe round trip included",
        "greedy": "Translator.translate_batch(beam_size=1), exactly N tokens (min_decoding_length = "
                  "max_decoding_length = N): the encoder once, then one cached decoder step per token",
        "beam": "Translator.translate_batch(beam_size=4, length_penalty=alpha), exactly N tokens: CTranslate2's beam "
                "search (scores divided by |Y|^alpha), cached",
    }
    NOT_MEASURED: dict[str, str] = {}
    UNCACHED: tuple[str, ...] = ()
    OWN_PROCESS = True              # its OpenMP would merge with PyTorch's (see OwnProcess)

    def __init__(self, config: TransformerConfig, params: dict[str, np.ndarray], threads: int):
        ctranslate2 = require_ctranslate2()
        self.config = config
        with tempfile.TemporaryDirectory() as directory:
            path = save_ctranslate2(config, params, Path(directory) / "model")
            self.translator = ctranslate2.Translator(str(path), device="cpu", compute_type="float32",
                                                     intra_threads=threads)

    def _source(self, src: npt.ArrayLike) -> list[list[str]]:
        return to_tokens(self.config, src, self.config.src_vocab_size)

    def score(self, src: np.ndarray, tgt: np.ndarray) -> list[np.ndarray]:
        """Per row, the log-probability of each token of ``tgt[1:]`` + eos after the prefix before it
        (``tgt`` starts with bos, as the reference's target; CTranslate2 prepends its start token itself)."""
        targets = to_tokens(self.config, np.asarray(tgt)[:, 1:], self.config.tgt_vocab_size)
        results = self.translator.score_batch(self._source(src), targets, max_input_length=0)
        return [np.asarray(result.log_probs, dtype=np.float32) for result in results]

    forward = score

    def translate(self, src: npt.ArrayLike, beam_size: int = 1, alpha: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
        """Tokens (B, L) without bos, pad-filled, and CTranslate2's scores (B,), each row within the reference's
        budget (non-pad source tokens + 50, capped at max_len: one call per row) and
        :func:`transformer_export.ctranslate2.translate_options`."""
        source = np.asarray(src)
        limits = max_output_lengths(self, source)                           # reads self.config only
        rows, scores = [], []
        for row, limit in zip(source, limits):
            result = self.translator.translate_batch(self._source(row[None]),
                                                     **translate_options(int(limit), beam_size, alpha))[0]
            rows.append(result.hypotheses[0])
            scores.append(result.scores[0])
        return to_ids(self.config, rows, self.config.tgt_vocab_size), np.asarray(scores, dtype=np.float32)

    def greedy(self, src: np.ndarray, steps: int) -> np.ndarray:
        return self.beam(src, steps, 1, 0.0)

    def beam(self, src: np.ndarray, steps: int, beam_size: int, alpha: float) -> np.ndarray:
        options = translate_options(steps, beam_size, alpha, forced=True)
        results = self.translator.translate_batch(self._source(src), **options)
        return to_ids(self.config, [result.hypotheses[0] for result in results], self.config.tgt_vocab_size)


class NNTransformerPeer:
    """``torch.nn.Transformer`` in eval mode, float32, inside the port's embeddings, positional encodings and
    generator (:class:`transformer_torch.interop.NNTransformerModel`). It has no cache and no decoding API:
    greedy decoding is a loop over its forward pass, the whole prefix every step; no beam search."""

    NAME = "torch.nn.Transformer"
    COMPUTES = {
        "forward": "NNTransformerModel(src, tgt): the embeddings, nn.Transformer's encoder and decoder (masks in "
                   "its convention), the generator's log-softmax: (B, T, V) log-probabilities",
        "greedy": "a loop of N steps (nn.Transformer has no decoding API and no cache): the encoder once, then per "
                  "step the decoder over the whole prefix and the generator on its last position, argmax with pad "
                  "and bos excluded",
    }
    NOT_MEASURED = {"beam 4 batch 1": "nn.Transformer has no decoding API; a beam search around it would be this "
                                      "project's own code, not the peer's"}
    UNCACHED: tuple[str, ...] = ("greedy",)   # the whole prefix every step: timed once, as uncached decoding
    OWN_PROCESS = False

    def __init__(self, config: TransformerConfig, params: dict[str, np.ndarray], threads: int):
        import torch

        from transformer_torch.checkpoint import from_params
        from transformer_torch.interop import to_nn_transformer
        self.torch, self.config = torch, config
        self.model = to_nn_transformer(from_params(config, params, torch.float32, "cpu")).eval()

    def log_probs(self, src: np.ndarray, tgt: np.ndarray) -> np.ndarray:
        """(B, T, V) float32 log-probabilities, the reference's default masks."""
        with self.torch.no_grad():
            return self.model(self.torch.as_tensor(src), self.torch.as_tensor(tgt)).numpy()

    forward = log_probs

    def greedy(self, src: np.ndarray, steps: int) -> np.ndarray:
        torch, cfg = self.torch, self.config
        with torch.no_grad():
            source = torch.as_tensor(src)
            src_mask = torch.as_tensor(padding_mask(source.numpy(), cfg.pad_id))
            memory = self.model.encode(source, src_mask)                                # (B, S, D)
            tgt = torch.full((len(source), 1), cfg.bos_id, dtype=torch.long)
            for _ in range(steps):
                out = self.model.decode(tgt, memory, src_mask)                          # (B, t, D)
                log_probs = self.model.generator(out[:, -1:])[:, 0]                     # (B, V)
                log_probs[:, [cfg.pad_id, cfg.bos_id]] = -torch.inf
                tgt = torch.cat([tgt, log_probs.argmax(-1, keepdim=True)], dim=1)
        return tgt[:, 1:].numpy()

    beam = None


class Seq2SeqPeer:
    """What the peers of transformers share: a ``PreTrainedModel`` for sequence-to-sequence generation (eager,
    float32, eval mode) in ``self.model``, its forward pass and ``generate``, given ``self.generation``'s settings
    beside the directory's own generation config."""

    NOT_MEASURED: dict[str, str] = {}
    UNCACHED: tuple[str, ...] = ()
    OWN_PROCESS = False

    def __init__(self, config: TransformerConfig, model: Any, generation: dict[str, Any]):
        import torch
        self.torch, self.config, self.model, self.generation = torch, config, model.eval(), generation

    def _inputs(self, src: npt.ArrayLike, tgt: npt.ArrayLike | None = None) -> dict[str, torch.Tensor]:
        torch, pad = self.torch, self.config.pad_id
        source = torch.as_tensor(np.asarray(src))
        inputs = {"input_ids": source, "attention_mask": (source != pad).long()}
        if tgt is not None:
            target = torch.as_tensor(np.asarray(tgt))
            read = target != pad
            read[:, 0] = True                  # the start token, even a pad one (Marian's): the reference's target_mask
            inputs.update(decoder_input_ids=target, decoder_attention_mask=read.long())
        return inputs

    def log_probs(self, src: np.ndarray, tgt: np.ndarray) -> np.ndarray:
        """(B, T, V) float32 log-probabilities: log-softmax of the model's logits."""
        with self.torch.no_grad():
            return self.torch.log_softmax(self.model(**self._inputs(src, tgt)).logits, dim=-1).numpy()

    def forward(self, src: np.ndarray, tgt: np.ndarray) -> torch.Tensor:
        with self.torch.no_grad():
            return self.model(**self._inputs(src, tgt)).logits

    def greedy(self, src: np.ndarray, steps: int) -> np.ndarray:
        return self._generate(src, steps, num_beams=1)

    def beam(self, src: np.ndarray, steps: int, beam_size: int, alpha: float) -> np.ndarray:
        return self._generate(src, steps, num_beams=beam_size, length_penalty=alpha)

    def _generate(self, src: np.ndarray, steps: int, **search: float) -> np.ndarray:
        with self.torch.no_grad():
            out = self.model.generate(**self._inputs(src), do_sample=False, min_new_tokens=steps, max_new_tokens=steps,
                                      **self.generation, **search)
        return out[:, 1:].numpy()                                                       # without the start token


class MarianPeer(Seq2SeqPeer):
    """Hugging Face ``MarianMTModel`` (eager, float32, eval mode) with our weights: see the module docstring.
    It computes the reference's function for every post-LN config (tests/benchmarks/test_peers.py)."""

    NAME = "marian"
    COMPUTES = {
        "forward": "MarianMTModel(input_ids, attention_mask, decoder_input_ids, decoder_attention_mask).logits: "
                   "the embeddings, encoder, decoder and output projection (B, T, V), no log-softmax",
        "greedy": "MarianMTModel.generate(num_beams=1, min_new_tokens=N, max_new_tokens=N): its cached decoder, "
                  "exactly N tokens",
        "beam": "MarianMTModel.generate(num_beams=4, length_penalty=alpha, min_new_tokens=N, max_new_tokens=N): "
                "transformers' beam search (scores divided by |Y|^alpha), cached",
    }

    def __init__(self, config: TransformerConfig, params: dict[str, np.ndarray], threads: int):
        from transformers import MarianConfig, MarianMTModel
        if config.norm_first:
            raise ValueError("norm_first is True: MarianMTModel is post-LN only (a LayerNorm after each residual)")
        refuse_choices(config, "this MarianMTModel peer (built with the paper's choices)", **PAPER_CHOICES)
        share = config.share_embeddings
        marian = MarianConfig(vocab_size=config.src_vocab_size, decoder_vocab_size=config.tgt_vocab_size,
                              d_model=config.d_model, encoder_layers=config.n_encoder_layers,
                              decoder_layers=config.n_decoder_layers, encoder_attention_heads=config.n_heads,
                              decoder_attention_heads=config.n_heads, encoder_ffn_dim=config.d_ff,
                              decoder_ffn_dim=config.d_ff, activation_function="relu",
                              max_position_embeddings=config.max_len, scale_embedding=True,
                              pad_token_id=config.pad_id, eos_token_id=config.eos_id, bos_token_id=config.bos_id,
                              decoder_start_token_id=config.bos_id, forced_eos_token_id=None,
                              share_encoder_decoder_embeddings=share, tie_word_embeddings=share, dropout=0.0,
                              attention_dropout=0.0, activation_dropout=0.0)
        model = MarianMTModel(marian)
        load_marian_weights(model, config, params)
        super().__init__(config, model, {"bad_words_ids": [[config.pad_id], [config.bos_id]],
                                         "pad_token_id": config.pad_id, "eos_token_id": config.eos_id,
                                         "decoder_start_token_id": config.bos_id})


class TransformersPeer(Seq2SeqPeer):
    """Hugging Face transformers on the checkpoint as ``export --to hf`` writes it
    (:func:`transformer_hf.exporter.save_hf`, into a temporary directory that
    ``AutoModelForSeq2SeqLM.from_pretrained`` reads: ``MarianMTModel`` or ``M2M100ForConditionalGeneration``, eager,
    float32, eval mode), decoding with the checkpoint's conventions from the directory's generation config: what a
    user of an imported opus-mt, M2M100 or NLLB model runs in transformers. What the export refuses, this peer
    refuses (the presets' ``layer_norm_eps`` of 1e-6 among it: the ``marian`` peer runs those)."""

    NAME = "transformers"
    COMPUTES = {
        "forward": "AutoModelForSeq2SeqLM on the export --to hf directory: model(input_ids, attention_mask, "
                   "decoder_input_ids, decoder_attention_mask).logits (B, T, V), no log-softmax",
        "greedy": "generate(num_beams=1, min_new_tokens=N, max_new_tokens=N) with the directory's generation config "
                  "(the checkpoint's start token, suppressed and forced tokens): its cached decoder, exactly N tokens",
        "beam": "generate(num_beams=4, length_penalty=alpha, min_new_tokens=N, max_new_tokens=N) with the "
                "directory's generation config: transformers' beam search (scores divided by |Y|^alpha), cached",
    }

    def __init__(self, config: TransformerConfig, params: dict[str, np.ndarray], threads: int):
        import torch
        from transformers import AutoModelForSeq2SeqLM
        from transformers.utils import logging

        from transformer_hf.exporter import save_hf
        bar = logging.is_progress_bar_enabled()
        logging.disable_progress_bar()                          # from_pretrained's "Loading weights" bar
        try:
            with tempfile.TemporaryDirectory() as directory:
                save_hf(config, params, directory)
                model = AutoModelForSeq2SeqLM.from_pretrained(directory, dtype=torch.float32)
        finally:
            if bar:
                logging.enable_progress_bar()
        super().__init__(config, model, {"max_length": None})  # the export's budget gives way to N, unwarned


def marian_name_table(config: TransformerConfig) -> dict[str, str]:
    """Checkpoint tensor name -> ``MarianMTModel`` parameter path, one entry per checkpoint tensor (tied
    parameters are reached through the first name; with ``share_embeddings`` the shared embedding is
    ``model.shared``, also the decoder's embedding and the output projection)."""
    table = {}
    if config.share_embeddings:
        table["shared_embed.weight"] = "model.shared.weight"
    else:
        table.update({"src_embed.weight": "model.encoder.embed_tokens.weight",
                      "tgt_embed.weight": "model.decoder.embed_tokens.weight", "generator.weight": "lm_head.weight"})
    if config.positional_encoding == "learned":
        table.update({"src_pos_embed.weight": "model.encoder.embed_positions.weight",
                      "tgt_pos_embed.weight": "model.decoder.embed_positions.weight"})
    for stack, layers in (("encoder", config.n_encoder_layers), ("decoder", config.n_decoder_layers)):
        for i in range(layers):
            ours, theirs = f"{stack}.layers.{i}", f"model.{stack}.layers.{i}"
            _marian_attention(table, f"{ours}.self_attn", f"{theirs}.self_attn")
            _affine(table, f"{ours}.self_attn_norm", f"{theirs}.self_attn_layer_norm")
            if stack == "decoder":
                _marian_attention(table, f"{ours}.cross_attn", f"{theirs}.encoder_attn")
                _affine(table, f"{ours}.cross_attn_norm", f"{theirs}.encoder_attn_layer_norm")
            _affine(table, f"{ours}.ffn.linear1", f"{theirs}.fc1")
            _affine(table, f"{ours}.ffn.linear2", f"{theirs}.fc2")
            _affine(table, f"{ours}.ffn_norm", f"{theirs}.final_layer_norm")
    return table


def _marian_attention(table: dict[str, str], ours: str, theirs: str) -> None:
    for proj, marian in (("q_proj", "q_proj"), ("k_proj", "k_proj"), ("v_proj", "v_proj"), ("o_proj", "out_proj")):
        _affine(table, f"{ours}.{proj}", f"{theirs}.{marian}")


def _affine(table: dict[str, str], ours: str, theirs: str) -> None:
    """A module with a weight and a bias (``nn.Linear``, ``nn.LayerNorm``)."""
    table[f"{ours}.weight"] = f"{theirs}.weight"
    table[f"{ours}.bias"] = f"{theirs}.bias"


def marian_transposed(config: TransformerConfig) -> tuple[str, ...]:
    """The checkpoint tensors whose Marian parameter is the transpose: every projection weight (ours (in, out),
    ``nn.Linear``'s (out, in)), the separate output projection included."""
    return tuple(name for name in marian_name_table(config) if is_projection_weight(name))


def load_marian_weights(model: torch.nn.Module, config: TransformerConfig, params: dict[str, np.ndarray]) -> None:
    """Copy ``params`` into ``model`` (a ``MarianMTModel`` of ``config``'s shapes) through :func:`marian_name_table`
    and :func:`marian_transposed`, a shape check per tensor; the sinusoid table into both position embeddings
    (unless learned); every LayerNorm's epsilon set to ``layer_norm_eps``."""
    import torch
    state, flip = model.state_dict(), set(marian_transposed(config))
    values = {theirs: params[ours].T if ours in flip else params[ours]
              for ours, theirs in marian_name_table(config).items()}
    if config.positional_encoding == "sinusoidal":
        table = sinusoidal_positional_encoding(config.max_len, config.d_model)               # (L, D) interleaved
        values.update({"model.encoder.embed_positions.weight": table, "model.decoder.embed_positions.weight": table})
    unset = set(dict(model.named_parameters())) ^ set(values)
    if unset:
        raise AssertionError(f"the Marian name table and the model's parameters differ: {sorted(unset)}")
    for path, value in values.items():
        if tuple(state[path].shape) != value.shape:
            raise AssertionError(f"Marian parameter {path!r} has shape {tuple(state[path].shape)}; the tensor for it "
                                 f"has {value.shape}")
        state[path].copy_(torch.as_tensor(np.ascontiguousarray(value), dtype=state[path].dtype))
    state["final_logits_bias"].zero_()
    for module in model.modules():
        if isinstance(module, torch.nn.LayerNorm):
            module.eps = config.layer_norm_eps


SERVE = "from transformer_bench.peers import serve; serve()"   # what an OwnProcess's worker runs


class OwnProcess:
    """A peer run in a Python process of its own, its calls pickled through the process's standard input and
    output: the same ``forward``, ``greedy`` and ``beam`` (each blocks until the worker has answered, so the
    calls stay interleaved with the other engines'), the class's ``NAME``, ``COMPUTES``, ``NOT_MEASURED`` and
    ``UNCACHED``. A call costs one round trip of its arguments and result on top of the peer's own work.

    Why: CTranslate2 ships its own GNU OpenMP, but in a process that imported PyTorch first the dynamic linker
    binds its ``GOMP_*`` calls to PyTorch's copy (``LD_DEBUG=bindings`` shows it). Once PyTorch has started its
    threads, that one runtime manages more threads than the machine has cores and throttles its spin-waiting:
    CTranslate2's threads sleep between parallel regions (their CPU time halves) and it decodes far slower than
    in a process of its own (the numbers: docs/peers.md, ``transformer-reference bench --peers``)."""

    beam: Callable[[np.ndarray, int, int, float], np.ndarray] | None

    def __init__(self, peer: PeerClass, config: TransformerConfig, params: dict[str, np.ndarray], threads: int):
        self._process = subprocess.Popen([sys.executable, "-c", SERVE], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE)
        self._closed = weakref.finalize(self, _stop, self._process)
        refusal = self._exchange((peer.NAME, config.to_json(), params, threads))
        if refusal is not None:
            self.close()
            raise ValueError(refusal)
        self.NAME, self.COMPUTES, self.NOT_MEASURED, self.UNCACHED = (peer.NAME, peer.COMPUTES, peer.NOT_MEASURED,
                                                                      peer.UNCACHED)
        self.beam = None if peer.beam is None else functools.partial(self._call, "beam")

    def _exchange(self, message: object) -> Any:
        requests, answers = _pipes(self._process)
        pickle.dump(message, requests, protocol=pickle.HIGHEST_PROTOCOL)
        requests.flush()
        return pickle.load(answers)

    def _call(self, method: str, *args: object) -> Any:
        ok, value = self._exchange((method, args))
        if not ok:
            raise RuntimeError(f"{self.NAME} worker: {value}")
        return value

    def forward(self, src: np.ndarray, tgt: np.ndarray) -> object:
        return self._call("forward", src, tgt)

    def greedy(self, src: np.ndarray, steps: int) -> np.ndarray:
        return self._call("greedy", src, steps)

    def close(self) -> None:
        """Stop the worker process."""
        self._closed()


def serve() -> None:
    """The worker of :class:`OwnProcess` (``python -c`` :data:`SERVE`): build the peer from the first message (a
    ``ValueError`` is sent back as its text), then answer each (method, args) with (True, result) or (False, the
    error) until the input ends. Anything the peer prints goes to stderr."""
    requests, answers = sys.stdin.buffer, os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def answer(message: object) -> None:
        pickle.dump(message, answers, protocol=pickle.HIGHEST_PROTOCOL)
        answers.flush()

    name, config, params, threads = pickle.load(requests)
    try:
        peer = PEERS[name][0](TransformerConfig.from_json(config), params, threads)
    except ValueError as err:
        answer(str(err))
        return
    answer(None)
    del params
    while True:
        try:
            method, args = pickle.load(requests)
        except EOFError:
            return
        try:
            answer((True, getattr(peer, method)(*args)))
        except Exception as err:  # noqa: BLE001 - sent back to the caller, which raises it
            answer((False, f"{type(err).__name__}: {err}"))


def _pipes(process: subprocess.Popen[bytes]) -> tuple[IO[bytes], IO[bytes]]:
    """The worker's standard input and output, the pipes :class:`OwnProcess` opened."""
    if process.stdin is None or process.stdout is None:
        raise AssertionError("the worker process was started without its pipes")
    return process.stdin, process.stdout


def _stop(process: subprocess.Popen[bytes]) -> None:
    requests, answers = _pipes(process)
    requests.close()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    answers.close()


PeerClass = type[CTranslate2Peer] | type[NNTransformerPeer] | type[MarianPeer] | type[TransformersPeer]
# peer name -> (its class, every module it needs, the pip extra that installs them)
PEERS: dict[str, tuple[PeerClass, tuple[str, ...], str]] = {
    "ctranslate2": (CTranslate2Peer, ("ctranslate2",), "peers"),
    "torch.nn.Transformer": (NNTransformerPeer, ("torch",), "torch"),
    "marian": (MarianPeer, ("transformers", "torch"), "peers"),
    "transformers": (TransformersPeer, ("transformers", "torch", "safetensors"), "peers"),
}


def load(config: TransformerConfig, params: dict[str, np.ndarray],
         threads: int) -> tuple[dict[str, Peer], list[Missing]]:
    """Build every installed peer on ``params`` (``OWN_PROCESS`` ones in a process of their own,
    :class:`OwnProcess`); a peer whose modules are not installed, or that cannot represent ``config`` (its
    ``ValueError``), is reported with the reason instead."""
    peers: dict[str, Peer] = {}
    missing = []
    for name, (peer, modules, extra) in PEERS.items():
        absent = [module for module in modules if importlib.util.find_spec(module) is None]
        if absent:
            missing.append(Missing(name, f"not installed ({' and '.join(absent)} missing): "
                                         f"pip install 'transformer-reference[{extra}]'"))
            continue
        try:
            peers[name] = (OwnProcess(peer, config, params, threads) if peer.OWN_PROCESS
                           else peer(config, params, threads))
        except ValueError as err:
            missing.append(Missing(name, f"cannot run this config: {err}"))
    return peers, missing

