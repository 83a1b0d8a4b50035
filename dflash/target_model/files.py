"""A target directory, read and checked before the target loads (seconds to minutes): its
``config.json`` and what it says (the context, each decoder layer's type and whether packed rows can
keep them apart, the transformers release and kernels the model needs), and its tokenizer files.

Imports neither torch nor transformers (:func:`load_tokenizer` imports transformers when called):
``dflash train`` settles its config with these checks before anything heavy loads.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from dflash.config import FULL_ATTENTION, SLIDING_ATTENTION
from dflash.files import read_json_object


class TargetLoadError(ValueError):
    """The target directory cannot be loaded as a causal LM."""


_QWEN3_5_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")

#: The first transformers release with each model type that older releases cannot load (Qwen3.5 and
#: Qwen3.6, dense and MoE, came with 5.2.0; transformers 4.x maps them to nothing).
FIRST_TRANSFORMERS = dict.fromkeys(_QWEN3_5_TYPES, "5.2.0")

#: The transformers releases (first, last minor) whose hybrid cache :mod:`dflash.target_model.rollback` puts
#: back after a rejected draft: 5.2-5.6 start every chunked Gated DeltaNet forward from a zero state,
#: and a minor release may lay the linear-attention cache out anew (5.15 and 5.25 did), so eval
#: refuses a newer one rather than measure acceptance against a wrongly restored target.
TRANSFORMERS_FOR_DECODING = dict.fromkeys(_QWEN3_5_TYPES, ("5.7.0", "5.25"))


def decoding_transformers_range(model_type: str = "qwen3_5") -> str:
    """The releases :data:`TRANSFORMERS_FOR_DECODING` names for ``model_type``, as ``"5.7-5.25"``."""
    first, last = TRANSFORMERS_FOR_DECODING[model_type]
    return f"{first.removesuffix('.0')}-{last}"


def require_transformers_for(config: dict, source: str | Path, *, decoding: bool = False) -> None:
    """Refuse a target whose ``model_type`` the installed transformers cannot load (or, with
    ``decoding``, cannot verify speculative drafts with), before it loads.

    Args:
        config (dict): the target's ``config.json``.
        source: the file, for the message.
        decoding (bool): the target decodes with a cache (``dflash eval``).

    Raises:
        TargetLoadError: names the model type, the transformers releases that work, the installed
            one, and the pip command that installs one of them.
    """
    from importlib.metadata import version

    from packaging.version import Version

    model_type = config.get("model_type") or (config.get("text_config") or {}).get("model_type")
    installed = version("transformers")
    first = FIRST_TRANSFORMERS.get(model_type)
    if first and Version(installed) < Version(first):
        raise TargetLoadError(
            f"target {source}: model_type {model_type!r} (Qwen3.5 / Qwen3.6) loads with transformers {first} or "
            f"newer; this environment has {installed}: pip install -U 'transformers>={first}'"
        )
    if not decoding or model_type not in TRANSFORMERS_FOR_DECODING:
        return
    first, last = TRANSFORMERS_FOR_DECODING[model_type]
    if Version(installed) < Version(first):
        raise TargetLoadError(
            f"target {source}: model_type {model_type!r} (Qwen3.5 / Qwen3.6) verifies speculative drafts from its "
            f"cache with transformers {first} or newer; this environment has {installed}: "
            f"pip install -U 'transformers>={first}'"
        )
    if Version(installed).release[:2] > Version(last).release[:2]:
        upper = f"{Version(last).major}.{Version(last).minor + 1}"
        raise TargetLoadError(
            f"target {source}: dflash eval rolls back the linear-attention cache of model_type {model_type!r} "
            f"(Qwen3.5 / Qwen3.6) as transformers {decoding_transformers_range(model_type)} lay it out; this "
            f"environment has {installed}, whose layout it has not been tested on and could measure acceptance "
            f"wrongly: pip install 'transformers>={first},<{upper}' to evaluate (training is not affected)"
        )


def read_target_config(path: str | Path) -> dict:
    """The ``config.json`` of a target directory, read without loading anything else.

    Raises:
        TargetLoadError: no such directory, no ``config.json``, or one that is not a JSON object.
    """
    path = Path(path)
    if path.is_file():
        raise TargetLoadError(f"target {path}: a file; pass --target with the model's directory ({path.parent}?)")
    if not path.is_dir():
        raise TargetLoadError(
            f"target {path}: no such directory; pass --target with a local HF model "
            "directory (config.json + safetensors)"
        )
    config_file = path / "config.json"
    if not config_file.is_file():
        raise TargetLoadError(
            f"target {path}: no config.json; this is not a Hugging Face model "
            "directory (save one with model.save_pretrained)"
        )
    return read_json_object(
        config_file, error=TargetLoadError, name=f"target {config_file}", fix="restore it from the model's source"
    )


def context_length(path: str | Path) -> int:
    """The target's context in tokens: ``max_position_embeddings`` of its ``config.json`` (of its
    ``text_config`` in a multimodal config), read without loading the model.

    Raises:
        TargetLoadError: see :func:`read_target_config`; or no positive integer
            ``max_position_embeddings`` (the drafter config copies it, so every target has it).
    """
    raw = read_target_config(path)
    positions = (raw.get("text_config") or raw).get("max_position_embeddings")
    if not isinstance(positions, int) or isinstance(positions, bool) or positions < 1:
        raise TargetLoadError(
            f"target {Path(path) / 'config.json'}: max_position_embeddings is {positions!r}, expected the "
            "context length in tokens; is it a causal LM's config?"
        )
    return positions


def require_tokenizer_files(path: str | Path) -> None:
    """Check that the target directory holds its tokenizer and chat template, before anything
    loads it.

    Raises:
        TargetLoadError: no ``tokenizer_config.json`` (its special tokens: eos, pad), no
            vocabulary (``tokenizer.json``, or ``tokenizer.model``/``vocab.json`` for transformers
            to convert), or no chat template (a ``chat_template`` key there, ``chat_template.jinja``
            or ``chat_template.json``): the loss mask and prompts come from it. Names the file.
    """
    path = Path(path)
    fix = "copy it from the model's source, or save it with tokenizer.save_pretrained(DIR)"
    config = path / "tokenizer_config.json"
    if not config.is_file():
        raise TargetLoadError(f"no tokenizer_config.json in {path} (the target's special tokens: eos, pad); {fix}")
    if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise TargetLoadError(f"no tokenizer.json in {path} (the target's vocabulary); {fix}")
    if not any((path / name).is_file() for name in ("chat_template.jinja", "chat_template.json")):
        try:
            has_template = "chat_template" in json.loads(config.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise TargetLoadError(f"{config}: cannot read ({e}); {fix}") from None
        if not has_template:
            raise TargetLoadError(
                f"no chat template in {path} (no chat_template.jinja, and tokenizer_config.json has no "
                f"chat_template): the loss mask and prompts are rendered with it; {fix}"
            )


def load_tokenizer(path: str | Path):
    """The target's tokenizer from its local directory (``AutoTokenizer``, no network).

    Raises:
        TargetLoadError: no tokenizer files (:func:`require_tokenizer_files`), or files that
            ``AutoTokenizer`` cannot load (the message names the directory).
    """
    from transformers import AutoTokenizer

    require_tokenizer_files(path)
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise TargetLoadError(
            f"tokenizer in {path}: cannot load ({type(e).__name__}: {e}); check tokenizer.json/tokenizer_config.json"
        ) from e


#: The layer type of a hybrid target's linear-attention layers (the attention ones: :mod:`dflash.config`).
LINEAR_ATTENTION = "linear_attention"

#: Layer types whose documents packed rows keep apart (:mod:`dflash.target_model.documents` says how).
PACKABLE_LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION, LINEAR_ATTENTION)

#: The flash-linear-attention distributions (pure Python + Triton): what a hybrid target needs on CUDA.
FLA_PACKAGE = "flash-linear-attention"


class UnknownLayerType(ValueError):
    """A decoder layer type whose documents cannot be kept apart in a packed row."""


def layer_types(config: dict) -> list[str]:
    """The decoder layer types of a causal LM's (text) ``config.json`` dict, one per layer.

    ``layer_types`` when the config lists them; else a hybrid config's pattern (Qwen3.5 /
    Qwen3-Next: every ``full_attention_interval``-th layer, default 4, is full attention, the rest
    linear); else ``sliding_attention`` for a config with an active ``sliding_window`` (Mistral)
    and ``full_attention`` for the rest (Llama, Qwen3).

    Args:
        config (dict): the text config (``text_config`` of a multimodal ``config.json``).

    Returns:
        list[str]: ``num_hidden_layers`` entries.
    """
    num_layers = int(config.get("num_hidden_layers") or 0)
    if isinstance(config.get("layer_types"), list):
        return list(config["layer_types"])
    if "linear_conv_kernel_dim" in config or "full_attention_interval" in config:
        interval = int(config.get("full_attention_interval") or 4)
        return [LINEAR_ATTENTION if (i + 1) % interval else FULL_ATTENTION for i in range(num_layers)]
    sliding = config.get("sliding_window") is not None and config.get("use_sliding_window", True)
    return [SLIDING_ATTENTION if sliding else FULL_ATTENTION] * num_layers


def is_hybrid(config: dict) -> bool:
    """Whether a (text) config has linear-attention layers (Qwen3.5 / Qwen3.6)."""
    return LINEAR_ATTENTION in layer_types(config)


def check_packable(config: dict, source: str) -> None:
    """Refuse packed rows for a target with a layer type :mod:`dflash.target_model.documents` cannot keep apart.

    Args:
        config (dict): the target's text config (see :func:`layer_types`).
        source (str): where it came from, for the message (the ``config.json`` path).

    Raises:
        UnknownLayerType: names the first unknown layer type, the known ones, and ``--no-pack``.
    """
    unknown = sorted({t for t in layer_types(config) if t not in PACKABLE_LAYER_TYPES})
    if unknown:
        raise UnknownLayerType(
            f"target {source}: decoder layer type {unknown[0]!r} cannot keep the conversations of a packed row "
            f"apart (packing knows {', '.join(PACKABLE_LAYER_TYPES)}); train with --no-pack"
        )


def fla_available() -> bool:
    """Whether flash-linear-attention is importable (without importing it)."""
    return importlib.util.find_spec("fla") is not None
