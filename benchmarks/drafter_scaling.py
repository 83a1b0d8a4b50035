"""Drafter-side scaling of the threaded engine (dflash/train/threaded.py), from synthetic hidden
states (no target weights needed).

    python benchmarks/drafter_scaling.py --device cuda --size realistic     # H200: W = visible GPUs
    python benchmarks/drafter_scaling.py --device cpu --size tiny           # CPU smoke test

Phases, one run, ratios printed at the end:

1. scaling: the trainer's drafter threads (``DrafterWorker``, flat-buffer gradient sums,
   every replica stepping its optimizer) in lockstep, 1 thread vs W threads. Reports drafter
   tokens/s per device and ``W-thread per-device / solo`` (goal >= 0.95), and the drafter step's
   MFU (the trainer's FLOP count, ``drafter_step_flops``; goal >= 50% on H200).
2. recompile: W free-running threads (forward + backward, no lockstep so the others keep
   running compiled steps while one compiles); after a warm window, thread W-1 gets a new
   sequence length every step (a recompile each time). Run twice, each in a fresh interpreter:
   with the project's torch patches and with ``DFLASH_PATCHES=0`` (plain torch). Reports per
   run: errors (first message), eager fallbacks (steps whose compiled graph did not run),
   recompiles, and the steady threads' tokens/s in the recompile window relative to the warm one.

``--size realistic``: hidden 4096, 32 heads (8 KV), intermediate 12288, vocab 151936, 5 tapped
target layers, block 16, 512 anchors, seq 2048, batch 1 (Qwen3-8B-shaped drafter); the
drafter step is compiled (inductor, flex_attention). ``--size tiny``: a few thousand
parameters; on CPU the scaling phase is eager SDPA like the trainer and the recompile phase
compiles with ``aot_eager`` (still traces with make_fx, the race window), quick on 2 cores.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import threading
import time
import types

import torch
from transformers import Qwen3Config

from dflash.compile_watch import DynamoWarnings, raise_recompile_limit
from dflash.config import TrainConfig
from dflash.data.batches import Batch
from dflash.devices import Slot
from dflash.drafter.model import AnchoredDrafter, create_drafter_config
from dflash.masks import sample_anchors
from dflash.target_model.model import TargetStates
from dflash.train.drafter_rows import DrafterRows
from dflash.train.flops import detect_peak_tflops, drafter_step_flops
from dflash.train.jobs import Job
from dflash.train.loss_settings import LossSettings
from dflash.train.replica import build_replicas, optimizer_step
from dflash.train.step import TargetBatch, drafter_step
from dflash.train.threaded import Control, DrafterWorker, Inbox, Prefetched, run_drafters

SIZES = {
    "tiny": dict(
        hidden=64,
        heads=4,
        kv_heads=2,
        head_dim=16,
        intermediate=128,
        vocab=512,
        layers=1,
        block=8,
        anchors=16,
        seq=64,
        batch=2,
    ),
    "realistic": dict(
        hidden=4096,
        heads=32,
        kv_heads=8,
        head_dim=128,
        intermediate=12288,
        vocab=151936,
        layers=1,
        block=16,
        anchors=512,
        seq=2048,
        batch=1,
    ),
    # A 27B-class drafter: Qwen3-32B's width (the issue's 64 layers x 5120 target shape).
    "27b": dict(
        hidden=5120,
        heads=64,
        kv_heads=8,
        head_dim=128,
        intermediate=25600,
        vocab=151936,
        layers=1,
        block=16,
        anchors=512,
        seq=2048,
        batch=1,
    ),
}
RESULT_TAG = "RESULT "


class _Heads:
    """Random frozen heads standing in for a target (what ``build_replicas`` reads of one)."""

    def __init__(self, device: torch.device, s: dict) -> None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.device = device
        self.embed_tokens = torch.nn.Embedding(s["vocab"], s["hidden"]).to(device, dtype).requires_grad_(False)
        self.lm_head = torch.nn.Linear(s["hidden"], s["vocab"], bias=False).to(device, dtype).requires_grad_(False)


def build(devices: list[torch.device], s: dict, compiled: bool, backend: str, warnings: DynamoWarnings):
    """Drafter replicas (same initial weights) with random frozen heads, and their loss settings."""
    target = Qwen3Config(
        vocab_size=s["vocab"],
        hidden_size=s["hidden"],
        intermediate_size=s["intermediate"],
        num_hidden_layers=36,
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"],
        head_dim=s["head_dim"],
    )
    config = create_drafter_config(target, s["layers"], block_size=s["block"], mask_token_id=s["vocab"] - 1)
    torch.manual_seed(0)
    attention = "flex_attention" if devices[0].type == "cuda" else "sdpa"
    model = AnchoredDrafter._from_config(config, attn_implementation=attention, dtype=torch.float32).train()
    settings = LossSettings.from_config(
        TrainConfig(), block_size=s["block"], mask_token_id=config.mask_token_id, selector=config.is_dflash2
    )
    slots = [Slot(f"{d.type}:{i}", d) for i, d in enumerate(devices)]
    optimizer_config = types.SimpleNamespace(lr=1e-4, weight_decay=0.0)
    replicas = build_replicas(
        model,
        slots,
        [_Heads(devices[0], s)],
        optimizer_config,
        settings,
        compiled=compiled,
        warnings=warnings,
        backend=backend,
    )
    return replicas, settings


def make_item(device: torch.device, s: dict, seq_len: int, seed: int, model) -> Prefetched:
    """A synthetic micro-batch: random tokens, all supervised, random tapped target states."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, s["vocab"] - 1, (s["batch"], seq_len), generator=gen)
    loss_mask = torch.ones(s["batch"], seq_len, dtype=torch.bool)
    anchors, valid = sample_anchors(loss_mask, s["anchors"], generator=gen)
    width = len(model.config.target_layer_ids) * s["hidden"]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    context = torch.randn(s["batch"], seq_len, width, generator=gen).to(device, dtype)
    host = Batch(ids, loss_mask, torch.full((s["batch"],), seq_len))
    ids, loss_mask, positions, documents = (
        t.to(device) for t in (ids, loss_mask, host.position_ids, host.document_ids)
    )
    batch = TargetBatch(ids, loss_mask, positions, documents, TargetStates(context, None), host.num_tokens)
    job = Job(seed, 0, 0, 0, host, anchors, valid, {})
    return Prefetched(job, batch, anchors.to(device), valid.to(device))


def _sync(devices) -> None:
    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------------
# Phase 1: lockstep scaling (the trainer's drafter side)
# ---------------------------------------------------------------------------------------


def lockstep(devices: list[torch.device], s: dict, args) -> dict:
    """Drafter tokens/s per device and MFU with ``len(devices)`` lockstep drafter threads."""
    compiled = devices[0].type == "cuda"
    warnings = DynamoWarnings()
    replicas, settings = build(devices, s, compiled, args.backend, warnings)
    items = [make_item(d, s, s["seq"], i, r.model) for i, (d, r) in enumerate(zip(devices, replicas))]
    control = Control()
    inboxes = [Inbox(2, control) for _ in replicas]
    workers = [
        DrafterWorker(
            r, inbox, control, settings, grad_accum=1, recompile_limit=16, rows=DrafterRows(s["batch"], None, r.name)
        )
        for r, inbox in zip(replicas, inboxes)
    ]
    for inbox, w in zip(inboxes, workers):
        control.on_stop(inbox.wake)
        control.on_stop(w.wake)
        w.start()
    try:
        with warnings:
            for step in range(args.warmup + args.steps):
                if step == args.warmup:
                    _sync(devices)
                    start, flops0 = time.perf_counter(), sum(w.flops for w in workers)
                for inbox, item in zip(inboxes, items):
                    inbox.put(step, item)
                run_drafters(workers, control, step)
                optimizer_step(replicas, lr=1e-4, grad_clip=1.0)
            _sync(devices)
            elapsed = time.perf_counter() - start
    finally:
        control.shutdown()
        for w in workers:
            w.join()
    tokens = args.steps * s["batch"] * s["seq"]  # per device
    flops = (sum(w.flops for w in workers) - flops0) / len(workers)
    peak = 1e12 * (args.peak_tflops or detect_peak_tflops(devices[0]) or 0.0)
    summaries = [r.watch.summary() for r in replicas]
    return {
        "threads": len(devices),
        "tokens_per_s_per_device": tokens / elapsed,
        "mfu": flops / elapsed / peak if peak else None,
        "tflops_per_device": flops / elapsed / 1e12,
        "eager_fallbacks": sum(c["eager_fallbacks"] for c in summaries),
        "unexpected_recompiles": sum(c["unexpected_recompiles"] for c in summaries),
    }


# ---------------------------------------------------------------------------------------
# Phase 2: free-running threads, one recompiling (run in a fresh interpreter per torch mode)
# ---------------------------------------------------------------------------------------


def free_running(devices: list[torch.device], s: dict, args) -> dict:
    """W threads run forward + backward freely; after a warm window thread W-1 recompiles every step."""
    replicas, settings = build(devices, s, True, args.backend, DynamoWarnings())
    last = len(devices) - 1
    start_barrier, switch_barrier = threading.Barrier(len(devices)), threading.Barrier(len(devices))
    stats = [
        dict(errors=0, first_error=None, eager=0, compiles=0, warm_tokens=0, warm_s=0.0, hot_tokens=0, hot_s=0.0)
        for _ in devices
    ]

    def one_step(i, replica, item) -> None:
        st = stats[i]
        watch = replica.watch
        before = (watch.compiles, watch.eager_fallbacks)
        watch.before()
        try:
            drafter_step(
                replica.step_fn,
                replica.model,
                replica.heads,
                item.batch,
                item.anchors,
                item.valid,
                settings=settings,
                position_weight=replica.position_weight,
            )
        except Exception as e:
            st["errors"] += 1
            st["first_error"] = st["first_error"] or f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            return
        finally:
            replica.flat.zero_()
        watch.after(0, item.batch.input_ids.shape[1])
        st["compiles"] += watch.compiles - before[0]
        st["eager"] += watch.eager_fallbacks - before[1]

    def run(i: int) -> None:
        replica, device = replicas[i], devices[i]
        if device.type == "cuda":
            torch.cuda.set_device(device)
        raise_recompile_limit(10_000)
        item = make_item(device, s, s["seq"], i, replica.model)
        one_step(i, replica, item)  # first compile, before the clock
        _sync([device])
        start_barrier.wait()
        for window, seconds in (("warm", args.warm_seconds), ("hot", args.seconds)):
            deadline = time.perf_counter() + seconds
            begin, tokens, n = time.perf_counter(), 0, 0
            while time.perf_counter() < deadline:
                if window == "hot" and i == last:  # a new shape each step: recompiles
                    n += 1
                    length = s["seq"] - 8 * n
                    if length < 16:
                        break
                    step_item = make_item(device, s, length, 1000 + n, replica.model)
                else:
                    step_item = item
                one_step(i, replica, step_item)
                _sync([device])
                tokens += step_item.batch.num_tokens
            stats[i][f"{window}_tokens"] += tokens
            stats[i][f"{window}_s"] += time.perf_counter() - begin
            if window == "warm":
                switch_barrier.wait()

    threads = [threading.Thread(target=run, args=(i,), name=f"drafter {i}") for i in range(len(devices))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    steady = [st for i, st in enumerate(stats) if i != last] or stats
    ratio = sum(st["hot_tokens"] / st["hot_s"] for st in steady) / sum(
        st["warm_tokens"] / st["warm_s"] for st in steady
    )
    return {
        "patches": os.environ.get("DFLASH_PATCHES", "1") != "0",
        "torch": torch.__version__,
        "errors": sum(st["errors"] for st in stats),
        "first_error": next((st["first_error"] for st in stats if st["first_error"]), None),
        "eager_fallbacks": sum(st["eager"] for st in stats),
        "recompiles": stats[last]["compiles"] - 1,
        "steady_ratio": ratio,
        "steady_tokens_per_s": sum(st["hot_tokens"] / st["hot_s"] for st in steady) / len(steady),
    }


def _child(args, plain: bool) -> dict:
    import tempfile

    seconds = args.plain_seconds if plain else args.seconds
    # A fresh inductor cache per run: the second run must compile as much as the first.
    cache = tempfile.mkdtemp(prefix="dflash-inductor-")
    env = {**os.environ, "DFLASH_PATCHES": "0" if plain else "1", "TORCHINDUCTOR_CACHE_DIR": cache}
    cmd = [
        sys.executable,
        __file__,
        "--phase",
        "recompile-child",
        "--json",
        "--device",
        args.device,
        "--size",
        args.size,
        "--threads",
        str(args.threads),
        "--seconds",
        str(seconds),
        "--warm-seconds",
        str(args.warm_seconds),
        "--backend",
        args.backend,
        "--layers",
        str(args.layers),
        "--seq",
        str(args.seq),
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.child_timeout)
    for line in reversed(done.stdout.splitlines()):
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG) :])
    tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
    return {
        "patches": not plain,
        "errors": 1,
        "first_error": f"child exited {done.returncode}: {' | '.join(tail)}",
        "eager_fallbacks": None,
        "recompiles": None,
        "steady_ratio": None,
        "steady_tokens_per_s": None,
    }


# ---------------------------------------------------------------------------------------
# Profile and capacity: one drafter replica stepping on the main thread
# ---------------------------------------------------------------------------------------

#: Kernel-name fragments of each part of the drafter step (first match wins), for the profile table.
KERNEL_KINDS = (
    ("attention (flex)", ("flex", "tem_fused")),
    ("optimizer (AdamW)", ("adam", "multi_tensor", "foreach")),
    ("matmul", ("gemm", "gmma", "xmma", "cutlass", "nvjet", "sm90", "mm_")),
    ("reduce/copy", ("reduce", "copy", "memcpy", "memset", "fill", "cat")),
)


def _kind(name: str) -> str:
    lowered = name.lower()
    return next((kind for kind, parts in KERNEL_KINDS if any(p in lowered for p in parts)), "fused elementwise/other")


def _solo_step(replica, settings, item, step: int) -> None:
    replica.flat.zero_()
    replica.watch.before()
    replica.flat.stats.add_(
        drafter_step(
            replica.step_fn,
            replica.model,
            replica.heads,
            item.batch,
            item.anchors,
            item.valid,
            settings=settings,
            position_weight=replica.position_weight,
        )
    )
    replica.watch.after(step, item.batch.input_ids.shape[1])
    optimizer_step([replica], lr=1e-4, grad_clip=1.0)


def profile(device: torch.device, s: dict, args) -> dict:
    """Where the drafter step's GPU time goes: kernels by kind and the top kernels, over ``--steps``
    steps after ``--warmup``; with the step's MFU from the trainer's FLOP count."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    warnings = DynamoWarnings()
    (replica,), settings = build([device], s, device.type == "cuda", args.backend, warnings)
    item = make_item(device, s, s["seq"], 0, replica.model)
    with warnings:
        for step in range(args.warmup):
            _solo_step(replica, settings, item, step)
        _sync([device])
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            for step in range(args.steps):
                _solo_step(replica, settings, item, args.warmup + step)
            _sync([device])
            elapsed = time.perf_counter() - start
    rows = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.self_device_time_total for e in rows) or 1.0
    kinds: dict[str, float] = {}
    for e in rows:
        kinds[_kind(e.key)] = kinds.get(_kind(e.key), 0.0) + e.self_device_time_total
    blocks, pairs = replica.flat.stats[[2, 3]].tolist()
    flops = drafter_step_flops(
        replica.model, draft_tokens=blocks * s["block"], context_tokens=s["batch"] * s["seq"], visible_pairs=pairs
    )
    peak = 1e12 * (args.peak_tflops or detect_peak_tflops(device) or 0.0)
    step_s = elapsed / args.steps
    print(f"profile: {args.steps} steps, {1e3 * step_s:.1f} ms/step, GPU busy {total / 1e6 / elapsed:.0%} of wall")
    if peak:
        print(f"  MFU {100 * flops / step_s / peak:.1f}% ({flops / step_s / 1e12:.0f} TFLOP/s of model FLOPs)")
    for kind, t in sorted(kinds.items(), key=lambda kv: -kv[1]):
        print(f"  {kind:<26} {100 * t / total:5.1f}%")
    print("  top kernels:")
    for e in sorted(rows, key=lambda e: -e.self_device_time_total)[:12]:
        share = 100 * e.self_device_time_total / total
        print(f"    {share:5.1f}%  {e.count:5d}x  {e.key[:110]}")
    return {"ms_per_step": 1e3 * step_s, "mfu": flops / step_s / peak if peak else None, "kinds": kinds}


def capacity(device: torch.device, s: dict, args) -> dict:
    """The first of ``--candidates`` (``SEQxANCHORS``, largest first) whose full drafter step (compiled
    forward, backward, optimizer) fits the device, batch ``s["batch"]``; with each one's peak memory."""
    tried = []
    for candidate in args.candidates.split(","):
        seq, anchors = (int(x) for x in candidate.lower().split("x"))
        torch.empty(1, device=device)  # the CUDA context exists before its statistics are reset
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        try:
            trial = {**s, "seq": seq, "anchors": anchors}
            (replica,), settings = build([device], trial, True, args.backend, DynamoWarnings())
            item = make_item(device, trial, seq, 0, replica.model)
            for step in range(2):
                _solo_step(replica, settings, item, step)
            _sync([device])
            peak = torch.cuda.max_memory_allocated(device) / 2**30
            tried.append({"seq": seq, "anchors": anchors, "fits": True, "peak_gib": peak})
            print(f"  seq {seq} x {anchors} anchors: fits, peak {peak:.1f} GiB")
            break
        except Exception as error:  # OOM surfaces wrapped too (e.g. inside a compile's autotuning)
            if "out of memory" not in str(error).lower():
                raise
            tried.append({"seq": seq, "anchors": anchors, "fits": False, "error": str(error).splitlines()[0][:120]})
            print(f"  seq {seq} x {anchors} anchors: out of memory")
        finally:
            replica = item = None  # free the trial before the next one
            torch._dynamo.reset()
    return {"tried": tried}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--size", choices=tuple(SIZES), default="tiny")
    p.add_argument("--threads", type=int, default=None, help="W (default: visible GPUs; 2 on CPU)")
    p.add_argument("--layers", type=int, default=None, help="drafter layers (default: the preset's)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: the preset's)")
    p.add_argument("--steps", type=int, default=10, help="timed lockstep steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed lockstep steps (compile)")
    p.add_argument("--seconds", type=float, default=10.0, help="length of the recompiling window (patched run)")
    p.add_argument("--warm-seconds", type=float, default=None, help="length of the warm window (default: --seconds)")
    p.add_argument(
        "--plain-seconds",
        type=float,
        default=None,
        help="length of the plain-torch run's recompiling window (default: --seconds)",
    )
    p.add_argument("--backend", default=None, help="dynamo backend (default: inductor on cuda, aot_eager on cpu)")
    p.add_argument("--peak-tflops", type=float, default=None, help="for MFU (default: detect; H100/H200 989)")
    p.add_argument(
        "--phase",
        choices=("all", "scaling", "recompile", "recompile-child", "profile", "capacity"),
        default="all",
        help="recompile = only the patched vs plain comparison; recompile-child = one such run here",
    )
    p.add_argument("--no-plain", action="store_true", help="skip the DFLASH_PATCHES=0 run")
    p.add_argument(
        "--concurrent",
        action="store_true",
        help="run the patched and plain interpreters at the same time (their speeds are then not comparable)",
    )
    p.add_argument("--child-timeout", type=float, default=540.0)
    p.add_argument("--json", action="store_true", help="print the phase's result as one JSON line")
    p.add_argument(
        "--candidates",
        default="16384x4096,16384x2048,8192x3072,8192x2048,8192x1024,4096x2048,4096x1024,2048x512",
        help="capacity phase: SEQxANCHORS to try, largest first",
    )
    args = p.parse_args()
    args.backend = args.backend or ("inductor" if args.device == "cuda" else "aot_eager")
    args.warm_seconds = args.seconds if args.warm_seconds is None else args.warm_seconds
    args.plain_seconds = args.seconds if args.plain_seconds is None else args.plain_seconds
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no visible GPU; use --device cpu")
    args.threads = args.threads or (torch.cuda.device_count() if args.device == "cuda" else 2)
    s = dict(SIZES[args.size])
    s["layers"] = args.layers = args.layers or s["layers"]
    s["seq"] = args.seq = args.seq or s["seq"]
    devices = (
        [torch.device("cuda", i % torch.cuda.device_count()) for i in range(args.threads)]
        if args.device == "cuda"
        else [torch.device("cpu")] * args.threads
    )
    if args.device == "cuda" and args.threads > torch.cuda.device_count():
        print(f"note: {args.threads} threads on {torch.cuda.device_count()} GPU(s): threads share GPUs")

    if args.phase == "recompile-child":
        print(RESULT_TAG + json.dumps(free_running(devices, s, args)), flush=True)
        return 0
    if args.phase in ("profile", "capacity"):
        print(f"drafter {args.size}: {s}; {args.phase} on {devices[0]}, torch {torch.__version__}")
        result = (profile if args.phase == "profile" else capacity)(devices[0], s, args)
        if args.json:
            print(RESULT_TAG + json.dumps(result), flush=True)
        return 0
    print(
        f"drafter {args.size}: {s}; W={args.threads} on {args.device}, backend {args.backend}; "
        f"torch {torch.__version__}"
    )
    result = {}
    if args.phase in ("all", "scaling"):
        solo = lockstep(devices[:1], s, args)
        multi = lockstep(devices, s, args) if args.threads > 1 else solo
        scaling = multi["tokens_per_s_per_device"] / solo["tokens_per_s_per_device"]
        for run in (solo, multi):
            mfu = f"{100 * run['mfu']:.1f}%" if run["mfu"] is not None else "n/a (no known peak)"
            print(
                f"  {run['threads']} thread(s): {run['tokens_per_s_per_device']:.0f} tok/s per device, "
                f"{run['tflops_per_device']:.1f} TFLOP/s per device, MFU {mfu}, eager fallbacks "
                f"{run['eager_fallbacks']}, unexpected recompiles {run['unexpected_recompiles']}"
            )
        print(f"scaling: W={args.threads} per-device / solo = {scaling:.3f} (goal >= 0.95)")
        result.update(solo=solo, multi=multi, scaling=scaling)
    if args.phase in ("all", "recompile"):
        modes = [False] + ([] if args.no_plain else [True])
        if args.concurrent:  # both interpreters at once, sharing the devices: errors count, speeds do not
            with concurrent.futures.ThreadPoolExecutor(len(modes)) as pool:
                runs = list(pool.map(lambda plain: _child(args, plain), modes))
        else:
            runs = [_child(args, plain) for plain in modes]
        plain = "" if args.no_plain or args.plain_seconds == args.seconds else f" (plain: {args.plain_seconds:.0f} s)"
        print(
            f"recompile phase ({args.warm_seconds:.0f} s warm + {args.seconds:.0f} s{plain} with thread "
            f"{args.threads - 1} recompiling every step):"
        )
        print(
            f"  {'torch':<10}{'errors':>8}{'eager':>8}{'recompiles':>12}{'steady tok/s':>14}{'vs warm':>9}  first error"
        )
        for run in runs:
            fmt = lambda v, spec: "-" if v is None else format(v, spec)
            print(
                f"  {'patched' if run['patches'] else 'plain':<10}{run['errors']:>8}"
                f"{fmt(run['eager_fallbacks'], 'd'):>8}"
                f"{fmt(run['recompiles'], 'd'):>12}{fmt(run['steady_tokens_per_s'], '.0f'):>14}"
                f"{fmt(run['steady_ratio'], '.3f'):>9}  {run['first_error'] or ''}"
            )
        result["recompile"] = runs
    if args.json:
        print(RESULT_TAG + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
