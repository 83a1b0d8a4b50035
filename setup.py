"""Packaging for dflash, including the startup hook that patches torch at import.

The hook is a ``.pth`` file (plus a PEP 829 ``.start`` file for Python 3.15+)
placed at the root of site-packages. ``build_py`` below puts it where both a
regular and an editable (PEP 660) wheel pick it up; ``docs/packaging.md`` says
why neither ``data_files`` nor copying it into ``build_lib`` alone works for
``pip install -e .``.
"""

from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).parent
STARTUP_FILES = ("dflash-patches.pth", "dflash-patches.start")


class BuildPyWithStartupHook(build_py):
    """Ship the startup files at the wheel root, for regular and editable wheels.

    In editable mode setuptools points the ``install`` command's ``install_lib``
    at the folder it zips into the editable wheel (stable from setuptools 64 to
    84; ``tests/integration/test_packaging.py`` checks the file lands after ``pip install -e .``).
    """

    def run(self):
        super().run()
        if self.editable_mode:
            target = Path(self.get_finalized_command("install").install_lib)
        else:
            target = Path(self.build_lib)
        target.mkdir(parents=True, exist_ok=True)
        for name in STARTUP_FILES:
            self.copy_file(str(HERE / "dflash" / "patching" / name), str(target / name))

    def get_outputs(self, include_bytecode=True):
        return super().get_outputs(include_bytecode) + [str(Path(self.build_lib) / name) for name in STARTUP_FILES]


setup(
    # Metadata and dependencies are in pyproject.toml; the package layout and the hook stay here.
    packages=find_packages(include=["dflash", "dflash.*"]) + ["dflash.patch_series"],
    # patches/ is the single source of truth for the series; shipping it as a
    # package lets the engine, the wheel builder and the PR kit read it alike.
    package_dir={"dflash.patch_series": "patches"},
    package_data={
        "dflash.patch_series": ["series", "*.patch", "generated/releases", "generated/*/*.patch", "records/*.json"],
        "dflash.patching": [*STARTUP_FILES],
        "dflash.patchtools": ["upstream_tests/*/*.py", "upstream_texts/*.md"],
        # The embedded default target and chat corpus (scripts/make_default_target.py).
        "dflash.assets": ["*/*.json", "*/*.jinja", "*/*.safetensors", "*/*.jsonl", "*/*.md", "*/*.txt"],
    },
    cmdclass={"build_py": BuildPyWithStartupHook},
)
