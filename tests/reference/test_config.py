"""The configuration: Table 3 presets, JSON round trip, one clear error per invalid field, and the architecture's
config holding its decoding's while the header stays one flat object."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from equivalence.cases import VARIANTS
from reference_numpy import PRESETS, DecodingConfig, TransformerConfig
from reference_numpy.config import DECODING_CONVENTIONS


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


# ----------------------------------------------------------------------------- the architecture and the decoding

# The header of a config with imported conventions, as the checkpoint holds it: one flat object, sorted
FLAT_HEADER = (
    '{"activation": "silu", "beam_size": 4, "bos_id": 1, "d_ff": 40, "d_model": 16, "decoder_start_id": 0, '
    '"dropout": 0.1, "early_stopping": true, "embedding_norm": false, "eos_id": 2, "forced_bos_id": null, '
    '"forced_eos": true, '
    '"forced_eos_id": null, "layer_norm_eps": 1e-06, "length_normalization": "hf", "length_penalty": 1.0, '
    '"max_len": 64, "max_output_length": 20, "min_output_length": 3, "n_decoder_layers": 3, "n_encoder_layers": 2, '
    '"n_heads": 4, "no_repeat_ngram_size": 2, "norm_first": false, "output_bias": true, "pad_id": 0, '
    '"position_offset": 0, '
    '"positional_encoding": "sinusoidal", "renormalize": true, "repetition_penalty": 1.3, "scale_embeddings": true, '
    '"share_embeddings": false, '
    '"sinusoidal_layout": "halves", "src_vocab_size": 19, "suppressed_ids": [0], "tgt_vocab_size": 23}')


def test_the_header_is_one_flat_object_of_the_architecture_and_its_decoding():
    config = TransformerConfig.from_json(FLAT_HEADER)
    assert (config.activation, config.output_bias, config.sinusoidal_layout) == ("silu", True, "halves")
    assert config.decoding == DecodingConfig(
        decoder_start_id=0, suppressed_ids=(0,), renormalize=True, max_output_length=20, forced_eos=True,
        length_normalization="hf", length_penalty=1.0, early_stopping=True, beam_size=4, min_output_length=3,
        no_repeat_ngram_size=2, repetition_penalty=1.3)
    assert config.to_json() == FLAT_HEADER                                   # the same bytes written back
    assert set(config.to_dict()) == {f.name for f in dataclasses.fields(TransformerConfig)} - {"decoding"} \
        | set(DECODING_CONVENTIONS)
    older = {name: value for name, value in json.loads(FLAT_HEADER).items() if name not in DECODING_CONVENTIONS}
    assert TransformerConfig.from_dict(older) == config.paper_decoding()     # a header without them: section 6.1's
    assert config.paper_decoding().decoding == DecodingConfig()
    # a header before the embedding LayerNorm and the position offset: the paper's choices of both
    before = {name: value for name, value in json.loads(FLAT_HEADER).items()
              if name not in ("embedding_norm", "position_offset")}
    assert TransformerConfig.from_dict(before) == config


def test_the_decoding_is_changed_through_its_own_config():
    config = TransformerConfig.preset("tiny")
    assert config.with_decoding(beam_size=4).decoding.beam_size == 4
    assert config.with_decoding(beam_size=4) == config.replace(decoding=DecodingConfig(beam_size=4))
    with pytest.raises(ValueError, match=r"^beam_size is a field of the config's decoding: "
                                         r"config\.with_decoding\(beam_size=\.\.\.\)$"):
        config.replace(beam_size=4)
    with pytest.raises(ValueError, match=r"^decoding must be a DecodingConfig, got dict$"):
        config.replace(decoding={"beam_size": 4})
    with pytest.raises(ValueError, match=r"^unknown decoding config field 'beam'$"):
        config.with_decoding(beam=4)


def test_the_decoding_checks_its_fields_and_the_config_them_against_the_model():
    """Alone, a decoding knows no vocabulary: a start token of 99 is an id; held by ``tiny`` (23 target tokens), it
    is refused, as is eos among the suppressed tokens and a forced first token that is pad."""
    assert DecodingConfig(decoder_start_id=99, suppressed_ids=[2]).suppressed_ids == (2,)
    for changes, message in (({"decoder_start_id": 99}, "decoder_start_id (99) must be below tgt_vocab_size (23)"),
                             ({"suppressed_ids": (2,)}, "suppressed_ids must be ids below tgt_vocab_size (23), eos_id"),
                             ({"forced_bos_id": 0}, "forced_bos_id (0) must be a target token id")):
        with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
            TransformerConfig.preset("tiny", decoding=DecodingConfig(**changes))
