"""A path mistake on the command line is refused before torch and transformers load (seconds) and
before any data is tokenized, by a message that names the flag it came from (``--eval-data nope``
was refused after tokenizing the training data, naming ``--data``; ``--init-from /nope`` after 28.7 s;
``dflash eval --drafter nope`` and ``dflash export`` mistakes after 7-10 s of imports). One fresh
interpreter runs every case and reports whether torch or transformers was imported."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = """
import json, sys
from dflash.cli import main
cases = json.loads(sys.argv[1])
results = [main(argv) for argv in cases]
print(json.dumps({"codes": results, "heavy": sorted({"torch", "transformers"} & set(sys.modules))}))
"""


def test_path_mistakes_are_refused_before_the_heavy_imports_naming_their_flag(tmp_path):
    not_a_dir = tmp_path / "notes.txt"
    not_a_dir.write_text("not a drafter")
    cases = {
        "--init-from /nope: no such directory; pass a drafter directory": [
            ["train", "--init-from", "/nope", "--out", str(tmp_path / "a"), "--steps", "1"]
        ],
        f"--init-from {not_a_dir}: a file, not a directory": [
            ["train", "--init-from", str(not_a_dir), "--out", str(tmp_path / "b")]
        ],
        "nope.jsonl: no such data file; pass --eval-data with a JSONL chat file": [
            ["train", "--eval-data", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "c"), "--responses", "data"]
        ],
        "--drafter nope: does not exist": [["eval", "--drafter", "nope"]],
        f"--drafter {not_a_dir}: a file, not a directory; pass a run directory": [
            ["eval", "--drafter", str(not_a_dir)]
        ],
        "nope: does not exist; pass a run directory": [["export", "nope", "--out", str(tmp_path / "x-dflash")]],
        "vLLM recognises a DFlash drafter by 'dflash' in its path": [["export", "nope", "--out", str(tmp_path / "x")]],
    }
    argvs = [argv for group in cases.values() for argv in group]
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(argvs)], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"codes": [2] * len(argvs), "heavy": []}, proc.stderr
    for message in cases:
        assert message in proc.stderr, message
    assert not (tmp_path / "c" / "tokenized").exists()
