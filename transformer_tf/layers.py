"""Keras plumbing of the TensorFlow port's layers: framework idiom, not section 3, so not in :mod:`.model`.

The serialization registry (``register``), the base class that keeps a layer's config for ``get_config`` and takes
masks as plain inputs (``_TransformerLayer``), the reference's ``Linear`` as a ``keras.layers.Dense`` (``_Dense``),
the building of sublayers whose shapes the config fixes (``_build_all``), and Keras' one model input
(``_one_input``). TensorFlow only: the other backends' frameworks need none of it (docs/ports.md, "Layers").
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import keras
import tensorflow as tf

from reference_numpy.config import TransformerConfig

from .precision import autocast_dtype, narrow, parse_dtype, wide

register = keras.saving.register_keras_serializable(package="transformer_tf")
MIXED_POLICIES = ("mixed_bfloat16", "mixed_float16")   # Keras' mixed precision: the autocast recipe


def _checked_dtype(dtype: Any) -> Any:
    """``Transformer``'s ``dtype`` for Keras: one of the four dtypes of ``parse_dtype`` by name, or a dtype policy (a
    mixed one's name, a ``keras.DTypePolicy`` or its config, None: Keras' global one) that computes by the autocast
    recipe (a mixed policy) or in one of the four."""
    if dtype is not None and not isinstance(dtype, (keras.DTypePolicy, dict)) and dtype not in MIXED_POLICIES:
        return parse_dtype(dtype).name
    policy = keras.dtype_policies.get(dtype)
    if autocast_dtype(policy) is None:
        parse_dtype(policy.name)
    return dtype


@register
class _Dense(keras.layers.Dense):
    """The reference's ``Linear``: ``keras.layers.Dense``, y = x W + b, W stored (in, out).

    Shape: x (..., in) -> y (..., out).
    """

    def call(self, inputs, training=None):
        return narrow(super().call(wide(inputs)), self.compute_dtype)


class _TransformerLayer(keras.layers.Layer):
    """Keras plumbing of :mod:`.model`'s layers: the config kept for ``get_config``, masks as plain inputs."""

    def __init__(self, config: TransformerConfig | dict, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.config = _as_config(config)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        arguments = self._call_signature.bind(*args, **kwargs).arguments
        return super().__call__(**tf.nest.map_structure(_without_keras_mask, arguments))

    def get_config(self) -> dict:
        return {**super().get_config(), "config": self.config.to_dict()}

    def compute_mask(self, inputs: object, previous_mask: object) -> None:
        """Attention masks are not Keras sequence masks: outputs carry none."""
        return None

    def _sublayer_kwargs(self, name: str) -> dict:
        return {"name": name, "dtype": self.dtype_policy}

    @property
    def input_dtype(self) -> str:
        """The dtype Keras converts float inputs to: the compute dtype, or float32 for a layer reading the residual
        stream under a mixed policy.
        """
        return self.dtype_policy.variable_dtype if self._STREAM else self.compute_dtype

    _STREAM = False


class _Stream(_TransformerLayer):
    """A layer of the residual stream (the encoder's and decoder's layers and stacks): float32 under a mixed policy."""

    _STREAM = True


def _as_config(config: TransformerConfig | dict) -> TransformerConfig:
    """The config given to a layer, or rebuilt from its dict (``from_config``)."""
    return config if isinstance(config, TransformerConfig) else TransformerConfig.from_dict(config)


def _without_keras_mask(value: object) -> object:
    if getattr(value, "_keras_mask", None) is not None:
        return tf.identity(value)  # a new tensor, without the mask attribute
    return value


def _build_all(layers: Iterable[keras.layers.Layer], config: TransformerConfig) -> None:
    """Build sublayers whose weight shapes depend only on the config (inputs (..., D))."""
    for layer in layers:
        layer.build((None, config.d_model))


def _one_input(inputs: Any) -> tuple[Any, Any]:
    """(src, tgt) of Keras' one model input: a pair or a dict of exactly "src" and "tgt"; else one ValueError naming
    ``src``.
    """
    if isinstance(inputs, dict) and sorted(inputs) == ["src", "tgt"]:
        return inputs["src"], inputs["tgt"]
    if isinstance(inputs, (tuple, list)) and len(inputs) == 2:
        return inputs[0], inputs[1]
    kind = f"a dict with the keys {sorted(inputs)}" if isinstance(inputs, dict) else \
        f"a {type(inputs).__name__} of {len(inputs)}" if isinstance(inputs, (tuple, list)) else "one tensor"
    raise ValueError(f"src: without tgt, the model's input must be a (src, tgt) pair or a dict with the keys 'src' "
                     f"and 'tgt', got {kind}")
