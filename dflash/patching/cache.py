"""On-disk cache of the plan and of patched modules' source and bytecode (like ``__pycache__``).

Without it every ``import torch`` would read the series, import the diff and
version parsers and compile the patched modules: ~120 ms. Keys hash the stat
of every input (torch's files, the series, the Python bytecode magic), so an
upgrade of torch or of the series misses the cache. Set ``DFLASH_PATCH_CACHE``
to move it.

The cache can only cost time, never the patches: an entry is a header (format
tag + CRC-32 of the payload) followed by the payload, and an entry that
is truncated, altered, undecodable or unreadable counts as a miss. It is
recomputed and rewritten, and recorded in :data:`faults` for ``dflash patches
status``. A cache that cannot be written is skipped. Writes go to a temp file
that is fsynced, then renamed over the entry (and the directory fsynced), so a
crash or a concurrent reader never sees half an entry.

Each torch upgrade or series change adds entries; a write that takes the cache past
:data:`MAX_BYTES` removes the oldest-written ones (a removed entry in use is one miss, rewritten).
"""

from __future__ import annotations

import hashlib
import marshal
import os
import tempfile
import time
import types
import zlib
from importlib.util import MAGIC_NUMBER
from pathlib import Path

CACHE_ENV = "DFLASH_PATCH_CACHE"
# Part of every key: entries written in an older layout are plain misses, not faults.
_FORMAT = b"dflash-patch-cache-2\n"
_DIGEST_BYTES = 4
_TMP_PREFIX = ".tmp-"
#: Size the cache is pruned back to after a write (the entries of one torch release take ~2-3 MB).
MAX_BYTES = 256 << 20
_STALE_TMP_SECONDS = 3600  # a temp file this old was left by a crashed writer

#: Entries found unusable in this process: name -> {"why": str, "rewritten": bool}.
faults: dict[str, dict] = {}


def cache_dir() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "dflash" / "patched"


def stat_key(path: Path) -> tuple:
    """(path, mtime_ns, size), or (path, None) for a missing file."""
    try:
        st = path.stat()
    except OSError:
        return (str(path), None)
    return (str(path), st.st_mtime_ns, st.st_size)


def key(*parts) -> str:
    return hashlib.sha256(repr((_FORMAT, MAGIC_NUMBER, parts)).encode()).hexdigest()[:40]


def _digest(payload: bytes | memoryview) -> bytes:
    # A CRC, not a cryptographic hash: it guards against crashes and bit rot, not an attacker
    # (whoever can write the cache can already run code as its user), at ~0.2 ms per import torch
    # where BLAKE2b took ~1 ms.
    return zlib.crc32(payload).to_bytes(_DIGEST_BYTES, "little")


def _unframe(data: bytes) -> memoryview:
    """The payload of an entry's bytes (a view: copying the ~2 MB of patched modules costs ~0.8 ms).

    Raises:
        ValueError: the header is missing or the digest does not match (truncated or altered).
    """
    header = len(_FORMAT) + _DIGEST_BYTES
    if len(data) < header or not data.startswith(_FORMAT):
        raise ValueError(f"no entry header ({len(data)} bytes)")
    payload = memoryview(data)[header:]
    if _digest(payload) != data[len(_FORMAT) : header]:
        raise ValueError(f"digest mismatch ({len(data)} bytes: truncated or altered)")
    return payload


def _fault(name: str, why: str) -> None:
    faults[name] = {"why": why, "rewritten": False}


def read(name: str) -> memoryview | None:
    """The payload stored under ``name`` (bytes-like), or None on a miss (absent, unreadable, or
    corrupt: see :data:`faults`)."""
    try:
        data = (cache_dir() / name).read_bytes()
    except (FileNotFoundError, NotADirectoryError):  # a missing entry; a bad directory is describe()'s
        return None
    except OSError as error:
        _fault(name, f"unreadable: {error!r}")
        return None
    try:
        return _unframe(data)
    except ValueError as error:
        _fault(name, str(error))
        return None


def read_decoded(name: str, decode):
    """``decode(payload)`` of the entry ``name``, or None on a miss; a payload ``decode`` rejects
    (any exception) is a fault like a corrupt file: the caller recomputes and rewrites it."""
    payload = read(name)
    if payload is None:
        return None
    try:
        return decode(payload)
    except Exception as error:  # whatever the decoder raises, the entry is unusable, not the patches
        _fault(name, f"undecodable: {error!r}")
        return None


def write(name: str, payload: bytes) -> None:
    """Store ``payload`` durably and atomically (temp file, fsync, rename, directory fsync); skipped
    if the cache directory cannot be written."""
    directory = cache_dir()
    tmp = None
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=_TMP_PREFIX, delete=False) as f:
            tmp = f.name
            f.write(_FORMAT + _digest(payload) + payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, directory / name)
        tmp = None
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        if name in faults:
            faults[name]["rewritten"] = True
        _prune(directory, keep=name)
    except OSError:
        pass
    finally:
        if tmp is not None:
            _unlink(tmp)


def _prune(directory: Path, *, keep: str) -> None:
    """Remove the oldest-written entries (never ``keep``) until the cache is within
    :data:`MAX_BYTES`, and temp files left by crashed writers. Runs on writes only (misses), so a
    cache hit costs nothing; an entry another process removes first is skipped."""
    entries, now = [], time.time()
    with os.scandir(directory) as it:
        for entry in it:
            try:
                st = entry.stat()
            except OSError:
                continue
            if entry.name.startswith(_TMP_PREFIX):
                if now - st.st_mtime > _STALE_TMP_SECONDS:
                    _unlink(entry.path)
            elif entry.name != keep:
                entries.append((st.st_mtime_ns, st.st_size, entry.path))
    total = sum(size for _, size, _ in entries) + (directory / keep).stat().st_size
    for _, size, path in sorted(entries):
        if total <= MAX_BYTES:
            break
        _unlink(path)
        total -= size


def _unlink(path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _decode_module(payload: bytes) -> tuple[str, types.CodeType]:
    source, code = marshal.loads(payload)
    if not isinstance(source, str) or not isinstance(code, types.CodeType):
        raise TypeError(f"expected (str, code), got ({type(source).__name__}, {type(code).__name__})")
    return source, code


def read_module(name: str) -> tuple[str, types.CodeType] | None:
    """(patched source, code object) stored by :func:`write_module`, or None on a miss."""
    return read_decoded(name, _decode_module)


def write_module(name: str, source: str, code: types.CodeType) -> None:
    write(name, marshal.dumps((source, code)))


def describe() -> dict:
    """The cache's state for ``dflash patches status``.

    Returns:
        dict: ``directory`` (str), ``state`` (``ok``, ``absent`` or ``unusable``), ``detail``
        (what that means and the fix, if any), ``entries`` (int), ``corrupt`` (entry names that
        do not verify now; each is recomputed on its next use), ``stale`` (entries without this
        version's header, e.g. another dflash version's: never read, removed by the size limit) and
        ``faults`` (entries this process found unusable: name -> ``{"why", "rewritten"}``).
    """
    directory = cache_dir()
    report = {
        "directory": str(directory),
        "entries": 0,
        "corrupt": [],
        "faults": {k: dict(v) for k, v in faults.items()},
    }
    if not directory.exists():
        return {**report, "state": "absent", "detail": "created at the next `import torch`"}
    try:
        names = sorted(p.name for p in directory.iterdir() if not p.name.startswith(_TMP_PREFIX))
        probe = tempfile.NamedTemporaryFile(dir=directory, prefix=_TMP_PREFIX)
        probe.close()
    except OSError as error:
        return {
            **report,
            "state": "unusable",
            "detail": f"{error!r}; every `import torch` recomputes the patches (~120 ms more). "
            f"Make it a writable directory, or set {CACHE_ENV} to one",
        }
    report["stale"] = []
    for name in names:
        try:
            data = (directory / name).read_bytes()
        except OSError:
            report["corrupt"].append(name)
            continue
        if not data.startswith(_FORMAT):
            report["stale"].append(name)  # another dflash version's layout: its keys never match ours
            continue
        try:
            _unframe(data)
        except ValueError:
            report["corrupt"].append(name)
    return {**report, "state": "ok", "entries": len(names), "detail": ""}
