"""A run that runs out of GPU memory ends with one message that says where and what to change,
not a traceback (``dflash train``; the threaded engine re-raises a thread's error as the cause of
its own, :class:`dflash.train.threaded.PipelineError`). A first step that runs out in the drafter's
forward/backward is first retried with fewer rows per drafter forward (:mod:`dflash.train.drafter_rows`,
one warning line); the message comes when one row does not fit either, in a later step, or
anywhere else (the target's forward, building the run).

The flags that reduce memory, in the order the message offers them: fewer rows per drafter forward
(``--drafter-rows``, halved: the same training, the drafter's activations, which grow with rows x
anchors, of fewer rows at a time; offered when the drafter ran out), fewer rows per micro-batch with
more micro-batches per step (``--batch-size`` halved, ``--grad-accum`` doubled: the same step, as
the loss is normalised over the whole step), fewer anchors per row (``--max-anchors``: the drafter's
activations grow with them), shorter rows (``--seq-len``), the target's weights in FP8
(``--target-dtype fp8``: half the target's weights), and the target on GPUs of its own
(``--target-devices`` / ``--drafter-devices``).
"""

from __future__ import annotations

import re

#: CUDA's own words for a failed allocation, in the messages of errors that are no
#: ``torch.OutOfMemoryError``: torch's CUDA checks (cudaGetErrorString), a Triton kernel's launch
#: (its launcher's gpuAssert: ``Triton Error [CUDA]: `` and cuGetErrorString, triton 3.x
#: backends/nvidia/driver.c) and NCCL (its CUDACHECK's warning, which torch's NCCL error reports as
#: the last error; NCCL src/include/checks.h).
_CUDA_WORDS = (
    "CUDA out of memory",
    "CUDA error: out of memory",
    "Triton Error [CUDA]: out of memory",
    "Cuda failure 'out of memory'",
)


def out_of_memory_error(error: BaseException) -> BaseException | None:
    """The out-of-memory error that ``error`` is or was raised from (``raise ... from``), if any. An
    error raised while another was handled (``__context__`` only) is an error of its own."""
    import torch

    cuda_words = lambda e: any(words in str(e) for words in _CUDA_WORDS)
    return next((e for e in _causes(error) if isinstance(e, torch.OutOfMemoryError) or cuda_words(e)), None)


def _causes(error: BaseException | None):
    """``error`` and the errors it was raised from, each once."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__


class DrafterOutOfMemory(RuntimeError):
    """The drafter's forward/backward ran out of GPU memory at ``rows`` rows per forward, and the
    step was not retried (:mod:`dflash.train.drafter_rows`); raised from the out-of-memory error.
    ``fewer``: the rows per forward to offer instead (``--drafter-rows``), None at one row."""

    def __init__(self, rows: int, fewer: int | None) -> None:
        super().__init__(f"out of GPU memory in the drafter's forward/backward at {rows_text(rows)} per forward")
        self.rows, self.fewer = rows, fewer


def rows_text(rows: int) -> str:
    """``1 row``, ``2 rows``."""
    return f"{rows} row" if rows == 1 else f"{rows} rows"


def what_failed(error: BaseException) -> str:
    """``an allocation of 2.37 GiB failed`` from an out-of-memory ``error``, else its first line (200
    characters at most)."""
    text = str(error).strip()
    first = text.splitlines()[0] if text else type(error).__name__
    asked = re.search(r"[Tt]ried to allocate ([0-9.]+ [KMG]iB)", first)
    return f"an allocation of {asked.group(1)} failed" if asked else first[:200]


def advice(config, error: BaseException, step: int | None) -> str:
    """The message for ``error`` of a run of ``config`` (:class:`dflash.config.TrainConfig`), an
    out-of-memory error or one raised from it (:func:`out_of_memory_error` finds it), in ``step``
    (None: while the run was built, before its first step): where it happened (in the drafter at
    how many rows per forward, from a :class:`DrafterOutOfMemory` in the chain), the allocation that
    failed and each device's peak, then the flags that reduce memory, with values for this run."""
    oom = out_of_memory_error(error) or error
    drafter = _drafter_error(error)
    when = "while building the run" if step is None else f"in step {step}"
    if drafter is not None:
        when += f", in the drafter's forward/backward at {rows_text(drafter.rows)} per forward"
    lines = [f"out of GPU memory {when} ({what_failed(oom)}); peak memory: {_peaks()}.", "To fit, change one of:"]
    rows, accum = config.batch_size, config.grad_accum
    if drafter is not None and drafter.fewer:
        lines.append(
            f"  --drafter-rows {drafter.fewer}: the drafter runs each micro-batch {rows_text(drafter.fewer)} at a "
            "time (its activations), the same training"
        )
    if rows > 1:
        lines.append(
            f"  --batch-size {rows // 2} --grad-accum {accum * 2}: half the rows per micro-batch, twice the "
            f"micro-batches: the same {rows * accum} rows per step, the same training"
        )
    lines.append(
        f"  --max-anchors {max(1, config.max_anchors // 2)}: half the draft blocks per row (the drafter's activations)"
    )
    lines.append(f"  --seq-len {max(2, config.seq_len // 2)}: shorter rows (the target's and the drafter's context)")
    if config.target_dtype != "fp8":
        lines.append("  --target-dtype fp8: the target's linear layers in FP8, half their memory (Ada/Hopper GPUs)")
    lines.append("  --target-devices / --drafter-devices: the target and the drafter on GPUs of their own")
    return "\n".join(lines)


def _drafter_error(error: BaseException) -> DrafterOutOfMemory | None:
    """The :class:`DrafterOutOfMemory` that ``error`` is or was raised from, if any."""
    return next((e for e in _causes(error) if isinstance(e, DrafterOutOfMemory)), None)


def _peaks() -> str:
    import torch

    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return "n/a"
    gib = 2**30
    peaks = []
    for index in range(torch.cuda.device_count()):
        total = torch.cuda.get_device_properties(index).total_memory / gib
        peaks.append(f"cuda:{index} {torch.cuda.max_memory_allocated(index) / gib:.1f} of {total:.1f} GiB")
    return ", ".join(peaks)
