"""Small-file I/O every part shares: a JSON object read with errors that name the file and the fix
(a target's or a drafter's ``config.json``), atomic writes and sha256 digests, and weight files checked
whole from their headers before anything loads them.

Weight files: an interrupted download or copy leaves a ``.safetensors`` file shorter than its header says; the
safetensors loader then fails with ``SafetensorError: incomplete metadata, file not fully
covered``, a traceback from inside ``from_pretrained`` after transformers was imported and the
other shards were read. The format (https://github.com/huggingface/safetensors, "Format") is an
8-byte little-endian header length N, an N-byte JSON header whose entries give each tensor's
``data_offsets`` ``[begin, end)`` into the byte buffer that follows, and that buffer, which the
loader requires the file to end exactly with. So reading 8 + N bytes per file tells whether it
is whole: milliseconds for a sharded 235B model. A sharded model's index
(``model.safetensors.index.json``) names its shards, each of which must be there.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

#: The index of a sharded safetensors model (``weight_map``: tensor name -> shard file).
SAFETENSORS_INDEX = "model.safetensors.index.json"
#: Torch pickles transformers also loads; checked only for presence (their zip form is not parsed).
PICKLE_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json")
#: Largest header read (the format caps it at 100 MB).
MAX_HEADER_BYTES = 100_000_000


class WeightFileError(ValueError):
    """A weight file that is missing, truncated or unreadable (the message names it and the fix)."""


def check_weight_files(directory: str | Path, *, role: str = "target") -> list[Path]:
    """The safetensors files of the model in ``directory``, each checked to be whole.

    Args:
        directory: a Hugging Face model directory.
        role: what the model is in the messages (``target``).

    Returns:
        list[Path]: the checked ``.safetensors`` files (empty for a model saved as torch pickles).

    Raises:
        WeightFileError: no weight file at all; an index naming a shard that is not there or an
            unreadable index; a ``.safetensors`` file that is shorter or longer than its header
            says, has a header that is not the format's, or cannot be read. The message names the
            file, the sizes and the fix.
    """
    directory = Path(directory)
    index = directory / SAFETENSORS_INDEX
    if index.is_file():
        files = _shards(index, role)
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files and not any((directory / name).is_file() for name in PICKLE_WEIGHTS):
        raise WeightFileError(
            f"{role} {directory}: no weight files (model.safetensors, its shards and {SAFETENSORS_INDEX}, or "
            "pytorch_model.bin); copy them from the model's source or save the model with save_pretrained"
        )
    for path in files:
        check_safetensors(path, role=role)
    return files


def _shards(index: Path, role: str) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        names = sorted(set(weight_map.values()))
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise WeightFileError(
            f"{role} {index}: unreadable shard index ({type(e).__name__}: {e}); download it again from the "
            "model's source"
        ) from None
    missing = [name for name in names if not (index.parent / name).is_file()]
    if missing:
        raise WeightFileError(
            f"{role} {index.parent}: {len(missing)} of the {len(names)} weight shards its {SAFETENSORS_INDEX} names "
            f"are missing ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); finish the download "
            "(huggingface-cli download REPO --local-dir DIR fetches missing files) or copy them"
        )
    return [index.parent / name for name in names]


def check_safetensors(path: str | Path, *, role: str = "target", fix: str | None = None) -> None:
    """``path`` is a whole safetensors file: its size is 8 + header + the data its header describes.

    Args:
        path: the ``.safetensors`` file.
        role: what the model is in the messages (``target``, ``drafter``).
        fix: what to do about a damaged file, ending the message; None: download or copy it again.

    Raises:
        WeightFileError: see :func:`check_weight_files`.
    """
    path = Path(path)
    again = fix or (
        "delete it and download it again (huggingface-cli download REPO --local-dir DIR fetches missing files), "
        "or copy it again from the model's source"
    )
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            length = int.from_bytes(f.read(8), "little") if size >= 8 else 0
            header = f.read(length) if 0 < length <= min(MAX_HEADER_BYTES, size - 8) else None
    except OSError as e:
        raise WeightFileError(
            f"{role} weight file {path}: cannot read it ({e.strerror}); fix its permissions"
        ) from None
    if size < 8 or header is None:
        raise WeightFileError(
            f"{role} weight file {path}: truncated or not a safetensors file ({size:,} bytes, header length "
            f"{length:,}); {again}"
        )
    try:
        entries = json.loads(header)
        end = max((entry["data_offsets"][1] for name, entry in entries.items() if name != "__metadata__"), default=0)
    except (UnicodeDecodeError, ValueError, KeyError, TypeError, IndexError, AttributeError):
        raise WeightFileError(f"{role} weight file {path}: its header is not safetensors JSON; {again}") from None
    expected = 8 + length + end
    if size != expected:
        what = "truncated" if size < expected else "longer than its header says"
        raise WeightFileError(
            f"{role} weight file {path} is {what}: {size:,} bytes, its header describes {expected:,} (an "
            f"interrupted download or copy?); {again}"
        )


def read_json_object(path: Path, *, error: type[Exception], name: str, fix: str) -> dict:
    """The JSON object in ``path``.

    Args:
        error: the exception class to raise.
        name (str): how messages name the file (e.g. ``target /models/x/config.json``).
        fix (str): what to do about it, appended to every message.

    Raises:
        error: the file cannot be read or decoded, or holds another JSON value than an object.
    """
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise error(f"{name}: missing or unreadable ({e}); {fix}") from None
    if not isinstance(value, dict):
        raise error(f"{name}: expected a JSON object, got {type(value).__name__}; {fix}")
    return value


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in the directory ``path`` durable (fsync of the directory itself)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temp file in the same directory, fsync, ``os.replace``."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
