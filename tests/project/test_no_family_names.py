"""The reference and the ports know no Hugging Face family (docs/huggingface.md, "Where the reference's variants come
from"): every variant and decoding rule is described by what it computes, and which family or transformers field it
stands for is said by the family layer (``transformer_hf``) and its documents alone.

The scan reads every .py file of ``reference_numpy`` and the three ports for the families' names (a word matched
whatever its case) and for transformers' own field names, taken from the family layer's tables: the config.json and
generation_config.json keys that ``transformer_hf`` reads or writes, and the state-dict names of its weight tables.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import re
from pathlib import Path

from reference_numpy.checkpoint import parameter_shapes
from reference_numpy.config import DecodingConfig, TransformerConfig

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("reference_numpy", "transformer_torch", "transformer_jax", "transformer_tf")
# The families and their makers, as a text would name them; "transformers" is the library that defines them
FAMILY_WORDS = ("Marian", "opus-mt", "opus", "M2M100", "M2M_100", "NLLB", "BART", "mBART", "Pegasus", "Hugging Face",
                "HuggingFace", "transformers")
# Fields generation.py reads that none of the family layer's tables lists (generate's budget and held-back tokens)
READ_ONLY_FIELDS = ("max_new_tokens", "min_new_tokens")
# A configuration with every optional tensor: its weight tables and checkpoint names hold every name there is
EVERY_TENSOR = TransformerConfig.preset("tiny", output_bias=True, embedding_norm=True, norm_first=True,
                                        positional_encoding="learned", share_embeddings=False)
# transformers' field names that are also this project's own names (a config field, a checkpoint tensor's part, or
# an identifier of the scanned code): the scan cannot tell them apart, so it leaves them out
OWN_NAMES = ("d_model", "early_stopping", "k_proj", "layer_norm", "length_penalty", "model_type",
             "no_repeat_ngram_size", "out_proj", "q_proj", "repetition_penalty", "self_attn", "v_proj", "vocab_size")


def hf_fields() -> set[str]:
    """Every config.json and generation_config.json key the family layer reads or writes (its tables: each family's
    ``DEFAULTS``, ``LEGACY_FIELDS``, ``BOS_FIELD`` and export fields, the import's refusals, the generation settings,
    the export's config.json and generation_config.json) and every part of its weight tables' state-dict names, less
    the plain words (no underscore and no digit: "dropout", "model", "shared" name nothing of a family's)."""
    registry = importlib.import_module("transformer_hf.registry")
    importer = importlib.import_module("transformer_hf.importer")
    exporter = importlib.import_module("transformer_hf.exporter")
    generation = importlib.import_module("transformer_hf.generation")
    family = importlib.import_module("transformer_hf.family")
    config = TransformerConfig.preset("tiny", layer_norm_eps=family.LAYER_NORM_EPS)     # a config the export writes
    names = {*importer.ABSENT_OR, *generation.GENERATE_NEUTRAL, *family.PRE_LN_LEGACY_FIELDS, *READ_ONLY_FIELDS,
             *exporter.hf_config(config), *generation.generation_config(config)}
    for chosen in registry.FAMILIES.values():
        names |= {*chosen.DEFAULTS, *chosen.LEGACY_FIELDS, chosen.BOS_FIELD, *chosen.hf_config(config)}
        for entry in chosen.weight_table(EVERY_TENSOR, False).values():
            names |= {part for name in entry.names for part in name.split(".")}
    return {name for name in names if re.search(r"[_0-9]", name) and not name.isdigit()}


def own_names() -> set[str]:
    """This project's names: the config's fields, the parts of the checkpoint's tensor names, and every identifier
    of the scanned code (names, attributes, arguments, definitions)."""
    names = {item.name for cls in (TransformerConfig, DecodingConfig) for item in dataclasses.fields(cls)}
    names |= {part for name in parameter_shapes(EVERY_TENSOR) for part in name.split(".")}
    for path in sources(ROOT):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            for attribute in ("id", "attr", "arg", "name"):
                value = getattr(node, attribute, None)
                if isinstance(value, str):
                    names.add(value)
    return names


def sources(root: Path) -> list[Path]:
    return sorted(path for package in PACKAGES for path in (root / package).rglob("*.py")
                  if "__pycache__" not in path.parts)


def words() -> tuple[str, ...]:
    return (*FAMILY_WORDS, *sorted(hf_fields() - set(OWN_NAMES)))


def mentions(root: Path, banned: tuple[str, ...]) -> list[str]:
    """``path:line: word`` for every word of ``banned`` in the scanned packages under ``root`` (case-insensitive,
    whole words: letters, digits and underscores on neither side)."""
    pattern = re.compile("|".join(rf"(?<![A-Za-z0-9_/]){re.escape(word)}(?![A-Za-z0-9_])" for word in banned),
                         re.IGNORECASE)
    return [f"{path.relative_to(root)}:{number}: {match.group(0)}" for path in sources(root)
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
            for match in pattern.finditer(line)]


def test_the_reference_and_the_ports_name_no_family_or_field():
    found = mentions(ROOT, words())
    assert found == [], (f"the reference and the ports describe each variant by what it computes; its family and "
                         f"field go to docs/huggingface.md (not scanned, as the project's own names: {OWN_NAMES})\n"
                         + "\n".join(found))


def test_the_names_left_out_are_exactly_the_project_own():
    """The fields left out of the scan are those that are also the project's names, no more: a field that becomes an
    identifier of the reference is a decision to write down here, not a silent gap."""
    assert sorted(hf_fields() & own_names()) == sorted(OWN_NAMES)


def test_the_field_list_is_the_family_layer_s():
    """The derived list holds what the family layer reads and writes (a config key, a generation key, a tensor name),
    and the fields listed by hand are read by transformer_hf/generation.py."""
    fields = hf_fields()
    assert {"scale_embedding", "decoder_start_token_id", "num_beams", "forced_bos_token_id", "final_logits_bias",
            "layernorm_embedding", "max_new_tokens", "bad_words_ids"} <= fields
    generation = (ROOT / "transformer_hf" / "generation.py").read_text(encoding="utf-8")
    assert all(f'"{name}"' in generation for name in READ_ONLY_FIELDS)


def test_the_scan_names_file_line_and_word(tmp_path):
    """A planted mention in a copy is reported by file, line and word, whatever its case; a word inside a longer
    name is not one, nor a document's path (docs/huggingface.md, where the provenance is written)."""
    for package in PACKAGES:
        (tmp_path / package).mkdir()
    planted = '"""Every sine first (docs/huggingface.md).\n\nMarian\'s layout, as ``max_new_tokens`` says."""\n'
    (tmp_path / "reference_numpy" / "variants.py").write_text(planted + "marianne = 1\n", encoding="utf-8")
    (tmp_path / "transformer_jax" / "decoding.py").write_text("# hugging face's generate\n", encoding="utf-8")
    assert mentions(tmp_path, words()) == ["reference_numpy/variants.py:3: Marian",
                                           "reference_numpy/variants.py:3: max_new_tokens",
                                           "transformer_jax/decoding.py:1: hugging face"]
