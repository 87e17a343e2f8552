"""The reference's backward pass, written by hand: the gradient of the training loss (section 5.4)
with respect to every checkpoint tensor, dropout off.

Each concept of :mod:`.model` has one function here, named after it, that computes the concept's
output with :mod:`.model`'s own code and returns it with its **backward** function::

    out, backward = layer_norm(norm, "encoder.norm", x, grads)
    grad_x = backward(grad_out)          # dL/dx from dL/dout

``backward`` returns the gradient with respect to the concept's input(s) and adds the gradient of
every parameter it reads to ``grads`` (checkpoint name -> array, in checkpoint layout), summing
over uses: the tied embedding of ``share_embeddings`` receives the source embedding's, the
target embedding's and the generator's share. The forward values a backward needs are kept by
its closure, so the forward pass runs once. Each backward function names the derivative it
computes; ``loss_and_gradients`` chains them from the loss back to the embeddings. The loss itself is
:mod:`.training`'s (section 5.4): its caller passes :func:`.training.label_smoothed_cross_entropy` in, and this
module differentiates it without importing :mod:`.training`, which imports this one.

In a low precision P (bfloat16, float16) the backward pass mirrors the forward recipe of :mod:`.precision`: each
concept's backward is computed wide (float64) from the values its forward read (P) and the gradient of its output
(P; float32 for the log-probabilities), and every gradient it returns -- of its inputs and of its parameters -- is
rounded once to P. Gradients that meet (the residual skip and the sublayer, the query, key and value of
self-attention, the memory read by every decoder layer, the three uses of a tied embedding) add in P arithmetic
(:func:`.model.add`); the rows of an embedding's gradient are summed wide and rounded once. The attention weights
and the softmax of the logits are recomputed wide for the backward, as the frameworks' autodiff does from its
float32 values.

Under autocast (:func:`.precision.autocast`, a float32 model) the backward pass is what autodiff gives through the
autocast recipe's casts: each product's gradients are products of P values rounded once to P and widened to their
tensor's dtype (the backward of a cast), a sublayer's P output receives the residual stream's float32 gradient
rounded to P (the backward of the addition's promotion), the softmax, LayerNorm, embedding and loss gradients are
float32, and the parameters' gradients are float32, summed over their uses.

Shapes as in :mod:`.model` (B, H, S, T, Tq, Tk, D, d_k, F, V, L); ``...`` is any leading axes.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from .checkpoint import parameter_shapes
from .model import (
    Decoder,
    DecoderLayer,
    Embeddings,
    Encoder,
    EncoderLayer,
    Generator,
    LayerNorm,
    Linear,
    MultiHeadAttention,
    PositionalEncoding,
    PositionwiseFeedForward,
    Transformer,
    add,
    padding_mask,
    scaled_dot_product_attention,
    target_mask,
)
from .model import activation as model_activation
from .precision import autocast_dtype, cast, is_low, narrow, product_dtype, round_to, wide
from .variants import _erf

Grads = dict[str, np.ndarray]
Backward = Callable[[np.ndarray], np.ndarray]
Sublayer = Callable[[np.ndarray], tuple[np.ndarray, Backward]]
# :func:`.training.label_smoothed_cross_entropy`: (log_probs, labels, pad_id, epsilon) -> the loss, a scalar
Loss = Callable[[np.ndarray, np.ndarray, int, float], np.ndarray]


def _add(grads: Grads, name: str, value: np.ndarray) -> None:
    """Add one use's gradient of the tensor ``name`` to ``grads`` (a tensor used twice receives the sum, in its
    precision)."""
    grads[name] = add(grads[name], value) if name in grads else value


def _sum(gradients: tuple[np.ndarray, ...]) -> np.ndarray:
    """The gradients of one value's uses added in turn, in the value's precision."""
    total = gradients[0]
    for gradient in gradients[1:]:
        total = add(total, gradient)
    return total


def _rows(x: np.ndarray) -> np.ndarray:
    """(..., n) -> (rows, n): every leading axis is a row of the same map."""
    return x.reshape(-1, x.shape[-1])


# ----------------------------------------------------------------------------- attention

def linear(layer: Linear, name: str, x: np.ndarray, grads: Grads) -> tuple[np.ndarray, Backward]:
    """y = x W + b with W stored (in, out), the projection of every sublayer (section 3).

    Shape: x (..., in) -> y (..., out); backward: dL/dy (..., out) -> dL/dx (..., in).
    """
    dtype, stored = product_dtype(layer.weight.dtype), layer.weight.dtype   # under autocast: P, float32

    def backward(grad_y: np.ndarray) -> np.ndarray:
        """dL/dW = x^T dL/dy, dL/db = dL/dy summed over rows, dL/dx = dL/dy W^T; under autocast each one a product
        of P values rounded once to P (the product's backward in P), then widened to its tensor's dtype (the backward
        of autocast's cast), the parameters' gradients summed over uses in float32."""
        rows = _rows(wide(grad_y))
        _add(grads, f"{name}.weight", narrow(_rows(wide(cast(x, dtype))).T @ rows, dtype).astype(stored))  # (in, out)
        _add(grads, f"{name}.bias", narrow(rows.sum(axis=0), dtype).astype(stored))                     # (out,)
        return narrow(wide(grad_y) @ wide(cast(layer.weight, dtype)).T, dtype).astype(x.dtype)          # (..., in)

    return layer(x), backward


def softmax_backward(weights: np.ndarray, grad_weights: np.ndarray) -> np.ndarray:
    """dL/dscores of weights = softmax(scores) over the last axis (Eq. 1):
    dL/ds_j = w_j (dL/dw_j - sum_k w_k dL/dw_k).

    Masked scores (-inf) have weight exactly 0 and so gradient exactly 0; a fully masked row has
    all weights 0 and a zero gradient, never NaN.

    Shape: weights and grad_weights (..., Tq, Tk) -> (..., Tq, Tk).
    """
    return weights * (grad_weights - (weights * grad_weights).sum(axis=-1, keepdims=True))


def attention(query: np.ndarray, key: np.ndarray, value: np.ndarray,
              mask: np.ndarray | None = None) -> tuple[np.ndarray, Callable]:
    """Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V -- Eq. (1), section 3.2.1, by
    :func:`.model.scaled_dot_product_attention` (bool mask, True = may attend; a fully masked
    query row outputs zero).

    Shape: query (..., Tq, d_k), key (..., Tk, d_k), value (..., Tk, d_v) -> (..., Tq, d_v);
    backward: dL/dout (..., Tq, d_v) -> (dL/dQ, dL/dK, dL/dV), shaped like query, key, value.
    """
    mixed = autocast_dtype()
    if mixed is not None:
        return _autocast_attention(query, key, value, mask, mixed)
    dtype = query.dtype
    out, weights = scaled_dot_product_attention(query, key, value, mask)  # weights (..., Tq, Tk)
    query, key, value = wide(query), wide(key), wide(value)
    if is_low(dtype):
        weights = scaled_dot_product_attention(query, key, value, mask)[1]  # unrounded, as autodiff keeps them
    scale = math.sqrt(query.shape[-1])

    def backward(grad_out: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """dL/dV = A^T dL/dout, dL/dA = dL/dout V^T, dL/dscores by :func:`softmax_backward` and
        1/sqrt(d_k), dL/dQ = dL/dscores K, dL/dK = dL/dscores^T Q (A: the weights)."""
        grad_out = wide(grad_out)
        grad_value = np.swapaxes(weights, -1, -2) @ grad_out                                 # (..., Tk, d_v)
        grad_scores = softmax_backward(weights, grad_out @ np.swapaxes(value, -1, -2)) / scale  # (..., Tq, Tk)
        return (narrow(grad_scores @ key, dtype), narrow(np.swapaxes(grad_scores, -1, -2) @ query, dtype),
                narrow(grad_value, dtype))

    return out, backward


def _autocast_attention(query: np.ndarray, key: np.ndarray, value: np.ndarray, mask: np.ndarray | None,
                        low: np.dtype) -> tuple[np.ndarray, Callable]:
    """:func:`attention` under autocast in ``low`` (P): the forward of :func:`.model.scaled_dot_product_attention`
    (S = Q K^T a P product, A = softmax(S / sqrt(d_k)) float32, out = A_P V a P product) and its backward as autodiff
    gives it through the casts: dL/dA_P = dL/dout V^T and dL/dV = A_P^T dL/dout, P products; dL/dA widened;
    dL/dS the float32 softmax backward over sqrt(d_k), rounded to P (the backward of widening S); dL/dQ = dL/dS K and
    dL/dK = dL/dS^T Q, P products."""
    out, rounded = scaled_dot_product_attention(query, key, value, mask)   # rounded: A_P (..., Tq, Tk)
    query, key, value = (wide(cast(t, low)) for t in (query, key, value))
    scale = math.sqrt(query.shape[-1])
    scores = round_to(query @ np.swapaxes(key, -1, -2), low).astype(np.float32)   # as the forward has them
    if mask is not None:
        scores = np.where(mask, scores, -np.inf)
    row_max = scores.max(axis=-1, keepdims=True)
    exp = np.exp((scores - np.where(np.isfinite(row_max), row_max, 0.0)) / scale)
    total = exp.sum(axis=-1, keepdims=True)
    weights = exp / np.where(total > 0, total, 1.0)                            # A, float32

    def backward(grad_out: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        grad_out = wide(grad_out)
        grad_value = round_to(np.swapaxes(wide(rounded), -1, -2) @ grad_out, low)             # (..., Tk, d_v)
        grad_weights = round_to(grad_out @ np.swapaxes(value, -1, -2), low).astype(np.float32)  # (..., Tq, Tk)
        grad_scores = wide(round_to(softmax_backward(weights, grad_weights) / scale, low))     # (..., Tq, Tk)
        return (round_to(grad_scores @ key, low), round_to(np.swapaxes(grad_scores, -1, -2) @ query, low),
                grad_value)

    return out, backward


def _merge_heads(x: np.ndarray) -> np.ndarray:
    """Concat(head_1, ..., head_h), head-major (section 3.2.2). Shape: (B, H, T, d_k) -> (B, T, D)."""
    batch, _, length, _ = x.shape
    return x.transpose(0, 2, 1, 3).reshape(batch, length, -1)                 # (B, T, D)


def multi_head_attention(attn: MultiHeadAttention, name: str, query: np.ndarray, key: np.ndarray,
                         value: np.ndarray, mask: np.ndarray | None, grads: Grads) -> tuple[np.ndarray, Callable]:
    """MultiHead(Q, K, V) = Concat(head_1, ..., head_h) W^O, head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V)
    -- section 3.2.2; head i owns columns i*d_k .. (i+1)*d_k - 1 of W^Q, W^K, W^V.

    Shape: query (B, Tq, D), key and value (B, Tk, D) -> (B, Tq, D); backward: dL/dout (B, Tq, D)
    -> (dL/dquery, dL/dkey, dL/dvalue) (self-attention sums the three, cross-attention the last two).
    """
    q, q_backward = linear(attn.q_proj, f"{name}.q_proj", query, grads)       # (B, Tq, D)
    k, k_backward = linear(attn.k_proj, f"{name}.k_proj", key, grads)         # (B, Tk, D)
    v, v_backward = linear(attn.v_proj, f"{name}.v_proj", value, grads)       # (B, Tk, D)
    split = attn._split_heads
    heads, heads_backward = attention(split(q), split(k), split(v), mask)     # (B, H, Tq, d_k)
    out, o_backward = linear(attn.o_proj, f"{name}.o_proj", _merge_heads(heads), grads)

    def backward(grad_out: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """dL/dConcat through W^O, split into heads like the projections (head-major), each head
        through Eq. (1), merged back and through W^Q, W^K, W^V."""
        grad_q, grad_k, grad_v = heads_backward(split(o_backward(grad_out)))  # (B, H, T, d_k)
        return (q_backward(_merge_heads(grad_q)), k_backward(_merge_heads(grad_k)),
                v_backward(_merge_heads(grad_v)))

    return out, backward


# ----------------------------------------------------------------------------- sublayers

def activation(x: np.ndarray, name: str) -> tuple[np.ndarray, Backward]:
    """The feed-forward network's nonlinearity, :func:`.model.activation` (``config.activation``).

    Shape: x (...) -> (...); backward: dL/dout -> dL/dx, both (...).
    """
    dtype, h = x.dtype, wide(x)

    def backward(grad_out: np.ndarray) -> np.ndarray:
        """relu: dL/dout where x > 0, zero elsewhere; silu: dL/dout (s + x s (1 - s)), s = sigmoid(x);
        gelu: dL/dout (Phi(x) + x phi(x)), phi(x) = exp(-x^2 / 2) / sqrt(2 pi) the standard normal density."""
        if name == "relu":
            return np.where(x > 0, grad_out, np.zeros_like(grad_out))
        if name == "silu":
            with np.errstate(over="ignore"):
                s = 1.0 / (1.0 + np.exp(-h))
            derivative = s + h * s * (1.0 - s)
        else:
            cdf = 0.5 * (1.0 + _erf(h / math.sqrt(2.0)).astype(h.dtype))
            derivative = cdf + h * np.exp(-0.5 * h * h) / math.sqrt(2.0 * math.pi)
        return narrow(wide(grad_out) * derivative, dtype)

    return model_activation(x, name), backward


def feed_forward(ffn: PositionwiseFeedForward, name: str, x: np.ndarray,
                 grads: Grads) -> tuple[np.ndarray, Backward]:
    """FFN(x) = act(x W_1 + b_1) W_2 + b_2 -- Eq. (2), section 3.3 (act: :func:`activation`).

    Shape: x (B, T, D) -> (B, T, D), hidden (B, T, F); backward: dL/dout -> dL/dx, both (B, T, D).
    """
    hidden, hidden_backward = linear(ffn.linear1, f"{name}.linear1", x, grads)          # (B, T, F)
    active, active_backward = activation(hidden, ffn.activation)
    out, out_backward = linear(ffn.linear2, f"{name}.linear2", active, grads)

    def backward(grad_out: np.ndarray) -> np.ndarray:
        """Back through the second projection, the activation and the first projection."""
        return hidden_backward(active_backward(out_backward(grad_out)))

    return out, backward


def layer_norm(norm: LayerNorm, name: str, x: np.ndarray, grads: Grads) -> tuple[np.ndarray, Backward]:
    """y = (x - mean) / sqrt(var + eps) * weight + bias over the last axis, biased variance,
    eps = ``config.layer_norm_eps`` (section 3.1).

    Shape: x (..., D) -> (..., D); backward: dL/dy (..., D) -> dL/dx (..., D).
    """
    dtype, wide_x = x.dtype, wide(x)
    centered = wide_x - wide_x.mean(axis=-1, keepdims=True)                       # (..., D)
    inv_std = 1.0 / np.sqrt((centered ** 2).mean(axis=-1, keepdims=True) + norm.eps)  # (..., 1)
    normalized = centered * inv_std                                                # x_hat (..., D)

    def backward(grad_y: np.ndarray) -> np.ndarray:
        """With g = dL/dy * weight: dL/dx = (g - mean(g) - x_hat mean(g x_hat)) / sqrt(var + eps),
        the means over the D features (the biased variance divides by D); dL/dweight = sum of
        dL/dy x_hat, dL/dbias = sum of dL/dy over every position."""
        grad_y = wide(grad_y)
        _add(grads, f"{name}.weight", narrow(_rows(grad_y * normalized).sum(axis=0), dtype))  # (D,)
        _add(grads, f"{name}.bias", narrow(_rows(grad_y).sum(axis=0), dtype))                # (D,)
        g = grad_y * wide(norm.weight)
        return narrow(inv_std * (g - g.mean(axis=-1, keepdims=True)
                                 - normalized * (g * normalized).mean(axis=-1, keepdims=True)), dtype)

    return norm(x), backward


def residual(norm: LayerNorm, name: str, norm_first: bool, x: np.ndarray, sublayer: Sublayer,
             grads: Grads) -> tuple[np.ndarray, Backward]:
    """Residual connection around ``sublayer`` (section 3.1), as :func:`.model.residual`: post-LN
    (the paper) LayerNorm(x + Sublayer(x)); pre-LN x + Sublayer(LayerNorm(x)). ``name`` is the
    norm's; ``sublayer(h)`` returns (output, backward) like the functions of this module.

    Shape: x (B, T, D) -> (B, T, D); backward: dL/dout -> dL/dx, both (B, T, D).
    """
    if norm_first:
        normed, norm_backward = layer_norm(norm, name, x, grads)
        out, sublayer_backward = sublayer(normed)

        def pre_ln_backward(grad_out: np.ndarray) -> np.ndarray:
            """dL/dx = dL/dout (the skip) + the sublayer's and the norm's chain (the sublayer's P output under
            autocast receiving dL/dout rounded to P: the backward of the addition's type promotion)."""
            return add(grad_out, norm_backward(sublayer_backward(cast(grad_out, out.dtype))))

        return add(x, out), pre_ln_backward
    out, sublayer_backward = sublayer(x)
    summed = add(x, out)
    result, norm_backward = layer_norm(norm, name, summed, grads)

    def post_ln_backward(grad_out: np.ndarray) -> np.ndarray:
        """dL/dsum through the norm; dL/dx = dL/dsum (the skip) + the sublayer's chain of dL/dsum."""
        grad_summed = norm_backward(grad_out)
        return add(grad_summed, sublayer_backward(cast(grad_summed, out.dtype)))

    return result, post_ln_backward


# ----------------------------------------------------------------------------- embeddings

def embeddings(embed: Embeddings, name: str, tokens: np.ndarray,
               grads: Grads) -> tuple[np.ndarray, Callable[[np.ndarray], None]]:
    """E[token] * sqrt(d_model) -- section 3.4.

    Shape: tokens (B, T) int -> (B, T, D); backward: dL/dout (B, T, D) -> None (the tokens are
    integers), adding dL/dE (V, D) to ``grads``.
    """
    dtype = embed.weight.dtype

    def backward(grad_out: np.ndarray) -> None:
        """Row v of dL/dE is the sum, over the positions holding v, of sqrt(d_model) dL/dout (in P: each
        product rounded to P, the sum wide and rounded once)."""
        table = np.zeros(embed.weight.shape, wide(grad_out).dtype)            # (V, D)
        np.add.at(table, tokens, wide(narrow(wide(grad_out) * embed.scale, dtype)))
        _add(grads, f"{name}.weight", narrow(table, dtype))

    return embed(tokens), backward


def positional_encoding(encoding: PositionalEncoding, name: str, learned: bool, x: np.ndarray, tokens: np.ndarray,
                        grads: Grads, by_step: bool = False, position_offset: int = 0) -> tuple[np.ndarray, Backward]:
    """x + PE[rows] -- section 3.5 (rows 0 .. T-1, or :func:`.variants.position_ids` of ``tokens`` in the ``fairseq``
    layout, counted by step with ``by_step``: the decoder's, as :class:`.model.Decoder` counts them); the
    sinusoidal table is fixed, a ``learned`` one (Table 3, row E) is the checkpoint tensor ``{name}.weight``.

    Shape: x (B, T, D), tokens (B, T) -> (B, T, D); backward: dL/dout -> dL/dx = dL/dout, both (B, T, D).
    """
    def backward(grad_out: np.ndarray) -> np.ndarray:
        """A learned table's row t + ``position_offset`` receives dL/dout at position t summed over the batch;
        the rows before position 0 and those after T are unused and receive zero."""
        if learned:
            rows, width = encoding.table.shape
            table = np.zeros((rows + position_offset, width), wide(grad_out).dtype)   # (L + offset, D)
            table[position_offset:position_offset + grad_out.shape[1]] = wide(grad_out).sum(axis=0)
            _add(grads, f"{name}.weight", narrow(table, encoding.table.dtype))
        return grad_out

    return encoding(x, 0, tokens, by_step), backward


def _embedding_norm(norm: LayerNorm | None, name: str, x: np.ndarray, grads: Grads) -> tuple[np.ndarray, Backward]:
    """``config.embedding_norm``'s LayerNorm of the embeddings plus positions (:func:`layer_norm`), or x itself
    without one. Shape: (B, T, D) -> (B, T, D)."""
    if norm is None:
        return x, lambda grad_out: grad_out
    return layer_norm(norm, name, x, grads)


def generator(gen: Generator, name: str, shared: bool, x: np.ndarray, grads: Grads) -> tuple[np.ndarray, Backward]:
    """log_softmax(x W (+ b)) -- section 3.4; the bias ``generator.bias`` only with ``output_bias``. With ``shared``
    (``share_embeddings``), W is the transposed shared embedding ``{name}.weight`` (V, D); otherwise ``{name}.weight``
    is W (D, V).

    Shape: x (B, T, D) -> log-probabilities (B, T, V); backward: dL/dlog_probs (B, T, V) -> dL/dx (B, T, D).
    """
    log_probs, dtype, stored = gen(x), product_dtype(gen.weight.dtype), gen.weight.dtype   # (B, T, V)
    probs = np.exp(wide(log_probs))                                            # float32 in P, as autodiff keeps

    def backward(grad_log_probs: np.ndarray) -> np.ndarray:
        """dL/dlogits = dL/dlog_probs - softmax * (sum over V of dL/dlog_probs) (the log-softmax),
        dL/dW = x^T dL/dlogits (D, V), given to a shared embedding transposed (V, D);
        dL/db = dL/dlogits summed over every position; dL/dx = dL/dlogits W^T."""
        grad = wide(grad_log_probs)
        grad_logits = narrow(grad - probs * grad.sum(axis=-1, keepdims=True), dtype)  # (B, T, V)
        grad_weight = narrow(_rows(wide(cast(x, dtype))).T @ _rows(wide(grad_logits)), dtype).astype(stored)  # (D, V)
        _add(grads, f"{name}.weight", grad_weight.T if shared else grad_weight)
        if gen.bias is not None:
            _add(grads, "generator.bias", narrow(_rows(wide(grad_logits)).sum(axis=0), dtype).astype(stored))  # (V,)
        return narrow(wide(grad_logits) @ wide(cast(gen.weight, dtype)).T, dtype).astype(x.dtype)   # (B, T, D)

    return log_probs, backward


def label_smoothed_cross_entropy(loss: Loss, log_probs: np.ndarray, labels: np.ndarray, pad_id: int,
                                 epsilon: float) -> tuple[float, Callable[[float], np.ndarray]]:
    """The loss of section 5.4 by ``loss``, :func:`.training.label_smoothed_cross_entropy` (its checks, its
    ValueErrors): the mean over the n non-pad labels of -sum_k q(k) log p(k), with
    q = (1 - epsilon) one_hot(label) + epsilon / V.

    Shape: log_probs (B, T, V), labels (B, T) int -> scalar; backward: dL/dloss (a float) -> dL/dlog_probs (B, T, V).
    """
    value = loss(log_probs, labels, pad_id, epsilon)
    labels = np.asarray(labels)
    real = labels != pad_id                                                    # (B, T)

    def backward(grad_loss: float = 1.0) -> np.ndarray:
        """The loss is linear in log_probs: dL/dlog p(k) = -q(k) / n at non-pad positions, 0 at pad ones."""
        smoothing = epsilon / log_probs.shape[-1]
        target = np.full(log_probs.shape, smoothing, dtype=log_probs.dtype)                  # q (B, T, V)
        np.put_along_axis(target, labels[..., None], smoothing + (1.0 - epsilon), axis=-1)
        weight = ((grad_loss / real.sum()) * real).astype(log_probs.dtype)                 # (B, T)
        return -target * weight[..., None]

    return float(value), backward


# ----------------------------------------------------------------------------- layers and stacks

def encoder_layer(layer: EncoderLayer, name: str, x: np.ndarray, mask: np.ndarray | None,
                  grads: Grads) -> tuple[np.ndarray, Backward]:
    """Self-attention then feed-forward, each in :func:`residual` (section 3.1).

    Shape: x (B, S, D) -> (B, S, D); backward: dL/dout -> dL/dx, both (B, S, D).
    """
    def self_attention(h: np.ndarray) -> tuple[np.ndarray, Backward]:
        out, attn_backward = multi_head_attention(layer.self_attn, f"{name}.self_attn", h, h, h, mask, grads)
        return out, lambda grad: _sum(attn_backward(grad))                    # query, key and value are h

    x, attn_backward = residual(layer.self_attn_norm, f"{name}.self_attn_norm", layer.norm_first, x,
                                self_attention, grads)
    x, ffn_backward = residual(layer.ffn_norm, f"{name}.ffn_norm", layer.norm_first, x,
                               lambda h: feed_forward(layer.ffn, f"{name}.ffn", h, grads), grads)
    return x, lambda grad_out: attn_backward(ffn_backward(grad_out))


def decoder_layer(layer: DecoderLayer, name: str, x: np.ndarray, memory: np.ndarray,
                  src_mask: np.ndarray | None, tgt_mask: np.ndarray | None,
                  grads: Grads) -> tuple[np.ndarray, Callable]:
    """Masked self-attention, encoder-decoder attention, feed-forward, each in :func:`residual`
    (sections 3.1 and 3.2.3).

    Shape: x (B, T, D), memory (B, S, D) -> (B, T, D); backward: dL/dout (B, T, D) ->
    (dL/dx (B, T, D), dL/dmemory (B, S, D): the keys' and the values' shares).
    """
    grad_memory: list[np.ndarray] = []

    def self_attention(h: np.ndarray) -> tuple[np.ndarray, Backward]:
        out, attn_backward = multi_head_attention(layer.self_attn, f"{name}.self_attn", h, h, h, tgt_mask, grads)
        return out, lambda grad: _sum(attn_backward(grad))

    def cross_attention(h: np.ndarray) -> tuple[np.ndarray, Backward]:
        out, attn_backward = multi_head_attention(layer.cross_attn, f"{name}.cross_attn", h, memory, memory,
                                                  src_mask, grads)

        def backward(grad: np.ndarray) -> np.ndarray:
            grad_query, grad_key, grad_value = attn_backward(grad)
            grad_memory.append(add(grad_key, grad_value))
            return grad_query

        return out, backward

    x, self_backward = residual(layer.self_attn_norm, f"{name}.self_attn_norm", layer.norm_first, x,
                                self_attention, grads)
    x, cross_backward = residual(layer.cross_attn_norm, f"{name}.cross_attn_norm", layer.norm_first, x,
                                 cross_attention, grads)
    x, ffn_backward = residual(layer.ffn_norm, f"{name}.ffn_norm", layer.norm_first, x,
                               lambda h: feed_forward(layer.ffn, f"{name}.ffn", h, grads), grads)

    def backward(grad_out: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        grad_x = self_backward(cross_backward(ffn_backward(grad_out)))
        return grad_x, grad_memory.pop()

    return x, backward


def encoder(stack: Encoder, name: str, x: np.ndarray, mask: np.ndarray | None,
            grads: Grads) -> tuple[np.ndarray, Backward]:
    """N encoder layers, then (pre-LN) the stack's final LayerNorm (section 3.1).

    Shape: x (B, S, D) -> (B, S, D); backward: dL/dout -> dL/dx, both (B, S, D).
    """
    backwards = []
    for i, layer in enumerate(stack.layers):
        x, layer_backward = encoder_layer(layer, f"{name}.layers.{i}", x, mask, grads)
        backwards.append(layer_backward)
    if stack.norm is not None:
        x, norm_backward = layer_norm(stack.norm, f"{name}.norm", x, grads)
        backwards.append(norm_backward)

    def backward(grad_out: np.ndarray) -> np.ndarray:
        for step_backward in reversed(backwards):
            grad_out = step_backward(grad_out)
        return grad_out

    return x, backward


def decoder(stack: Decoder, name: str, x: np.ndarray, memory: np.ndarray, src_mask: np.ndarray | None,
            tgt_mask: np.ndarray | None, grads: Grads) -> tuple[np.ndarray, Callable]:
    """N decoder layers, then (pre-LN) the stack's final LayerNorm (section 3.1).

    Shape: x (B, T, D), memory (B, S, D) -> (B, T, D); backward: dL/dout (B, T, D) ->
    (dL/dx (B, T, D), dL/dmemory (B, S, D) summed over the layers).
    """
    backwards = []
    for i, layer in enumerate(stack.layers):
        x, layer_backward = decoder_layer(layer, f"{name}.layers.{i}", x, memory, src_mask, tgt_mask, grads)
        backwards.append(layer_backward)
    x, norm_backward = (x, None) if stack.norm is None else layer_norm(stack.norm, f"{name}.norm", x, grads)

    def backward(grad_out: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        grad_out = grad_out if norm_backward is None else norm_backward(grad_out)
        grad_memory = np.zeros_like(memory)                                    # (B, S, D)
        for layer_backward in reversed(backwards):
            grad_out, layer_grad_memory = layer_backward(grad_out)
            grad_memory = add(grad_memory, layer_grad_memory)
        return grad_out, grad_memory

    return x, backward


# ----------------------------------------------------------------------------- the model

def loss_and_gradients(model: Transformer, loss: Loss, src: np.ndarray, tgt: np.ndarray, labels: np.ndarray,
                       epsilon: float, scale: float = 1.0) -> tuple[float, dict[str, np.ndarray]]:
    """The label-smoothed loss of section 5.4 (:func:`.training.loss`, the model's default masks,
    dropout off; ``loss`` is :func:`.training.label_smoothed_cross_entropy`) and its gradient with respect to every
    checkpoint tensor, by name, in checkpoint layout and the model's dtype. Bad input gets the ValueErrors of
    :func:`.training.loss`. With ``scale`` (float16's loss scaling) the gradients are those of ``scale`` times the
    loss.

    Shape: src (B, S), tgt (B, T) the shifted-right input, labels (B, T) the next tokens.
    """
    config = model.config
    src, tgt = model._check_inputs(src, tgt, None, None)
    src_mask, tgt_mask = padding_mask(src, config.pad_id), target_mask(tgt, config.pad_id)
    shared = config.share_embeddings
    src_name, tgt_name, generator_name = ("shared_embed",) * 3 if shared else ("src_embed", "tgt_embed", "generator")
    learned = config.positional_encoding == "learned"
    grads: Grads = {}

    x, src_embed_backward = embeddings(model.src_embed, src_name, src, grads)
    x, src_pos_backward = positional_encoding(model.src_pos, "src_pos_embed", learned, x, src, grads,
                                              position_offset=config.position_offset)
    x, src_norm_backward = _embedding_norm(model.src_embed_norm, "src_embed_norm", x, grads)
    memory, encoder_backward = encoder(model.encoder, "encoder", x, src_mask, grads)
    y, tgt_embed_backward = embeddings(model.tgt_embed, tgt_name, tgt, grads)
    y, tgt_pos_backward = positional_encoding(model.tgt_pos, "tgt_pos_embed", learned, y, tgt, grads, by_step=True,
                                              position_offset=config.position_offset)
    y, tgt_norm_backward = _embedding_norm(model.tgt_embed_norm, "tgt_embed_norm", y, grads)
    out, decoder_backward = decoder(model.decoder, "decoder", y, memory, src_mask, tgt_mask, grads)
    log_probs, generator_backward = generator(model.generator, generator_name, shared, out, grads)
    value, loss_backward = label_smoothed_cross_entropy(loss, log_probs, labels, config.pad_id, epsilon)

    grad_y, grad_memory = decoder_backward(generator_backward(loss_backward(scale)))
    tgt_embed_backward(tgt_pos_backward(tgt_norm_backward(grad_y)))
    src_embed_backward(src_pos_backward(src_norm_backward(encoder_backward(grad_memory))))
    return value, {name: grads[name].astype(model.dtype, copy=False) for name in parameter_shapes(config)}
