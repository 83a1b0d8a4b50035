"""Regenerated replies shared by a user's runs: a corpus the target regenerated for one ``--out``
(:mod:`dflash.data.regenerate`: hours at a real target's size) is copied into a new ``--out`` whose
run has the same regeneration key instead of being generated again.

The key (:func:`dflash.data.regenerate.regeneration_key`) is what the replies depend on: the data
file's sha256; the target's config, generation config, tokenizer and chat template files by sha256
and its weight files by name, size and modification time; its dtype; ``--seq-len`` and
``--regenerate-max-new-tokens``; the version of the regeneration procedure and of transformers.
An entry, a directory named by the key's digest, holds the corpus and a record of its key and its
sha256. It is used only when its key equals the run's field for
field and the corpus still hashes to the recorded sha256 (an entry that does not is said to be
stale or damaged, and the run regenerates); every use is logged with the entry's path, so no run
trains on replies it did not say where they came from. The run keeps its own copy, so its resume
never depends on the store.

The store is ``$DFLASH_REPLY_STORE``, else ``$XDG_CACHE_HOME/dflash/replies`` (``~/.cache`` when
unset); ``DFLASH_REPLY_STORE=off`` turns it off. Nothing is ever pruned: delete an entry (or the
store) to reclaim its space. A store that cannot be written costs a warning, never the run.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from dflash.files import sha256_file

logger = logging.getLogger(__name__)

STORE_ENV = "DFLASH_REPLY_STORE"
REPLIES_NAME = "replies.jsonl"
RECORD_NAME = "record.json"


def store_dir() -> Path | None:
    """Where the store is; None when ``DFLASH_REPLY_STORE=off``."""
    configured = os.environ.get(STORE_ENV, "")
    if configured.strip().lower() == "off":
        return None
    if configured:
        return Path(configured)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dflash" / "replies"


def entry_dir(key: dict) -> Path | None:
    """The entry of ``key`` (which may not exist); None with the store off."""
    store = store_dir()
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    return None if store is None else store / digest


def fetch(key: dict, corpus: Path) -> bool:
    """Copy the stored corpus of ``key`` to ``corpus`` when there is one whose record matches
    (logged with its path); False when there is none, or it is stale or damaged (said)."""
    entry = entry_dir(key)
    if entry is None or not (entry / RECORD_NAME).is_file():
        return False
    try:
        record = json.loads((entry / RECORD_NAME).read_text())
        if not isinstance(record, dict) or record.get("key") != key:
            logger.warning("%s: its key is not the one it is filed under; regenerating instead", entry)
            return False
        # The copy is what the run trains on, so the copy is what is checked against the record.
        tmp = corpus.with_name(f".{corpus.name}.tmp")
        corpus.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(entry / REPLIES_NAME, tmp)
        if sha256_file(tmp) != record.get("sha256"):
            tmp.unlink()
            logger.warning(
                "%s: the stored replies changed since they were kept (sha256 differs); regenerating instead (delete "
                "the entry to stop this warning)",
                entry,
            )
            return False
        tmp.replace(corpus)
    except (OSError, ValueError) as e:
        logger.warning("%s: cannot read the stored replies (%s); regenerating instead", entry, e)
        return False
    logger.info(
        "replies: the target's replies regenerated for %s, reused from %s (same data, target files, dtype and lengths; "
        "%s=off regenerates)",
        record.get("from", "an earlier run"),
        entry,
        STORE_ENV,
    )
    return True


def keep(key: dict, corpus: Path) -> None:
    """File ``corpus`` (regenerated for ``key``) in the store, unless an entry of ``key`` is there;
    a store that cannot be written is warned about and skipped."""
    entry = entry_dir(key)
    if entry is None or entry.exists():
        return
    tmp = None
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        # A name of its own: on a shared filesystem another host's run may hold this pid.
        tmp = Path(tempfile.mkdtemp(dir=entry.parent, prefix=f".{entry.name}.", suffix=".tmp"))
        shutil.copyfile(corpus, tmp / REPLIES_NAME)
        record = {"key": key, "sha256": sha256_file(tmp / REPLIES_NAME), "from": str(corpus.parent)}
        (tmp / RECORD_NAME).write_text(json.dumps(record, indent=1) + "\n")
        tmp.rename(entry)
    except OSError as e:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if not entry.exists():  # another run filed it first: nothing lost
            logger.warning("%s: cannot keep the regenerated replies for other runs (%s)", entry.parent, e)
        return
    logger.info("replies: kept in %s for other runs with the same data, target and lengths", entry)
