"""`dflash eval`: greedy speculative decoding of a trained drafter against its target.

Prints the acceptance length tau (per step, and per prompt as z-lab's published numbers count
it), its histogram and the speedup over target-only greedy decoding with and without prefill on
held-out prompts (``--json`` for machine-readable output; conventions in :mod:`dflash.evaluate`).
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

logger = logging.getLogger(__name__)


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "eval",
        help="measure a drafter: acceptance length tau, histogram, speedup",
        description="Greedy (T=0) speculative decoding with a DFlash drafter against its target on held-out "
        "conversations (prompt = the conversation up to its first assistant turn).",
    )
    parser.add_argument(
        "--drafter", required=True, help="run directory of dflash train (--out), its checkpoints/ or a step_N directory"
    )
    parser.add_argument(
        "--target",
        default=None,
        help="local HF target directory (default: the target the run was trained against, "
        "from its train_config.json; else the embedded default target)",
    )
    parser.add_argument(
        "--data", default=None, help="JSONL chat file of held-out conversations (default: the embedded held-out set)"
    )
    parser.add_argument("--num-prompts", type=int, default=20, help="prompts to decode (default: 20)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per prompt (default: 64)")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default: auto)")
    parser.add_argument(
        "--cpu-threads",
        type=int,
        default=None,
        help="torch intra-op threads on CPU (default: torch's; use 1 on a shared machine)",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.num_prompts < 1 or args.max_new_tokens < 1:
        logger.error("--num-prompts and --max-new-tokens must be >= 1")
        return 2
    try:
        report = _evaluate(args)
    except ValueError as e:  # bad input: the message names the problem and the fix
        logger.error("%s", e)
        return 2
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
        return 0
    _print_report(report)
    return 0


def _print_report(report) -> None:
    total = sum(report.histogram.values())
    print(
        f"acceptance length tau (block size {report.block_size}, {report.num_prompts} prompts, "
        f"{report.num_tokens} tokens, {total} steps):"
    )
    print(f"  {report.tau_per_step:.3f} per step   (mean over all steps; last step cut at EOS/token budget)")
    print(
        f"  {report.tau_per_prompt:.3f} per prompt (z-lab's published convention: mean of per-prompt means; "
        "last step counted in full)"
    )
    print("accepted+1 per step (last step cut):")
    for length in range(1, report.block_size + 1):
        count = report.histogram.get(length, 0)
        share = count / max(total, 1)
        print(f"  {length:3d}: {count:6d} {100 * share:5.1f}% {'#' * round(40 * share)}")
    print("speedup over target-only greedy decoding:")
    print(
        f"  {report.speedup:.2f}x with prefill    (target-only {report.target_ms_per_token:.2f} ms/token, "
        f"speculative {report.speculative_ms_per_token:.2f} ms/token; all tokens / all time)"
    )
    print(
        f"  {report.decode_speedup:.2f}x without prefill (target-only {report.target_decode_ms_per_token:.2f} "
        f"ms/token, speculative {report.speculative_decode_ms_per_token:.2f} ms/token; z-lab's convention: "
        "per-prompt decoding time per output token, averaged)"
    )


def _evaluate(args: argparse.Namespace):
    import torch

    from dflash.assets import default_data_dir, default_target_dir
    from dflash.evaluate import evaluate, load_drafter, load_prompts
    from dflash.target import load_target, load_tokenizer, resolve_device

    device = resolve_device(args.device)
    if args.cpu_threads is not None:
        torch.set_num_threads(args.cpu_threads)
    target_dir = Path(args.target) if args.target else _trained_target(Path(args.drafter)) or default_target_dir()
    data = Path(args.data) if args.data else default_data_dir() / "heldout.jsonl"
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    # Tokenizer and prompts first: their errors come before the (slow) target loads.
    tokenizer = load_tokenizer(target_dir)
    prompts = load_prompts(tokenizer, data, num_prompts=args.num_prompts)
    drafter = load_drafter(args.drafter, device=device, dtype=dtype)
    target = load_target(target_dir, layer_ids=drafter.config.target_layer_ids, device=device, dtype=dtype)
    if drafter.config.num_target_layers != target.num_layers:
        raise ValueError(
            f"--drafter was trained for a {drafter.config.num_target_layers}-layer target, "
            f"{target_dir} has {target.num_layers} layers; pass the matching --target"
        )
    eos_ids = {tokenizer.eos_token_id} | set(_as_list(getattr(target.config, "eos_token_id", None)))
    return evaluate(
        target,
        drafter,
        prompts,
        max_new_tokens=args.max_new_tokens,
        eos_ids={e for e in eos_ids if e is not None},
        progress=True,
    )


def _trained_target(drafter: Path) -> Path | None:
    """The --target of the run that ``drafter`` (run, checkpoints/ or step_N directory) belongs to, if recorded.

    Raises:
        ValueError: the run's train_config.json is not valid JSON.
    """
    from dflash.config import SAVED_CONFIG_NAME, read_saved_config

    runs = [drafter]
    if drafter.name == "checkpoints":
        runs.append(drafter.parent)
    if drafter.parent.name == "checkpoints":
        runs.append(drafter.parent.parent)
    for run in runs:
        if (run / SAVED_CONFIG_NAME).is_file():
            target = read_saved_config(run).get("target")
            if target:
                logger.info("target: %s (from %s; pass --target to use another)", target, run / SAVED_CONFIG_NAME)
            return Path(target) if target else None
    return None


def _as_list(value):
    return value if isinstance(value, list) else [value]
