"""End-to-end throughput of ``dflash train`` with and without sequence packing, side by side.

    python benchmarks/packing_e2e.py --shape qwen3-8b                      # one GPU, colocated
    python benchmarks/packing_e2e.py --shape qwen3-8b --layout split       # target cuda:0, drafter cuda:1
    python benchmarks/packing_e2e.py --shape qwen3.6-27b --batch-size 2   # the user's hybrid target
    python benchmarks/packing_e2e.py --shape qwen3-32b --seq-len 4096      # a dense 27B-class shape
    python benchmarks/packing_e2e.py --tiny                                # CPU smoke test, about a minute
    python benchmarks/packing_e2e.py --tiny --shape tiny-qwen3.6           # the same with a hybrid target
    python benchmarks/packing_e2e.py --shape qwen3.6-27b --arch dflash2 --block-size 8 --modes packed
    python benchmarks/packing_e2e.py --shape qwen3.6-27b --modes packed --target-dtypes auto,fp8
    python benchmarks/packing_e2e.py --shape qwen3.6-27b --layers 16 --batch-size 4 --drafter-rows 2 --modes packed
    python benchmarks/packing_e2e.py --recipe specforge                    # SpecForge's 27B DFlash2 recipe
    python benchmarks/packing_e2e.py --recipe specforge --modes unpacked,packed  # ... and on packed rows
    python benchmarks/packing_e2e.py --shape qwen3.6-27b --arch dflash2 --block-size 8 --modes packed \
        --selector-codebooks projected                                    # codebooks from the embeddings

One run trains the same drafter on the same conversations twice through the real CLI, ``python -m
dflash train ... --pack`` and ``... --no-pack``, each in a fresh interpreter, and prints one table:
end-to-end tok/s, drafter-step tok/s, drafter TFLOP/s and MFU, row fill, the target's share of the
step time, seconds from the drafter's build to its first step (its compiles) and peak memory per
device, then the packed/unpacked ratios. ``--target-dtypes auto,fp8`` runs each mode against the
bf16 and the FP8 target (``--target-dtype``) and adds the FP8/bf16 ratios. The numbers are the
trainer's own: the last line of its log that starts with ``steady state over``, whose format is
:data:`SUMMARY_FORMAT` (fields the trainer does not print show as ``n/a``).

The target is a random-weight model of a named public shape (:data:`SHAPES`), written as a HF
directory: its ``config.json``, the embedded default target's tokenizer and chat template, and a
weight file holding only the final norm; ``from_pretrained`` initialises every missing weight
randomly (``initializer_range``), so a 16 GB (8B), 55 GB (Qwen3.6-27B) or 65 GB (32B) random
checkpoint never touches the disk (the hybrid Qwen3.6-27B directory is the multimodal checkpoint
form, its vision tower's config included, never loaded); the price is the CPU time of that
initialisation in each run (``normal_`` over every weight, tens of seconds for 8B, minutes for 32B;
run one mode per command with ``--modes`` when a command's time is short). The drafter has the
published DFlash geometry for the target (5 layers, 5 tapped layers, block size 16; the trainer's
defaults for the target's family).

``--recipe specforge`` runs SpecForge's Qwen3.8-27B DFlash2 recipe at the user's shape instead of
ours (:data:`SPECFORGE`: block 8, 512 anchors per conversation of up to 8,192 tokens, mean about
4.5k, one conversation per row, DFlash2, an FP8 target) and prints its context tok/s and supervised
draft positions/s per GPU beside SpecForge's published figures (:data:`SPECFORGE_PUBLISHED`).
``--recipe specforge --modes unpacked,packed`` adds the same recipe on packed rows: the anchors a
packed row gets are SpecForge's 512 per conversation times the data's mean conversations per packed
row (:func:`packed_anchors`), shared by the row's conversations, so an epoch trains on about as
many anchors as one conversation per row does, without the padding.

A run whose first step ran out of GPU memory in the drafter and was retried with fewer rows per
drafter forward (:mod:`dflash.train.drafter_rows`) trains on; its warning line is printed after the
run's command, and ``--drafter-rows`` starts a run there.

Data (``--data``): ``synthetic`` writes chats whose lengths vary like real chat corpora (token
counts log-normal, median ``--median-tokens``, sigma ``--sigma``, 1 to 6 exchanges, replies three
times the length of prompts, words drawn from the embedded chat corpus so the tokenizer sees
ordinary text); ``embedded`` is the embedded chat corpus (short chats, median ~240 tokens); any
other value is a JSONL chat file. Conversations longer than ``--seq-len`` are truncated, as in
training.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from first_step import first_step_seconds
from runs import run_logged
from shapes import QWEN36_VISION, SHAPES

#: The trainer's final summary line (agreed with the trainer; fields after the TFLOP/s are parsed
#: one by one, so a line without MFU, row fill, target share or peak memory still parses):
SUMMARY_FORMAT = (
    "steady state over {steps} steps: {e2e:.0f} tok/s end to end, {draft:.0f} draft tok/s, target forward "
    "{forward:.0f} tok/s, drafter step {drafter:.0f} tok/s, "
    "{tflops:.3g} TFLOP/s, drafter MFU {mfu:.1f}% of {peak:.3g} TFLOP/s, row fill {fill:.1f}%, "
    "target share {target:.1f}%, supervised draft positions {supervised:.0f}/s end to end, "
    "{drafter_supervised:.0f}/s per drafter busy second, "
    "peak memory {device} {gib:.1f} GiB[, {device} {gib:.1f} GiB ...]"
)
_NUMBER = r"([0-9][0-9.]*(?:e[+-]?\d+)?)"
_FIELDS = {
    "steps": r"steady state over (\d+) steps",
    "e2e_tok_s": rf"{_NUMBER} tok/s end to end",
    "draft_tok_s": rf"{_NUMBER} draft tok/s",
    "target_tok_s": rf"target forward {_NUMBER} tok/s",
    "drafter_tok_s": rf"drafter step {_NUMBER} tok/s",
    "tflops": rf"drafter step [0-9.e+-]+ tok/s, {_NUMBER} TFLOP/s",
    "mfu_pct": rf"drafter MFU {_NUMBER}%",
    "row_fill_pct": rf"row fill {_NUMBER}%",
    "target_share_pct": rf"target share {_NUMBER}%",
    "supervised_s": rf"supervised draft positions {_NUMBER}/s end to end",
    "drafter_supervised_s": rf"{_NUMBER}/s per drafter busy second",
}
_MEMORY = re.compile(rf"(\S+) {_NUMBER} GiB")


#: SpecForge's Qwen3.8-27B DFlash2 recipe (block 8, 512 anchors per conversation of up to 8,192
#: tokens, mean about 4.5k; DFlash2 against an FP8 target), as flag values of this script. One
#: conversation per row, as SpecForge samples; a log-normal of median 4,100 tokens and sigma 0.5
#: has a mean of about 4.5k before the cut at 8,192.
SPECFORGE = dict(
    shape="qwen3.6-27b",
    arch="dflash2",
    block_size=8,
    max_anchors=512,
    seq_len=8192,
    median_tokens=4100,
    sigma=0.5,
    modes="unpacked",
    target_dtypes="fp8",
)
#: SpecForge's published per-GPU figures at that shape (8 x H200 runs: colocated, 5 capture + 3
#: training GPUs, the same with fused kernels and RDMA; 2 x H200 with features preloaded, rows up to
#: 1,024 tokens, with length bucketing).
SPECFORGE_PUBLISHED = {
    "context tok/s per GPU": "4.8K colocated, 6.0K split 5+3, 12.7K fused kernels + RDMA",
    "supervised draft positions/s per GPU": "15.7K, 19.5K with length bucketing (features preloaded)",
}


def parse_summary(log: str) -> dict:
    """The fields of the last ``steady state over`` line of a trainer log.

    Returns:
        dict: floats by name (missing fields absent) and ``peak_memory``, a ``{device: GiB}`` dict.

    Raises:
        ValueError: the log has no summary line (the message quotes its tail).
    """
    lines = [line for line in log.splitlines() if "steady state over" in line]
    if not lines:
        raise ValueError("no 'steady state over' line in the trainer's log; its tail:\n" + log[-3000:])
    line = lines[-1]
    fields = {name: float(m.group(1)) for name, pattern in _FIELDS.items() if (m := re.search(pattern, line))}
    memory = line.split("peak memory", 1)[1] if "peak memory" in line else ""
    fields["peak_memory"] = {device.rstrip(":"): float(gib) for device, gib in _MEMORY.findall(memory)}
    return fields


def write_target(directory: Path, shape: str, *, layers: int | None = None, sliding_window: int | None = None) -> Path:
    """A HF directory of a random-weight target of ``shape`` (module docstring), its first ``layers``
    decoder layers (None: all): its config, the embedded tokenizer and a weight file holding only
    the final norm. ``sliding_window`` (dense shapes) turns on a window of that many tokens for the
    second half of the layers (Qwen3's ``use_sliding_window`` and ``max_window_layers``)."""
    import torch
    from safetensors.torch import save_file

    from dflash.assets import default_target_dir

    config, norm_key = _target_config(shape, layers, sliding_window)
    directory.mkdir(parents=True, exist_ok=True)
    source = default_target_dir()
    tokenizer_files = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
    for name in tokenizer_files:
        shutil.copy(source / name, directory / name)
    config.save_pretrained(directory)
    norm = torch.ones(SHAPES[shape]["hidden_size"], dtype=torch.bfloat16)
    save_file({norm_key: norm}, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def _target_config(shape: str, layers: int | None, sliding_window: int | None = None):
    """The transformers config of ``shape`` (cut to ``layers``, :func:`write_target`'s ``sliding_window``)
    and the checkpoint key of its final norm."""
    fields = dict(SHAPES[shape])
    fields["num_hidden_layers"] = layers or fields["num_hidden_layers"]
    arch = fields.pop("arch")
    tokens = dict(pad_token_id=0, eos_token_id=2)  # the embedded tokenizer's
    if sliding_window is not None:
        if arch != "qwen3":
            raise ValueError(f"--sliding-window needs a dense (qwen3) shape, not {shape}")
        half = fields["num_hidden_layers"] // 2
        fields.update(use_sliding_window=True, sliding_window=sliding_window, max_window_layers=half)
    if arch == "qwen3":
        from transformers import Qwen3Config

        theta = fields.pop("rope_theta")
        config = Qwen3Config(
            **fields,
            **tokens,
            max_position_embeddings=40960,
            rope_parameters={"rope_type": "default", "rope_theta": theta},
            tie_word_embeddings=False,
            architectures=["Qwen3ForCausalLM"],
            dtype="bfloat16",
        )
        return config, "model.norm.weight"
    from transformers import Qwen3_5Config

    vision = dict(QWEN36_VISION, out_hidden_size=fields["hidden_size"])
    if shape.startswith("tiny"):
        vision.update(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=4)
    text = dict(fields, **tokens, max_position_embeddings=262144, tie_word_embeddings=False)
    config = Qwen3_5Config(
        text_config=text,
        vision_config=vision,
        tie_word_embeddings=False,
        architectures=["Qwen3_5ForConditionalGeneration"],
        dtype="bfloat16",
    )
    return config, "model.language_model.norm.weight"


def write_synthetic_chats(path: Path, *, count: int, median_tokens: int, sigma: float, seed: int) -> Path:
    """``count`` chats with log-normal token counts (module docstring), as OpenAI JSONL."""
    from dflash.assets import default_data_dir

    words = [w for line in (default_data_dir() / "train.jsonl").read_text().splitlines() for w in line.split()]
    words = [w for w in words if w.isalpha()]
    rng = random.Random(seed)
    tokens_per_word = 1.3  # the embedded BPE on this corpus; only the length distribution matters
    text = lambda tokens: " ".join(rng.choices(words, k=max(1, round(tokens / tokens_per_word))))
    with open(path, "w") as f:
        for _ in range(count):
            total = rng.lognormvariate(math.log(median_tokens), sigma)
            exchanges = rng.randint(1, 6)
            messages = []
            for _ in range(exchanges):
                messages.append({"role": "user", "content": text(0.25 * total / exchanges)})
                messages.append({"role": "assistant", "content": text(0.75 * total / exchanges)})
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


def token_lengths(target: Path, data: Path, seq_len: int) -> list[int]:
    """Tokens per conversation after the chat template and truncation, as the trainer sees them."""
    from transformers import AutoTokenizer

    from dflash.data.chats import read_conversations
    from dflash.data.tokenize import build_examples

    tokenizer = AutoTokenizer.from_pretrained(target)
    return [len(e.input_ids) for e in build_examples(tokenizer, read_conversations(data), seq_len=seq_len)]


def conversations_per_row(lengths: list[int], seq_len: int) -> float:
    """The mean conversations per row of :func:`dflash.data.packing.pack_rows` over ``lengths``
    (tokens per conversation).

    Raises:
        ValueError: a length over ``seq_len`` (from ``pack_rows``).
    """
    from dflash.data.packing import pack_rows

    return len(lengths) / len(pack_rows(lengths, range(len(lengths)), seq_len=seq_len))


def packed_anchors(per_row: float, per_conversation: int) -> int:
    """The anchors per packed row (``--max-anchors`` of a ``--pack`` run, the row's budget shared by
    its conversations) that give about ``per_conversation`` anchors per conversation at ``per_row``
    conversations a row (:func:`conversations_per_row`), rounded to a multiple of 64 (draft tokens
    per row a multiple of flex_attention's 128-token blocks at block size 2 or more), at least 64."""
    return max(64, 64 * round(per_conversation * per_row / 64))


def train_flags(
    args, target: Path, data: Path, out: Path, *, pack: bool, max_anchors: int, target_dtype: str = "auto"
) -> list[str]:
    """``dflash train``'s flags for one run; ``max_anchors`` its anchors per row."""
    flags = {
        "target": target,
        "data": data,
        "out": out,
        "responses": "data",
        "seq-len": args.seq_len,
        "batch-size": args.batch_size,
        "max-anchors": max_anchors,
        "block-size": args.block_size,
        "num-draft-layers": args.draft_layers,
        "num-target-layers": 5,
        "steps": args.steps,
        "warmup-steps": 0,
        "log-every": max(1, args.steps // 5),
        "save-every": 0,
        "seed": args.seed,
    }
    if args.layout == "split":
        flags |= {"target-devices": "cuda:0", "drafter-devices": "cuda:1"}
    else:
        flags["device"] = args.device
    if args.compile:
        flags["compile"] = args.compile
    if args.compile_scope:
        flags["compile-scope"] = args.compile_scope
    if args.arch:
        flags["arch"] = args.arch
    if args.selector_codebooks:
        flags["selector-codebooks"] = args.selector_codebooks
    if args.selector_target:
        flags["selector-target"] = args.selector_target
    if target_dtype != "auto":
        flags["target-dtype"] = target_dtype
    if args.profile_step:
        flags["profile-step"] = args.profile_step
    if args.drafter_rows:
        flags["drafter-rows"] = args.drafter_rows
    if args.cpu_threads:
        flags["cpu-threads"] = args.cpu_threads
    argv = [item for name, value in flags.items() for item in (f"--{name}", str(value))]
    # --no-save: a checkpoint of the 1-3B drafter with its training state is 14-40 GB.
    # --random-target-weights: the target's files hold only its final norm (write_target).
    return argv + ["--no-progress", "--no-save", "--random-target-weights", "--pack" if pack else "--no-pack"]


def run_train(
    args,
    target: Path,
    data: Path,
    workdir: Path,
    *,
    pack: bool,
    max_anchors: int,
    target_dtype: str = "auto",
) -> dict:
    """One ``dflash train`` in a fresh interpreter; its parsed summary, seconds from the drafter's
    build to its first step (``first_step_s``: the compiles) and wall time. Its log is written as it
    runs to ``--log-dir`` (default: the work directory), so a run stopped by a time limit still
    leaves what it printed."""
    mode = run_name("packed" if pack else "unpacked", target_dtype, args.target_dtypes)
    out = workdir / mode
    flags = train_flags(args, target, data, out, pack=pack, target_dtype=target_dtype, max_anchors=max_anchors)
    command = [sys.executable, "-m", "dflash", "train", *flags]
    logs = args.log_dir or workdir
    run = run_logged(command, logs / f"train_{mode}.log", timeout=args.timeout)
    for trace in out.glob("profile_step*.json.gz"):  # --profile-step's trace outlives the run directory
        shutil.move(trace, logs / f"{mode}_{trace.name}")
    shutil.rmtree(out, ignore_errors=True)  # checkpoints of a 1B drafter: gigabytes each
    log, wall = run.checked(f"dflash train ({mode})").log, run.seconds
    for line in log.splitlines():  # a first step retried with fewer rows per drafter forward says so
        if "retrying the step on the same micro-batches" in line:
            print(f"{mode}: {line}")
    return {**parse_summary(log), "first_step_s": first_step_seconds(log), "wall_s": wall}


def run_name(mode: str, target_dtype: str, target_dtypes: list[str]) -> str:
    """``packed``, or ``packed-fp8`` when the runs compare target dtypes."""
    return mode if len(target_dtypes) == 1 else f"{mode}-{target_dtype}"


def _cell(value, fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


def print_table(results: dict[str, dict], target_dtypes: list[str]) -> None:
    columns = [
        ("e2e tok/s", "e2e_tok_s", ",.0f"),
        ("draft tok/s", "draft_tok_s", ",.0f"),
        ("target fwd tok/s", "target_tok_s", ",.0f"),
        ("drafter tok/s", "drafter_tok_s", ",.0f"),
        ("TFLOP/s", "tflops", ".3g"),
        ("MFU %", "mfu_pct", ".1f"),
        ("row fill %", "row_fill_pct", ".1f"),
        ("target share %", "target_share_pct", ".1f"),
        ("steps", "steps", ".0f"),
        ("first step s", "first_step_s", ".0f"),
        ("wall s", "wall_s", ".0f"),
    ]
    header = f"{'run':<15}" + "".join(f"{title:>17}" for title, _, _ in columns) + "  peak memory (GiB)"
    print(header)
    for mode, fields in results.items():
        memory = ", ".join(f"{device} {gib:.1f}" for device, gib in fields["peak_memory"].items()) or "n/a"
        cells = "".join(f"{_cell(fields.get(key), fmt):>17}" for _, key, fmt in columns)
        print(f"{mode:<15}{cells}  {memory}")
    keys = (("end to end", "e2e_tok_s"), ("drafter step", "drafter_tok_s"), ("MFU", "mfu_pct"))
    for dtype in target_dtypes:
        packed, unpacked = (results.get(run_name(m, dtype, target_dtypes), {}) for m in ("packed", "unpacked"))
        ratios = [f"{title} {packed[k] / unpacked[k]:.2f}x" for title, k in keys if packed.get(k) and unpacked.get(k)]
        label = "" if len(target_dtypes) == 1 else f" ({dtype} target)"
        print(f"packed / unpacked{label}: " + (", ".join(ratios) or "n/a"))
    if {"auto", "fp8"} <= set(target_dtypes):
        keys += (("target forward", "target_tok_s"),)
        for mode in ("packed", "unpacked"):
            fp8, auto = (results.get(run_name(mode, d, target_dtypes), {}) for d in ("fp8", "auto"))
            ratios = [f"{title} {fp8[k] / auto[k]:.2f}x" for title, k in keys if fp8.get(k) and auto.get(k)]
            if ratios:
                print(f"FP8 / bf16 target, {mode}: " + ", ".join(ratios))


def main(argv: list[str] | None = None) -> int:
    from dflash.choices import literal_choices
    from dflash.config import TrainConfig

    trainer_choices = literal_choices(TrainConfig)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b", help="target shape")
    parser.add_argument(
        "--layers", type=int, default=None, help="keep the first N decoder layers of the shape (a quicker cut)"
    )
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny shape, short rows, few steps")
    parser.add_argument("--layout", choices=("colocated", "split"), default="colocated")
    parser.add_argument("--device", default="cuda", help="device of the colocated layout")
    parser.add_argument("--data", default="synthetic", help="synthetic, embedded or a JSONL chat file")
    parser.add_argument("--conversations", type=int, default=2000, help="synthetic conversations")
    parser.add_argument("--median-tokens", type=int, default=800, help="median tokens of a synthetic chat")
    parser.add_argument("--sigma", type=float, default=0.9, help="log-normal sigma of synthetic chat lengths")
    # A GPU run's shape on purpose, not dflash train's defaults (sized for a 2-core CPU).
    gpu_shape = "dflash train's %s (default %%(default)s: a GPU run's shape, not dflash train's CPU default)"
    parser.add_argument("--seq-len", type=int, default=2048, help=gpu_shape % "--seq-len")
    parser.add_argument("--batch-size", type=int, default=4, help=gpu_shape % "--batch-size")
    parser.add_argument("--max-anchors", type=int, default=512, help=gpu_shape % "--max-anchors")
    parser.add_argument("--block-size", type=int, default=16, help=gpu_shape % "--block-size")
    parser.add_argument("--draft-layers", type=int, default=5, help=gpu_shape % "--num-draft-layers")
    parser.add_argument("--steps", type=int, default=40, help="steps per run; the first is warm-up")
    parser.add_argument(
        "--drafter-rows", type=int, default=None, help="dflash train --drafter-rows (empty: the trainer's default)"
    )
    # The trainer's choice flags, its choices and defaults read from TrainConfig (None: its default).
    for flag in ("compile", "compile_scope", "arch", "selector_codebooks", "selector_target"):
        parser.add_argument(
            f"--{flag.replace('_', '-')}", choices=trainer_choices[flag], default=None, help="dflash train's flag"
        )
    parser.add_argument("--cpu-threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per training run")
    parser.add_argument(
        "--modes", default="packed,unpacked", help="runs to make, in order (one alone if time is short)"
    )
    parser.add_argument(
        "--target-dtypes",
        default="auto",
        help="comma list of dflash train --target-dtype values (auto: bf16 on a GPU; fp8); each mode runs per value",
    )
    parser.add_argument(
        "--profile-step",
        type=int,
        default=0,
        help="dflash train --profile-step: that step's GPU time by kernel kind; its trace is kept in --log-dir",
    )
    parser.add_argument(
        "--recipe", choices=("ours", "specforge"), default="ours", help="specforge: SpecForge's 27B DFlash2 recipe"
    )
    parser.add_argument("--workdir", type=Path, default=None, help="where the target, data and runs go")
    parser.add_argument("--log-dir", type=Path, default=None, help="where each run's log is written as it runs")
    if parser.parse_known_args(argv)[0].recipe == "specforge":
        parser.set_defaults(**SPECFORGE)  # the recipe's values, under any flag given
    args = parser.parse_args(argv)
    if args.tiny:
        args.shape = args.shape if args.shape.startswith("tiny") else "tiny"
        args.device, args.compile, args.cpu_threads = "cpu", "off", args.cpu_threads or 1
        args.seq_len, args.batch_size, args.max_anchors, args.block_size = 256, 2, 16, 8
        args.draft_layers, args.steps, args.conversations, args.median_tokens = 1, 6, 300, 60
    modes = args.modes.split(",")
    if set(modes) - {"packed", "unpacked"}:
        parser.error(f"--modes: a comma list of packed and unpacked, got {args.modes!r}")
    args.target_dtypes = args.target_dtypes.split(",")
    if set(args.target_dtypes) - {"auto", "fp8"}:
        parser.error(f"--target-dtypes: a comma list of auto and fp8, got {','.join(args.target_dtypes)!r}")
    if args.layout == "split" and args.device != "cuda":
        parser.error("--layout split puts the target on cuda:0 and the drafter on cuda:1")

    with tempfile.TemporaryDirectory(dir=args.workdir, prefix="packing_e2e_") as tmp:
        workdir = Path(tmp)
        target = write_target(workdir / "target", args.shape, layers=args.layers)
        data = chat_data(args, workdir)
        lengths = token_lengths(target, data, args.seq_len)
        describe(args, lengths)
        anchors = {"packed": args.max_anchors, "unpacked": args.max_anchors}
        if args.recipe == "specforge":
            per_row = conversations_per_row(lengths, args.seq_len)
            anchors["packed"] = packed_anchors(per_row, args.max_anchors)
            print(
                f"packed rows: {per_row:.2f} conversations a row, {anchors['packed']} anchors a row "
                f"(about {anchors['packed'] / per_row:.0f} per conversation; unpacked: {args.max_anchors})"
            )
        results = {
            run_name(mode, dtype, args.target_dtypes): run_train(
                args, target, data, workdir, pack=mode == "packed", target_dtype=dtype, max_anchors=anchors[mode]
            )
            for dtype in args.target_dtypes
            for mode in modes
        }
        print_table(results, args.target_dtypes)
        if args.recipe == "specforge":
            print_against_specforge(results, gpus=2 if args.layout == "split" else 1)
    return 0


def print_against_specforge(results: dict[str, dict], gpus: int) -> None:
    """Each run's context tok/s and supervised draft positions/s per GPU (the trainer's counts: label
    slots the loss counted), beside SpecForge's published per-GPU figures: end to end over the
    run's ``gpus``, and per second of the drafter's busy time on its GPU, the rate of the drafter
    alone, which is what SpecForge's figures with features preloaded measure (theirs at rows of up
    to 1,024 tokens, bucketed by length; this recipe's rows hold up to 8,192)."""

    def figure(fields: dict, name: str, per: int) -> str:
        return f"{fields[name] / per:,.0f}" if name in fields else "n/a"

    for mode, fields in results.items():
        print(
            f"SpecForge's recipe ({mode}), per GPU of {gpus}: context {figure(fields, 'e2e_tok_s', gpus)} tok/s "
            f"(SpecForge: {SPECFORGE_PUBLISHED['context tok/s per GPU']}); supervised draft positions "
            f"{figure(fields, 'supervised_s', gpus)}/s end to end, "
            f"{figure(fields, 'drafter_supervised_s', 1)}/s of the "
            f"drafter alone (SpecForge: {SPECFORGE_PUBLISHED['supervised draft positions/s per GPU']})"
        )


def chat_data(args, workdir: Path) -> Path:
    """The JSONL file ``--data`` names (module docstring)."""
    if args.data == "synthetic":
        return write_synthetic_chats(
            workdir / "chats.jsonl",
            count=args.conversations,
            median_tokens=args.median_tokens,
            sigma=args.sigma,
            seed=args.seed,
        )
    if args.data == "embedded":
        from dflash.assets import default_data_dir

        return default_data_dir() / "train.jsonl"
    return Path(args.data)


def describe(args, lengths: list[int]) -> None:
    """Print the setup and the data's length distribution (:func:`token_lengths`)."""
    import torch

    lengths = sorted(lengths)
    shape = SHAPES[args.shape]
    print(
        f"packing_e2e: target {args.shape} ({args.layers or shape['num_hidden_layers']} layers, "
        f"hidden {shape['hidden_size']}, "
        f"random weights), drafter {args.draft_layers} layers, block {args.block_size}, seq {args.seq_len} x "
        f"batch {args.batch_size}, {args.max_anchors} anchors, layout {args.layout}, {args.steps} steps; "
        f"torch {torch.__version__}, DFLASH_PATCHES={os.environ.get('DFLASH_PATCHES', '1')}"
    )
    print(
        f"data {args.data}: {len(lengths)} conversations, tokens median {statistics.median(lengths):.0f}, "
        f"p90 {lengths[int(0.9 * (len(lengths) - 1))]}, max {lengths[-1]} (truncated at {args.seq_len}); "
        f"one per row would fill {100 * statistics.mean(lengths) / args.seq_len:.1f}% of a row",
        flush=True,
    )


if __name__ == "__main__":
    sys.exit(main())
