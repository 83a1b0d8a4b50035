"""The drafter's shape: block size, layers and their attention, heads, widths and tapped layers.

``dflash train`` leaves each of these empty unless a flag sets it; :func:`resolve_drafter_shape`
fills them, before the target loads, by one of three rules:

- ``--init-from DIR``: the published drafter's own (``config.json``), checked to fit the target
  (hidden size, vocabulary, number of target layers); a flag that disagrees with it is refused;
- a Qwen3.5/3.6 target (:func:`qwen3_5_family`): the published drafters' shape, not the
  target's gated-attention heads (24 / 4 / 256 for the 27B). Dense (``model_type`` ``qwen3_5``,
  text-only or multimodal): :data:`PUBLISHED_QWEN3_5` (z-lab/Qwen3.6-27B-DFlash as SpecForge ships
  its config: 5 layers, 4 sliding-window layers of 2048 then 1 full, 32 heads, 8 KV heads,
  head_dim 128, the target's MLP width, block 16, 5 tapped layers). MoE (``qwen3_5_moe``, e.g.
  Qwen3.5/3.6-35B-A3B): :data:`PUBLISHED_QWEN3_5_MOE` (z-lab/Qwen3.5-35B-A3B-DFlash: 8 full
  layers, 32 heads, 4 KV heads, head_dim 128, MLP width 6144, block 16, 5 tapped layers), whose
  experts have no single MLP width to copy;
- any other target: the target's own attention and MLP geometry (left empty: the drafter config
  copies it), all full attention, :data:`STANDARD` block size, layers and taps (small enough for a
  CPU run).

``--arch`` (empty: ``dflash``, or the ``--init-from`` drafter's) picks DFlash or DFlash2; for a
DFlash2 drafter of a dense Qwen3.5/3.6 target the rule is :data:`PUBLISHED_QWEN3_5_DFLASH2`
(z-lab/Qwen3.8-27B-DFlash2: block 8, every layer sliding, and for 64 target layers the taps of
:data:`PUBLISHED_DFLASH2_TAPS`).

Flags given explicitly always win over the rule (and must agree with ``--init-from``). Sliding
layers without ``--draft-sliding-window`` get :data:`DEFAULT_SLIDING_WINDOW`.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from dflash.assets import default_target_dir
from dflash.config import FULL_ATTENTION, SLIDING_ATTENTION, TrainConfig, check_block_fits_row, parse_layer_types
from dflash.drafter.files import CONFIG_NAME, DRAFTER_FILES, CheckpointError, check_tensors, read_drafter_config
from dflash.run.step_dirs import find_checkpoint, verify_checkpoint
from dflash.target_model.files import read_target_config
from dflash.target_model.taps import max_captured_layers

logger = logging.getLogger(__name__)

#: ``model_type`` of the Qwen3.5/3.6 hybrid targets (the multimodal checkpoint and its text model),
#: dense and mixture-of-experts.
QWEN3_5_MODEL_TYPES = {"dense": ("qwen3_5", "qwen3_5_text"), "moe": ("qwen3_5_moe", "qwen3_5_moe_text")}
#: Window of the published sliding drafter layers, in tokens.
DEFAULT_SLIDING_WINDOW = 2048
#: Rule for targets without a published shape: the target's geometry, TrainConfig field -> value.
STANDARD = {"block_size": 8, "num_draft_layers": 1, "num_target_layers": 3}
#: The published Qwen3.5/3.6 drafters' shape (layer types: all sliding but the last).
PUBLISHED_QWEN3_5 = {
    "block_size": 16,
    "num_draft_layers": 5,
    "num_target_layers": 5,
    "draft_heads": 32,
    "draft_kv_heads": 8,
    "draft_head_dim": 128,
}
#: The published Qwen3.5/3.6 MoE drafters' shape (z-lab/Qwen3.5-35B-A3B-DFlash, for a 40-layer target:
#: taps [1, 10, 19, 28, 37]; all full attention; the MLP width of its config, feed_forward_length 6144
#: in the GGUF conversions of the 35B-A3B drafters, as its 905 MB of bf16 weights imply).
PUBLISHED_QWEN3_5_MOE = {
    "block_size": 16,
    "num_draft_layers": 8,
    "num_target_layers": 5,
    "draft_heads": 32,
    "draft_kv_heads": 4,
    "draft_head_dim": 128,
    "draft_intermediate_size": 6144,
}
#: The published Qwen3.5/3.6-family DFlash2 drafters' shape (z-lab/Qwen3.8-27B-DFlash2, whose target has the
#: Qwen3.6-27B shape: block 8, 5 layers all sliding of 2048, 32 / 8 heads of 128, the target's MLP width).
PUBLISHED_QWEN3_5_DFLASH2 = {**PUBLISHED_QWEN3_5, "block_size": 8}
#: Its tapped layers for a 64-layer target, not the default spread ([1, 16, 31, 46, 61]).
PUBLISHED_DFLASH2_TAPS = {64: [5, 19, 33, 47, 61]}
#: The TrainConfig fields :func:`resolve_drafter_shape` fills.
SHAPE_FIELDS = (
    "arch",
    "block_size",
    "num_draft_layers",
    "draft_layer_types",
    "draft_sliding_window",
    "draft_heads",
    "draft_kv_heads",
    "draft_head_dim",
    "draft_intermediate_size",
    "target_layer_ids",
    "num_target_layers",
    "mask_token_id",
)
# TrainConfig field -> what a drafter's config.json calls it (for --init-from).
_FROM_DRAFTER = {
    "block_size": "block_size",
    "num_draft_layers": "num_hidden_layers",
    "draft_heads": "num_attention_heads",
    "draft_kv_heads": "num_key_value_heads",
    "draft_head_dim": "head_dim",
    "draft_intermediate_size": "intermediate_size",
}


def qwen3_5_family(target_config: dict) -> str | None:
    """``"dense"`` or ``"moe"`` for a Qwen3.5/3.6 hybrid target ``config.json`` (dict), text-only or
    multimodal; None for any other target."""
    text = target_config.get("text_config") or target_config
    for family, model_types in QWEN3_5_MODEL_TYPES.items():
        if target_config.get("model_type") in model_types or text.get("model_type") in model_types:
            return family
    return None


def resolve_drafter_shape(config: TrainConfig) -> TrainConfig:
    """``config`` with the drafter's shape filled in by the rule of the module docstring; reads
    only the target's ``config.json`` (and the ``--init-from`` drafter's config). Idempotent.

    Raises:
        TargetLoadError: the target directory has no readable ``config.json``.
        CheckpointError: the ``--init-from`` directory is not a complete drafter (its config, or
            weights that are cut short, that differ from its ``manifest.json``, or that the config does
            not describe).
        ValueError: flags that contradict each other or the ``--init-from`` drafter, or an
            ``--init-from`` drafter that does not fit the target (the message names the field).
    """
    target_dir = Path(config.target) if config.target else default_target_dir()
    target = read_target_config(target_dir)
    if config.init_from:
        config = dataclasses.replace(config, init_from=_drafter_directory(config.init_from))
        values = _from_drafter(config, target, target_dir)
    else:
        family = qwen3_5_family(target)
        if config.arch is None:
            config = dataclasses.replace(config, arch="dflash")
        values = _rule_values(config, family)
        values |= _default_taps_that_fit(config, values, target)
        values |= _published_dflash2_taps(config, values, target, family)
        _warn_if_far_wider(values, target)
    if config.block_size is None:  # before replace() checks it as if --block-size had been given
        origin = "the --init-from drafter's" if config.init_from else "the default for this target: not given"
        check_block_fits_row(values["block_size"], config.seq_len, origin=origin)
    config = dataclasses.replace(config, **values)
    _refuse_selector_flags_without_a_selector(config)
    return config


def _rule_values(config: TrainConfig, family: str | None) -> dict:
    """The shape fields the rule fills for a target of ``family`` (:func:`qwen3_5_family`), where
    ``config`` (its ``arch`` set) leaves them empty; before the taps are fitted to the target's depth."""
    dense = PUBLISHED_QWEN3_5_DFLASH2 if config.arch == "dflash2" else PUBLISHED_QWEN3_5
    rule = {"dense": dense, "moe": PUBLISHED_QWEN3_5_MOE, None: STANDARD}[family]
    values = {k: v for k, v in rule.items() if getattr(config, k) is None}
    sliding = "all" if family == "dense" and config.arch == "dflash2" else family == "dense"
    return values | _layer_types(config, values, sliding_rule=sliding)


#: The kinds of target the rule tells apart, as --help names them: (name, family, arch).
_RULE_KINDS = (
    ("other targets", None, "dflash"),
    ("Qwen3.5/3.6", "dense", "dflash"),
    ("Qwen3.5/3.6 with --arch dflash2", "dense", "dflash2"),
    ("Qwen3.5/3.6 MoE", "moe", "dflash"),
)
#: What an empty field left by the rule means (else: the target's own, copied by the drafter config).
_LEFT_EMPTY = {"draft_layer_types": "all full", "draft_sliding_window": "none (no sliding layer)"}


def rule_help(field: str) -> str | None:
    """What the rule gives an empty ``field`` for each kind of target, for ``dflash train --help``
    (computed by the rule itself, so the help cannot drift from it); None for a field it does not fill
    by kind of target."""
    if field not in SHAPE_FIELDS or field in ("arch", "target_layer_ids", "mask_token_id"):
        return None
    entries = []
    for name, family, arch in _RULE_KINDS:
        value = _rule_values(TrainConfig(arch=arch), family).get(field)
        if value is None:
            text = _LEFT_EMPTY.get(field, "the target's")
        elif field == "draft_layer_types":
            text = _runs_of(value.split(","))
        else:
            text = str(value)
        entries.append(f"{name} {text}")
    return "the --init-from drafter's, else " + "; ".join(entries)


def _runs_of(types: list[str]) -> str:
    """``sliding x4, full`` for four sliding layers and then a full one."""
    runs: list[list] = []
    for kind in types:
        short = kind.removesuffix("_attention")
        if runs and runs[-1][0] == short:
            runs[-1][1] += 1
        else:
            runs.append([short, 1])
    return ", ".join(kind if count == 1 else f"{kind} x{count}" for kind, count in runs)


#: The drafter's attention width (heads x head dim) past which a warning says it is far wider than
#: its target's hidden size (the published 27B drafters: 4,096 against 5,120).
FAR_WIDER = 4


def _warn_if_far_wider(values: dict, target: dict) -> None:
    """The published shape is for the published targets: on a small target of their family (a test
    model of hidden size 64) its 32 heads of 128 make a drafter many times wider than its target,
    slow to train and no better for it. Said when the rule, not a flag, gave the heads."""
    if "draft_heads" not in values or "draft_head_dim" not in values:
        return
    text = target.get("text_config") or target
    hidden, width = text.get("hidden_size"), values["draft_heads"] * values["draft_head_dim"]
    if not isinstance(hidden, int) or width <= FAR_WIDER * hidden:
        return
    heads, kv_heads, head_dim = (text.get(k) for k in ("num_attention_heads", "num_key_value_heads", "head_dim"))
    theirs = f" (e.g. the target's {heads} / {kv_heads} / {head_dim})" if heads and kv_heads and head_dim else ""
    logger.warning(
        "drafter: the published shape of this target family's drafters, %d heads of %d (%d KV heads), is %d wide, "
        "%.0fx this target's hidden size %d: a drafter far wider than its target trains slowly and accepts no more "
        "for it; pass --draft-heads, --draft-kv-heads and --draft-head-dim%s for one that fits",
        values["draft_heads"],
        values["draft_head_dim"],
        values.get("draft_kv_heads", 0),
        width,
        width / hidden,
        hidden,
        theirs,
    )


def _refuse_selector_flags_without_a_selector(config: TrainConfig) -> None:
    """The selector's flags on a DFlash drafter would do nothing: most likely ``--arch dflash2`` was
    forgotten."""
    defaults = TrainConfig.defaults()
    given = [
        f"--{name.replace('_', '-')} {getattr(config, name)}"
        for name in ("selector_loss_weight", "selector_missing_gold", "selector_target", "selector_codebooks")
        if getattr(config, name) != defaults[name]
    ]
    if config.arch == "dflash" and given:
        raise ValueError(
            f"{', '.join(given)}: the candidate selector is DFlash2's; this drafter is DFlash (pass --arch dflash2, "
            "or drop the flag)"
        )


def _default_taps_that_fit(config: TrainConfig, values: dict, target: dict) -> dict:
    """The rule's tap count, lowered to what the target's depth spreads (a flag the user passed
    is checked as given, with an error naming it: :func:`dflash.target_model.taps.check_taps`)."""
    layers = (target.get("text_config") or target).get("num_hidden_layers")
    if "num_target_layers" not in values or config.target_layer_ids is not None or not isinstance(layers, int):
        return {}
    fits = max_captured_layers(layers)
    if values["num_target_layers"] <= fits:
        return {}
    logger.info(
        "tapping %d target layers, the most the default spread fits in a %d-layer target (the rule's %d need %d)",
        fits,
        layers,
        values["num_target_layers"],
        values["num_target_layers"] + 3,
    )
    return {"num_target_layers": fits}


def _published_dflash2_taps(config: TrainConfig, values: dict, target: dict, family: str | None) -> dict:
    """The published DFlash2 taps (:data:`PUBLISHED_DFLASH2_TAPS`) for a dense Qwen3.5/3.6 target of
    that depth, where no tap flag was given."""
    layers = (target.get("text_config") or target).get("num_hidden_layers")
    taps = PUBLISHED_DFLASH2_TAPS.get(layers)
    if config.arch != "dflash2" or family != "dense" or taps is None or config.target_layer_ids is not None:
        return {}
    if values.get("num_target_layers", config.num_target_layers) != len(taps):
        return {}
    return {"target_layer_ids": taps}


def _layer_types(config: TrainConfig, values: dict, *, sliding_rule: bool | str) -> dict:
    """``draft_layer_types`` / ``draft_sliding_window`` (and the layer count from the types):
    ``sliding_rule`` True for all sliding but the last, ``"all"`` for all sliding."""
    layers = values.get("num_draft_layers", config.num_draft_layers)
    if config.draft_layer_types is not None:
        types = parse_layer_types(config.draft_layer_types)
        if config.num_draft_layers is not None and len(types) != config.num_draft_layers:
            raise ValueError(
                f"--draft-layer-types names {len(types)} layers, --num-draft-layers is {config.num_draft_layers}; "
                "give one type per drafter layer (or drop --num-draft-layers)"
            )
    elif sliding_rule == "all":
        types = [SLIDING_ATTENTION] * layers
    elif sliding_rule:
        types = [SLIDING_ATTENTION] * (layers - 1) + [FULL_ATTENTION]
    else:
        types = [FULL_ATTENTION] * (config.num_draft_layers or layers)
    out = {"num_draft_layers": len(types)}
    if SLIDING_ATTENTION not in types:
        if config.draft_sliding_window is not None:
            raise ValueError(
                f"--draft-sliding-window {config.draft_sliding_window}: no drafter layer is sliding; pass "
                "--draft-layer-types with sliding layers (e.g. sliding,sliding,sliding,sliding,full)"
            )
        if config.draft_layer_types is None:
            return out  # all full attention: the field stays empty, as in runs saved before it existed
    else:
        out["draft_sliding_window"] = config.draft_sliding_window or DEFAULT_SLIDING_WINDOW
    return out | {"draft_layer_types": ",".join(types)}


def _drafter_directory(init_from: str) -> str:
    """``--init-from`` as the drafter directory it names: itself, or the latest checkpoint of a
    run directory (``--out`` of ``dflash train``, as ``dflash eval`` and ``dflash export`` take).

    Raises:
        CheckpointError: no such directory (before anything reads it).
    """
    path = Path(init_from)
    if not path.is_dir():
        what = "a file, not a directory" if path.exists() else "no such directory"
        raise CheckpointError(
            f"--init-from {init_from}: {what}; pass a drafter directory (config.json + model.safetensors, as "
            "published) or a dflash train run directory"
        )
    if (path / CONFIG_NAME).is_file():
        return init_from
    try:
        step_dir = find_checkpoint(path, verify=False, files=DRAFTER_FILES)
    except CheckpointError:
        return init_from
    logger.info("--init-from %s: a training run; starting from its checkpoint %s", init_from, step_dir)
    return str(step_dir)


def _from_drafter(config: TrainConfig, target: dict, target_dir: Path) -> dict:
    """The shape fields of the ``--init-from`` drafter, refused where they contradict a flag or
    do not fit the target, or where its weights cannot load (read from the file's header)."""
    drafter = read_drafter_config(config.init_from)
    values = {field: getattr(drafter, key) for field, key in _FROM_DRAFTER.items()}
    values |= {
        "draft_layer_types": ",".join(drafter.layer_types),
        "draft_sliding_window": drafter.window_of(SLIDING_ATTENTION)
        if SLIDING_ATTENTION in drafter.layer_types
        else None,
        "target_layer_ids": drafter.target_layer_ids,
        "num_target_layers": len(drafter.target_layer_ids),
        "mask_token_id": drafter.mask_token_id,
    }
    for field, value in values.items():
        given = getattr(config, field)
        if field == "draft_layer_types" and given is not None:
            given = ",".join(parse_layer_types(given))
        if given is not None and given != value:
            raise ValueError(
                f"--{field.replace('_', '-')} {getattr(config, field)} disagrees with the --init-from drafter "
                f"{config.init_from} ({value}); drop the flag: the drafter's own shape is kept"
            )
    text = target.get("text_config") or target
    fits = {"hidden_size": drafter.hidden_size, "vocab_size": drafter.vocab_size}
    fits["num_hidden_layers"] = drafter.num_target_layers
    for key, value in fits.items():
        if text.get(key) != value:
            name = "num_target_layers" if key == "num_hidden_layers" else key
            raise ValueError(
                f"--init-from {config.init_from}: {name} {value} does not fit the target {target_dir} ({key} "
                f"{text.get(key)}); this drafter was trained for another target: pass its target, or train a "
                "new drafter without --init-from"
            )
    arch = "dflash2" if drafter.is_dflash2 else "dflash"
    if config.arch not in (None, arch):
        raise ValueError(
            f"--arch {config.arch} disagrees with the --init-from drafter {config.init_from} (a {arch} drafter); drop "
            "--arch: the drafter's own architecture is kept"
        )
    # Before the target loads: a checkpoint's manifest catches a same-size change the header cannot (as
    # --resume and dflash eval check it); a drafter as published has none, and its header is all there is.
    verify_checkpoint(Path(config.init_from), files=DRAFTER_FILES, picked=False)
    check_tensors(config.init_from, drafter)
    return values | {"arch": arch}
