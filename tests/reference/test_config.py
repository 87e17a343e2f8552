"""The configuration: Table 3 presets, JSON round trip, and one clear error per invalid field."""

from __future__ import annotations

import dataclasses

import pytest

from equivalence.cases import VARIANTS
from reference_numpy import PRESETS, TransformerConfig


def test_presets_follow_table_3():
    base, big = TransformerConfig.preset("base"), TransformerConfig.preset("big")
    assert (base.n_encoder_layers, base.n_decoder_layers, base.d_model, base.d_ff, base.n_heads, base.dropout) == \
        (6, 6, 512, 2048, 8, 0.1)
    assert (big.n_encoder_layers, big.n_decoder_layers, big.d_model, big.d_ff, big.n_heads, big.dropout) == \
        (6, 6, 1024, 4096, 16, 0.3)
    assert base.d_k == 64 and big.d_k == 64                                   # d_k = d_v = 64 in both
    for config in (base, big):
        assert (config.layer_norm_eps, config.norm_first, config.positional_encoding) == (1e-6, False, "sinusoidal")


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        TransformerConfig().d_model = 8


@pytest.mark.parametrize("config", [*PRESETS.values(), *VARIANTS.values()], ids=[*PRESETS, *VARIANTS])
def test_json_round_trip(config):
    assert TransformerConfig.from_json(config.to_json()) == config


def test_preset_overrides_are_validated():
    assert TransformerConfig.preset("tiny", d_ff=8).d_ff == 8
    with pytest.raises(ValueError, match="d_ff"):
        TransformerConfig.preset("tiny", d_ff=0)


@pytest.mark.parametrize("field, value", [
    ("d_model", 30), ("d_model", 0), ("d_model", 7), ("n_heads", -1), ("n_heads", 2.0), ("d_ff", 0),
    ("src_vocab_size", 0), ("tgt_vocab_size", -3), ("n_encoder_layers", 0), ("n_decoder_layers", 0),
    ("max_len", 0), ("dropout", 1.0), ("dropout", -0.1), ("dropout", "0.1"), ("layer_norm_eps", 0.0),
    ("positional_encoding", "rotary"), ("norm_first", 1), ("share_embeddings", "yes"), ("pad_id", -1),
    ("eos_id", 40000),
])
def test_invalid_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field) as info:
        dataclasses.replace(PRESETS["base"], **{field: value})
    assert "\n" not in str(info.value)


def test_d_model_must_be_even_for_sin_cos_pairs():
    with pytest.raises(ValueError, match="d_model .* must be even"):
        TransformerConfig(d_model=9, n_heads=3)


def test_sharing_needs_equal_vocabularies():
    with pytest.raises(ValueError, match="share_embeddings"):
        TransformerConfig(src_vocab_size=10, tgt_vocab_size=11, share_embeddings=True)


def test_special_ids_must_differ():
    with pytest.raises(ValueError, match="pad_id, bos_id and eos_id"):
        TransformerConfig(bos_id=0)


def test_unknown_preset_and_unknown_json_field():
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        TransformerConfig.preset("huge")
    with pytest.raises(ValueError, match="unknown config field 'd_modle'"):
        TransformerConfig.from_json('{"d_modle": 512}')
    with pytest.raises(ValueError, match="not valid JSON"):
        TransformerConfig.from_json("{")
