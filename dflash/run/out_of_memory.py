"""A run that runs out of GPU memory ends with one message that says where and what to change,
not a traceback (``dflash train``; the threaded engine re-raises a thread's error as the cause of
its own, :class:`dflash.train.threaded.PipelineError`).

The flags that reduce memory, in the order the message offers them: fewer rows per micro-batch with
more micro-batches per step (``--batch-size`` halved, ``--grad-accum`` doubled: the same step, as
the loss is normalised over the whole step), fewer anchors per row (``--max-anchors``: the drafter's
activations grow with them), shorter rows (``--seq-len``), the target's weights in FP8
(``--target-dtype fp8``: half the target's weights), and the target on GPUs of its own
(``--target-devices`` / ``--drafter-devices``).
"""

from __future__ import annotations

import re

#: CUDA's own words for a failed allocation, in the messages of errors that are no
#: ``torch.OutOfMemoryError`` (a Triton kernel's launch, NCCL).
_CUDA_WORDS = ("CUDA out of memory", "CUDA error: out of memory")


def out_of_memory_error(error: BaseException) -> BaseException | None:
    """The out-of-memory error that ``error`` is or was raised from (``raise ... from``), if any. An
    error raised while another was handled (``__context__`` only) is an error of its own."""
    import torch

    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, torch.OutOfMemoryError) or any(words in str(error) for words in _CUDA_WORDS):
            return error
        error = error.__cause__
    return None


def advice(config, error: BaseException, step: int | None) -> str:
    """The message for an out-of-memory ``error`` of a run of ``config`` (:class:`dflash.config.TrainConfig`)
    in ``step`` (None: while the run was built, before its first step): where it happened, the
    allocation that failed and each device's peak, then the flags that reduce memory, with values
    for this run."""
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    asked = re.search(r"[Tt]ried to allocate ([0-9.]+ [KMG]iB)", first)
    when = "while building the run" if step is None else f"in step {step}"
    lines = [
        f"out of GPU memory {when}"
        + (f" (an allocation of {asked.group(1)} failed)" if asked else f": {first[:200]}")
        + f"; peak memory: {_peaks()}.",
        "To fit, change one of:",
    ]
    rows, accum = config.batch_size, config.grad_accum
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
