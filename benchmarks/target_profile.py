"""Where a hybrid target's forward spends its time on packed rows: linear-attention (Gated DeltaNet)
vs full-attention layers, and by kernel kind; and how tok/s and memory move with the batch.

    python benchmarks/target_profile.py                    # one GPU: Qwen3.6-27B width, 16 layers
    python benchmarks/target_profile.py --layers 64        # the whole shape (55.6 GB bf16)
    python benchmarks/target_profile.py --fp8              # linear layers in FP8 (--target-dtype fp8)
    python benchmarks/target_profile.py --tiny             # CPU smoke test

The target is a random-weight Qwen3.6-27B language model (``benchmarks/shapes.py``, first
``--layers`` layers) in bf16 on the device (with ``--fp8``, its linear layers then turned FP8 as
``dflash train --target-dtype fp8`` does, :mod:`dflash.target_model.fp8`); the input is ``--batch`` packed rows of
``--seq-len`` tokens holding documents of log-normal lengths (median 744 tokens, as
``packing_e2e.py``'s synthetic chats), captured as the trainer does (``Target.capture`` with
``document_ids``, the DFlash default 5 taps, stopping at the deepest). One run prints, for each
batch size: target tok/s and peak memory; then, for the largest: the capture that stops at the
deepest tap against the one that runs every layer (as soft labels need), timed alternately;
milliseconds per layer type (CUDA events around each decoder layer's token mixer and MLP) and GPU
time by kernel kind (``torch.profiler``: matmuls, flash-linear-attention's Triton kernels,
attention, the rest).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import random
import statistics
import sys
import time
from collections import defaultdict

import torch
from shapes import SHAPES, hybrid_text_config

from dflash import masks
from dflash.profiling import kernel_kind
from dflash.target_model import documents


def packed_documents(batch: int, seq_len: int, seed: int = 0) -> torch.Tensor:
    """document_ids ``[batch, seq_len]``: rows filled with log-normal document lengths, -1 on the tail."""
    rng = random.Random(seed)
    rows = []
    for _ in range(batch):
        row, doc = [], 0
        while len(row) < seq_len:
            length = max(16, min(seq_len, round(rng.lognormvariate(math.log(744), 0.9))))
            if len(row) + length > seq_len:
                break
            row += [doc] * length
            doc += 1
        rows.append(row + [-1] * (seq_len - len(row)))
    return torch.tensor(rows)


#: ``--kernels`` names: the linear-attention kernels (:mod:`dflash.target_model.documents`) and whether the
#: decoder's RMSNorms and SwiGLU MLPs also run fused (:func:`fused_decoder`).
KERNEL_SETS = {
    "reference": (documents.REFERENCE_KERNELS, False),
    "fla": (documents.FLA_KERNELS, False),
    "fla-conv": (documents.FLA_CONV_KERNELS, False),
    "fla-fused": (documents.FLA_FUSED_KERNELS, False),
    "fla-fused-all": (documents.FLA_FUSED_KERNELS, True),
}


@contextlib.contextmanager
def fused_decoder(model):
    """Inside, every Qwen3.5 RMSNorm (``x * rsqrt(mean(x^2) + eps) * (1 + w)`` in fp32, one rounding)
    and SwiGLU MLP of ``model`` runs on flash-linear-attention's fused kernels (the MLP's SiLU-times-up
    rounds once where transformers rounds after the SiLU too)."""
    from fla.modules.activations import swiglu
    from fla.modules.norm.layernorm import rms_norm

    def norm(module, x):
        return rms_norm(x, 1 + module.weight.float(), None, eps=module.eps)

    def mlp(module, x):
        return module.down_proj(swiglu(module.gate_proj(x), module.up_proj(x)))

    swapped = []
    for module in model.modules():
        kind = type(module).__name__
        replacement = norm if kind == "Qwen3_5RMSNorm" else mlp if kind == "Qwen3_5MLP" else None
        if replacement is not None:
            swapped.append((module, module.__dict__.get("forward")))
            module.forward = functools.partial(replacement, module)
    try:
        yield
    finally:
        for module, own in swapped:
            if own is None:
                del module.forward
            else:
                module.forward = own


def later_document_difference(capture_packed, target, ids: torch.Tensor, document_ids: torch.Tensor) -> float:
    """Largest |packed - alone| of the tapped states over every document after the first of each
    row (the packing bar of ``tests/integration/test_hybrid_cuda.py``): ``capture_packed()`` against
    each document captured alone by transformers' own forward."""
    packed = capture_packed()
    worst = 0.0
    for row in range(ids.shape[0]):
        starts = masks.document_starts(document_ids[row : row + 1])[0]
        bounds = (starts == torch.arange(ids.shape[1])).nonzero().squeeze(1).tolist() + [ids.shape[1]]
        for begin, end in zip(bounds[1:], bounds[2:]):
            if document_ids[row, begin] < 0:
                break
            alone = target.capture(ids[row : row + 1, begin:end], last_hidden=False).context
            worst = max(worst, (packed[row : row + 1, begin:end].float() - alone.float()).abs().max().item())
    return worst


def compare_kernels(model, layer_ids: list[int], names: list[str], ids, document_ids, seconds, repeats: int) -> None:
    """tok/s (medians of alternate calls) and the packing bar of each kernel set; ratios to the first."""
    from dflash.target_model.model import Target

    def capture(name: str):
        kernels, fuse = KERNEL_SETS[name]
        target = Target(model, layer_ids, linear_kernels=kernels)

        def run():
            with fused_decoder(model) if fuse else contextlib.nullcontext():
                return target.capture(ids, document_ids=document_ids, last_hidden=False).context

        return target, run

    runs = {name: capture(name) for name in names}
    for _, run in runs.values():
        run()
    times = defaultdict(list)
    for _ in range(repeats):
        for name, (_, run) in runs.items():
            times[name].append(seconds(run))
    base = statistics.median(times[names[0]])
    for name, (target, run) in runs.items():
        took = statistics.median(times[name])
        bar = later_document_difference(run, target, ids, document_ids)
        kernels, fuse = KERNEL_SETS[name]
        print(
            f"kernels {name:>13} ({kernels.name}{', fused norms and MLPs' if fuse else ''}): "
            f"{ids.numel() / took:,.0f} tok/s, {base / took:.3f}x {names[0]}; later documents vs alone, "
            f"max |diff| {bar:.4f}"
        )


def layer_timers(target, device: torch.device):
    """CUDA-event timers around the token mixer and MLP of every decoder layer a capture runs (up to
    the deepest tap), by layer type."""
    events = defaultdict(list)
    if device.type != "cuda":
        return events, []
    hooks = []
    types = target.config.get_text_config().layer_types
    layers = target.model.get_decoder().layers[: max(target.layer_ids) + 1]
    for layer, layer_type in zip(layers, types):
        mixer = layer.linear_attn if layer_type == "linear_attention" else layer.self_attn
        for name, module in ((f"{layer_type} mixer", mixer), (f"{layer_type} MLP", layer.mlp)):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            hooks.append(module.register_forward_pre_hook(lambda *_, e=start: e.record()))
            hooks.append(module.register_forward_hook(lambda *_, e=end: e.record()))
            events[name].append((start, end))
    return events, hooks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batches", default="1,2,4", help="batch sizes to time (the last is profiled)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--fp8", action="store_true", help="the linear layers in FP8 (needs an FP8 GPU and torchao)")
    parser.add_argument(
        "--kernels",
        default=None,
        help=f"comma list of linear-attention kernel sets to compare at the largest batch ({', '.join(KERNEL_SETS)}): "
        "tok/s and later documents against each run alone",
    )
    args = parser.parse_args(argv)
    unknown = set(args.kernels.split(",")) - set(KERNEL_SETS) if args.kernels else set()
    if unknown:
        parser.error(f"--kernels: unknown {', '.join(sorted(unknown))}; choose from {', '.join(KERNEL_SETS)}")
    shape, device = ("tiny-qwen3.6", "cpu") if args.tiny else ("qwen3.6-27b", "cuda")
    if args.tiny:
        args.layers, args.seq_len, args.batches, args.repeats = 8, 128, "1,2", 1
    from transformers import Qwen3_5ForCausalLM

    from dflash.target_model.model import Target
    from dflash.target_model.taps import default_target_layer_ids

    device = torch.device(device)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):
        model = Qwen3_5ForCausalLM(hybrid_text_config(shape, args.layers))
    torch.set_default_dtype(torch.float32)
    if args.fp8:
        from dflash.target_model.fp8 import quantize_target

        print(f"FP8 linear layers: {quantize_target(model)}")
    target = Target(model, default_target_layer_ids(args.layers, 5))
    vocab = SHAPES[shape]["vocab_size"]
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    print(f"target_profile: Qwen3.6-27B layout, {shape} width, {args.layers} layers, seq {args.seq_len}, {device}")

    def capture(batch: int, last_hidden: bool = False):
        """The trainer's capture of ``batch`` packed rows (the same rows for a given batch size)."""
        documents = packed_documents(batch, args.seq_len)
        ids = torch.randint(5, vocab, documents.shape, generator=torch.Generator().manual_seed(batch))
        return lambda: target.capture(ids, document_ids=documents, last_hidden=last_hidden)

    def seconds(run) -> float:
        sync()
        began = time.perf_counter()
        run()
        sync()
        return time.perf_counter() - began

    batches = list(map(int, args.batches.split(",")))
    for batch in batches:
        run = capture(batch)
        run()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        took = sum(seconds(run) for _ in range(args.repeats)) / args.repeats
        peak = f", peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB" if device.type == "cuda" else ""
        print(f"batch {batch}: {batch * args.seq_len / took:,.0f} tok/s, {1e3 * took:.1f} ms{peak}")

    largest = batches[-1]
    if args.kernels:
        document_ids = packed_documents(largest, args.seq_len)
        ids = torch.randint(5, vocab, document_ids.shape, generator=torch.Generator().manual_seed(largest))
        compare_kernels(model, target.layer_ids, args.kernels.split(","), ids, document_ids, seconds, args.repeats)
    run, full = capture(largest), capture(largest, last_hidden=True)
    full()
    pairs = [(seconds(run), seconds(full)) for _ in range(args.repeats)]
    shallow_s, full_s = (statistics.median(times) for times in zip(*pairs))
    print(
        f"batch {largest}, taps {target.layer_ids}: stopping after layer {max(target.layer_ids)} "
        f"{full_s / shallow_s:.3f}x the capture of all {args.layers} layers ({1e3 * shallow_s:.1f} vs "
        f"{1e3 * full_s:.1f} ms, medians of {args.repeats} alternate calls)"
    )

    events, hooks = layer_timers(target, device)
    run()
    sync()
    totals = {name: sum(s.elapsed_time(e) for s, e in pairs) for name, pairs in events.items()}
    for hook in hooks:
        hook.remove()
    whole = sum(totals.values())
    for name, ms in sorted(totals.items()):
        print(f"  {name:>26}: {ms:8.1f} ms ({100 * ms / whole:4.1f}% of mixers + MLPs)")

    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CUDA] if device.type == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        run()
        sync()
    by_kind, by_kernel = defaultdict(float), defaultdict(float)
    for event in prof.key_averages():
        time_us = event.device_time_total if device.type == "cuda" else event.self_cpu_time_total
        if time_us and (device.type != "cuda" or event.device_type.name == "CUDA"):
            by_kind[kernel_kind(event.key)] += time_us
            by_kernel[event.key] += time_us
    total = sum(by_kind.values()) or 1.0
    for kind, time_us in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"  {kind:>38}: {time_us / 1e3:8.1f} ms ({100 * time_us / total:4.1f}% of GPU time)")
    print("slowest kernels:")
    for name, time_us in sorted(by_kernel.items(), key=lambda kv: -kv[1])[:12]:
        print(f"  {time_us / 1e3:8.1f} ms  {kernel_kind(name)[:10]:<10}  {name[:110]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
