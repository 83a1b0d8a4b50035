"""``dflash patches coverage``: a sources folder that is not there is a usage error, not ignored; the
table has a header, marks the installed torch's release and ends with a legend."""

import pytest
import torch
from packaging.version import Version

from dflash.cli import main


@pytest.mark.parametrize("how", ["flag", "environment"])
def test_missing_sources_are_a_one_line_usage_error(tmp_path, monkeypatch, capsys, how):
    missing = tmp_path / "nonexistent"
    if how == "flag":
        code, given = main(["patches", "coverage", "--sources", str(missing)]), f"--sources {missing}"
    else:
        monkeypatch.setenv("DFLASH_TORCH_SOURCES", str(missing))
        code, given = main(["patches", "coverage"]), f"DFLASH_TORCH_SOURCES={missing}"
    err = capsys.readouterr().err
    assert code == 2
    assert err == f"dflash patches coverage: {given}: no such directory; pass a folder of <version>/torch trees " + (
        "(scripts/fetch_torch_sources.py)\n"
    )


def test_sources_without_torch_trees_are_a_usage_error(tmp_path, capsys):
    (tmp_path / "torch").mkdir()  # the torch tree itself instead of the folder of <version>/torch trees
    assert main(["patches", "coverage", "--sources", str(tmp_path)]) == 2
    assert "holds no <version>/torch/version.py tree" in capsys.readouterr().err


def test_the_table_has_a_header_marks_the_installed_release_and_explains_itself(monkeypatch, capsys):
    monkeypatch.delenv("DFLASH_TORCH_SOURCES", raising=False)
    assert main(["patches", "coverage"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["release", "state", "records", "reason"]
    marked = [line.split()[1] for line in lines[1:-1] if line.startswith("*")]
    assert marked == [Version(torch.__version__).public]
    legend = lines[-1]
    assert legend.startswith(f"* = installed torch {torch.__version__}; ")
    assert all(word in legend for word in ("verified:", "fits:", "unsupported:", "records:"))
