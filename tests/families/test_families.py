"""The family layer (``transformer_hf/``, docs/huggingface.md "The family layer"): each registered family's weight
table held to a tiny random transformers model of that family (every tensor of its state dict read exactly once,
or a tied copy or a sinusoid buffer left, each shape checked, the transposes exactly its ``nn.Linear`` weights); the
registry; and the reference and the ports, which know no family."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import numpy as np
import pytest
from support import FAMILIES as TINY
from support import build

from reference_numpy.checkpoint import parameter_shapes
from reference_numpy.config import TransformerConfig
from transformer_hf import family, family_for
from transformer_hf.family import Family
from transformer_hf.importer import config_from_hf, convert
from transformer_hf.registry import FAMILIES, TOKENIZER_KINDS

torch = pytest.importorskip("torch", reason="torch is not installed: transformers' models need it")
pytest.importorskip("transformers", reason="transformers is not installed: the tables are held to its models")

ROOT = Path(__file__).resolve().parent.parent
# (family, the config.json changes of a variant): one matrix for every embedding, every embedding its own (transformers
# 5 then builds model.shared unread), and Marian's separate target vocabulary
VARIANTS = [(name, changes) for name in FAMILIES for changes in (
    {}, {"tie_word_embeddings": False},
    *([{"share_encoder_decoder_embeddings": False, "decoder_vocab_size": 33}] if name == "marian" else []))]


def test_every_registered_family_has_its_tiny_model_here():
    assert set(TINY) == set(FAMILIES)


def imported(name: str, changes: dict):
    """(transformers' model, its state dict as float32 arrays, the config of its config.json, tie_word_embeddings)."""
    model = build(name, seed=7, **changes)
    state = {key: value.detach().numpy() for key, value in model.state_dict().items()}
    hf = model.config.to_diff_dict()
    config = config_from_hf(hf, model.generation_config.to_diff_dict())
    return model, state, config, hf.get("tie_word_embeddings", True) is True


def first_present(entry, state: dict) -> str:
    return next(name for name in entry.names if name in state)


@pytest.mark.parametrize(("name", "changes"), VARIANTS, ids=[f"{n}-{'-'.join(c) or 'tied'}" for n, c in VARIANTS])
def test_the_table_reads_every_tensor_of_a_random_model_once(name, changes):
    model, state, config, tie = imported(name, changes)
    table = FAMILIES[name].weight_table(config, tie)
    shapes = parameter_shapes(config)
    assert list(table) == [key for key in table if key in shapes] and set(table) == set(shapes)
    read = [first_present(entry, state) for entry in table.values()]
    assert len(read) == len(set(read))                                      # no state tensor read twice
    left = {key for key in state if key not in read}
    copies = {key for entry in table.values() for key in entry.names[1:]}
    assert {key for key in left if not key.endswith(FAMILIES[name].IGNORED)} <= copies, "a tensor nothing reads"
    for (ours, entry), theirs in zip(table.items(), read):
        value = state[theirs].reshape(-1) if entry.row else state[theirs]
        assert (value.T if entry.transpose else value).shape == shapes[ours], (ours, theirs)
        owner = model.get_submodule(theirs.rpartition(".")[0])
        linear = isinstance(owner, torch.nn.Linear) and theirs.endswith(".weight")
        assert entry.transpose == linear, f"{ours} ({theirs}): transposed exactly when it is an nn.Linear weight"
    params = convert(config, name, state, tie)
    for (ours, entry), theirs in zip(table.items(), read):
        value = state[theirs].reshape(-1) if entry.row else state[theirs]
        assert np.array_equal(params[ours], value.T if entry.transpose else value), ours
    written = FAMILIES[name].hf_weights(config, params)
    for theirs in read:
        assert np.array_equal(written[theirs], state[theirs]), theirs


@pytest.mark.parametrize("name", FAMILIES)
def test_a_tensor_of_another_shape_is_refused_naming_it(name):
    _, state, config, tie = imported(name, {})
    theirs = "model.decoder.layers.1.fc1.weight"
    state[theirs] = state[theirs][:, :-1]
    with pytest.raises(ValueError, match=rf"^tensor '{re.escape(theirs)}' has shape \(24, 15\); the config gives "
                                         r"the checkpoint's 'decoder\.layers\.1\.ffn\.linear1\.weight' the shape "
                                         r"\(16, 24\)$"):
        convert(config, name, state, tie)


def test_the_registry_holds_each_family_by_its_model_type():
    protocol = {member for member in vars(Family) if not member.startswith("_")} | set(Family.__annotations__)
    for model_type, module in FAMILIES.items():
        assert module.MODEL_TYPE == model_type and family(model_type) is module
        assert all(hasattr(module, member) for member in protocol), model_type
    classes = [name for kind in TOKENIZER_KINDS.values() for name in kind.classes]
    assert len(classes) == len(set(classes))                                  # one kind per tokenizer class
    with pytest.raises(ValueError, match=r"^config.json model_type 't5' is not supported \(supported: 'marian', "
                                         r"'m2m_100', 'pegasus', 'bart', 'mbart': Marian/opus-mt, M2M100 and "
                                         r"NLLB, Pegasus, BART, mBART and mBART-50\)$"):
        family("t5")


def test_the_export_writes_each_config_as_the_one_family_that_claims_it():
    for config, expected in ((TransformerConfig.preset("tiny", layer_norm_eps=1e-5), "marian"),
                             (TransformerConfig.preset("tiny", layer_norm_eps=1e-5, norm_first=True,
                                                       sinusoidal_layout="fairseq", tgt_vocab_size=19), "m2m_100"),
                             (TransformerConfig.preset("tiny", layer_norm_eps=1e-5, norm_first=True,
                                                       tgt_vocab_size=19), "pegasus"),
                             (TransformerConfig.preset("tiny", layer_norm_eps=1e-5, positional_encoding="learned",
                                                       position_offset=2, embedding_norm=True, tgt_vocab_size=19),
                              "bart"),
                             (TransformerConfig.preset("tiny", layer_norm_eps=1e-5, norm_first=True,
                                                       positional_encoding="learned", position_offset=2,
                                                       embedding_norm=True, tgt_vocab_size=19), "mbart")):
        assert [module.MODEL_TYPE for module in FAMILIES.values() if module.claims(config)] == [expected]
        assert family_for(config) is FAMILIES[expected]


# The names of the family layer: its package and the modules it replaced in the reference
FAMILY_MODULES = re.compile(r"\btransformer_hf\b|\bhf_(import|export|tokenizer)\b|\bpretrained\b")


@pytest.mark.parametrize("package", ["reference_numpy", "transformer_torch", "transformer_jax", "transformer_tf"])
def test_the_reference_and_the_ports_name_no_family_module(package):
    """Nothing in the reference or a port imports the family layer or names one of its modules (import-linter's
    layers contract, tests/project/test_layers.py, refuses the imports too)."""
    for path in sorted((ROOT / package).rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                modules = [alias.name for alias in node.names] + [getattr(node, "module", None) or ""]
                assert not any(module.split(".")[0] == "transformer_hf" for module in modules), path
        named = [line for line in text.splitlines() if FAMILY_MODULES.search(line)]
        assert named == [], f"{path.relative_to(ROOT)} names the family layer: {named[0]}"
