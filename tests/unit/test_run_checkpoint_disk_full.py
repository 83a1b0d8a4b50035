"""dflash.run.checkpoint: a save the OS refuses (disk full) removes its temp directory and raises one
CheckpointError naming the directory, the OS error and the fix; the previous checkpoint stays usable.

The writers are faked: each writes part of its file, then fails the way the real one does on a full
disk (checked by hand on a 256 KiB tmpfs): safetensors raises SafetensorError with the errno in its
text, torch.save into a Python file raises RuntimeError during the file's OSError.
"""

import errno
import os

import pytest
import torch
from safetensors import SafetensorError

from dflash.drafter.files import CheckpointError
from dflash.run import checkpoint as ckpt
from dflash.run.checkpoint import save_checkpoint
from dflash.run.step_dirs import find_checkpoint

ROPE = {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
ENOSPC = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _save(out, step):
    return save_checkpoint(
        out,
        step,
        weights={"fc.weight": torch.full((2, 3), float(step))},
        drafter_config=ROPE,
        training_state={"step": step},
    )


def _partial(path):
    with open(path, "wb") as f:
        f.write(b"partial")


def _raise_os_error(tensors, filename, metadata=None):
    _partial(filename)
    raise ENOSPC


def _raise_safetensor_error(tensors, filename, metadata=None):
    _partial(filename)
    raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")


def _raise_torch_error(obj, f):
    f.write(b"partial")
    try:
        raise ENOSPC
    except OSError:
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598") from None


@pytest.mark.parametrize(
    "writer, fake",
    [
        ("safetensors.torch.save_file", _raise_os_error),
        ("safetensors.torch.save_file", _raise_safetensor_error),
        ("torch.save", _raise_torch_error),
    ],
    ids=["oserror", "safetensors", "torch-save"],
)
def test_a_full_disk_removes_the_temp_dir_and_names_directory_error_and_fix(tmp_path, monkeypatch, writer, fake):
    first = _save(tmp_path, 1)
    monkeypatch.setattr(writer, fake)
    with pytest.raises(CheckpointError) as raised:
        _save(tmp_path, 2)
    monkeypatch.undo()
    message = str(raised.value)
    root = tmp_path / "checkpoints"
    assert isinstance(raised.value, ValueError) and "\n" not in message  # the CLI prints it as one line
    assert f"step 2 in {root}: No space left on device [ENOSPC]" in message
    assert "step_00000002.tmp was removed and the previous checkpoint step_00000001 is intact" in message
    assert "free space on that disk (or pass another --out)" in message
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000001"]
    assert find_checkpoint(tmp_path) == first
    assert ckpt.load_training_state(first)["step"] == 1


def test_a_failed_first_save_says_none_was_saved_and_other_errors_name_permissions(tmp_path, monkeypatch):
    def refuse(tensors, filename, metadata=None):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), filename)

    monkeypatch.setattr("safetensors.torch.save_file", refuse)
    with pytest.raises(CheckpointError, match=r"Permission denied \[EACCES\]; .*no earlier checkpoint was saved: "):
        _save(tmp_path, 1)
    with pytest.raises(CheckpointError, match=r"make .*checkpoints writable \(or pass another --out\)"):
        _save(tmp_path, 1)
    assert list((tmp_path / "checkpoints").iterdir()) == []


def test_a_failure_that_is_no_os_error_propagates_unchanged_without_a_temp_dir(tmp_path, monkeypatch):
    def bug(obj, f):
        raise RuntimeError("a bug, not the disk")

    monkeypatch.setattr(torch, "save", bug)
    with pytest.raises(RuntimeError, match="a bug, not the disk"):
        _save(tmp_path, 1)
    assert list((tmp_path / "checkpoints").iterdir()) == []
