"""The package's structure: no import circle, and every room imports only the floors below it
(leaves -> target_model, patchtools -> data, drafter -> run -> evaluation, export -> train -> commands),
read from the sources (function-level imports count too); every module named in the README's layout
block and in its folder's docstring; no folder named as build output is; no two classes of a folder
named alike."""

import ast
import re
from pathlib import Path

import dflash

PACKAGE = Path(dflash.__file__).parent
README = PACKAGE.parent / "README.md"
#: Bottom up; a module outside these rooms and not named here is a leaf (config, masks, files, ...).
FLOORS = (
    ("target_model", "patchtools"),
    ("data", "drafter"),
    ("run",),
    ("evaluation", "export"),
    ("train",),
    ("commands",),
)
#: Folder names that tools reading a global gitignore take for build output and skip (Rust's and
#: Maven's target/, Python's build/ and dist/, .NET's bin/ and obj/).
BUILD_OUTPUT = {"target", "build", "dist", "out", "bin", "obj"}


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ("dflash", *path.relative_to(PACKAGE).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the dflash modules it imports."""
    found = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                # `from package import submodule` imports the submodule; any other name is the module's own.
                submodules = [f"{node.module}.{alias.name}" for alias in node.names]
                candidates = [m if m in modules else node.module for m in submodules]
            elif isinstance(node, ast.Import):
                candidates = [alias.name for alias in node.names]
            else:
                continue
            targets |= {c for c in candidates if c in modules and c != name}
        found[name] = targets
    return found


def _room(module: str) -> str:
    return module.split(".")[1] if "." in module else module


def _floor(room: str) -> int:
    return next((i + 1 for i, rooms in enumerate(FLOORS) if room in rooms), 0)


def test_no_room_imports_its_floor_or_one_above_it_except_itself():
    upward = sorted(
        f"{module} -> {target}"
        for module, targets in _imports(_modules()).items()
        for target in targets
        if _room(module) != _room(target)
        and _floor(_room(target)) >= _floor(_room(module)) > 0
        or (_floor(_room(module)) == 0 and _floor(_room(target)) > 0)
    )
    assert not upward


def test_no_import_circle():
    imports = _imports(_modules())
    done, path = set(), []

    def visit(module):
        if module in path:
            raise AssertionError("import circle: " + " -> ".join(path[path.index(module) :] + [module]))
        if module in done:
            return
        path.append(module)
        for target in imports[module]:
            visit(target)
        path.pop()
        done.add(module)

    for module in imports:
        visit(module)


def test_no_folder_is_named_as_build_output_is():
    """dflash/target/ was skipped by tools reading a global gitignore that names target/."""
    folders = {path.parent.name for path in PACKAGE.rglob("*.py")}
    assert "target_model" in folders and not folders & BUILD_OUTPUT


def test_no_two_classes_of_a_folder_share_a_name():
    """drafter/ had two DFlashDraftModel classes, the served one and the trainer's subclass of it."""
    by_folder: dict[tuple[Path, str], list[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                by_folder.setdefault((path.parent, node.name), []).append(path.name)
    shared = {f"{folder.name}/{name}": files for (folder, name), files in by_folder.items() if len(files) > 1}
    assert not shared


def _members(folder: Path) -> set[str]:
    """The modules of a package folder (``__main__`` aside) and its subpackages (``name/``)."""
    modules = {p.stem for p in folder.glob("*.py") if not p.stem.startswith("__")}
    return modules | {p.name + "/" for p in folder.iterdir() if (p / "__init__.py").is_file()}


def _names(text: str, member: str) -> bool:
    return re.search(rf"(?<![\w/]){re.escape(member.rstrip('/'))}\b", text) is not None


def _layout_block() -> dict[str, str]:
    """The README's layout block: each entry's text by its first word (``dflash/run/``), continuation lines joined."""
    block = README.read_text().split("## Layout", 1)[1].split("```", 2)[1]
    entries, current = {}, None
    for line in block.splitlines():
        if line[:1].strip():
            current, _, text = line.partition(" ")
            entries[current] = text
        elif current and line.strip():
            entries[current] += " " + line.strip()
    return entries


def _folders() -> list[Path]:
    return sorted(init.parent for init in PACKAGE.rglob("__init__.py"))


def test_every_module_is_named_in_its_folders_docstring():
    missing = [
        f"{folder.relative_to(PACKAGE.parent)}: {member}"
        for folder in _folders()
        for member in sorted(_members(folder))
        if not _names(ast.get_docstring(ast.parse((folder / "__init__.py").read_text())) or "", member)
    ]
    assert not missing


def test_every_module_is_named_in_the_readmes_layout_block():
    """A folder with an entry of its own names its modules there; any other folder is named in its parent's."""
    entries = _layout_block()
    missing = []
    for folder in _folders():
        key = f"{folder.relative_to(PACKAGE.parent)}/"
        if key in entries:
            missing += [
                f"{key} {member}"
                for member in sorted(_members(folder))
                if f"{key}{member}" not in entries and not _names(entries[key], member)
            ]
        elif not _names(entries.get(f"{folder.parent.relative_to(PACKAGE.parent)}/", ""), folder.name):
            missing.append(f"{key} (in its parent's entry)")
    assert "dflash/" in entries and not missing


#: The self-contained file every checkpoint carries (it may import only torch and transformers).
SHIPPED = "drafter/modeling_dflash.py"


def test_no_module_is_over_700_lines_but_the_shipped_modeling_file():
    lengths = {str(path.relative_to(PACKAGE)): len(path.read_text().splitlines()) for path in PACKAGE.rglob("*.py")}
    assert SHIPPED in lengths
    assert not {name: n for name, n in lengths.items() if n > 700 and name != SHIPPED}
