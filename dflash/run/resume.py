"""What a resumed run (``dflash train --resume``) may change, and how it continues.

A resume continues exactly (the batches, anchors, learning-rate schedule and optimizer state of
the run had it not stopped) when nothing that changes the math differs from the saved run. Flags
that do not change it (logging, saving, compile, the target threads, ``--device``, the drafter's
rows per forward ``--drafter-rows``: the same sums in another order) may differ.

**Elastic resume.** Jobs are drawn in one fixed order per process (:mod:`dflash.train.jobs`):
job j is the loader's next batch with anchors from one generator, for drafter replica ``j % W``,
so one device with ``--grad-accum k * W`` trains on exactly the batches and anchors that W drafter
replicas with ``--grad-accum k`` do. The device layout (``--device``, ``--target-devices``,
``--drafter-devices``) may therefore change whenever the rows of an optimizer step, ``--batch-size``
x ``--grad-accum`` x drafter replicas, stay the same: ``--grad-accum`` is adjusted to keep them
when it is not given, and the log says what changed. What cannot be kept is refused with the
reason: a step's rows that the new replica count does not divide, ``--vary-seq-len`` (its lengths
are cycled per replica), and another torchrun process count (each process draws its own data shard
and its own anchor stream, seeded ``--seed`` + rank).

:func:`resumed_values` merges the flags given now over the saved ones (``dflash train``), and
:func:`check_resume_config` compares a config with a saved one (:mod:`dflash.run.preflight` against
``train_config.json`` before anything loads, :class:`dflash.train.trainer.Trainer` against the
checkpoint it loads).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

from dflash.config import INPUT_PATHS, TrainConfig, absolute_path
from dflash.devices import count_slots
from dflash.drafter.files import CheckpointError
from dflash.run.drafter_shape import SHAPE_FIELDS, resolve_drafter_shape

logger = logging.getLogger(__name__)

#: Fields that may change between a run and its resumption without changing the math.
RESUMABLE_CHANGES = frozenset(
    {
        "out",
        "resume",
        "allow_nonempty_out",
        "steps",
        "epochs",
        "progress",
        "log_every",
        "save_every",
        "keep_last",
        "device",
        "compile",
        "compile_scope",
        "cpu_threads",
        "slow_linear_attention",
        "random_target_weights",
        "peak_tflops",
        "save",
        "save_dtype",
        "target_devices",
        "prefetch_depth",
        "drafter_rows",
        "stall_minutes",
        "profile_step",
    }
)
#: Fields of the drafter layout: they may change together when a step's rows stay the same.
LAYOUT_FIELDS = ("drafter_devices", "grad_accum")
_LAYOUT_FLAGS = ("device", "target_devices", "drafter_devices")


def drafter_replicas(values: dict) -> int:
    """Drafter replicas of one process under the flags ``values``: the slots of
    ``drafter_devices`` (counted, not checked against this host), else 1."""
    spec = values.get("drafter_devices")
    return 1 if spec is None else count_slots(spec)


def rows_per_step(values: dict) -> int:
    """Rows one process trains on per optimizer step: batch size x grad accumulation x replicas."""
    return values["batch_size"] * values["grad_accum"] * drafter_replicas(values)


def resumed_values(saved: dict, given: dict) -> dict:
    """The flags of a resumed run: those ``given`` now over the ``saved`` ones (not the defaults).

    A length given now replaces the saved one (``--steps`` a saved ``--epochs``), and a layout
    given now replaces the saved one: ``--device`` alone means the single-device path
    (the saved ``--target-devices``/``--drafter-devices`` are dropped), a layout flag drops the
    saved ``--device``. A saved ``--profile-step`` is not carried over. When ``--grad-accum`` is
    not given it is set to keep the rows of a step under the new drafter replica count, where that
    count divides them (else the saved value stays, and :func:`check_resume_config` says why the
    run cannot continue).
    """
    merged = {**saved, **given}
    if "profile_step" not in given:  # a diagnostic of the run that asked for it, not of its resumes
        merged.pop("profile_step", None)
    if "steps" in given and "epochs" not in given:  # a length given now replaces the saved one
        merged.pop("epochs", None)
    if saved and "device" in given and not {"target_devices", "drafter_devices"} & given.keys():
        merged.pop("target_devices", None)
        merged.pop("drafter_devices", None)
    if "device" not in given and merged.get("target_devices") is not None:
        merged.pop("device", None)  # the layout names the devices (older runs saved both)
    if saved and "grad_accum" not in given:
        before, after = ({**TrainConfig.defaults(), **values} for values in (saved, merged))
        rows, per_micro_batch = rows_per_step(before), rows_per_step({**after, "grad_accum": 1})
        if rows % per_micro_batch == 0 and rows // per_micro_batch != before["grad_accum"]:
            merged["grad_accum"] = rows // per_micro_batch
    return merged


def same_input(saved: str | None, current: str | None, *, warn: bool = True) -> bool:
    """Whether a saved --target/--data names the file or directory given now.

    Runs saved before input paths were made absolute hold them as typed, relative to where
    that run started. A saved path that does not exist here (another host's mount point) is
    taken as the same input, with a warning, rather than failing only on some ranks.
    """
    if not saved or not current:
        return saved == current
    if absolute_path(saved) == current:
        return True
    if not os.path.exists(saved):
        if warn:
            logger.warning(
                "the run was trained on %s, which does not exist here; taking %s as the same input", saved, current
            )
        return True
    return os.path.exists(current) and os.path.samefile(saved, current)


def check_resume_config(saved: dict, current: TrainConfig, where: Path, *, warn: bool = True) -> None:
    """``current``, a settled config (:func:`dflash.run.settle.settle`), continues the run saved with the
    flags ``saved`` (module docstring).

    Args:
        where: the run or step directory the flags come from (named in messages).
        warn: log the tolerated differences (a moved input, another length, another layout).

    Raises:
        CheckpointError: a flag that changes the math differs (each named, old -> new), or the
            layout changed in a way the run cannot continue exactly under (the reason and the fix).
    """
    # A key the saved run lacks is a field added since; it ran with that field's default.
    saved = {**TrainConfig.defaults(), **saved}
    shape = {k: saved[k] for k in SHAPE_FIELDS}
    if shape != {k: getattr(current, k) for k in SHAPE_FIELDS}:
        # A run saves its settled config, so only one saved before the rule of dflash.run.drafter_shape
        # existed can have left a shape field empty: it is filled by the rule, as the current one was.
        resolved = resolve_drafter_shape(dataclasses.replace(current, **shape))  # once: it reads (and verifies) files
        saved |= {k: getattr(resolved, k) for k in SHAPE_FIELDS}
    values = current.to_dict()
    changed = [k for k in _changed(saved, values) if k not in INPUT_PATHS]
    changed += [k for k in INPUT_PATHS if not same_input(saved.get(k), getattr(current, k), warn=warn)]
    _refuse_changes(saved, values, changed, where)
    _check_layout(saved, values, where, warn=warn)
    if warn and (saved.get("steps"), saved.get("epochs")) != (current.steps, current.epochs):
        logger.warning(
            "%s: resuming with a different length (steps %s -> %s, epochs %s -> %s): the learning-rate "
            "schedule is recomputed for the new length, so the continuation is not the run it would have "
            "been",
            where,
            saved.get("steps"),
            current.steps,
            saved.get("epochs"),
            current.epochs,
        )


def check_given_flags(saved: dict, given: dict, where: Path) -> None:
    """The flags ``given`` on ``--resume`` keep the math of the run saved with the flags ``saved``,
    compared as given, before they are merged and built into a config: a config's own checks would
    otherwise refuse a changed flag first with a fix that does not help (another ``--block-size``
    asks for a ``--gamma``). :func:`check_resume_config` compares the settled config, input paths
    included, afterwards.

    Raises:
        CheckpointError: see :func:`check_resume_config`.
    """
    saved = {**TrainConfig.defaults(), **saved}
    # A shape field left empty (given now, or by a run saved before the rule) is filled by the rule
    # when the config settles, and compared then; input paths are compared as files, once absolute.
    unknown = set(INPUT_PATHS) | {k for k in SHAPE_FIELDS if saved.get(k) is None or given.get(k) is None}
    _refuse_changes(saved, given, [k for k in _changed(saved, given) if k not in unknown], where)


def _changed(saved: dict, values: dict) -> list[str]:
    """The fields of ``values`` that change the math and differ from ``saved`` (sorted)."""
    exempt = RESUMABLE_CHANGES | set(LAYOUT_FIELDS)
    return sorted(k for k, v in values.items() if k not in exempt and saved.get(k) != v)


def _refuse_changes(saved: dict, values: dict, changed: list[str], where: Path) -> None:
    if changed:
        details = ", ".join(f"{k}: {saved.get(k)!r} -> {values[k]!r}" for k in changed)
        raise CheckpointError(
            f"{where} was trained with a different config ({details}); resume with the same flags "
            "(train_config.json in --out holds them; flags you do not repeat are taken from it) "
            "or train into a new --out"
        )


def _layout_text(values: dict) -> str:
    replicas = drafter_replicas(values)
    where = values.get("drafter_devices") or values.get("device") or "auto"
    return (
        f"--batch-size {values['batch_size']} x --grad-accum {values['grad_accum']} x {replicas} drafter "
        f"replica{'s' * (replicas > 1)} on {where}"
    )


def _check_layout(saved: dict, values: dict, where: Path, *, warn: bool) -> None:
    before, after = (tuple(v.get(k) for k in (*_LAYOUT_FLAGS, "grad_accum")) for v in (saved, values))
    if before == after:
        return
    rows, replicas = rows_per_step(saved), drafter_replicas(values)
    if rows_per_step(values) != rows:
        micro_batches = rows // values["batch_size"]  # --batch-size itself cannot change (checked above)
        if micro_batches % replicas == 0:
            fix = f"pass --grad-accum {micro_batches // replicas} (or leave it out)"
        else:
            fits = [n for n in range(1, micro_batches + 1) if micro_batches % n == 0]
            fix = f"use {' or '.join(map(str, fits))} drafter device(s) (a count that divides {micro_batches})"
        raise CheckpointError(
            f"{where}: a step of this run trains on {rows} rows per process ({_layout_text(saved)}), the resumed "
            f"layout on {rows_per_step(values)} ({_layout_text(values)}); it continues exactly only with the same "
            f"rows per step: {fix}"
        )
    if values.get("vary_seq_len") and drafter_replicas(saved) != replicas:
        raise CheckpointError(
            f"{where}: --vary-seq-len {values['vary_seq_len']} cycles the sequence lengths per drafter replica, so "
            f"another replica count ({drafter_replicas(saved)} -> {replicas}) trains on other lengths; resume with "
            f"--drafter-devices {saved.get('drafter_devices')}, or train into a new --out"
        )
    if warn:
        logger.info(
            "%s: resuming under another layout: %s -> %s; a step still trains on the same %d rows per process in "
            "the same order, so the run continues with the same batches, anchors and schedule",
            where,
            _layout_text(saved),
            _layout_text(values),
            rows,
        )


def check_process_count(saved: int, current: int, where: Path) -> None:
    """The resumed run has as many torchrun processes as the saved one.

    Raises:
        CheckpointError: another count (the reason: per-process data shards and anchor streams).
    """
    if saved != current:
        raise CheckpointError(
            f"{where} was saved by {saved} process(es), this run has {current}: each process trains on its own shard "
            "of the data with its own anchor stream (--seed + rank), which another process count cannot continue; "
            f"resume with {saved} torchrun process(es) (any device layout within each), or train into a new --out"
        )
