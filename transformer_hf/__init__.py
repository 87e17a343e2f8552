"""Hugging Face's families as a layer on top of the paper: a family's model directory as the shared checkpoint
(import), the checkpoint as a family's directory (export), the families' tokenizers, and ``from_pretrained`` for the
reference and every port. The reference and the ports know no family; each family is one module (:mod:`.marian`,
:mod:`.m2m_100`), read from :mod:`.registry` by ``model_type`` (docs/huggingface.md, "The family layer")."""

from reference_numpy import __version__ as __version__

from .exporter import save_hf
from .importer import config_from_hf, import_hf, load_hf
from .pretrained import from_pretrained
from .registry import FAMILIES, family, family_for
from .tokenizers import FamilyTokenizer, load_tokenizer, load_tokenizer_json, tokenizer_of

__all__ = ["FAMILIES", "FamilyTokenizer", "config_from_hf", "family", "family_for", "from_pretrained", "import_hf",
           "load_hf", "load_tokenizer", "load_tokenizer_json", "save_hf", "tokenizer_of"]
