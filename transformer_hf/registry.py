"""The families, by ``model_type``: adding a family is one module (:class:`.family.Family`) named here, and its
tests (docs/huggingface.md, "Adding a family")."""

from __future__ import annotations

from reference_numpy.config import TransformerConfig

from . import bart, m2m_100, marian, mbart, pegasus
from .family import Family, TokenizerKind

FAMILIES: dict[str, Family] = {family.MODEL_TYPE: family for family in (marian, m2m_100, pegasus, bart, mbart)}
# Every family's tokenizers, by the name a record's "family" field gives, in the order a directory's files name one
TOKENIZER_KINDS: dict[str, TokenizerKind] = {kind.name: kind for family in FAMILIES.values()
                                             for kind in family.TOKENIZERS}


def family(model_type: object) -> Family:
    """The family of a ``config.json``'s ``model_type``, or one ``ValueError`` naming the supported ones."""
    if model_type not in FAMILIES:
        raise ValueError(f"config.json model_type {model_type!r} is not supported (supported: "
                         f"{', '.join(repr(name) for name in FAMILIES)}: "
                         f"{', '.join(family.MODELS for family in FAMILIES.values())})")
    return FAMILIES[str(model_type)]


def family_for(config: TransformerConfig) -> Family:
    """The family the export writes ``config`` as: the first that claims it, checked (one ``ValueError`` naming the
    first field it cannot express)."""
    # every config is claimed by exactly one family: post-LN by Marian (sinusoids) or BART (learned positions); pre-LN
    # by M2M100 (fairseq's sinusoid), Pegasus (another sinusoid) or mBART (learned positions)
    chosen = next(family for family in FAMILIES.values() if family.claims(config))
    chosen.check_export(config)
    return chosen
