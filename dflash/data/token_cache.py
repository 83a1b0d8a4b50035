"""The training data's tokens, cached in ``--out`` and tokenized over the usable cores.

Tokenizing renders each conversation with the chat template once per assistant turn (the loss
mask's spans, :mod:`dflash.data.tokenize`) and encodes it: about 3 ms per chat on one core of the CI
machine, minutes for 60k chats, and every start and every resume did it again on one core. Here
the conversations are tokenized in parts of :data:`PART_SIZE`, in worker processes (spawned: the
trainer's threads make ``fork`` unsafe) over the cores this process may use, and every finished
part is written to ``--out/tokenized/<digest>/`` at once (safetensors: token ids, loss masks,
lengths; the counts of what was left out in its metadata). The directory is named for the digest
of :func:`cache_key`: the data's sha256, every tokenizer and chat-template file, ``--seq-len``,
``--overflow``, and the code and library versions that render and tokenize. A run that finds
every part there (a resume, or a new run on the same data and settings) reads them instead of
tokenizing; one stopped while tokenizing (SIGTERM, Ctrl-C) keeps its finished parts, says so, and
the next start tokenizes only the rest.
"""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing
import os
import shutil
import signal
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from pathlib import Path

import torch

from dflash.data.tokenize import Example, Tokenized, tokenize_conversations, tokenizing_bar
from dflash.devices import usable_cores
from dflash.files import atomic_write_bytes, sha256_file
from dflash.log_once import once_per_process
from dflash.signals import Stopped, StopRequest

logger = once_per_process(logging.getLogger(__name__))

#: Conversations per part (one worker task, one file): a few seconds of work on one core.
PART_SIZE = 2048
_KEY_NAME, _COMPLETE_NAME = "key.json", "complete.json"
#: The files of a tokenizer directory that tokenizing reads (whichever exist).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)
#: The modules whose code decides the tokens (rendering, loss mask, tool calls).
_CODE = ("chats.py", "tokenize.py", "tool_calls.py")


def cache_key(*, data_sha256: str, tokenizer_dir: Path, seq_len: int, overflow: str) -> dict:
    """What the tokens of a data file depend on (module docstring)."""
    import tokenizers
    import transformers

    here = Path(__file__).parent
    return {
        "data_sha256": data_sha256,
        "tokenizer": {
            name: sha256_file(tokenizer_dir / name) for name in TOKENIZER_FILES if (tokenizer_dir / name).is_file()
        },
        "seq_len": seq_len,
        "overflow": overflow,
        "code": {name: sha256_file(here / name) for name in _CODE},
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
    }


def usable_workers() -> int:
    """Worker processes for tokenizing: the cores this process may use, shared with the other
    torchrun processes of its host."""
    return max(1, usable_cores() // int(os.environ.get("LOCAL_WORLD_SIZE", 1)))


class TokenCache:
    """The cache of one data file's tokens under one :func:`cache_key`, in ``root`` (a run's
    ``out/tokenized/``, :data:`dflash.run.layout.TOKENS_DIR`).

    Args:
        root (Path): the directory of the run's token caches.
        key (dict): :func:`cache_key`.
    """

    def __init__(self, root: Path, key: dict) -> None:
        self.key = key
        self.root = Path(root)
        self.dir = self.root / hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]

    def complete(self) -> Tokenized | None:
        """Every part of a finished tokenizing, joined; None if any is missing or unreadable."""
        try:
            parts = json.loads((self.dir / _COMPLETE_NAME).read_text())["parts"]
        except (OSError, ValueError, KeyError):
            return None
        read = [self._read_part(index) for index in range(parts)]
        return None if any(part is None for part in read) else Tokenized.joined(read)

    def tokenize(
        self,
        tokenizer,
        conversations,
        *,
        seq_len: int,
        overflow: str,
        source: str,
        progress: bool,
        write: bool,
        workers: int,
    ) -> Tokenized:
        """The tokens of ``conversations`` (:func:`dflash.data.tokenize.tokenize_conversations`): the parts
        already here are read, the others tokenized over ``workers`` processes (1: in this one)
        and, with ``write``, saved as each finishes; the cache is marked complete at the end.

        Raises:
            Stopped: SIGTERM/SIGINT; the parts finished by then are saved (with ``write``).
            DatasetError: see :func:`dflash.data.tokenize.tokenize_conversations`.
        """
        starts = range(0, len(conversations), PART_SIZE)
        parts = {index: self._read_part(index) for index in range(len(starts))}
        parts = {index: part for index, part in parts.items() if part is not None}
        todo = [index for index in range(len(starts)) if index not in parts]
        if write:
            self.dir.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(self.dir / _KEY_NAME, json.dumps(self.key, indent=1).encode())
        done = sum(parts[i].conversations for i in parts)
        if todo:
            # A worker costs seconds to start (torch, transformers): each gets two parts at least.
            workers = max(1, min(workers, len(todo) // 2))
            logger.info(
                "%s: tokenizing %d conversations in %d process(es)%s",
                source,
                len(conversations) - done,
                workers,
                f" ({done} read from {self.dir}, tokenized before)" if done else "",
            )
        settings = dict(seq_len=seq_len, overflow=overflow, source=source)
        tasks = {index: (conversations[starts[index] : starts[index] + PART_SIZE], starts[index] + 1) for index in todo}

        def finished(index: int, part: Tokenized) -> None:
            parts[index] = part
            if write:
                self._write_part(index, part)

        with tokenizing_bar(len(conversations), source=source, progress=progress, initial=done) as bar:
            with StopRequest("stopping the tokenizing after the parts in flight").installed() as stop:
                if workers > 1:
                    _in_processes(tokenizer, tasks, settings, workers, stop, bar, finished)
                else:
                    for index, (chunk, first) in tasks.items():
                        if stop.signum is not None:
                            break
                        finished(index, tokenize_conversations(tokenizer, chunk, first=first, bar=bar, **settings))
            if stop.signum is not None:
                kept = sum(part.conversations for part in parts.values())
                logger.warning(
                    "%s: stopped by %s while tokenizing: %s; start the same run again to tokenize the rest",
                    source,
                    signal.Signals(stop.signum).name,
                    f"the tokens of {kept} of {len(conversations)} conversations are kept in {self.dir}"
                    if write
                    else f"{kept} of {len(conversations)} conversations were tokenized, none kept (not rank 0)",
                )
                raise Stopped(stop.signum, "tokenizing")
        if write:
            atomic_write_bytes(self.dir / _COMPLETE_NAME, json.dumps({"parts": len(starts)}).encode())
            self._remove_others()
        return Tokenized.joined([parts[index] for index in range(len(starts))])

    def _part_path(self, index: int) -> Path:
        return self.dir / f"part_{index:05d}.safetensors"

    def _write_part(self, index: int, part: Tokenized) -> None:
        from safetensors.torch import save

        ids = [t for example in part.examples for t in example.input_ids]
        mask = [m for example in part.examples for m in example.loss_mask]
        tensors = {
            "input_ids": torch.tensor(ids, dtype=torch.int32),
            "loss_mask": torch.tensor(mask, dtype=torch.uint8),
            "lengths": torch.tensor([len(example.input_ids) for example in part.examples], dtype=torch.int64),
        }
        counts = {k: v for k, v in vars(part).items() if k != "examples"}
        atomic_write_bytes(self._part_path(index), save(tensors, metadata={"counts": json.dumps(counts)}))

    def _read_part(self, index: int) -> Tokenized | None:
        from safetensors import SafetensorError, safe_open

        path = self._part_path(index)
        if not path.is_file():
            return None
        try:
            with safe_open(path, framework="pt") as f:
                counts = json.loads(f.metadata()["counts"])
                ids, mask = f.get_tensor("input_ids").tolist(), f.get_tensor("loss_mask").tolist()
                ends = f.get_tensor("lengths").cumsum(0).tolist()
        except (OSError, SafetensorError, ValueError, KeyError, TypeError) as e:
            logger.warning("%s: unreadable (%s); tokenizing its conversations again", path, e)
            return None
        starts = [0, *ends[:-1]]
        examples = [Example(ids[a:b], mask[a:b]) for a, b in zip(starts, ends)]
        return Tokenized(examples, **counts)

    def _remove_others(self) -> None:
        """Caches of other settings or data (a changed --seq-len, an edited file) are never read again."""
        for other in self.root.iterdir():
            if other.is_dir() and other != self.dir:
                shutil.rmtree(other, ignore_errors=True)
                logger.info("removed %s: tokens of another data file or other settings", other)


_worker_tokenizer = None


def _start_worker(tokenizer) -> None:
    global _worker_tokenizer
    _worker_tokenizer = tokenizer
    for s in (signal.SIGTERM, signal.SIGINT):  # the main process decides when to stop
        signal.signal(s, signal.SIG_IGN)


def _tokenize_part(chunk, first: int, settings: dict) -> Tokenized:
    return tokenize_conversations(_worker_tokenizer, chunk, first=first, **settings)


def _in_processes(tokenizer, tasks: dict, settings: dict, workers: int, stop: StopRequest, bar, finished) -> None:
    """Tokenize ``tasks`` (part index -> (conversations, first index)) in ``workers`` spawned
    processes, handing each result to ``finished``; on ``stop``, the parts not started are
    cancelled and those in flight finished."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_start_worker, initargs=(tokenizer,)) as pool:
        pending = {pool.submit(_tokenize_part, *task, settings): index for index, task in tasks.items()}
        try:
            while pending:
                ready, _ = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
                for future in ready:
                    part = future.result()
                    bar.update(part.conversations)
                    finished(pending.pop(future), part)
                if stop.signum is not None:
                    for future in [f for f in pending if f.cancel()]:
                        del pending[future]
        except BaseException:  # a bad conversation: the parts not started are not waited for
            for future in pending:
                future.cancel()
            raise
