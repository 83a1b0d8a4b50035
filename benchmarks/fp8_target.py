"""The FP8 target forward against bf16 (``--target-dtype fp8``, :mod:`dflash.target_model.fp8`), side by
side in one run on the same rows: how far the tapped hidden states move, and how fast the forward is.

    python benchmarks/fp8_target.py --shape qwen3.6-27b --layers 16       # one H200
    python benchmarks/fp8_target.py --shape qwen3-8b --layers 36 --rows 8
    python benchmarks/fp8_target.py --compile      # also with the per-token work compiled (--compile)

A random-weight target of a public shape (``benchmarks/shapes.py``), cut to its first ``--layers``
layers and tapped as the trainer taps a target of that depth, is built once in fp32 on the GPU. The
same rows (the embedded chat corpus, tokenized and cut into ``--rows`` rows of ``--seq-len`` tokens,
each row packed with documents of log-normal lengths as ``target_profile.py`` lays them out, so the
trainer's packed forward runs) go through it three times: fp32, then the same weights cast to bf16,
then bf16 with the linear layers in FP8. Printed per tapped layer: the relative L2 deviation (``||x
- ref|| / ||ref||`` over the layer's states) of bf16 and of FP8 from fp32, and of FP8 from bf16; the
deviation that matters is FP8's next to bf16's own, since bf16 is what drafters are trained on
today. Then the forward's tokens/s in bf16 and in FP8 (median of ``--repeats`` timed forwards after
a warm-up) and their ratio; with ``--compile``, also with the target's per-token work compiled as
the trainer compiles it (:mod:`dflash.target_model.compiled`: norms, MLPs and the Gated DeltaNet
projections as regions), so each activation's quantization fuses into the op before it (the eager
forward quantizes in separate kernels), with each form's packing bar: the largest difference of a
later document's tapped states in a packed row from the document captured alone in a row of its own. Random weights lack
the outlier channels of trained ones, which is where FP8's per-row scales lose most: read the
deviations as a floor.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shapes import SHAPES, dense_text_config, hybrid_text_config
from target_profile import packed_documents

from dflash import masks
from dflash.assets import default_data_dir, default_target_dir
from dflash.target_model.fp8 import fp8_problem, quantize_target
from dflash.target_model.model import Target
from dflash.target_model.taps import check_taps


def corpus_rows(rows: int, seq_len: int) -> torch.Tensor:
    """int64 ``[rows, seq_len]``: the embedded chat corpus's messages, tokenized and concatenated."""
    from dflash.target_model.files import load_tokenizer

    tokenizer = load_tokenizer(default_target_dir())
    ids: list[int] = []
    with open(default_data_dir() / "train.jsonl") as f:
        for line in f:
            for message in json.loads(line).get("messages", []):
                ids += tokenizer(str(message.get("content", "")), add_special_tokens=False)["input_ids"]
            if len(ids) >= rows * seq_len:
                return torch.tensor(ids[: rows * seq_len]).view(rows, seq_len)
    raise SystemExit(f"the embedded corpus has {len(ids)} tokens, fewer than {rows} x {seq_len}")


def build_target(shape: str, layers: int, seed: int) -> Target:
    from transformers import Qwen3_5ForCausalLM, Qwen3ForCausalLM

    hybrid = SHAPES[shape]["arch"] == "qwen3_5"
    config = hybrid_text_config(shape, layers) if hybrid else dense_text_config(shape, layers)
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = (Qwen3_5ForCausalLM if hybrid else Qwen3ForCausalLM)(config).float()
    return Target(model, check_taps(layers, layer_ids=None, num_captured=5))


def tapped(target: Target, rows: torch.Tensor, document_ids: torch.Tensor) -> torch.Tensor:
    """float32 ``[K, rows, S, H]``: each tapped layer's states, captured as the trainer captures packed rows."""
    states = target.capture(rows, document_ids=document_ids, last_hidden=False).context.float()
    return states.view(*states.shape[:2], len(target.layer_ids), -1).permute(2, 0, 1, 3)


def tokens_per_s(target: Target, rows: torch.Tensor, document_ids: torch.Tensor, repeats: int) -> float:
    times = []
    for _ in range(repeats + 2):  # the first two are the warm-up (compiles, autotuning)
        torch.cuda.synchronize()
        start = time.perf_counter()
        target.capture(rows, document_ids=document_ids, last_hidden=False)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return rows.numel() / statistics.median(times[2:])


def packing_bar(target: Target, rows: torch.Tensor, document_ids: torch.Tensor) -> float:
    """The largest |packed - alone| of a later document's tapped states, each document captured alone
    as a row of its own (itself, then padding) through the same forward: one shape for every
    document, so a compiled form compares with itself (captured at its own length, each document
    would recompile the regions until dynamo's limit sent the rest to the eager forward)."""
    packed = target.capture(rows, document_ids=document_ids, last_hidden=False).context.float()
    starts = masks.document_starts(document_ids)
    worst = 0.0
    for row in range(rows.shape[0]):
        begins = (starts[row] == torch.arange(rows.shape[1])).nonzero().squeeze(1).tolist() + [rows.shape[1]]
        for begin, end in zip(begins[1:], begins[2:]):
            if document_ids[row, begin] < 0:
                break
            alone_ids = torch.zeros_like(rows[row : row + 1])
            alone_ids[0, : end - begin] = rows[row, begin:end]
            alone_documents = torch.full_like(document_ids[row : row + 1], -1)
            alone_documents[0, : end - begin] = 0
            alone = target.capture(alone_ids, document_ids=alone_documents, last_hidden=False).context.float()
            worst = max(worst, (packed[row, begin:end] - alone[0, : end - begin]).abs().max().item())
    return worst


def deviation(states: torch.Tensor, reference: torch.Tensor) -> list[float]:
    """Per tapped layer: ``||states - reference|| / ||reference||``."""
    return [float((s - r).norm() / r.norm()) for s, r in zip(states, reference)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen3.6-27b", choices=[s for s in SHAPES if not s.startswith("tiny")])
    parser.add_argument("--layers", type=int, default=16, help="the shape's first N layers (fp32 must fit)")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--compile", action="store_true", help="also time each forward with its per-token work compiled"
    )
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    if not torch.cuda.is_available() or (problem := fp8_problem(device)):
        raise SystemExit(f"fp8_target.py: {problem if torch.cuda.is_available() else 'needs a CUDA GPU'}")
    rows = corpus_rows(args.rows, args.seq_len).to(device)
    document_ids = packed_documents(args.rows, args.seq_len, seed=args.seed)
    target = build_target(args.shape, args.layers, args.seed)
    fp32 = tapped(target, rows, document_ids)
    target.model.to(torch.bfloat16)
    bf16 = tapped(target, rows, document_ids)
    compiled = Target(target.model, target.layer_ids)
    compiled.compile_regions(index=0)
    forms = {"bf16": target} | ({"bf16 compiled": compiled} if args.compile else {})
    rates = {name: tokens_per_s(t, rows, document_ids, args.repeats) for name, t in forms.items()}
    bars = {name: packing_bar(t, rows, document_ids) for name, t in forms.items()}
    report = quantize_target(target.model)
    fp8 = tapped(target, rows, document_ids)
    forms = {"FP8": target} | ({"FP8 compiled": compiled} if args.compile else {})
    rates |= {name: tokens_per_s(t, rows, document_ids, args.repeats) for name, t in forms.items()}
    bars |= {name: packing_bar(t, rows, document_ids) for name, t in forms.items()}

    print(
        f"{args.shape}, first {args.layers} layers (random weights), {args.rows} rows x {args.seq_len} tokens of the "
        f"embedded chat corpus; {report.layers} linear layers FP8 ({report.weight_share:.1%} of the decoder's "
        f"weights), {report.bf16_layers} bf16; {torch.cuda.get_device_name(device)}, torch {torch.__version__}"
    )
    print(f"{'tapped layer':>12} {'bf16 vs fp32':>13} {'fp8 vs fp32':>12} {'fp8 vs bf16':>12} {'fp8 / bf16':>11}")
    columns = zip(target.layer_ids, deviation(bf16, fp32), deviation(fp8, fp32), deviation(fp8, bf16))
    for layer, b, f, fb in columns:
        print(f"{layer:>12} {b:>13.5f} {f:>12.5f} {fb:>12.5f} {f / b:>10.2f}x")
    print(
        f"target forward, tok/s (median of {args.repeats}): "
        + ", ".join(f"{name} {rate:,.0f} ({rate / rates['bf16']:.2f}x bf16)" for name, rate in rates.items())
    )
    print("packing bar, later documents vs alone, max |diff|: " + ", ".join(f"{n} {b:.4f}" for n, b in bars.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
