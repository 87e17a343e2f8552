"""``transformer-reference export`` (docs/deploy.md): every artefact is written by the CLI, then loaded and run in a
fresh Python process that cannot import the project (``python -I -S`` with only site-packages on its path: the
editable install's ``.pth`` hook is never run, and the script asserts that ``reference_numpy``, ``transformer_*``
and ``equivalence`` are not importable), and its answers are compared with the NumPy reference's:

* ``ctranslate2`` with the checkpoint's BPE vocabulary: CTranslate2 translates English *text* (the tokenizer's
  pieces in, pieces out) into exactly the reference's greedy and beam-4 French on held-out sentences of the shipped
  model; a checkpoint without a tokenizer keeps the ``<N>`` names.

An engine that is not installed is a skip naming its extra.
"""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys

import numpy as np
import pytest

from reference_numpy import Transformer, TransformerConfig, beam_search, greedy_decode, init_params, save_checkpoint
from reference_numpy.decoding import BEAM_SIZE, LENGTH_PENALTY_ALPHA
from transformer_cli import ctranslate2_export
from transformer_cli.main import EXIT_OK, main
from transformer_cli.numbers_task import NumbersTask, english
from transformer_cli.translate import SHIPPED, load_translator

PROJECT = ("reference_numpy", "transformer_torch", "transformer_jax", "transformer_tf", "transformer_cli",
           "equivalence")
SHIPPED_TEXTS = 32                 # held-out sentences of the shipped model, every length of the test split


def require(module: str, extra: str):
    return pytest.importorskip(module, reason=f"{module} is not installed (pip install '.[{extra}]')")


# ----------------------------------------------------------------------------- a process without the project

ISOLATION = f"""
import importlib.util, json, sys
sys.path[:0] = {site.getsitepackages()!r}
assert not [name for name in {PROJECT!r} if importlib.util.find_spec(name)], "the project is importable"
"""


def run_isolated(script: str, *args, cwd) -> dict:
    """Run ``script`` in ``python -I -S`` (no site hooks, no PYTHONPATH, no working directory on the path) with the
    interpreter's site-packages appended by hand, so that only installed runtimes import; returns the JSON object
    the script prints last."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("PYTHON")}
    done = subprocess.run([sys.executable, "-I", "-S", "-c", ISOLATION + script, *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_isolated_process_cannot_import_the_project(tmp_path):
    """The check every isolated run starts with can fail: here the project is importable (its path is added)."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("PYTHON")}
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-I", "-S", "-c", f"import sys; sys.path.append({repo!r})" + ISOLATION],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "the project is importable" in done.stderr
    assert run_isolated("print(json.dumps([sys.flags.no_site, sys.flags.isolated]))", cwd=tmp_path) == [1, 1]


# ----------------------------------------------------------------------------- CTranslate2 with the BPE vocabulary

CT2_TRANSLATE = """
import ctranslate2, tokenizers
model, texts, options = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
tokenizer = tokenizers.Tokenizer.from_file(model + "/tokenizer.json")
translator = ctranslate2.Translator(model, device="cpu", compute_type="float32")
eos = tokenizer.token_to_id("</s>")

def text(pieces):
    ids = [tokenizer.token_to_id(piece) for piece in pieces]
    return tokenizer.decode(ids[:ids.index(eos)] if eos in ids else ids, skip_special_tokens=False)

sources = [tokenizer.encode(text, add_special_tokens=False).tokens for text in texts]
print(json.dumps({name: [text(result.hypotheses[0]) for result in translator.translate_batch(sources, **kwargs)]
                  for name, kwargs in options.items()}))
"""


def shipped_texts() -> list[str]:
    """English sentences spread over the shipped model's test split (3 to 6 digits)."""
    numbers = NumbersTask().split.held_out("test")
    return [english(n) for n in numbers[::len(numbers) // SHIPPED_TEXTS][:SHIPPED_TEXTS]]


def test_ctranslate2_translates_text_as_the_reference(tmp_path, capsys):
    """The shipped model exported by the CLI: CTranslate2, given the tokenizer's pieces of English sentences (no
    eos: the model's config appends it), writes pieces whose text is exactly the float64 reference's greedy and
    beam-4 (alpha 0.6) translation of every sentence (``translate_options``: the reference's decoding rules as far
    as CTranslate2 can follow them)."""
    require("ctranslate2", "peers")
    tokenizers = require("tokenizers", "text")
    out = tmp_path / "numbers-ct2"
    assert main(["export", "--to", "ctranslate2", str(SHIPPED), str(out)]) == EXIT_OK
    assert "BPE vocabulary" in capsys.readouterr().out
    config, params, tokenizer = load_translator()
    library = tokenizers.Tokenizer.from_str(tokenizer.to_json())
    expected = [library.id_to_token(i) or f"<{i}>" for i in range(config.tgt_vocab_size)]
    assert json.loads((out / "shared_vocabulary.json").read_text()) == expected          # pieces at their ids
    assert expected[:4] == ["<pad>", "<s>", "</s>", "<unk>"] and expected[-1] == f"<{config.tgt_vocab_size - 1}>"
    texts = shipped_texts()
    src, model = tokenizer.batch(texts), Transformer(config, params)
    reference = {"greedy": greedy_decode(model, src),
                 "beam": beam_search(model, src, BEAM_SIZE, LENGTH_PENALTY_ALPHA)[0]}
    options = {"greedy": ctranslate2_export.translate_options(config.max_len),
               "beam": ctranslate2_export.translate_options(config.max_len, BEAM_SIZE, LENGTH_PENALTY_ALPHA)}
    got = run_isolated(CT2_TRANSLATE, out, json.dumps(texts), json.dumps(options), cwd=tmp_path)
    for kind, tokens in reference.items():
        assert got[kind] == [tokenizer.decode(row) for row in tokens], kind
    assert len(set(got["beam"])) == len(texts)


def test_ctranslate2_without_a_tokenizer_keeps_id_names(tmp_path):
    """A checkpoint without a tokenizer: ``<N>`` names, the specials at their ids, no tokenizer.json, and no eos
    appended to the source (the caller's id rows carry it, ``to_tokens``)."""
    require("ctranslate2", "peers")
    config = TransformerConfig.preset("tiny")
    save_checkpoint(tmp_path / "m.safetensors", config, init_params(config, seed=0))
    out = ctranslate2_export.export_ctranslate2(tmp_path / "m.safetensors", tmp_path / "model")
    names = json.loads((out / "target_vocabulary.json").read_text())
    assert names[:5] == ["<pad>", "<s>", "</s>", "<3>", "<4>"] and len(names) == config.tgt_vocab_size
    assert not (out / "tokenizer.json").exists()
    assert json.loads((out / "config.json").read_text())["add_source_eos"] is False


def test_ctranslate2_refuses_a_vocabulary_naming_two_ids_alike():
    """A BPE piece spelled like the name of an id beyond the tokenizer's vocabulary would make two ids one token."""
    config, _, tokenizer = load_translator()
    data = json.loads(tokenizer.to_json())
    piece = next(token for token, i in data["model"]["vocab"].items() if i == 10)
    data["model"]["vocab"][f"<{config.tgt_vocab_size - 1}>"] = data["model"]["vocab"].pop(piece)
    with pytest.raises(ValueError, match=rf"^token '<{config.tgt_vocab_size - 1}>' names two ids of the vocabulary"):
        ctranslate2_export.token_names(config, config.tgt_vocab_size, json.dumps(data))
    names = ctranslate2_export.token_names(config, config.tgt_vocab_size, tokenizer.to_json())
    assert np.unique(names).size == config.tgt_vocab_size
