"""The package's import structure: no import circle, and every room imports only the floors below it
(leaves -> target, patchtools -> data, drafter -> run -> evaluate, export -> train -> commands), read
from the sources (function-level imports count too)."""

import ast
from pathlib import Path

import dflash

PACKAGE = Path(dflash.__file__).parent
#: Bottom up; a module outside these rooms and not named here is a leaf (config, masks, files, ...).
FLOORS = (
    ("target_model", "patchtools"),
    ("data", "drafter"),
    ("run",),
    ("evaluate", "export"),
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
