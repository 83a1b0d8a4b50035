"""Device layout of a threaded training process: which devices run target threads and which
run drafter threads (``dflash train --target-devices ... --drafter-devices ...``).

Spec grammar (comma-separated items, each one of)::

    cuda:0-4      a range of GPUs (inclusive)
    cuda:2        one GPU
    3             a bare index, same type as the item before it ("cuda:0,2" = cuda:0, cuda:2)
    cpu           one CPU "device"
    cpu:0-1       several CPU "devices": threads that all run on the host CPU, so CI can run the
                  threaded code path without a GPU; at most one per CPU core (each holds a replica)

A slot is one thread's device; its ``name`` (``cuda:3``, ``cpu:1``) names the thread in logs.

Reading a spec needs no torch (a resumed run counts the slots of its saved layout while ``dflash
train`` settles its config, before torch is imported); a device is resolved by asking torch which
devices this host has, so the functions that do import it.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

_ITEM = re.compile(
    r"^(?:(?P<type>cpu|cuda)(?::(?P<first>\d+)(?:-(?P<last>\d+))?)?|(?P<bare>\d+)(?:-(?P<bare_last>\d+))?)$"
)


class DeviceSpecError(ValueError):
    """A device spec that cannot be parsed or names a device this host does not have."""


@dataclass(frozen=True)
class Slot:
    """One thread's device.

    Args:
        name (str): ``cuda:N`` or ``cpu:N`` (N = the logical CPU slot), the thread's name in logs.
        device (torch.device): ``cuda:N`` or ``cpu``.
    """

    name: str
    device: torch.device


@dataclass(frozen=True)
class DeviceLayout:
    """Target and drafter slots of one process (one target thread / drafter thread per slot)."""

    targets: tuple[Slot, ...]
    drafters: tuple[Slot, ...]

    @property
    def device_type(self) -> str:
        return self.drafters[0].device.type

    def shifted(self, local_rank: int) -> DeviceLayout:
        """The layout of local process ``local_rank`` when several processes share a host
        (``torchrun --nproc-per-node N``): CUDA indices move up by ``local_rank`` times the
        number of GPUs one process uses; CPU slots are unchanged.

        Raises:
            DeviceSpecError: the shifted layout names a GPU this host does not have.
        """
        if self.device_type != "cuda" or local_rank == 0:
            return self
        offset = local_rank * (1 + max(s.device.index for s in self.targets + self.drafters))
        flag = f"--target-devices/--drafter-devices (local rank {local_rank}: GPU indices + {offset})"

        def shift(slots):
            return tuple(_cuda_slot(s.device.index + offset, flag) for s in slots)

        return DeviceLayout(shift(self.targets), shift(self.drafters))


def _cuda_slot(index: int, flag: str) -> Slot:
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise DeviceSpecError(
            f"{flag}: cuda:{index} requested but CUDA is not available on this host "
            f"(torch {torch.__version__}, no visible GPU); use cpu or cpu:0-N"
        )
    if index >= count:
        raise DeviceSpecError(
            f"{flag}: cuda:{index} does not exist; this host has {count} GPU(s) "
            f"(cuda:0..cuda:{count - 1}); check CUDA_VISIBLE_DEVICES"
        )
    return Slot(f"cuda:{index}", torch.device("cuda", index))


def usable_cores() -> int:
    """Cores this process may run on (its affinity: a container's share, not the host's count)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def check_cpu_threads(threads: int | None, *, flag: str = "--cpu-threads") -> None:
    """``threads`` torch intra-op threads fit the cores this process may use (with the other torchrun
    processes of its host): more only oversubscribes them (64 on 2 cores ran 2.3x slower).

    Raises:
        ValueError: more threads than that, naming the count that fits.
    """
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    cores = usable_cores()
    if threads is not None and threads * processes > cores:
        each = f" for each of the {processes} processes on this host" if processes > 1 else ""
        raise ValueError(
            f"{flag} {threads}{each} is more than the {cores} CPU core(s) this process may use: oversubscribed "
            f"threads run several times slower; pass {flag} {max(1, cores // processes)} or less"
        )


def default_cpu_threads() -> tuple[int, str]:
    """torch intra-op threads for a CPU run whose ``--cpu-threads`` was left empty: the cores this
    process may use (its share of them under torchrun) less those other jobs keep busy (the
    1-minute load average, rounded), at least 1; and why, for the log. torch's own default takes every core,
    and its threads wait for each other at every op: on a 2-core machine with other jobs running, the
    same run took 3.4x as long with 2 threads as with 1. Like torchrun's default (OMP_NUM_THREADS=1
    per process), a guess that errs towards fewer threads; ``--cpu-threads`` sets it.
    """
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    share = max(1, usable_cores() // processes)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    free = max(1, int(usable_cores() - load + 0.5) // processes)
    threads = min(share, free)
    return threads, (
        f"{threads} of the {usable_cores()} CPU core(s) this process may use"
        + (f" ({processes} processes on this host)" if processes > 1 else "")
        + f" less the 1-minute load average, {load:.1f}"
    )


def set_cpu_threads(threads: int | None, device_type: str, *, flag: str = "--cpu-threads") -> None:
    """Set torch's intra-op threads to ``threads``; when None, on a CPU run, to
    :func:`default_cpu_threads` (logged with the reason and the flag that sets it), unless
    ``OMP_NUM_THREADS`` set them already. A GPU run keeps torch's default: its ops run on the GPU."""
    import torch

    if threads is None:
        if device_type != "cpu" or "OMP_NUM_THREADS" in os.environ:
            return
        threads, why = default_cpu_threads()
        logger.info(
            "%s not given: %d torch thread(s), %s (more threads than free cores run several times slower); "
            "pass %s N to choose",
            flag,
            threads,
            why,
            flag,
        )
    torch.set_num_threads(threads)


def _cpu_slot(index: int, flag: str) -> Slot:
    import torch

    cores = usable_cores()
    if index >= cores:
        raise DeviceSpecError(
            f"{flag}: cpu:{index} is past the {cores} CPU core(s) this process may use; CPU slots are threads "
            f"that each hold a drafter or target replica, one per core at most: use cpu:0-{cores - 1} or fewer"
        )
    return Slot(f"cpu:{index}", torch.device("cpu"))


def _spec_devices(spec: str, *, flag: str) -> list[tuple[str, int]]:
    """``(type, index)`` of each slot of ``spec`` in the order given, not checked against this host.

    Raises:
        DeviceSpecError: empty spec, an item that is not a device, a descending range.
    """
    items = [item.strip() for item in spec.split(",")]
    if not spec.strip() or not all(items):
        raise DeviceSpecError(f"{flag} {spec!r}: empty device item; write e.g. cuda:0-3, cuda:0,cuda:2 or cpu:0-1")
    devices, kind = [], None
    for item in items:
        m = _ITEM.match(item)
        if not m:
            raise DeviceSpecError(
                f"{flag}: {item!r} is not a device; write cuda:N, cuda:N-M, cpu or cpu:N-M (comma-separated)"
            )
        if m["bare"] is not None:
            if kind is None:
                raise DeviceSpecError(f"{flag}: {item!r} has no device type; write cuda:{item} or cpu:{item}")
            first, last = int(m["bare"]), int(m["bare_last"] or m["bare"])
        else:
            kind = m["type"]
            first = int(m["first"] or 0)
            last = int(m["last"] or first)
        if last < first:
            raise DeviceSpecError(f"{flag}: {item!r} is a descending range; write {kind}:{last}-{first}")
        devices += [(kind, index) for index in range(first, last + 1)]
    return devices


def count_slots(spec: str) -> int:
    """The number of slots (threads) ``spec`` names, on any host (a saved run's layout).

    Raises:
        DeviceSpecError: see :func:`_spec_devices`.
    """
    return len(_spec_devices(spec, flag="device spec"))


def parse_devices(spec: str, *, flag: str) -> tuple[Slot, ...]:
    """Parse one device spec (module docstring) into slots, in the order given.

    Args:
        spec: e.g. ``"cuda:0-4"``, ``"cuda:0,cuda:2"``, ``"cpu"``, ``"cpu:0-1"``.
        flag: the flag name for error messages.

    Raises:
        DeviceSpecError: empty spec, an item that is not a device, a descending range, a GPU
            this host does not have (names it and the GPU count), a CPU slot past the core count,
            or a slot listed twice.
    """
    slots = tuple(
        _cuda_slot(index, flag) if kind == "cuda" else _cpu_slot(index, flag)
        for kind, index in _spec_devices(spec, flag=flag)
    )
    names = [s.name for s in slots]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        fix = "list each GPU once"
        if all(s.device.type == "cpu" for s in slots):  # several CPU threads are numbered slots
            fix = f"for {len(slots)} CPU threads write {flag} cpu:0-{len(slots) - 1}"
        raise DeviceSpecError(f"{flag} {spec!r}: {', '.join(duplicates)} listed twice (one thread per slot); {fix}")
    return slots


def parse_layout(target_devices: str, drafter_devices: str) -> DeviceLayout:
    """Parse ``--target-devices`` and ``--drafter-devices`` into a :class:`DeviceLayout`.

    A target and a drafter may share a GPU (a 1-GPU host runs ``cuda:0`` for both).

    Raises:
        DeviceSpecError: a bad spec (see :func:`parse_devices`), or CPU and CUDA slots mixed
            (all threads of a process use one device type: the gradient averaging is NCCL on GPUs
            and a host sum on CPU).
    """
    targets = parse_devices(target_devices, flag="--target-devices")
    drafters = parse_devices(drafter_devices, flag="--drafter-devices")
    types_ = {s.device.type for s in targets + drafters}
    if len(types_) > 1:
        raise DeviceSpecError(
            f"--target-devices {target_devices!r} and --drafter-devices {drafter_devices!r} mix "
            "cpu and cuda; use one device type for all threads of a process"
        )
    return DeviceLayout(targets, drafters)


def resolve_device(name: str | None) -> torch.device:
    """Turn ``"auto"``/None, ``"cpu"``, ``"cuda"``, ``"cuda:N"`` into a device that exists.

    ``"auto"`` picks ``cuda`` when a GPU is visible, else ``cpu``.

    Raises:
        ValueError: unparsable name, CUDA requested on a host without it, or an index past
            the visible GPUs; the message names the fix.
    """
    import torch

    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"--device {name!r} is not a device name; use cpu, cuda or cuda:N ({e})") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"--device {name}: CUDA is not available on this host (torch "
                f"{torch.__version__}, no visible GPU); use --device cpu"
            )
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ValueError(
                f"--device {name}: this host has {count} CUDA device(s) "
                f"(cuda:0..cuda:{count - 1}); pick one of those or set CUDA_VISIBLE_DEVICES"
            )
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    elif device.type != "cpu":
        raise ValueError(f"--device {name}: only cpu and cuda are supported")
    return device


def compute_dtype(device: torch.device | str) -> torch.dtype:
    """What a model computes in on ``device``: bfloat16 on a GPU (the target's weights, the drafter
    under autocast; the published drafters are bf16), float32 on the CPU (whose bf16 matmuls are
    slow, and where ``dflash eval``'s outputs are checked equal to greedy decoding)."""
    import torch

    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
