"""Time to tokenized training data on a first start and on a resume, before and after the token cache.

    python benchmarks/tokenize_cache.py                  # 60k chats (the embedded corpus x 60), about 10 min here
    python benchmarks/tokenize_cache.py --chats 3000     # a smoke run, under a minute

What ``dflash train`` does with its data before step 1, each measured in a fresh interpreter on the
same JSONL file, the embedded default target's tokenizer and ``--seq-len``:

- **before** (the trainer up to the token cache): read and check every line
  (:func:`dflash.data.chats.read_conversations`), then tokenize in one process
  (:func:`dflash.data.tokenize.build_examples`). A resume did the same again, so it is measured again.
- **after, first start**: the data's sha256 and the cache key, read every line, tokenize in worker
  processes over the usable cores and write each part to the cache in ``--out``
  (:class:`dflash.data.token_cache.TokenCache`), as the trainer does.
- **after, resume**: the sha256 and the key, then the cache read (the chats are not read again).

Loading the tokenizer is left out (the same on every side). The table gives seconds and the
after / before ratios, measured in one run; the examples of every side are checked to be equal.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def write_chats(path: Path, count: int) -> Path:
    """``count`` chats: the embedded chat corpus repeated (and cut) to that many lines."""
    from dflash.assets import default_data_dir

    lines = (default_data_dir() / "train.jsonl").read_text(encoding="utf-8").splitlines()
    with path.open("w", encoding="utf-8") as f:
        for i in range(count):
            f.write(lines[i % len(lines)] + "\n")
    return path


def measure(mode: str, data: Path, out: Path, seq_len: int) -> dict:
    """Seconds of one side (module docstring) in this interpreter, and a digest of its examples."""
    from dflash.assets import default_target_dir
    from dflash.data.chats import read_conversations
    from dflash.data.token_cache import TokenCache, cache_key, usable_workers
    from dflash.data.tokenize import build_examples, usable_examples
    from dflash.files import sha256_file
    from dflash.run.layout import TOKENS_DIR
    from dflash.target_model.files import load_tokenizer

    tokenizer = load_tokenizer(default_target_dir())
    settings = dict(seq_len=seq_len, overflow="truncate", source=str(data))
    start = time.perf_counter()
    if mode == "before":
        examples = build_examples(tokenizer, read_conversations(data, progress=False), progress=False, **settings)
    else:
        key = cache_key(
            data_sha256=sha256_file(data), tokenizer_dir=default_target_dir(), seq_len=seq_len, overflow="truncate"
        )
        cache = TokenCache(Path(out) / TOKENS_DIR, key)
        tokens = cache.complete()
        if mode == "first" and tokens is not None:
            raise SystemExit(f"{cache.dir} exists before the first start")
        if tokens is None:
            if mode == "resume":
                raise SystemExit(f"{cache.dir} is not complete after the first start")
            conversations = read_conversations(data, progress=False)
            tokens = cache.tokenize(
                tokenizer, conversations, progress=False, write=True, workers=usable_workers(), **settings
            )
        examples = usable_examples(tokens, **settings)
    seconds = time.perf_counter() - start
    digest = hashlib.sha256(json.dumps([[e.input_ids, e.loss_mask] for e in examples]).encode()).hexdigest()
    return {"seconds": seconds, "examples": len(examples), "digest": digest}


def run_side(mode: str, data: Path, out: Path, seq_len: int) -> dict:
    """:func:`measure` in a fresh interpreter."""
    done = subprocess.run(
        [
            sys.executable,
            __file__,
            "--measure",
            mode,
            "--data",
            str(data),
            "--out",
            str(out),
            "--seq-len",
            str(seq_len),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"{mode} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def main() -> None:
    from dflash.config import TrainConfig

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--chats", type=int, default=60_000, help="conversations in the data file (default %(default)s)"
    )
    parser.add_argument(
        "--seq-len",
        type=int,
        default=TrainConfig.seq_len,
        help=f"--seq-len of the run (default: dflash train's {TrainConfig.seq_len})",
    )
    parser.add_argument("--measure", choices=("before", "first", "resume"), help=argparse.SUPPRESS)
    parser.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, args.data, args.out, args.seq_len)))
        return
    from dflash.data.token_cache import usable_workers

    with tempfile.TemporaryDirectory(prefix="dflash-tokenize-bench-") as tmp:
        data = write_chats(Path(tmp) / "chats.jsonl", args.chats)
        out = Path(tmp) / "run"
        sides = {}
        for name, mode in (("before first", "before"), ("before resume", "before"), ("after first", "first")):
            sides[name] = run_side(mode, data, out, args.seq_len)
        sides["after resume"] = run_side("resume", data, out, args.seq_len)
    if len({side["digest"] for side in sides.values()}) != 1:
        raise SystemExit(f"the sides tokenized differently: {sides}")
    s = {name: side["seconds"] for name, side in sides.items()}
    print(
        f"time to tokenized data, {args.chats} chats (the embedded chat corpus repeated), --seq-len {args.seq_len}, "
        f"{sides['after first']['examples']} examples; after: {usable_workers()} worker process(es)"
    )
    print(f"{'':34s}{'first start':>12s}{'resume':>12s}")
    print(f"{'before (1 process, no cache)':34s}{s['before first']:11.2f}s{s['before resume']:11.2f}s")
    print(f"{'after (workers, cache in --out)':34s}{s['after first']:11.2f}s{s['after resume']:11.2f}s")
    first, resume = s["after first"] / s["before first"], s["after resume"] / s["before resume"]
    print(f"{'after / before':34s}{first:11.3f}x{resume:11.3f}x")


if __name__ == "__main__":
    main()
