"""The guard in conftest.py: every test starts in its own empty directory, never where pytest was
started (the README's quick start leaves runs/dflash there)."""

from pathlib import Path


def test_each_test_starts_in_an_empty_directory_away_from_the_invocation_directory(request):
    cwd = Path.cwd()
    assert cwd != Path(request.config.invocation_params.dir) and cwd != Path(request.config.rootpath)
    assert not any(cwd.iterdir())
    Path("written-by-a-test").write_text("")  # lands in this test's directory only


def test_the_next_test_gets_another_one():
    assert not Path("written-by-a-test").exists() and not any(Path.cwd().iterdir())
