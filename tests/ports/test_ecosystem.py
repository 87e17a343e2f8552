"""Each framework's own training idiom on its port (``ecosystem.py``; docs/tf.md, docs/torch.md, docs/jax.md, "Train
it your framework's way"): Keras' ``compile`` + ``fit`` / ``evaluate`` / ``predict`` and its callbacks.

The oracle of every run is the float64 NumPy reference's run of the same steps, with its
:class:`~equivalence.tolerance.TrainingBound` (tests/equivalence/test_training.py's policy); the loss and the token
accuracy are held to naive loops over the tokens."""

from __future__ import annotations

import re

import numpy as np
import pytest
from support import TRAINING, port_backend

from equivalence import tolerance
from equivalence.cases import VARIANTS, seeded_params, training_inputs
from equivalence.training_runs import Run, assert_float64_run, assert_weights_and_moments, reference_run
from reference_numpy import training as reference_training
from reference_numpy.model import Transformer as ReferenceTransformer

FIT_STEPS = 20
CONFIG = VARIANTS["tiny"].replace(dropout=0.0)


def fit_batches(steps: int) -> list[dict[str, np.ndarray]]:
    """A different ragged batch for every step, all of one shape (a NumPy ``fit`` slices one array)."""
    return [training_inputs(CONFIG, seed=step) for step in range(steps)]


def stacked(batches: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {key: np.concatenate([batch[key] for batch in batches]) for key in batches[0]}


def keras_modules():
    port_backend("tf")
    import keras
    import tensorflow as tf

    import transformer_tf
    from transformer_tf import ecosystem
    return keras, tf, transformer_tf, ecosystem


def compiled(transformer_tf, ecosystem, params=None, dtype="float64", **options):
    model = transformer_tf.from_params(CONFIG, seeded_params(CONFIG) if params is None else params, dtype)
    model.compile(optimizer=ecosystem.adam(model, TRAINING), loss=ecosystem.LabelSmoothedCrossEntropy(CONFIG.pad_id),
                  metrics=[ecosystem.TokenAccuracy(CONFIG.pad_id)], **options)
    return model


def keras_dataset(tf, batches: list[dict[str, np.ndarray]]):
    """``((src, tgt), labels)``, one batch per element: Keras' (x, y)."""
    arrays = {key: np.stack([batch[key] for batch in batches]) for key in batches[0]}
    return tf.data.Dataset.from_tensor_slices(arrays).map(lambda b: ((b["src"], b["tgt"]), b["labels"]))


# ----------------------------------------------------------------------------- Keras: the one input, loss, metric

def test_keras_model_takes_one_input_a_pair_or_a_dict():
    keras, tf, transformer_tf, ecosystem = keras_modules()
    model = transformer_tf.from_params(CONFIG, seeded_params(CONFIG))
    batch = training_inputs(CONFIG)
    expected = np.asarray(model(batch["src"], batch["tgt"]))
    pair = (batch["src"], batch["tgt"])
    for inputs in (pair, list(pair), {"tgt": batch["tgt"], "src": batch["src"]}):
        np.testing.assert_array_equal(np.asarray(model(inputs)), expected)
    for bad, kind in (((batch["src"],), "a tuple of 1"), ({"src": batch["src"]}, "a dict with the keys ['src']"),
                      (batch["src"], "one tensor")):
        with pytest.raises(ValueError, match=r"^src: without tgt, the model's input must be a \(src, tgt\) pair or a "
                                             rf"dict with the keys 'src' and 'tgt', got {re.escape(kind)}$"):
            model(bad)


def test_keras_loss_and_token_accuracy_are_the_naive_sums():
    """The Keras loss against a loop over the tokens (section 5.4's q times log p, summed over V), the accuracy
    against a count of argmax hits; bad arguments are one ValueError each."""
    keras, tf, transformer_tf, ecosystem = keras_modules()
    model = transformer_tf.from_params(CONFIG, seeded_params(CONFIG))
    batch = training_inputs(CONFIG)
    log_probs = np.asarray(model((batch["src"], batch["tgt"])))
    total, hits, count, vocab = 0.0, 0, 0, log_probs.shape[-1]
    for row, labels in zip(log_probs, batch["labels"]):
        for p, label in zip(row, labels):
            if label == CONFIG.pad_id:
                continue
            total += sum(-((0.9 if k == label else 0.0) + 0.1 / vocab) * p[k] for k in range(vocab))
            hits, count = hits + int(np.argmax(p) == label), count + 1
    loss = ecosystem.LabelSmoothedCrossEntropy(CONFIG.pad_id)(batch["labels"], tf.constant(log_probs))
    assert loss.dtype == tf.float64
    assert abs(float(loss) - total / count) <= 1e-12 * abs(total / count)
    accuracy = ecosystem.TokenAccuracy(CONFIG.pad_id)
    accuracy.update_state(batch["labels"], log_probs)
    assert float(accuracy.result()) == hits / count
    accuracy.reset_state()                               # every label the most likely token, the padding's too: 1
    accuracy.update_state(batch["labels"], np.log(np.eye(vocab)[batch["labels"]] * 0.5 + 0.5 / vocab))
    assert float(accuracy.result()) == 1.0
    with pytest.raises(ValueError, match=r"^epsilon must be in \[0, 1\), got 1.5$"):
        ecosystem.LabelSmoothedCrossEntropy(CONFIG.pad_id, epsilon=1.5)
    with pytest.raises(ValueError, match=r"^pad_id must be a token id \(an int >= 0\), got -1$"):
        ecosystem.TokenAccuracy(-1)
    with pytest.raises(ValueError, match=r"^sample_weight: "):
        ecosystem.LabelSmoothedCrossEntropy(CONFIG.pad_id)(batch["labels"], log_probs, np.ones(3))
    with pytest.raises(ValueError, match=r"^config must be a TrainingConfig, got dict$"):
        ecosystem.adam(model, {"warmup_steps": 10})


# ----------------------------------------------------------------------------- Keras: fit against the reference

@pytest.mark.slow
@pytest.mark.parametrize("feed", ["tf.data", "numpy"])
def test_keras_fit_makes_the_reference_updates(feed):
    """``compile`` + ``fit`` of 20 steps on a ``tf.data.Dataset`` and on NumPy arrays: the weights, both Adam moments
    and the step count of the float64 reference's 20 ``train_step`` updates, within its TrainingBound."""
    keras, tf, transformer_tf, ecosystem = keras_modules()
    batches = fit_batches(FIT_STEPS)
    expected, bound = reference_run(CONFIG, seeded_params(CONFIG), TRAINING, batches)
    model = compiled(transformer_tf, ecosystem)
    if feed == "tf.data":
        model.fit(keras_dataset(tf, batches), epochs=1, verbose=0)
    else:
        arrays = stacked(batches)
        model.fit((arrays["src"], arrays["tgt"]), arrays["labels"], batch_size=len(batches[0]["src"]), epochs=1,
                  shuffle=False, verbose=0)
    state = ecosystem.fit_state(model)
    assert state.step == FIT_STEPS
    assert_weights_and_moments(Run(expected.losses, transformer_tf.to_params(model), state), expected, bound, feed)


def test_keras_evaluate_reports_the_loss_and_token_accuracy_and_predict_log_probabilities():
    """``evaluate`` of one batch: the reference's float64 loss, as Keras reports it (rounded to float32, then the
    loss tracker's float32 sum over the batch's B sentences and division by B: three roundings, each within 2^-24 of
    its value), and the share of argmax hits; ``predict``: the reference's float64 log-probabilities."""
    keras, tf, transformer_tf, ecosystem = keras_modules()
    model = compiled(transformer_tf, ecosystem)
    batch, reference = training_inputs(CONFIG), ReferenceTransformer(CONFIG, seeded_params(CONFIG))
    expected = float(reference_training.loss(reference, batch["src"], batch["tgt"], batch["labels"]))
    log_probs = reference(batch["src"], batch["tgt"])
    real = batch["labels"] != CONFIG.pad_id
    accuracy = np.sum((np.argmax(log_probs, axis=-1) == batch["labels"]) & real) / np.sum(real)
    report = model.evaluate({"src": batch["src"], "tgt": batch["tgt"]}, batch["labels"], verbose=0, return_dict=True)
    assert abs(report["loss"] - expected) <= 3 * 2.0 ** -24 * abs(expected) + tolerance.float64_bound(expected)
    assert report["token_accuracy"] == accuracy
    predicted = model.predict((batch["src"], batch["tgt"]), verbose=0)
    assert predicted.dtype == np.float64 and predicted.shape == log_probs.shape
    assert tolerance.max_abs(predicted, log_probs) <= tolerance.float64_bound(log_probs)


@pytest.mark.slow
def test_keras_callbacks_checkpoint_reloads_and_early_stopping_reads_val_loss(tmp_path, capsys):
    """``fit`` with validation data, Keras' progress bar, ``ModelCheckpoint`` and ``EarlyStopping`` on ``val_loss``
    (a min_delta no epoch can make: it stops at the second epoch of ten, which it can only do on a val_loss it reads):
    the ``.keras`` file reloads to the model's outputs, bit for bit, with its optimizer's step count."""
    keras, tf, transformer_tf, ecosystem = keras_modules()
    batches = fit_batches(3)
    model = compiled(transformer_tf, ecosystem)
    path = tmp_path / "model.keras"
    history = model.fit(keras_dataset(tf, batches[:2]), validation_data=keras_dataset(tf, batches[2:]), epochs=10,
                        verbose=1, callbacks=[keras.callbacks.ModelCheckpoint(path),
                                              keras.callbacks.EarlyStopping(monitor="val_loss", min_delta=1e9)])
    assert len(history.history["val_loss"]) == 2 and "val_token_accuracy" in history.history
    assert "2/2" in capsys.readouterr().out                                   # the progress bar's step count
    reloaded = keras.saving.load_model(path)
    assert int(reloaded.optimizer.iterations.numpy()) == 4
    inputs = (batches[0]["src"], batches[0]["tgt"])
    np.testing.assert_array_equal(np.asarray(reloaded(inputs)), np.asarray(model(inputs)))
    assert_weights_equal(ecosystem.fit_state(reloaded), ecosystem.fit_state(model))


def assert_weights_equal(state, expected) -> None:
    assert state.step == expected.step
    for name, value in expected.first_moments.items():
        np.testing.assert_array_equal(state.first_moments[name], value)
        np.testing.assert_array_equal(state.second_moments[name], expected.second_moments[name])


@pytest.mark.slow
def test_keras_fit_under_the_global_mixed_bfloat16_policy_makes_train_steps_updates():
    """``keras.mixed_precision.set_global_policy("mixed_bfloat16")``, then ``compile`` + ``fit``: float32 variables
    trained by the autocast recipe, each step the update the port's ``train_step`` makes for the same model (the
    same TensorFlow ops in the same order, without XLA: bit for bit). ``train_step``'s own run is held to the
    reference's mixed-precision run by tests/equivalence/test_training.py."""
    keras, tf, transformer_tf, ecosystem = keras_modules()
    from transformer_tf import training

    batches, float32 = fit_batches(3), transformer_tf.from_params(CONFIG, seeded_params(CONFIG), "float32")
    before = keras.config.dtype_policy()
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        fitted, stepped = (transformer_tf.Transformer(CONFIG, dtype=None) for _ in range(2))
    finally:
        keras.mixed_precision.set_global_policy(before)
    for model in (fitted, stepped):
        model.set_weights(float32.get_weights())
    fitted.compile(optimizer=ecosystem.adam(fitted, TRAINING), loss=ecosystem.LabelSmoothedCrossEntropy(CONFIG.pad_id),
                   jit_compile=False)
    fitted.fit(keras_dataset(tf, batches), epochs=1, verbose=0)
    optimizer = training.optimizer(stepped, TRAINING)
    for batch in batches:
        training.train_step(stepped, optimizer, **batch)
    assert {v.dtype for v in fitted.weights} == {"float32"}
    params, expected = transformer_tf.to_params(fitted), transformer_tf.to_params(stepped)
    assert any(not np.array_equal(value, float32_value) for value, float32_value in
               zip(params.values(), transformer_tf.to_params(float32).values()))
    for name, value in expected.items():
        np.testing.assert_array_equal(params[name], value, err_msg=name)
    assert_weights_equal(ecosystem.fit_state(fitted), training.training_state(stepped, optimizer))


# ----------------------------------------------------------------------------- PyTorch: Dataset, DataLoader, optim

def torch_modules():
    port_backend("torch")
    import torch

    import transformer_torch
    from transformer_torch import ecosystem
    return torch, transformer_torch, ecosystem


def sentences(batches: list[dict[str, np.ndarray]]) -> tuple[list[list[int]], list[list[int]]]:
    """Every sentence pair of the batches as ids without their padding: (sources, labels)."""
    rows = lambda key: [[int(t) for t in row if t != CONFIG.pad_id] for batch in batches for row in batch[key]]
    return rows("src"), rows("labels")


def test_torch_dataset_collates_pairs_as_the_training_batches():
    """``collate`` against a loop that pads each row by hand; a DataLoader over the dataset gives those batches."""
    torch, transformer_torch, ecosystem = torch_modules()
    sources, targets = [[5, 6, 7, 2], [8, 2]], [[9, 2], [10, 11, 12, 2]]
    dataset = ecosystem.TranslationDataset(sources, targets, CONFIG)
    assert len(dataset) == 2 and dataset[1] == ([8, 2], [10, 11, 12, 2])
    pad, start = CONFIG.pad_id, CONFIG.start_id
    expected = {"src": [[5, 6, 7, 2], [8, 2, pad, pad]], "tgt": [[start, 9, pad, pad], [start, 10, 11, 12]],
                "labels": [[9, 2, pad, pad], [10, 11, 12, 2]]}
    (batch,) = list(torch.utils.data.DataLoader(dataset, batch_size=2, collate_fn=dataset.collate))
    for key, rows in expected.items():
        assert batch[key].dtype == torch.int64
        assert batch[key].tolist() == rows, key
    with pytest.raises(ValueError, match=r"^targets holds 1 sentences, sources 2: one target per source$"):
        ecosystem.TranslationDataset(sources, targets[:1], CONFIG)
    with pytest.raises(ValueError, match=r"^sources\[1\] is empty: every sentence has at least its eos$"):
        ecosystem.TranslationDataset([[5, 2], []], targets, CONFIG)


def torch_loop(model, forward, loader, torch, transformer_torch) -> Run:
    """The loop of docs/torch.md, "Train it your framework's way": torch.optim's Adam and LambdaLR of Eq. (3),
    ``forward`` the model itself or ``torch.compile(model)`` (which shares its parameters)."""
    adam = torch.optim.Adam(model.parameters(), lr=1.0, betas=(TRAINING.beta1, TRAINING.beta2), eps=TRAINING.epsilon)
    schedule = torch.optim.lr_scheduler.LambdaLR(adam, transformer_torch.learning_rate_schedule(CONFIG.d_model,
                                                                                                 TRAINING))
    losses = []
    for batch in loader:
        adam.zero_grad()
        loss = transformer_torch.label_smoothed_cross_entropy(forward(batch["src"], batch["tgt"]), batch["labels"],
                                                              CONFIG.pad_id)
        loss.backward()
        adam.step()
        schedule.step()
        losses.append(loss.item())
    record = transformer_torch.training.Optimizer(adam, schedule, TRAINING)
    return Run(losses, transformer_torch.to_params(model), transformer_torch.training_state(model, record))


def torch_run(compiled: bool) -> tuple[Run, Run, object]:
    """10 steps of the loop over a DataLoader (one pair of the Keras steps' sentences per batch of 3), and the
    float64 reference's run of the batches the loader gives, with its bound."""
    torch, transformer_torch, ecosystem = torch_modules()
    dataset = ecosystem.TranslationDataset(*sentences(fit_batches(10)), CONFIG)
    loader = torch.utils.data.DataLoader(dataset, batch_size=3, shuffle=False, collate_fn=dataset.collate)
    batches = [{key: value.numpy() for key, value in batch.items()} for batch in loader]
    expected, bound = reference_run(CONFIG, seeded_params(CONFIG), TRAINING, batches)
    model = transformer_torch.from_params(CONFIG, seeded_params(CONFIG)).train()
    forward = torch.compile(model) if compiled else model
    return torch_loop(model, forward, loader, torch, transformer_torch), expected, bound


def test_a_torch_dataloader_loop_makes_the_reference_updates():
    """The documented loop (``torch.optim.Adam``, ``LambdaLR``, the port's loss) over a DataLoader of the dataset:
    every loss, weight and moment of the float64 reference's 10 ``train_step`` updates, within its TrainingBound."""
    result, expected, bound = torch_run(compiled=False)
    assert_float64_run(result, expected, bound, "torch DataLoader loop")


@pytest.mark.slow
def test_torch_compiled_model_makes_the_reference_updates():
    """The same loop on ``torch.compile(model)`` (Inductor's kernels): the reference's updates within its bound."""
    result, expected, bound = torch_run(compiled=True)
    assert_float64_run(result, expected, bound, "torch.compile loop")


# ----------------------------------------------------------------------------- JAX: nnx.Optimizer, nnx.jit, orbax

def jax_modules():
    port_backend("jax")
    import jax
    from flax import nnx

    import transformer_jax
    from transformer_jax import ecosystem
    return jax, nnx, transformer_jax, ecosystem


def jax_state(model, optimizer, transformer_jax):
    return transformer_jax.training_state(model, transformer_jax.training.Optimizer(optimizer, None, TRAINING))


@pytest.mark.slow
def test_a_flax_optax_loop_makes_the_reference_updates_and_orbax_resumes_it(tmp_path):
    """The documented ``nnx.jit`` step over ``ecosystem.adam`` (nnx.Optimizer, optax's Adam, Eq. (3)): 10 steps, saved
    by orbax after 5 and restored into a model and optimizer of other weights, give every loss, weight and moment of
    the float64 reference's 10 ``train_step`` updates within its TrainingBound."""
    jax, nnx, transformer_jax, ecosystem = jax_modules()
    batches = fit_batches(10)
    expected, bound = reference_run(CONFIG, seeded_params(CONFIG), TRAINING, batches)

    @nnx.jit
    def step(model, optimizer, src, tgt, labels):
        loss = lambda model: transformer_jax.label_smoothed_cross_entropy(model(src, tgt), labels, CONFIG.pad_id)
        value, grads = nnx.value_and_grad(loss)(model)
        optimizer.update(model, grads)
        return value

    with jax.enable_x64(True):
        model = transformer_jax.from_params(CONFIG, seeded_params(CONFIG))
        optimizer = ecosystem.adam(model, TRAINING)
        losses = [float(step(model, optimizer, **batch)) for batch in batches[:5]]
        ecosystem.save_training(tmp_path / "run", model, optimizer)
        model = transformer_jax.from_params(CONFIG, {k: v + 1.0 for k, v in seeded_params(CONFIG).items()})
        optimizer = ecosystem.adam(model, TRAINING)
        ecosystem.restore_training(tmp_path / "run", model, optimizer)
        losses += [float(step(model, optimizer, **batch)) for batch in batches[5:]]
        result = Run(losses, transformer_jax.to_params(model), jax_state(model, optimizer, transformer_jax))
    assert_float64_run(result, expected, bound, "flax optax loop")


def test_orbax_round_trips_the_training_state(tmp_path):
    """save_training, then restore_training into a model of other weights and a new optimizer: the saved weights,
    moments and step count, bit for bit."""
    jax, nnx, transformer_jax, ecosystem = jax_modules()
    with jax.enable_x64(True):
        model = transformer_jax.from_params(CONFIG, seeded_params(CONFIG))
        optimizer = ecosystem.adam(model, TRAINING)
        batch = training_inputs(CONFIG)
        grads = nnx.grad(lambda m: transformer_jax.label_smoothed_cross_entropy(m(batch["src"], batch["tgt"]),
                                                                                 batch["labels"], CONFIG.pad_id))(model)
        optimizer.update(model, grads)
        ecosystem.save_training(tmp_path / "state", model, optimizer)
        other = transformer_jax.from_params(CONFIG, {k: v + 1.0 for k, v in seeded_params(CONFIG).items()})
        fresh = ecosystem.adam(other, TRAINING)
        ecosystem.restore_training(tmp_path / "state", other, fresh)
        saved, restored = jax_state(model, optimizer, transformer_jax), jax_state(other, fresh, transformer_jax)
        for name, value in transformer_jax.to_params(model).items():
            np.testing.assert_array_equal(transformer_jax.to_params(other)[name], value, err_msg=name)
    assert restored.step == saved.step == 1
    assert_weights_equal(restored, saved)
