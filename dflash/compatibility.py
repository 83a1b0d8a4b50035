"""Whether a drafter fits a target, decided from the two ``config.json`` files before either loads.

A DFlash drafter is built for one target (arXiv 2602.06036, Sec. 3; ``docs/dflash.md``): its
``fc`` takes the K tapped layers' states concatenated, ``[.., K * H]`` with H the target's hidden
size; its ``target_layer_ids`` index the target's decoder layers (the drafter's config records how
many the target had, ``num_target_layers``); it has no embedding or LM head of its own but the
target's, so its vocabulary and mask token are the target's. Loading an 8B target takes minutes:
these checks read the two small files and say, in terms of the model each flag names, what does not
fit; they load no weights and never import transformers.
"""

from __future__ import annotations

from pathlib import Path

from dflash.checkpoint import CONFIG_NAME, CheckpointError
from dflash.json_files import read_json_object

#: Fields of a drafter's config.json the comparison needs (z-lab's layout, :mod:`dflash.checkpoint`).
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
        TargetLoadError: see :func:`dflash.target.files.read_target_config`, or a field is missing.
    """
    from dflash.target.files import TargetLoadError, read_target_config

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
