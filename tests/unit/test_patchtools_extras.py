"""The patch tools' packages are the ``patchtools`` extra (the startup hook needs neither): a tool run
without its package says which extra installs it instead of failing deep inside."""

import sys
from pathlib import Path

import pytest

from dflash.cli import main
from dflash.patchtools.wheel import WheelBuildError, build_wheel


def test_the_refresh_without_merge3_names_the_extra(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "merge3", None)  # import merge3 raises ImportError
    monkeypatch.delitem(sys.modules, "dflash.patchtools.refresh", raising=False)
    assert main(["patches", "refresh", "--sources", str(tmp_path)]) == 1
    assert "needs the merge3 package, which the patchtools extra installs: pip install -e '.[patchtools]'" in (
        capsys.readouterr().err
    )


def test_the_wheel_builder_without_wheel_names_the_extra(tmp_path, monkeypatch):
    real = __import__("importlib.util").util.find_spec
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "wheel" else real(name, *a))
    with pytest.raises(WheelBuildError, match=r"needs the wheel package, which the patchtools extra installs"):
        build_wheel(torch_wheel=Path(tmp_path / "torch.whl"), out_dir=tmp_path / "dist")
