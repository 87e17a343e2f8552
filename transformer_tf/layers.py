"""Keras plumbing of the TensorFlow port's layers: framework idiom, not section 3, so not in :mod:`.model`.

The serialization registry (``register``; every public layer class is registered as it is defined,
``_Registered``), the base class that builds a layer's sublayers, derives ``get_config``
from its constructor's arguments and takes masks as plain inputs (``_TransformerLayer``), ``LayerNorm``'s config
(``_Normalization``), the model's base (``_Model``: token inputs, checked before Keras' ``__call__``, and Keras' one
model input ``_one_input``), the reference's ``Linear`` as a ``keras.layers.Dense`` (``_Dense``), the generator's
product, whose weight no ``Dense`` holds (``_logits``) and the embeddings' tables (``_uniform_weight``).
TensorFlow only: the other backends' frameworks need none of it (docs/ports.md, "Layers").
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterable
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
    """The reference's ``Linear``: ``keras.layers.Dense``, y = x W + b, W stored (in, out), built on its
    ``in_features`` whatever input shape it is built on (``nn.Linear(in_features, out_features)``'s order).

    Shape: x (..., in) -> y (..., out).
    """

    def __init__(self, in_features: int, units: int, **kwargs: Any) -> None:
        super().__init__(units, **kwargs)
        self.in_features = in_features

    def build(self, input_shape: Any = None) -> None:
        super().build((None, self.in_features))

    def call(self, inputs, training=None):
        return narrow(super().call(wide(inputs)), self.compute_dtype)

    def get_config(self) -> dict:
        return {**super().get_config(), "in_features": self.in_features}


class _Registered:
    """Every public class of the package's layers registered for Keras serialization (``register``) as it is
    defined: :mod:`.model`'s concepts carry no decorator."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__module__.split(".")[0] == __name__.split(".")[0] and not cls.__name__.startswith("_"):
            register(cls)


class _TransformerLayer(_Registered, keras.layers.Layer):
    """Keras plumbing of :mod:`.model`'s layers: the config kept for ``get_config``, the sublayers built on inputs
    (..., D), masks as plain inputs."""

    def __init__(self, config: TransformerConfig | dict, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.config = _as_config(config)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        arguments = self._call_signature.bind(*args, **kwargs).arguments
        return super().__call__(**tf.nest.map_structure(_without_keras_mask, arguments))

    def build(self, input_shape: Any = None) -> None:
        """The sublayers, in the order they were made: their weight shapes depend only on the config."""
        _build_all(self._layers, self.config)

    def get_config(self) -> dict:
        return {**super().get_config(), **_constructor_config(self)}

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


class _Normalization(_Registered, keras.layers.LayerNormalization):
    """``LayerNorm``'s Keras plumbing: its config is the ``TransformerConfig`` alone (axis and epsilon follow from
    it), so ``get_config`` skips ``keras.layers.LayerNormalization``'s own."""

    config: TransformerConfig

    def get_config(self) -> dict:
        return {**keras.layers.Layer.get_config(self), **_constructor_config(self)}


class _Model(_TransformerLayer, keras.Model):
    """The model's Keras plumbing: token ids as inputs, the sublayers built on construction, every input checked
    before Keras' ``__call__``, where ``src`` alone may be Keras' one input (a (src, tgt) pair or a dict,
    :func:`_one_input`)."""

    input_dtype = "int64"                                               # token ids (Keras' property, overridden)
    _check_inputs: Callable[..., tuple[Any, Any]]

    def __init__(self, config: TransformerConfig | dict, dtype: Any = "float64", **kwargs: Any) -> None:
        super().__init__(config, dtype=_checked_dtype(dtype), **kwargs)

    def build(self, src_shape: Any = (None, None), tgt_shape: Any = (None, None)) -> None:
        """The sublayers, for token ids of shape (batch, length), both free."""
        _build_all(self._layers, self.config)

    def __call__(self, src, tgt=None, src_mask=None, tgt_mask=None, *args, **kwargs):
        """The model's ``call`` through Keras, its inputs checked first (``_check_inputs``), on the host."""
        if tgt is None:
            src, tgt = _one_input(src)
        src, tgt = self._check_inputs(src, tgt, src_mask, tgt_mask)
        return super().__call__(src, tgt, src_mask, tgt_mask, *args, **kwargs)


class _Generator(_TransformerLayer):
    """The generator's weights as tensors: the (D, V) weight, the shared embedding's transposed or its own, and the
    (V,) bias of ``output_bias`` or None."""

    embeddings: Any
    weight: Any
    bias: Any

    def _weight(self) -> tf.Tensor:
        if self.embeddings is not None:
            return tf.transpose(self.embeddings.weight)
        return tf.convert_to_tensor(self.weight)

    def _bias(self) -> tf.Tensor | None:
        return None if self.bias is None else tf.convert_to_tensor(self.bias)


def _constructor_config(layer: keras.layers.Layer) -> dict:
    """The config a layer's constructor reads back (``from_config``): the ``TransformerConfig`` as a dict, and each
    other argument of the constructor that the layer keeps as a plain value of the same name (``Embeddings``'
    ``vocab_size``); a layer argument (``Generator``'s shared ``embeddings``) is the model's to give, and the dtype
    policy is Keras' own config."""
    arguments = [name for name in inspect.signature(type(layer).__init__).parameters
                 if name not in ("self", "config", "dtype", "args", "kwargs")]
    plain = {name: getattr(layer, name) for name in arguments
             if isinstance(getattr(layer, name, None), (bool, int, float, str))}
    return {"config": layer.config.to_dict(), **plain}


def _as_config(config: TransformerConfig | dict) -> TransformerConfig:
    """The config given to a layer, or rebuilt from its dict (``from_config``)."""
    return config if isinstance(config, TransformerConfig) else TransformerConfig.from_dict(config)


def _without_keras_mask(value: object) -> object:
    if getattr(value, "_keras_mask", None) is not None:
        return tf.identity(value)  # a new tensor, without the mask attribute
    return value


def _build_all(layers: Iterable[keras.layers.Layer], config: TransformerConfig) -> None:
    """Build the sublayers not built yet (a shared one is built once) whose weight shapes depend only on the config
    (inputs (..., D))."""
    for layer in layers:
        if not layer.built:
            layer.build((None, config.d_model))


def _uniform_weight(layer: _TransformerLayer, shape: tuple[int, int]) -> keras.Variable:
    """An embedding table, the ``layer``'s ``weight`` of ``shape`` (rows, D): uniform with standard deviation
    d_model^-0.5."""
    limit = math.sqrt(3.0 / layer.config.d_model)
    return layer.add_weight(name="weight", shape=shape, initializer=keras.initializers.RandomUniform(-limit, limit))


def _logits(x: tf.Tensor, weight: tf.Tensor, bias: tf.Tensor | None = None) -> tf.Tensor:
    """x W (+ b) with a given (D, V) ``weight`` and (V,) ``bias`` or None, as the log-softmax reads them (a low
    precision's widened). Shape: x (..., D) -> (..., V)."""
    logits = tf.matmul(wide(x), wide(weight))
    if bias is not None:
        logits = logits + wide(bias)
    logits = narrow(logits, x.dtype)                                   # (..., V)
    return wide(logits)


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
