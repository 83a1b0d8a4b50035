"""The drafter step alone, DFlash against DFlash2 (and other variants) side by side, at a public
target's width, from synthetic target states: step time, drafter tok/s, MFU, memory, and where
the GPU time goes.

    python benchmarks/drafter_step.py --shape qwen3.6-27b --batch-size 2           # one H100 / H200
    python benchmarks/drafter_step.py --shape qwen3.6-27b --runs dflash,dflash2,dflash2:selector_loss_weight=0
    python benchmarks/drafter_step.py --runs 'dflash2;dflash2:output_multiplier=0.196,final_logit_softcapping=20.0'
    python benchmarks/drafter_step.py --runs 'dflash2;dflash2:selector_codebooks=projected;dflash2:selector_target=soft'
    python benchmarks/drafter_step.py --tiny                                         # CPU smoke test

Each run (``--runs``: an architecture, optionally with ``:field=value,...`` of ``dflash train``'s
config, or of z-lab's DFlash2 transforms for the drafter's ``dflash_config``) builds the drafter
``dflash train`` builds for a random-weight target of ``--shape``
(:func:`dflash.run.drafter_shape.resolve_drafter_shape`: the published shape for Qwen3.5/3.6),
its replica with the trainer's fused AdamW and compiled step (``--compile-scope``), and runs
``--warmup`` untimed then ``--steps`` timed optimizer steps of the trainer's own
:func:`~dflash.train.step.drafter_step` on one synthetic micro-batch (random tokens, every token
supervised, random tapped states), in a fresh interpreter per run so each has its own memory
peak. No target forward runs: the target's frozen embedding and LM head are random tensors.

Printed per run: ms per step, drafter tok/s (context tokens per second, as the trainer's
``drafter step`` figure), TFLOP/s and MFU (the trainer's FLOP count), the memory that stays
between steps (weights, gradients, optimizer state) and the step's peak (the two apart: activations
and transients), then each run's ratio to the first. ``--profile`` adds, per run, one profiled step's
GPU time by kernel kind (:mod:`dflash.profiling`) and its costliest kernels and launching ops.
``--memory`` adds, per run, what one more step holds at its peak beyond the memory that stays
between steps, by the line of the project's code that allocated it (CUDA's allocator history).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import tempfile
import time
import types
from collections import defaultdict
from pathlib import Path

RESULT_TAG = "RESULT "


def parse_run(spec: str) -> tuple[str, dict]:
    """``dflash2:selector_loss_weight=0,loss_chunk_blocks=8`` -> ("dflash2", {field: value}); values
    are read as Python literals where they parse, else kept as strings."""
    import ast

    arch, _, rest = spec.partition(":")
    fields = {}
    for item in filter(None, rest.split(",")):
        name, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--runs: {item!r} in {spec!r} is not field=value")
        try:
            fields[name] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            fields[name] = value
    return arch, fields


def child(args) -> dict:
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from packing_e2e import write_target

    from dflash.compile_watch import DynamoWarnings
    from dflash.config import TrainConfig
    from dflash.data.batches import Batch
    from dflash.devices import Slot
    from dflash.drafter.codebooks import project_codebooks
    from dflash.drafter.model import AnchoredDrafter, drafter_config
    from dflash.drafter.modeling_dflash import TRANSFORM_IDENTITY, DFlashDraftConfig
    from dflash.masks import sample_anchors
    from dflash.profiling import profiled_step
    from dflash.run.drafter_shape import resolve_drafter_shape
    from dflash.target_model.model import TargetStates
    from dflash.train.flops import detect_peak_tflops, drafter_step_flops
    from dflash.train.loss_settings import LossSettings
    from dflash.train.replica import build_replicas, optimizer_step
    from dflash.train.step import TargetBatch, drafter_step

    arch, fields = parse_run(args.run)
    # z-lab's DFlash2 transforms are the drafter config's, not the trainer's: set on the drafter below.
    transforms = {name: fields.pop(name) for name in TRANSFORM_IDENTITY if name in fields}
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    with tempfile.TemporaryDirectory(prefix="drafter_step_") as tmp:
        target_dir = write_target(Path(tmp) / "target", args.shape)
        config = TrainConfig(
            target=str(target_dir),
            arch=arch,
            block_size=args.block_size,
            seq_len=args.seq_len,
            batch_size=args.batch_size,
            max_anchors=args.max_anchors,
            num_draft_layers=args.draft_layers,
            compile_scope=args.compile_scope,
            steps=1,
            **fields,
        )
        config = resolve_drafter_shape(config)
        from transformers import AutoConfig

        text = AutoConfig.from_pretrained(target_dir)
    text = getattr(text, "text_config", text)
    layer_ids = config.target_layer_ids or _default_taps(text.num_hidden_layers, config.num_target_layers)
    drafter_cfg = drafter_config(config, text, target_layer_ids=layer_ids, mask_token_id=text.vocab_size - 1)
    if transforms:
        fields = {k: v for k, v in drafter_cfg.to_dict().items() if k != "model_type"}
        drafter_cfg = DFlashDraftConfig(**{**fields, "dflash_config": {**drafter_cfg.dflash_config, **transforms}})
    torch.manual_seed(args.seed)
    attention = "flex_attention" if cuda else "sdpa"
    model = AnchoredDrafter._from_config(drafter_cfg, attn_implementation=attention, dtype=torch.float32).train()
    if config.selector_codebooks == "projected":  # as the trainer builds it; build_replicas attaches the embeddings
        project_codebooks(model)
    settings = LossSettings.from_config(
        config,
        block_size=drafter_cfg.block_size,
        mask_token_id=drafter_cfg.mask_token_id,
        selector=drafter_cfg.is_dflash2,
    )
    vocab, hidden = text.vocab_size, text.hidden_size
    heads = types.SimpleNamespace(
        device=device,
        embed_tokens=torch.nn.Embedding(vocab, hidden).to(device, dtype).requires_grad_(False),
        lm_head=torch.nn.Linear(hidden, vocab, bias=False).to(device, dtype).requires_grad_(False),
    )
    (replica,) = build_replicas(
        model,
        [Slot(str(device), device)],
        [heads],
        types.SimpleNamespace(lr=1e-4, weight_decay=0.0),
        settings,
        compiled=cuda and args.compile,
        warnings=DynamoWarnings(),
        scope=config.compile_scope,
    )
    gen = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, vocab - 1, (args.batch_size, args.seq_len), generator=gen)
    loss_mask = torch.ones(args.batch_size, args.seq_len, dtype=torch.bool)
    anchors, valid = sample_anchors(loss_mask, args.max_anchors, generator=gen)
    width = len(layer_ids) * hidden
    context = torch.randn(args.batch_size, args.seq_len, width, generator=gen).to(device, dtype)
    # Soft labels and the soft selector target read the target's last hidden state.
    last = torch.randn(args.batch_size, args.seq_len, hidden, generator=gen) if settings.needs_last_hidden else None
    host = Batch(ids, loss_mask, torch.full((args.batch_size,), args.seq_len))
    on_device = [t.to(device) for t in (ids, loss_mask, host.position_ids, host.document_ids)]
    batch = TargetBatch(
        *on_device, TargetStates(context, None if last is None else last.to(device, dtype)), host.num_tokens
    )
    anchors, valid = anchors.to(device), valid.to(device)

    def step() -> None:
        stats = drafter_step(
            replica.step_fn,
            replica.model,
            replica.heads,
            batch,
            anchors,
            valid,
            settings=settings,
            position_weight=replica.position_weight,
        )
        replica.flat.stats.add_(stats)
        optimizer_step([replica], lr=1e-4, grad_clip=1.0)
        replica.flat.zero_()

    sync = torch.cuda.synchronize if cuda else lambda: None
    begin = time.perf_counter()
    step()
    sync()
    first_step_s = time.perf_counter() - begin
    for _ in range(args.warmup - 1):
        step()
    sync()
    resident = torch.cuda.memory_allocated(device) if cuda else 0
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    begin = time.perf_counter()
    for _ in range(args.steps):
        step()
    sync()
    seconds = (time.perf_counter() - begin) / args.steps
    peak = torch.cuda.max_memory_allocated(device) if cuda else 0
    pairs = replica.model.attention_pairs(anchors, valid, batch.document_ids)
    flops = drafter_step_flops(
        replica.model,
        draft_tokens=int(valid.sum()) * args.block_size,
        context_tokens=args.batch_size * args.seq_len,
        visible_pairs=int(pairs),
    )
    peak_tflops = detect_peak_tflops(device) or 0.0
    result = {
        "run": args.run,
        "parameters": sum(p.numel() for p in model.parameters()),
        "first_step_s": first_step_s,
        "ms": 1e3 * seconds,
        "tok_s": host.num_tokens / seconds,
        "tflops": flops / seconds / 1e12,
        "mfu_pct": 100 * flops / seconds / 1e12 / peak_tflops if peak_tflops else None,
        "resident_gib": resident / 2**30,
        "peak_gib": peak / 2**30,
        "recompiles": replica.watch.summary().get("unexpected_recompiles"),
    }
    if args.profile:
        out = Path(args.profile_dir or tempfile.mkdtemp(prefix="drafter_step_trace_"))
        with profiled_step(0, out, [device]):
            step()
        trace = out / "profile_step0.json.gz"
        name = args.run.replace(":", "_").replace(",", "_").replace("=", "-")
        trace = trace.rename(out / f"{name}.json.gz")
        result["profile"] = top_work(trace, args.top)
    if args.memory:
        entries = 1_000_000
        torch.cuda.memory._record_memory_history(context="alloc", stacks="python", max_entries=entries)
        step()
        sync()
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        trace = snapshot["device_traces"][torch.cuda.current_device() if device.index is None else device.index]
        if len(trace) >= entries:
            raise SystemExit(f"--memory: the step made {entries:,} or more allocator events, past the history kept")
        result["memory"] = peak_allocations(trace, args.top, roots=PROJECT_ROOTS)
    return result


#: The project's code, for :func:`_site`: the ``dflash`` package and this folder.
PROJECT_ROOTS = (Path(__file__).resolve().parents[1] / "dflash", Path(__file__).resolve().parent)


def _site(frames: list[dict], roots: tuple[Path, ...]) -> str:
    """The innermost frame (``frames[0]``) under one of ``roots``, named from the root's parent,
    followed by the innermost frame of all when that is elsewhere (an inductor kernel's buffer)."""
    inner = f"{Path(frames[0]['filename']).name}:{frames[0]['line']}" if frames else "?"
    for frame in frames:
        path = Path(frame["filename"])
        for root in roots:
            if path.is_relative_to(root):
                own = f"{path.relative_to(root.parent).as_posix()}:{frame['line']} {frame['name']}"
                return own if frame is frames[0] else f"{own} <- {inner}"
    return inner


def peak_allocations(trace: list[dict], top: int, roots: tuple[Path, ...]) -> dict:
    """From one device's allocator trace (``torch.cuda.memory._snapshot()["device_traces"][i]``,
    recorded with python stacks): the bytes allocated during the trace that were allocated at its
    highest point (as ``torch.cuda.max_memory_allocated`` counts: a block is free from its
    ``free_requested``), by :func:`_site` under ``roots``, largest first, in GiB, with their
    total. Blocks allocated before the trace began are not in it (the memory that stays between
    steps)."""
    live: dict[int, tuple[int, str]] = {}
    total = highest = highest_at = 0
    for index, event in enumerate(trace):
        if event["action"] == "alloc":
            live[event["addr"]] = (event["size"], "")
            total += event["size"]
            if total > highest:
                highest, highest_at = total, index
        elif event["action"] == "free_requested" and event["addr"] in live:
            total -= live.pop(event["addr"])[0]
    live.clear()
    for event in trace[: highest_at + 1]:
        if event["action"] == "alloc":
            live[event["addr"]] = (event["size"], _site(event.get("frames", []), roots))
        elif event["action"] == "free_requested":
            live.pop(event["addr"], None)
    sites: dict[str, int] = defaultdict(int)
    for size, site in live.values():
        sites[site] += size
    ranked = sorted(sites.items(), key=lambda kv: -kv[1])[:top]
    return {"peak_gib": highest / 2**30, "sites": [(site, round(size / 2**30, 3)) for site, size in ranked]}


def _default_taps(layers: int, count: int) -> list[int]:
    from dflash.target_model.taps import default_target_layer_ids

    return default_target_layer_ids(layers, count)


def top_work(trace: Path, top: int) -> dict:
    """GPU milliseconds of one profiled step by kernel kind, by kernel name and by launching op."""
    from dflash.profiling import kernel_kind

    with gzip.open(trace, "rt") as f:
        events = json.load(f)["traceEvents"]
    op_names = {
        e["args"]["External id"]: e["name"]
        for e in events
        if e.get("cat") == "cpu_op" and "External id" in e.get("args", {})
    }
    kinds, kernels, ops = defaultdict(float), defaultdict(float), defaultdict(float)
    for e in events:
        if e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        ms = e.get("dur", 0) / 1e3
        kinds[kernel_kind(e["name"])] += ms
        kernels[e["name"][:90]] += ms
        ops[op_names.get(e.get("args", {}).get("External id"), "?")[:90]] += ms
    ranked = lambda d: sorted(((k, round(v, 2)) for k, v in d.items()), key=lambda kv: -kv[1])
    return {"kinds": ranked(kinds), "kernels": ranked(kernels)[:top], "ops": ranked(ops)[:top]}


def run_child(args, spec: str) -> dict:
    argv = [sys.executable, __file__, "--child", spec, *sys.argv[1:]]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=args.child_timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_TAG)]
    if proc.returncode or not lines:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        raise SystemExit(f"run {spec!r} failed (exit {proc.returncode})")
    return json.loads(lines[-1][len(RESULT_TAG) :])


def print_results(results: list[dict]) -> None:
    base = results[0]
    print(
        f"{'run':<44}{'params M':>10}{'first s':>9}{'ms/step':>9}{'tok/s':>9}{'TFLOP/s':>9}{'MFU %':>7}"
        f"{'resident GiB':>14}{'peak GiB':>10}{'vs first':>10}{'peak +GiB':>10}"
    )
    for r in results:
        mfu = "n/a" if r["mfu_pct"] is None else f"{r['mfu_pct']:.1f}"
        print(
            f"{r['run']:<44}{r['parameters'] / 1e6:>10.1f}{r['first_step_s']:>9.1f}{r['ms']:>9.1f}"
            f"{r['tok_s']:>9.0f}{r['tflops']:>9.1f}{mfu:>7}{r['resident_gib']:>14.2f}{r['peak_gib']:>10.2f}"
            f"{r['tok_s'] / base['tok_s']:>9.3f}x{r['peak_gib'] - base['peak_gib']:>+10.2f}"
        )
    for r in results:
        if "profile" not in r:
            continue
        p = r["profile"]
        print(f"\n{r['run']}: one step's GPU time by kind: " + ", ".join(f"{k} {ms:.1f}" for k, ms in p["kinds"]))
        print("  kernels: " + "; ".join(f"{k} {ms:.1f}" for k, ms in p["kernels"]))
        print("  ops: " + "; ".join(f"{k} {ms:.1f}" for k, ms in p["ops"]))
    for r in results:
        if "memory" in r:
            m = r["memory"]
            print(f"\n{r['run']}: {m['peak_gib']:.2f} GiB allocated in the step and alive at its peak, by site (GiB):")
            print("\n".join(f"  {gib:7.3f}  {site}" for site, gib in m["sites"]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3.6-27b", help="target shape (benchmarks/shapes.py)")
    p.add_argument("--runs", default="dflash,dflash2", help="comma list of ARCH[:field=value,...]; ';' separates runs")
    p.add_argument("--tiny", action="store_true", help="CPU smoke test")
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--max-anchors", type=int, default=512)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--draft-layers", type=int, default=None, help="default: the trainer's rule for the target")
    p.add_argument("--compile-scope", choices=("step", "regional"), default="regional")
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", action="store_true", help="profile one more step per run")
    p.add_argument("--profile-dir", default=None, help="where the runs' traces go")
    p.add_argument("--top", type=int, default=12, help="kernels, ops and memory sites listed per run")
    p.add_argument("--memory", action="store_true", help="per run, one more step's memory at its peak by site (CUDA)")
    p.add_argument("--child-timeout", type=float, default=900)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.memory and (args.tiny or not args.device.startswith("cuda")):
        p.error("--memory reads CUDA's allocator history: it needs a CUDA --device (not --tiny)")
    if args.tiny:
        args.shape, args.device, args.compile = "tiny", "cpu", False
        args.seq_len, args.batch_size, args.max_anchors, args.block_size, args.steps = 128, 2, 8, 8, 2
    if args.child:
        args.run = args.child
        result = child(args)
        print(RESULT_TAG + json.dumps(result), flush=True)
        return 0
    specs = args.runs.split(";") if ";" in args.runs else args.runs.split(",")
    specs = [s for s in specs if s]
    results = []
    for spec in specs:
        results.append(run_child(args, spec))
        print(f"{spec}: {results[-1]['ms']:.1f} ms/step, peak {results[-1]['peak_gib']:.2f} GiB", flush=True)
    print_results(results)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
