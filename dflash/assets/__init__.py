"""Embedded default target and chat corpus, used by ``dflash train`` / ``dflash eval`` with no arguments.

``default_target/`` is a small ``Qwen3ForCausalLM`` (bfloat16 safetensors) with its byte-level BPE
tokenizer and Qwen3-style chat template; its ``config.json`` key ``dflash_mask_token_id`` (equal to
``tokenizer.mask_token_id``, the ``<|mask|>`` token) is the embedding row a drafter fills its draft
blocks with. ``default_chat/`` holds ``train.jsonl`` and ``heldout.jsonl`` (disjoint, OpenAI
``{"messages": [...]}`` records) from the MIT-licensed BYU Chit-Chat corpus; see its ``SOURCE.md``.
Both are rebuilt by ``scripts/make_default_target.py``; ``default_target/training_summary.json``
records how.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path


def _asset_dir(name: str) -> Path:
    # Package data is plain files in both regular and editable installs (never zipped), so a Path is safe.
    path = Path(str(resources.files(__name__) / name))
    if not path.is_dir():
        raise FileNotFoundError(
            f"{path} is missing: the dflash install lacks its package data; reinstall with `pip install .`"
        )
    return path


def default_target_dir() -> Path:
    """Folder of the default target: load with ``AutoModelForCausalLM/AutoTokenizer.from_pretrained``.

    Raises FileNotFoundError when the package data was not installed.
    """
    return _asset_dir("default_target")


def default_data_dir() -> Path:
    """Folder holding ``train.jsonl`` and ``heldout.jsonl`` of the default chat corpus.

    Raises FileNotFoundError when the package data was not installed.
    """
    return _asset_dir("default_chat")
