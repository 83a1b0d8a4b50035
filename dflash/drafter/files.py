"""A drafter directory read strictly: ``config.json`` + ``model.safetensors`` in the z-lab layout
(:mod:`dflash.drafter.modeling_dflash`), as ``dflash train`` checkpoints, ``dflash export`` and the
published drafters (z-lab/Qwen3.6-27B-DFlash, ...) lay it out, and whether it fits a target.

Loading a drafter must never invent one: ``from_pretrained`` fills a config field the file lacks
with Qwen3's default (hidden 4096, 36 layers, ...) and random-initialises every weight it does not
find, so a wrong directory evaluates as a random drafter with a warning at most. Here, in order,
each step before anything is allocated:

1. :func:`read_raw_config`: ``config.json`` names a DFlash drafter and every field that fixes its
   shape (:data:`REQUIRED_FIELDS`), read from the file itself, never from defaults;
2. :func:`check_tensors`: the tensor names and shapes in ``model.safetensors``' header are exactly
   those the config implies (a mismatch names the tensor and the config field behind it);
3. :func:`dflash.drafter.model.load_drafter_dir`: the model is built from the config and every
   weight loaded with ``strict=True``.

``dflash eval`` (:func:`dflash.evaluation.measure.load_drafter`) and ``dflash train --init-from`` use it.

A DFlash drafter is built for one target (arXiv 2602.06036, Sec. 3; ``docs/dflash.md``): its
``fc`` takes the K tapped layers' states concatenated, ``[.., K * H]`` with H the target's hidden
size; its ``target_layer_ids`` index the target's decoder layers (the drafter's config records how
many the target had, ``num_target_layers``); it has no embedding or LM head of its own but the
target's, so its vocabulary and mask token are the target's. Loading an 8B target takes minutes:
:func:`check_drafter_fits_target` reads the two ``config.json`` files and says, in terms of the model
each flag names, what does not fit; it loads no weights and never imports transformers.

Torch and transformers are imported only where a drafter's config class or a model on the meta
device is needed: ``dflash train`` reads the names here while it settles its config, before anything
heavy is imported.
"""

from __future__ import annotations

import re
from pathlib import Path

from dflash.files import WeightFileError, check_safetensors, read_json_object
from dflash.target_model.files import TargetLoadError, read_target_config

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
#: What ``dflash eval`` reads: a drafter shipped to serving (these and ``modeling_dflash.py``) is enough.
DRAFTER_FILES = (CONFIG_NAME, WEIGHTS_NAME)

#: Fields a drafter's ``config.json`` must carry itself (their class defaults would build another model).
REQUIRED_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "block_size",
    "num_target_layers",
)
#: Fields inside ``dflash_config`` that must be there.
REQUIRED_DFLASH_FIELDS = ("mask_token_id", "target_layer_ids")

# The config fields behind each dimension of a tensor (name without "layers.{i}."), for errors.
_SHAPE_FIELDS = {
    "fc.weight": ("hidden_size", "len(dflash_config.target_layer_ids) x hidden_size"),
    "hidden_norm.weight": ("hidden_size",),
    "norm.weight": ("hidden_size",),
    "input_layernorm.weight": ("hidden_size",),
    "post_attention_layernorm.weight": ("hidden_size",),
    "self_attn.q_proj.weight": ("num_attention_heads x head_dim", "hidden_size"),
    "self_attn.k_proj.weight": ("num_key_value_heads x head_dim", "hidden_size"),
    "self_attn.v_proj.weight": ("num_key_value_heads x head_dim", "hidden_size"),
    "self_attn.o_proj.weight": ("hidden_size", "num_attention_heads x head_dim"),
    "self_attn.q_norm.weight": ("head_dim",),
    "self_attn.k_norm.weight": ("head_dim",),
    "mlp.gate_proj.weight": ("intermediate_size", "hidden_size"),
    "mlp.up_proj.weight": ("intermediate_size", "hidden_size"),
    "mlp.down_proj.weight": ("hidden_size", "intermediate_size"),
    "attention_conv.base_kernel": ("2", "dflash_config.conv_kernel_size", "hidden_size"),
    "attention_conv.kernel_projection.weight": (
        "2 x conv_kernel_size x hidden_size / conv_group_size (dflash_config)",
        "hidden_size",
    ),
    "mlp_conv.base_kernel": ("2", "dflash_config.conv_kernel_size", "hidden_size"),
    "mlp_conv.kernel_projection.weight": (
        "2 x conv_kernel_size x hidden_size / conv_group_size (dflash_config)",
        "hidden_size",
    ),
    "candidate_selector.hidden_projection.weight": ("dflash_config.selector_rank", "hidden_size"),
    "candidate_selector.predecessor_codebook": ("vocab_size", "dflash_config.selector_rank"),
    "candidate_selector.successor_codebook": ("vocab_size", "dflash_config.selector_rank"),
}
_LAYER = re.compile(r"^layers\.(\d+)\.")


class CheckpointError(ValueError):
    """A checkpoint or drafter directory that is missing, incomplete or corrupt (the message names file
    and fix)."""


try:  # transformers 5 configs validate as huggingface_hub strict dataclasses, with their own errors
    from huggingface_hub.errors import StrictDataclassError

    _CONFIG_ERRORS: tuple[type[Exception], ...] = (StrictDataclassError,)
except ImportError:
    _CONFIG_ERRORS = ()


def read_raw_config(directory: str | Path) -> dict:
    """``config.json`` of a drafter directory, checked to name a DFlash drafter and carry
    :data:`REQUIRED_FIELDS`, a RoPE base and ``dflash_config``; nothing is built.

    Raises:
        CheckpointError: no or unreadable ``config.json``, no ``model.safetensors``, another
            architecture, or a missing field (the message names each and the fix).
    """
    directory = Path(directory)
    path = directory / CONFIG_NAME
    raw = read_json_object(
        path, error=CheckpointError, name=str(path), fix=f"a drafter directory holds its {CONFIG_NAME} as saved"
    )
    if not (directory / WEIGHTS_NAME).is_file():
        raise CheckpointError(f"{directory / WEIGHTS_NAME}: missing; a drafter needs {CONFIG_NAME} and {WEIGHTS_NAME}")
    if not {"DFlashDraftModel", "DFlash2DraftModel"} & set(raw.get("architectures") or []):
        raise CheckpointError(
            f"{path}: architectures {raw.get('architectures')!r} is not a DFlash drafter (DFlashDraftModel or "
            "DFlash2DraftModel); pass a drafter directory"
        )
    dflash = raw.get("dflash_config")
    # DFlash2 configs give the block size in dflash_config only.
    nested = {"block_size": dflash.get("block_size")} if isinstance(dflash, dict) else {}
    missing = [name for name in REQUIRED_FIELDS if raw.get(name, nested.get(name)) is None]
    missing += [
        f"dflash_config.{name}" for name in REQUIRED_DFLASH_FIELDS if not isinstance(dflash, dict) or name not in dflash
    ]
    rope = raw.get("rope_parameters")
    if raw.get("rope_theta") is None and not (isinstance(rope, dict) and "rope_theta" in rope):
        missing.append("rope_theta (or rope_parameters.rope_theta)")
    if missing:
        raise CheckpointError(
            f"{path}: no {', '.join(missing)}; a drafter's config.json carries its own shape and these are never "
            "guessed (copy the complete config.json of the drafter, or export it again with dflash export)"
        )
    return raw


def read_drafter_config(directory: str | Path):
    """The :class:`~dflash.drafter.modeling_dflash.DFlashDraftConfig` of a drafter directory (see
    :func:`read_raw_config`), validated; nothing is allocated.

    Raises:
        CheckpointError: see :func:`read_raw_config`; a field out of range (named).
    """
    read_raw_config(directory)  # before transformers loads (seconds)
    from dflash.drafter.modeling_dflash import DFlashDraftConfig

    try:
        return DFlashDraftConfig.from_pretrained(directory, local_files_only=True)
    except (ValueError, TypeError, *_CONFIG_ERRORS) as e:
        raise CheckpointError(f"{Path(directory) / CONFIG_NAME}: {e}") from None


def check_tensors(directory: str | Path, config) -> None:
    """The tensors of ``model.safetensors`` are exactly the drafter's of ``config``, by name and
    shape, read from the file's header (no tensor is loaded); the file is whole (its size is what
    its header describes: a drafter shipped without a manifest has nothing else to catch a copy cut short).

    Raises:
        CheckpointError: a truncated or unreadable file (named); a layer count, a tensor name or a
            shape disagrees: the message names the tensor and the ``config.json`` field that
            disagrees with it.
    """
    from safetensors import safe_open

    directory = Path(directory)
    try:
        fix = f"copy {directory} again from where it came from, or pass another drafter directory"
        check_safetensors(directory / WEIGHTS_NAME, role="drafter", fix=fix)
    except WeightFileError as e:
        raise CheckpointError(str(e)) from None
    with safe_open(str(directory / WEIGHTS_NAME), "pt") as f:
        found = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    expected = _expected_shapes(config)
    source = f"{directory / WEIGHTS_NAME} and {directory / CONFIG_NAME}"
    file_layers = {int(m.group(1)) for name in found if (m := _LAYER.match(name))}
    if file_layers and max(file_layers) + 1 != config.num_hidden_layers:
        raise CheckpointError(
            f"{source} disagree: num_hidden_layers is {config.num_hidden_layers}, the weights hold "
            f"{max(file_layers) + 1} decoder layers"
        )
    missing, unexpected = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
    if missing or unexpected:
        bias = [n for n in unexpected + missing if n.endswith(".bias")]
        hint = f" (attention_bias is {config.attention_bias})" if bias else ""
        raise CheckpointError(
            f"{source} disagree{hint}: missing tensors {missing[:6]}{' ...' if len(missing) > 6 else ''}, unexpected "
            f"tensors {unexpected[:6]}{' ...' if len(unexpected) > 6 else ''}; a drafter is loaded whole or not at all"
        )
    for name, shape in found.items():
        if shape != expected[name]:
            fields = _SHAPE_FIELDS.get(_LAYER.sub("", name), ())
            behind = [
                f"{fields[d]} in config.json gives {expected[name][d]}"
                for d in range(len(shape))
                if d < len(fields) and shape[d] != expected[name][d]
            ]
            raise CheckpointError(
                f"{source} disagree: tensor {name} is {list(shape)}, the config implies {list(expected[name])} "
                f"({'; '.join(behind) or 'shape'}); the config does not describe these weights"
            )


def _expected_shapes(config) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every weight of the drafter of ``config``, from a model on the meta device."""
    import torch

    from dflash.drafter.modeling_dflash import DFlashDraftModel

    with torch.device("meta"):
        model = DFlashDraftModel(config)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


#: Fields of a drafter's config.json the comparison needs (z-lab's layout, :mod:`dflash.run.checkpoint`).
_DRAFTER_FIELDS = ("hidden_size", "num_target_layers", "vocab_size")


def drafter_geometry(step_dir: Path) -> dict:
    """``hidden_size``, ``num_target_layers``, ``vocab_size`` and ``target_layer_ids`` of the drafter
    in ``step_dir``, from its ``config.json``.

    Raises:
        CheckpointError: the file is unreadable, or lacks a field (a config the drafter would be built
            from at some default size); names the file and the fields.
    """
    path = step_dir / CONFIG_NAME
    config = read_json_object(
        path, error=CheckpointError, name=f"--drafter {path}", fix="restore it from the drafter's source"
    )
    dflash_config = config.get("dflash_config")
    ids = dflash_config.get("target_layer_ids") if isinstance(dflash_config, dict) else None
    missing = [name for name in _DRAFTER_FIELDS if not isinstance(config.get(name), int)]
    missing += [] if isinstance(ids, list) else ["dflash_config.target_layer_ids"]
    if missing:
        raise CheckpointError(
            f"--drafter {path} has no {', '.join(missing)}: it is not a DFlash drafter's config (dflash train and "
            "z-lab's drafters write them all); restore the config.json that came with the drafter's weights"
        )
    return {**{name: config[name] for name in _DRAFTER_FIELDS}, "target_layer_ids": list(ids)}


def target_geometry(target_dir: Path) -> dict:
    """``hidden_size``, ``num_hidden_layers`` and ``vocab_size`` of the target in ``target_dir``
    (of its ``text_config`` in a multimodal config), from its ``config.json``.

    Raises:
        TargetLoadError: see :func:`dflash.target_model.files.read_target_config`, or a field is missing.
    """
    raw = read_target_config(target_dir)
    text = raw.get("text_config") or raw
    fields = ("hidden_size", "num_hidden_layers", "vocab_size")
    missing = [name for name in fields if not isinstance(text.get(name), int)]
    if missing:
        raise TargetLoadError(
            f"target {target_dir / 'config.json'}: no {', '.join(missing)}; is it a causal LM's config?"
        )
    return {name: text[name] for name in fields}


def check_drafter_fits_target(step_dir: Path, target_dir: Path, *, trained_on: str | None = None) -> None:
    """The drafter in ``step_dir`` can run on the target in ``target_dir``: same hidden size, the
    target has the decoder layers the drafter taps (and as many as it was trained against), same
    vocabulary size.

    Args:
        trained_on: the target the drafter's run was trained against (its train_config.json), named
            in the fix.

    Raises:
        CheckpointError: a mismatch; the message names every field that differs, with both values,
            and the fix in terms of ``--target`` and ``--drafter``.
        TargetLoadError: see :func:`target_geometry`.
    """
    drafter, target = drafter_geometry(step_dir), target_geometry(target_dir)
    problems = []
    if drafter["hidden_size"] != target["hidden_size"]:
        problems.append(
            f"the drafter reads hidden states of size {drafter['hidden_size']}, the target's are "
            f"{target['hidden_size']} (hidden_size)"
        )
    layers = target["num_hidden_layers"]
    beyond = [k for k in drafter["target_layer_ids"] if not 0 <= k < layers]
    if drafter["num_target_layers"] != layers or beyond:
        problems.append(
            f"the drafter was trained on a {drafter['num_target_layers']}-layer target and taps its layers "
            f"{drafter['target_layer_ids']}, the target has {layers} decoder layers (num_hidden_layers)"
        )
    if drafter["vocab_size"] != target["vocab_size"]:
        problems.append(
            f"the drafter's vocabulary has {drafter['vocab_size']} tokens, the target's {target['vocab_size']} "
            "(vocab_size: another tokenizer or model family)"
        )
    if problems:
        model = f"the target it was trained against (its run's train_config.json names {trained_on})"
        raise CheckpointError(
            f"--drafter {step_dir} does not fit the target {target_dir}: {'; '.join(problems)}; pass --target with "
            f"{model if trained_on else 'the model the drafter was trained for'}, or a --drafter trained for this "
            "target"
        )
