"""Decision margins of the float64 reference's decoding: how far each choice was from going the other way.

The float32 token rules of :mod:`equivalence.tolerance` (``greedy_tokens_agree``, ``beam_row_is_decisive``) compare
a backend's tokens only where the reference decided by more than the float32 error can move. The margins are
computed here, from the reference's public model and the step iterator of its beam search, so that the decoders'
public API returns tokens and scores only.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from reference_numpy.decoding import BEAM_SIZE, LENGTH_PENALTY_ALPHA, _beam_steps, max_output_lengths
from reference_numpy.model import Transformer


def greedy_margins(model: Transformer, src: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """Each greedy step's gap between the best and second-best log-probability, (B, L) for ``tokens`` (B, L) the
    reference's own greedy output; ``inf`` once a row has finished (ended with eos or reached its length budget).

    One teacher-forced pass gives every step's log-probabilities (the decoder is causal, section 3.2.3: position t
    sees only bos and the first t tokens, exactly the prefix the greedy step saw). pad_id and bos_id are left out,
    as the decoder never emits them (``reference_numpy/decoding.py``).
    """
    config = model.config
    tgt = np.concatenate([np.full((len(tokens), 1), config.bos_id), tokens[:, :-1]], axis=1)   # (B, L)
    log_probs = model(src, tgt)                                                             # (B, L, V)
    log_probs[..., [config.pad_id, config.bos_id]] = -np.inf
    top_two = np.sort(log_probs, axis=-1)[..., -2:]                                         # (B, L, 2)
    eos = (tokens == config.eos_id).astype(int)                                             # (B, L)
    ended = np.cumsum(eos, axis=1) - eos > 0                                                # an eos before step t
    finished = ended | (np.arange(tokens.shape[1]) >= max_output_lengths(model, src)[:, None])
    return np.where(finished, np.inf, top_two[..., 1] - top_two[..., 0])


def beam_step_margin(candidates: np.ndarray, eos_id: int, beam_size: int) -> float:
    """The smallest score gap that decides one beam-search step: at the rank-``beam_size`` boundary when an eos is
    near it (does it finish?) and between the last kept and first dropped non-eos candidate. Gaps below
    impossible (-inf) candidates decide nothing and are left out.

    ``candidates`` (n_live, V) are the step's summed log-probabilities, ranked as the search ranks them: by score,
    ties to the lower beam, then the lower token.
    """
    ranking = np.argsort(-candidates, axis=None, kind="stable")
    scores = candidates.ravel()[ranking]                                   # descending
    is_eos = ranking % candidates.shape[1] == eos_id
    pairs = []
    if len(scores) > beam_size and is_eos[:beam_size + 1].any():
        pairs.append(scores[beam_size - 1:beam_size + 1])
    live_scores = scores[~is_eos]
    if len(live_scores) > beam_size:
        pairs.append(live_scores[beam_size - 1:beam_size + 1])
    return float(min((high - low for high, low in pairs if np.isfinite(low)), default=np.inf))


def beam_margins(model: Transformer, src: np.ndarray, beam_size: int = BEAM_SIZE,
                 alpha: float = LENGTH_PENALTY_ALPHA) -> list[list[float]]:
    """Per source sentence: each step's :func:`beam_step_margin` (scores at step t sum t log-probabilities), then
    the gap between the best and second-best finished scores (the final choice), from the reference's search."""
    margins = []
    for steps in _beam_steps(model, src, beam_size, alpha):
        sentence: list[float] = []
        last: deque = deque(maxlen=1)
        for step in steps:
            sentence.append(beam_step_margin(step.candidates, model.config.eos_id, beam_size))
            last.append(step)
        ranked = sorted((score for score, _ in last[0].finished), reverse=True)
        margins.append([*sentence, float(ranked[0] - ranked[1]) if len(ranked) > 1 else np.inf])
    return margins

