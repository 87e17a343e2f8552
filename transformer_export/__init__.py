"""The exporters: a shared checkpoint as an artefact its framework's runtime serves without this project -- ONNX,
torch.export, a SavedModel, jax.export (:mod:`transformer_export.export`), a CTranslate2 model
(:mod:`transformer_export.ctranslate2`) -- and the check that runs an artefact in a fresh process and holds its
answers to the reference (:mod:`transformer_export.check`). The ``export`` command parses its flags and calls these;
no exporter writes over one of its inputs (:mod:`transformer_export.outputs`)."""

from reference_numpy import __version__ as __version__
