"""transformers' ``generate`` settings as the config's decoding conventions (``reference_numpy/decoding.py``), and
back: what every family here shares, since ``generate`` reads the same fields whatever the model.

Import (:func:`decoding_conventions`), from ``generation_config.json`` (or, without it, the same fields of
``config.json``, as older files hold them) as ``generate`` reads them: ``decoder_start_token_id`` is
``decoder_start_id``; ``bad_words_ids`` of one token each are ``suppressed_ids`` (nothing else is suppressed:
transformers may emit any other token), ``renormalize_logits`` is ``renormalize``; ``forced_eos_token_id`` is
``forced_eos`` with ``forced_eos_id`` when it is not eos; beam search is transformers' (``length_normalization``
"hf") with its ``length_penalty`` (1.0 by default) and ``early_stopping`` (False by default); ``num_beams`` (1 by
default) is ``beam_size``, the beam the decoding commands use when given none. A setting with which ``generate``
would choose other tokens than the reference can (:data:`GENERATE_NEUTRAL`: sampling, the encoder's repetition
penalty and n-gram blocking, ...) is refused, naming it; ``repetition_penalty`` (1.0 by default) is the config's;
``min_length`` (counting the start token and not eos) is
``min_output_length`` (eos held back below that output step), ``min_new_tokens`` + 1 when that is set (``generate``
lets it take precedence), and ``no_repeat_ngram_size`` the config's. The output budget is ``generate``'s:
``max_new_tokens``, or else ``max_length`` less the decoder start token it counts, or else transformers' default of
20 new tokens (:data:`GENERATE_NEW_TOKENS`), as ``max_output_length`` (every sentence's, where section 6.1 gives each
its source length + 50); ``max_len`` (``max_position_embeddings``) caps it as it caps transformers' default.
``forced_bos_token_id`` is ``forced_bos_id``, the first token decoding forces when a call names none (a language
given per call, by ``translate --target-lang``, takes precedence).

Export (:func:`generation_config`), what the import reads back: the start token (``decoder_start_token_id``:
``decoder_start_id``, or bos), the tokens never written (``bad_words_ids`` of one token each, which set their scores
to -inf as the reference does: pad and bos unless ``suppressed_ids`` says otherwise; ``renormalize_logits`` its
``renormalize``), eos (or ``forced_eos_id``) forced at the end of the budget only with ``forced_eos``,
``length_penalty`` and ``early_stopping``; the checkpoint's ``beam_size`` as ``num_beams`` (1, greedy, by default);
``min_output_length`` as ``min_length`` (one number: ``min_length`` counts the start token and not eos,
``min_output_length`` eos and not the start token), ``no_repeat_ngram_size`` and ``repetition_penalty``;
``forced_bos_id`` as
``forced_bos_token_id``; its ``max_output_length`` tokens after the start token (``max_length`` counts the start
token), or, without one, ``max_len``: section 6.1's per-sentence budget (source length + 50) has no ``generate``
equivalent (a caller gives it as ``max_new_tokens``), and the export imports back with the budget transformers
decodes it with. Beam search in transformers normalises by |Y|^length_penalty (``length_normalization`` "hf"): a
checkpoint with the paper's ((5 + |Y|) / 6)^alpha ("gnmt") has no ``generate`` equivalent, so its export's greedy
decoding is the reference's, its beam search transformers' own -- and it imports back as "hf".
"""

from __future__ import annotations

import math
from typing import Any

from reference_numpy.config import MAX_BEAM_SIZE, DecodingConfig, TransformerConfig

GENERATE_NEW_TOKENS = 20         # generate's budget without max_new_tokens or max_length (its default max_length 20)
# transformers' generation settings that make ``generate`` choose other tokens than the reference's decoding, with
# the values that leave it unchanged (transformers' own defaults, GenerationConfig._get_default_generation_params):
# any other value is refused, naming the field. The sampling parameters (temperature, top_k, ...) act only with
# do_sample, so they are not among them.
GENERATE_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "do_sample": (False,), "encoder_repetition_penalty": (1.0,), "encoder_no_repeat_ngram_size": (0,),
    "num_beam_groups": (1,), "diversity_penalty": (0.0,), "penalty_alpha": (0.0,), "guidance_scale": (1.0,),
    "sequence_bias": ({}, []), "force_words_ids": ([],), "constraints": ([],), "suppress_tokens": ([],),
    "begin_suppress_tokens": ([],), "exponential_decay_length_penalty": (), "stop_strings": ([],),
    "token_healing": (False,), "dola_layers": (), "watermarking_config": (), "forced_decoder_ids": ([],)}


def decoding_conventions(generation: dict[str, Any], ids: tuple[int, int, int], max_len: int,
                         source: str) -> DecodingConfig:
    """The config's decoding (:class:`DecodingConfig`) from transformers' generation settings (``source``: the file they
    come from; the module docstring says which) for the model's (pad, bos, eos) ``ids`` and ``max_position_embeddings``
    (``max_len``), each refused in one line naming the field when transformers would decode otherwise than the reference
    can: a bad word of several tokens, several forced eos tokens. A start token that is bos and suppressed tokens that
    are pad and bos are the config's defaults (None), as an exported checkpoint holds them."""
    pad, bos, eos = ids
    _check_neutral(generation, eos, source)
    start = generation.get("decoder_start_token_id")
    if not isinstance(start, int) or isinstance(start, bool) or start < 0:
        raise ValueError(f"{source} decoder_start_token_id must be an int >= 0, got {start!r}")
    bad = generation.get("bad_words_ids") or []
    if not isinstance(bad, list) or any(not isinstance(word, list) or len(word) != 1 for word in bad):
        raise ValueError(f"{source} bad_words_ids {bad!r} is not supported: only words of one token each")
    forced_eos = _forced_eos(generation, source)
    length_penalty = generation.get("length_penalty", 1.0)
    if not isinstance(length_penalty, (int, float)) or isinstance(length_penalty, bool) or not length_penalty >= 0:
        raise ValueError(f"{source} length_penalty must be a number >= 0 (the reference's stopping rules need lp "
                         f"to grow with length), got {length_penalty!r}")
    early_stopping = generation.get("early_stopping", False)
    if early_stopping not in (True, False, "never") or not isinstance(early_stopping, (bool, str)):
        raise ValueError(f"{source} early_stopping must be true, false or \"never\", got {early_stopping!r}")
    beams = generation.get("num_beams", 1)
    if not isinstance(beams, int) or isinstance(beams, bool) or not 1 <= beams <= MAX_BEAM_SIZE:
        raise ValueError(f"{source} num_beams must be an int from 1 to {MAX_BEAM_SIZE}, got {beams!r}")
    renormalize = generation.get("renormalize_logits", False)
    if not isinstance(renormalize, bool):
        raise ValueError(f"{source} renormalize_logits must be true or false, got {renormalize!r}")
    suppressed = [word[0] for word in bad]
    penalty = generation.get("repetition_penalty", 1.0)
    if penalty is None:
        penalty = 1.0
    if not isinstance(penalty, (int, float)) or isinstance(penalty, bool) or not 0 < penalty < math.inf:
        raise ValueError(f"{source} repetition_penalty must be a finite number > 0, got {penalty!r}")
    for name in ("min_length", "min_new_tokens", "no_repeat_ngram_size"):
        value = generation.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise ValueError(f"{source} {name} must be an int >= 0, got {value!r}")
    forced_bos = generation.get("forced_bos_token_id")
    if forced_bos is not None and (not isinstance(forced_bos, int) or isinstance(forced_bos, bool)
                                   or forced_bos < 0 or forced_bos in (pad, eos)):
        raise ValueError(f"{source} forced_bos_token_id {forced_bos!r} is not supported: only a token id other than "
                         f"pad ({pad}) and eos ({eos}), or none")
    # generate replaces min_length by min_new_tokens + its input length (the start token) when min_new_tokens is set
    min_new_tokens = generation.get("min_new_tokens")
    return DecodingConfig(
        decoder_start_id=None if start == bos else start,
        suppressed_ids=None if sorted(suppressed) == sorted({pad, bos}) else tuple(suppressed),
        renormalize=renormalize, max_output_length=_new_tokens(generation, max_len, source),
        forced_eos=forced_eos is not None, forced_eos_id=None if forced_eos in (None, eos) else forced_eos,
        length_normalization="hf", length_penalty=length_penalty, early_stopping=early_stopping, beam_size=beams,
        forced_bos_id=forced_bos, no_repeat_ngram_size=generation.get("no_repeat_ngram_size") or 0,
        min_output_length=(generation.get("min_length") or 0) if min_new_tokens is None else min_new_tokens + 1,
        repetition_penalty=penalty)


def _forced_eos(generation: dict[str, Any], source: str) -> int | None:
    """The token ``generate`` forces at the last step (``forced_eos_token_id``: an id, or a list of one), or None;
    several are refused (transformers would give each the same score 0 and choose by ties)."""
    forced = generation.get("forced_eos_token_id")
    if isinstance(forced, list) and len(forced) == 1:
        forced = forced[0]
    if forced is None or (isinstance(forced, int) and not isinstance(forced, bool) and forced >= 0):
        return forced
    raise ValueError(f"{source} forced_eos_token_id {forced!r} is not supported: only one token id or none")


def _new_tokens(generation: dict[str, Any], max_len: int, source: str) -> int:
    """``generate``'s budget of new tokens (transformers' ``_prepare_generated_length`` for an encoder-decoder,
    whose decoder input is the start token alone): ``max_new_tokens``, else ``max_length`` - 1, else 20 -- its
    default, which it caps at ``max_position_embeddings`` (``max_len``) with the start token."""
    for name, minimum in (("max_new_tokens", 1), ("max_length", 2)):
        value = generation.get(name)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise ValueError(f"{source} {name} must be an int >= {minimum}, got {value!r}")
        return value if name == "max_new_tokens" else value - 1
    return max(1, min(GENERATE_NEW_TOKENS, max_len - 1))


def _check_neutral(generation: dict[str, Any], eos: int, source: str) -> None:
    """One ``ValueError`` line naming the first generation setting (:data:`GENERATE_NEUTRAL`, or an
    ``eos_token_id`` other than the model's) with which ``generate`` would choose other tokens than the reference."""
    for name, neutral in GENERATE_NEUTRAL.items():
        value = generation.get(name)
        if value is not None and not any(value == allowed and isinstance(value, bool) == isinstance(allowed, bool)
                                         for allowed in neutral):
            raise ValueError(f"{source} {name} {value!r} is not supported: generate would choose other tokens than "
                             "every backend here; without the field the model imports, decoding as the reference")
    if generation.get("eos_token_id") not in (None, eos, [eos]):
        raise ValueError(f"{source} eos_token_id {generation['eos_token_id']!r} is not supported: only config.json's "
                         f"eos_token_id ({eos})")


# ----------------------------------------------------------------------------- export

def special_ids(config: TransformerConfig) -> dict[str, Any]:
    """pad, bos, eos, the token decoding starts from (``config.start_id``) and the forced eos (Marian's config
    forces one by default; the reference only with ``forced_eos``: ``forced_last_id``)."""
    forced = config.forced_last_id if config.decoding.forced_eos else None
    return {"pad_token_id": config.pad_id, "bos_token_id": config.bos_id, "eos_token_id": config.eos_id,
            "decoder_start_token_id": config.start_id, "forced_eos_token_id": forced}


def generation_config(config: TransformerConfig) -> dict[str, Any]:
    """``generation_config.json``: the checkpoint's decoding conventions as transformers' ``generate`` reads them
    (module docstring), its beam ``beam_size`` (greedy by default)."""
    decoding = config.decoding
    bad_words = {"bad_words_ids": [[token] for token in sorted(set(config.never_emitted))]} if config.never_emitted \
        else {}
    return {**special_ids(config), "num_beams": decoding.beam_size, "do_sample": False,
            "max_length": generate_budget(config) + 1, **bad_words, "renormalize_logits": decoding.renormalize,
            "length_penalty": decoding.length_penalty, "early_stopping": decoding.early_stopping,
            "min_length": decoding.min_output_length, "no_repeat_ngram_size": decoding.no_repeat_ngram_size,
            "forced_bos_token_id": decoding.forced_bos_id, "repetition_penalty": decoding.repetition_penalty}


def generate_budget(config: TransformerConfig) -> int:
    """The output budget of every sentence in ``generate``: ``decoding.max_output_length`` (capped at ``max_len``, as
    :func:`reference_numpy.decoding.max_output_lengths` caps it), or ``max_len``."""
    budget = config.decoding.max_output_length
    return min(config.max_len if budget is None else budget, config.max_len)
