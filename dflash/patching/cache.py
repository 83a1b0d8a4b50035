"""On-disk cache of the plan and of patched modules' source and bytecode (like ``__pycache__``).

Without it every ``import torch`` would read the series, import the diff and
version parsers and compile the patched modules: ~120 ms. Keys hash the stat
of every input (torch's files, the series, the Python bytecode magic), so an
upgrade of torch or of the series misses the cache. Set ``DFLASH_PATCH_CACHE``
to move it; a cache that cannot be written is skipped, never an error.
"""

from __future__ import annotations

import hashlib
import marshal
import os
import tempfile
from importlib.util import MAGIC_NUMBER
from pathlib import Path

CACHE_ENV = "DFLASH_PATCH_CACHE"


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
    return hashlib.sha256(repr((MAGIC_NUMBER, parts)).encode()).hexdigest()[:40]


def read(name: str) -> bytes | None:
    try:
        return (cache_dir() / name).read_bytes()
    except OSError:
        return None


def write(name: str, data: bytes) -> None:
    """Write atomically (temp file + rename), so a concurrent reader never sees half a file."""
    directory = cache_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, delete=False) as tmp:
            tmp.write(data)
        os.replace(tmp.name, directory / name)
    except OSError:
        pass


def read_module(name: str):
    """(patched source, code object) stored by :func:`write_module`, or None."""
    data = read(name)
    if data is None:
        return None
    try:
        return marshal.loads(data)
    except (EOFError, ValueError, TypeError):
        return None


def write_module(name: str, source: str, code) -> None:
    write(name, marshal.dumps((source, code)))
