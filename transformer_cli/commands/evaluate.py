"""``transformer-reference evaluate``: a checkpoint's translations of a test file scored against its references.

The source file is translated in batches by :class:`.translate.Translator` (section 6.1's decoding, greedy or beam
search), then scored by sacreBLEU (Post, 2018): corpus BLEU and chrF, each with its signature (the tokenisation,
smoothing and version that make a score comparable), the exact-match rate (the hypothesis equals its reference, white
space at its ends aside), and the speed of decoding (model loading left out). The two files hold one sentence a line,
line for line; a source line that cannot be encoded, or is blank, is refused before any decoding."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

from transformer_tasks.textfiles import read_lines
from transformer_tasks.translation import Translator


@dataclass(frozen=True)
class Evaluation:
    """Scores of one checkpoint, backend and decoding on one test set."""

    checkpoint: str
    backend: str
    device: str
    dtype: str
    beam: int
    alpha: float
    max_output_length: int | None    # every sentence's output budget; None: section 6.1's, its length + 50
    batch_size: int
    batches_at_once: int             # batches decoded at the same time (--batches-at-once)
    sentences: int
    bleu: float
    bleu_signature: str
    chrf: float
    chrf_signature: str
    exact: int                       # hypotheses equal to their reference
    tokens: int                      # target tokens generated (eos included)
    seconds: float                   # decoding time, model loading left out

    @property
    def exact_match(self) -> float:
        return self.exact / self.sentences

    @property
    def sentences_per_second(self) -> float:
        return self.sentences / self.seconds

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds

    def to_json(self) -> dict:
        return {**asdict(self), "exact_match": self.exact_match, "sentences_per_second": self.sentences_per_second,
                "tokens_per_second": self.tokens_per_second}


def parallel_lines(source: str, reference: str) -> tuple[list[str], list[str]]:
    """The source and reference lines of a test set, refused unless they pair line for line."""
    sources, references = read_lines(source, "--source"), read_lines(reference, "--reference")
    if len(sources) != len(references):
        raise ValueError(f"--source {source!r} has {len(sources)} lines and --reference {reference!r} has "
                         f"{len(references)}; they must pair line for line")
    if not sources:
        raise ValueError(f"--source {source!r} holds no sentence")
    return sources, references


def metrics():
    """sacreBLEU's BLEU and chrF metric objects with their default settings (13a tokenisation, exponential
    smoothing; character 6-grams, beta 2); a ``ValueError`` naming the extra if sacreBLEU is not installed."""
    try:
        from sacrebleu.metrics import BLEU, CHRF
    except ModuleNotFoundError:
        raise ValueError("evaluate needs sacrebleu: pip install 'transformer-reference[text]'") from None
    return BLEU(), CHRF()


def encoded(translator: Translator, sources: list[str], where: str) -> list[list[int]]:
    """The source ids of every line; the first that cannot be encoded (or is blank) is a ``ValueError`` naming
    ``where`` and its line."""
    rows = []
    for number, text in enumerate(sources, 1):
        try:
            rows.append(translator.encode(text))
        except ValueError as err:
            raise ValueError(f"{where}, line {number}: {err}") from None
    return rows


def evaluate(translator: Translator, sources: list[str], references: list[str], where: str = "--source",
             progress: Callable[[list], Iterable] = lambda batches: batches, **run: Any) -> Evaluation:
    """Translate ``sources`` (named ``where`` in errors) in batches and score the translations against
    ``references``; ``run`` names the checkpoint, backend, device and dtype for the record."""
    bleu, chrf = metrics()
    rows = encoded(translator, sources, where)
    start = time.perf_counter()
    outputs = translator.decode_all(rows, progress)
    seconds = time.perf_counter() - start
    hypotheses = [translator.tokenizer.decode(ids) for ids in outputs]
    pad = translator.tokenizer.config.pad_id
    return Evaluation(
        **run, beam=translator.beam_size, alpha=translator.alpha,
        max_output_length=translator.model.config.decoding.max_output_length, batch_size=translator.batch_size,
        batches_at_once=translator.batches_at_once, sentences=len(sources),
        bleu=bleu.corpus_score(hypotheses, [references]).score, bleu_signature=str(bleu.get_signature()),
        chrf=chrf.corpus_score(hypotheses, [references]).score, chrf_signature=str(chrf.get_signature()),
        exact=sum(h == r.strip() for h, r in zip(hypotheses, references)),
        tokens=sum(int((ids != pad).sum()) for ids in outputs), seconds=seconds)


def format_evaluation(result: Evaluation) -> str:
    decoding = "greedy" if result.beam == 1 else f"beam {result.beam}, alpha {result.alpha}"
    if result.max_output_length is not None:
        decoding += f", max_output_length {result.max_output_length}"
    at_once = f", {result.batches_at_once} at once" if result.batches_at_once > 1 else ""
    return "\n".join([
        f"{result.checkpoint}: {result.backend} on {result.device}, {result.dtype}, {decoding}, batches of "
        f"{result.batch_size}{at_once}, {result.sentences:,} sentences",
        f"  BLEU   {result.bleu:6.2f}   {result.bleu_signature}",
        f"  chrF   {result.chrf:6.2f}   {result.chrf_signature}",
        f"  exact  {100 * result.exact_match:6.2f}%  ({result.exact:,} of {result.sentences:,})",
        f"  speed  {result.sentences_per_second:,.1f} sentences/s, {result.tokens_per_second:,.0f} tokens/s "
        f"({result.seconds:.1f} s decoding)"])
