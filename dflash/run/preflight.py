"""Cheap checks of a training run's arguments and input files, before anything slow starts.

Importing transformers and loading the target take 15-120 s, regenerating replies minutes: an
error found after them costs all of that. :func:`validate_inputs` reads only small files (the
target's ``config.json`` and file names, the first records of the data, the output directory's
listing), never imports transformers and never loads weights, so every error below arrives in
well under a second; torch is imported only by its last checks, which ask it which devices this host
has. The one larger read is on ``--resume``: the checkpoint it continues is hashed against its
manifest here, once (the trainer then loads it without hashing it again). It changes nothing on disk.

Numbers (``--lr nan``, ``--steps 0``, ...) are checked earlier still, when the
:class:`~dflash.config.TrainConfig` is built.

:func:`check_drafter_config` comes next (the trainer runs it right after): it builds the config
of the drafter the run will train from the target's ``config.json``, no weights, so a drafter
shape that does not work (a window smaller than the block, heads that do not group over the KV
heads, a target with no MLP width to copy) is named before the target loads. It needs
transformers' config classes, a few seconds to import, which is why it is not part of
:func:`validate_inputs`.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from dflash.assets import default_data_dir, default_target_dir
from dflash.config import TrainConfig
from dflash.data.chats import read_conversations
from dflash.devices import check_cpu_threads, parse_layout, resolve_device
from dflash.drafter.files import CONFIG_NAME, CheckpointError
from dflash.files import check_weight_files
from dflash.run.layout import (
    CHECKPOINTS_DIR,
    SAVED_CONFIG_NAME,
    check_out_location,
    checkpoints_dir,
    is_run_file,
    read_saved_config,
    run_of,
    saved_steps,
)
from dflash.run.resume import check_resume_config
from dflash.run.step_dirs import find_checkpoint
from dflash.target_model.files import (
    FLA_PACKAGE,
    TargetLoadError,
    check_packable,
    fla_available,
    is_hybrid,
    read_target_config,
    require_tokenizer_files,
    require_transformers_for,
)
from dflash.target_model.taps import check_taps

#: Records of the data file parsed up front; the rest is read when the run builds its data.
HEAD_RECORDS = 64


def validate_inputs(config: TrainConfig) -> None:
    """Check every argument and input of ``config`` that can be checked without loading a model.

    - ``--out``: a directory (or creatable), writable, not inside another run and holding only a run's
      files (:mod:`dflash.run.layout`); without ``--resume`` it must not hold a run, with it it must hold a
      checkpoint whose files match its manifest, and the flags must be ones it can continue with
      (:mod:`dflash.run.resume`);
    - ``--max-anchors`` (new runs): at most ``--seq-len - 1``;
    - ``--data`` (or the embedded corpus) and ``--eval-data``: readable files whose first records parse;
    - ``--target`` (or the embedded target): a directory with ``config.json``, tokenizer files and
      whole weight files (:mod:`dflash.files`); the layers to tap (``--num-target-layers``/
      ``--target-layer-ids``), ``--mask-token-id`` and ``--seq-len`` fit its config;
    - ``--device``, ``--target-devices``/``--drafter-devices``: devices this host has, and
      ``--cpu-threads`` its cores;
    - a hybrid target (Qwen3.5 / Qwen3.6) on CUDA: flash-linear-attention is installed (or
      ``--slow-linear-attention`` asks for the reference kernels); with ``--pack``, every layer type
      of the target is one packing keeps apart; the installed transformers loads its model type;
    - ``--target-dtype fp8``: every target device can run FP8 matmuls and torchao is installed.

    Raises:
        ValueError: the first problem found; its subclasses (DatasetError, TargetLoadError,
            CheckpointError, DeviceSpecError) and the message name the flag or file and the fix.
    """
    check_out_dir(Path(config.out), resume=config.resume, allow_nonempty=config.allow_nonempty_out)
    if config.resume:
        check_resume_flags(config)
    else:  # a resumed run keeps the budget it started with (changing it changes the anchors drawn)
        check_anchor_budget(config)
    read_conversations(
        Path(config.data) if config.data else default_data_dir() / "train.jsonl",
        max_records=HEAD_RECORDS,
        progress=False,
    )
    if config.eval_data:
        read_conversations(config.eval_data, max_records=HEAD_RECORDS, progress=False, flag="--eval-data")
    target_dir = Path(config.target) if config.target else default_target_dir()
    target_config = check_target_fits(target_dir, config)
    check_devices(config)
    check_linear_attention_kernels(target_config, target_dir, config)
    check_fp8_target(config)


#: Drafter config fields and the ``dflash train`` flags that set them, for :func:`check_drafter_config`'s errors.
DRAFTER_FLAGS = {
    "block_size": "--block-size",
    "num_hidden_layers": "--num-draft-layers",
    "layer_types": "--draft-layer-types",
    "sliding_window": "--draft-sliding-window",
    "num_attention_heads": "--draft-heads",
    "num_key_value_heads": "--draft-kv-heads",
    "head_dim": "--draft-head-dim",
    "intermediate_size": "--draft-intermediate-size",
}


def check_drafter_config(config: TrainConfig) -> None:
    """The drafter of ``config`` (resolved, :func:`dflash.run.drafter_shape.resolve_drafter_shape`)
    builds for its target: its config, without weights, from the target's ``config.json``, as the
    trainer builds it once the target has loaded (module docstring). An ``--init-from`` drafter was
    read and checked whole when the shape was resolved.

    Raises:
        ValueError: the drafter config is invalid; the message names the field, the problem and
            the flags that set it.
    """
    if config.init_from:
        return
    # Transformers (seconds to import) and torch: after the config is settled (module docstring).
    from transformers import AutoConfig

    from dflash.drafter.model import drafter_config

    target_dir = Path(config.target) if config.target else default_target_dir()
    target = AutoConfig.from_pretrained(target_dir)
    text = target.get_text_config()
    ids = check_taps(text.num_hidden_layers, layer_ids=config.target_layer_ids, num_captured=config.num_target_layers)
    try:
        # The mask token is resolved from the tokenizer when the run starts; any row stands in for it
        # here (an explicit --mask-token-id was checked against the vocabulary by validate_inputs).
        drafter_config(config, target, target_layer_ids=ids, mask_token_id=config.mask_token_id or 0)
    except ValueError as e:
        flags = [flag for field, flag in DRAFTER_FLAGS.items() if field in str(e)]
        raise ValueError(
            f"the drafter this run would train does not build: {e}"
            + (f" (set by {', '.join(flags)}, or by the rule of dflash.run.drafter_shape where empty)" if flags else "")
        ) from None


def check_anchor_budget(config: TrainConfig) -> None:
    """``--max-anchors`` fits a row: a row of ``seq_len`` tokens has at most ``seq_len - 1`` anchors
    (``loss_mask[a]`` and ``loss_mask[a + 1]``, ``docs/dflash.md``), and every block past them is padding
    that the drafter still computes (queries grow with ``max_anchors * block_size``).

    Raises:
        ValueError: more anchors than that, naming both flags and the largest value that fits.
    """
    if config.max_anchors > config.seq_len - 1:
        raise ValueError(
            f"--max-anchors {config.max_anchors} is more than a row of --seq-len {config.seq_len} tokens holds "
            f"({config.seq_len - 1} anchors at most; the rest would be padding blocks the drafter still computes); "
            f"pass --max-anchors {config.seq_len - 1} or less"
        )


def check_resume_flags(config: TrainConfig) -> None:
    """The flags of a resumed run are ones its checkpoints can continue with (compared with the
    run's ``train_config.json``; the trainer compares again with the checkpoint it loads).

    Raises:
        CheckpointError: a flag that changes the math differs (names each, old -> new).
    """
    saved = read_saved_config(config.out)
    if saved:
        check_resume_config(saved, config, Path(config.out), warn=False)


def check_out_dir(out: Path, *, resume: bool, allow_nonempty: bool = False) -> None:
    """``--out`` can be written, holds a run exactly when ``resume`` is given, and may hold a run
    (:func:`dflash.run.layout.check_out_location`).

    Raises:
        ValueError: ``out`` is a file, or cannot be written; it holds a run and ``resume`` is off; it is
            inside another run, or holds other files without ``allow_nonempty``.
        CheckpointError: ``resume`` without a checkpoint in ``out``, or with one whose files are missing,
            truncated or altered (:func:`dflash.run.step_dirs.verify_checkpoint`).
    """
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; choose a directory")
    if (out / CONFIG_NAME).is_file() and not checkpoints_dir(out).is_dir():
        run = run_of(out) or out.parent
        raise ValueError(
            f"--out {out} is a checkpoint (a step directory), not a run directory; pass the run's --out "
            f"(here probably {run}); --resume continues from its newest checkpoint"
        )
    existing = next((p for p in (out, *out.parents) if p.exists()), None)
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        raise ValueError(f"--out {out}: cannot write in {existing} ({e.strerror}); choose a writable --out") from None
    refuse_existing_run(out, resume=resume)
    if resume:  # before the look at other files: a --resume of a directory that holds no run says so
        _refuse_a_resume_without_a_checkpoint(out)
    check_out_location(out, allow_nonempty=allow_nonempty)
    if resume:
        find_checkpoint(out)  # its files' sizes and sha256, once: the trainer loads them unhashed


def _refuse_a_resume_without_a_checkpoint(out: Path) -> None:
    """``--resume`` continues the run of ``--out`` from its newest checkpoint: say so when ``out`` holds
    none (a step directory is refused by :func:`check_out_dir`), and, for a run stopped before its first
    checkpoint, that the fix is to start the same run again (what it kept is reused).

    Raises:
        CheckpointError: ``out`` does not exist, holds no run, or holds a run's files but no complete
            step directory.
    """
    if saved_steps(out):
        return
    flag = f"--out {out}" + (" (the default)" if out == Path(TrainConfig.out) else "")
    no_run = (
        "--resume continues the run trained into --out: pass that run's --out (the directory that holds its "
        f"{CHECKPOINTS_DIR}/), or leave --resume out to start a new run"
    )
    if not out.is_dir():
        raise CheckpointError(f"{flag}: does not exist; {no_run}")
    kept = sorted(p.name for p in out.iterdir() if is_run_file(p.name) and not p.name.startswith("."))
    journals = [name for name in kept if name.endswith(".partial")]
    if journals:  # dflash.data.regenerate's journals
        raise CheckpointError(
            f"{out} has no checkpoint yet, only the replies regenerated before the run stopped "
            f"({', '.join(journals)}); start the same run again without --resume: it continues the regeneration"
        )
    if kept:
        raise CheckpointError(
            f"{out} has no checkpoint yet: the run stopped before its first save (it saves every --save-every steps "
            f"and at its end), so --resume has nothing to continue; start the same run again without --resume "
            f"(it reuses what it kept: {', '.join(kept)})"
        )
    raise CheckpointError(f"{flag}: holds no run (no {SAVED_CONFIG_NAME}, no {CHECKPOINTS_DIR}/); {no_run}")


def refuse_existing_run(out: Path, *, resume: bool) -> None:
    """A new run must not prune, or point ``latest`` away from, another run's checkpoints.

    Raises:
        ValueError: ``out`` already holds checkpoints and ``resume`` is off.
    """
    steps = saved_steps(out)
    if steps and not resume:
        raise ValueError(
            f"{out} already holds a training run (up to {steps[-1].name}); pass --resume to continue "
            "it, or choose another --out (nothing was changed)"
        )


def check_target_fits(target_dir: Path, config: TrainConfig) -> dict:
    """The target directory has its config and tokenizer, and the run's settings fit that config.

    Returns:
        dict: the target's text config (``text_config`` of a multimodal ``config.json``).

    Raises:
        TargetLoadError: no such directory, no (readable) ``config.json``, no tokenizer files, a
            config without ``num_hidden_layers``, or a model type the installed transformers cannot load.
        WeightFileError: a weight file is missing, truncated or unreadable.
        UnknownLayerType: with ``--pack``, a layer type packing cannot keep apart.
        ValueError: the layers to tap do not fit (names the flags and values that do), the mask
            token is not in the vocabulary, or ``--seq-len`` is past the target's positions.
    """
    raw = read_target_config(target_dir)
    require_transformers_for(raw, target_dir / "config.json", decoding=config.measures_acceptance)
    require_tokenizer_files(target_dir)
    check_weight_files(target_dir)
    text = raw.get("text_config") or raw  # multimodal configs nest the language model's
    if config.pack:
        check_packable(text, target_dir / "config.json")
    num_layers = text.get("num_hidden_layers")
    if not isinstance(num_layers, int):
        raise TargetLoadError(f"target {target_dir / 'config.json'}: no num_hidden_layers; is it a causal LM's config?")
    check_taps(num_layers, layer_ids=config.target_layer_ids, num_captured=config.num_target_layers)
    vocab_size = text.get("vocab_size")
    if config.mask_token_id is not None and isinstance(vocab_size, int) and not 0 <= config.mask_token_id < vocab_size:
        raise ValueError(
            f"--mask-token-id {config.mask_token_id} is not a token of the target (vocab_size {vocab_size}); "
            "pass an existing, rarely used token id, or leave it empty to use the tokenizer's mask token"
        )
    positions = text.get("max_position_embeddings")
    if isinstance(positions, int) and config.seq_len > positions:
        raise ValueError(
            f"--seq-len {config.seq_len} is longer than the target's max_position_embeddings {positions} "
            f"({target_dir / 'config.json'}); pass --seq-len {positions} or less"
        )
    return text


def check_devices(config: TrainConfig) -> None:
    """``--device``, or ``--target-devices``/``--drafter-devices``, name devices this host has, and
    ``--cpu-threads`` fits its cores.

    Raises:
        ValueError, DeviceSpecError: the message names the device, what this host has, and the fix.
    """
    check_cpu_threads(config.cpu_threads)
    if config.drafter_devices is not None:
        parse_layout(config.target_devices, config.drafter_devices)
    else:
        resolve_device(config.device)


def target_devices(config: TrainConfig) -> list:
    """The devices the target runs on: the layout's target slots, else ``--device`` (torch.device each)."""
    if config.drafter_devices is not None:
        return [slot.device for slot in parse_layout(config.target_devices, config.drafter_devices).targets]
    return [resolve_device(config.device)]


def check_fp8_target(config: TrainConfig) -> None:
    """With ``--target-dtype fp8``, every target device runs FP8 matmuls (:func:`dflash.target_model.fp8.fp8_problem`).

    Raises:
        ValueError: names the device or the missing package, and the fix.
    """
    if config.target_dtype != "fp8":
        return
    from dflash.target_model.fp8 import fp8_problem

    for device in target_devices(config):
        if problem := fp8_problem(device):
            raise ValueError(f"--target-dtype fp8: {problem}; or drop the flag (auto: bf16 on GPU, fp32 on CPU)")


def check_linear_attention_kernels(target_config: dict, target_dir: Path, config: TrainConfig) -> None:
    """A hybrid target (``target_config``, its text config) on CUDA has flash-linear-attention's
    kernels, unless ``--slow-linear-attention``.

    Without them transformers runs Gated DeltaNet on its pure-PyTorch reference (and packed rows on
    :mod:`dflash.target_model.documents`'s, one step per token): measured on one H200 with a 16-layer
    cut of Qwen3.6-27B's width, the first step did not finish in 200 s; with the kernels it ran at
    6,812 tok/s end to end.

    Raises:
        ValueError: names the package, the install command, the slowdown and the flag.
    """
    if config.slow_linear_attention or not is_hybrid(target_config) or fla_available():
        return
    if any(device.type == "cuda" for device in target_devices(config)):
        raise ValueError(
            f"target {target_dir}: its linear-attention layers (Gated DeltaNet) need {FLA_PACKAGE} on CUDA, which "
            "is not installed: without it a step of a 16-layer cut of Qwen3.6-27B did not finish in 200 s, with it "
            f"the run trained at 6,812 tok/s; install it with pip install -e '.[fla]' (or pip install {FLA_PACKAGE}), "
            "or pass --slow-linear-attention to run the reference kernels anyway"
        )
