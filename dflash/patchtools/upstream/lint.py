"""PyTorch's lint, as far as the kit's own additions go: imports as usort sorts them, 88 columns.

PyTorch formats Python with usort and a formatter at 88 columns, and its flake8 ignores E402 (a
module-level import not at the top), so a ``# noqa: E402`` is noise there. The kit tidies the
imports the series adds to torch's files (:func:`tidy_imports`: an import the module already has at
the top is dropped, a redundant ``# noqa: E402`` comment removed) and checks every commit
(:func:`problems`): the test files it adds or changes keep their added lines within 88 columns, the
files it adds their import blocks in usort's order (imports merged into an existing file are put in
their usort place by :func:`.placement.merge_tests`); added torch code keeps within 88 columns too, except a line
that only re-indents code already in the file and a line whose length comes from a trailing
``# type: ignore[...]``/``# noqa`` pragma, which the formatter leaves as it is.
"""

from __future__ import annotations

import ast
import re
import sys

MAX_COLUMNS = 88
_NOQA_E402 = re.compile(r"\s+# noqa: E402$")
_PRAGMA = re.compile(r"\s+# (?:type: ignore\[[^\]]*\]|noqa(?::[ A-Z0-9,]+)?|pyrefly: ignore.*)$")


def _top_level_imports(text: str) -> dict[str, int]:
    """Each top-level ``import x`` / ``from m import x`` statement's text (one name per key) -> its line."""
    out = {}
    for node in ast.parse(text).body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            for alias in node.names:
                if isinstance(node, ast.Import):
                    key = f"import {alias.name}" + (f" as {alias.asname}" if alias.asname else "")
                else:
                    key = f"from {'.' * node.level}{node.module or ''} import {alias.name}" + (
                        f" as {alias.asname}" if alias.asname else ""
                    )
                out.setdefault(key, node.lineno)
    return out


def tidy_imports(new_text: str, old_text: str | None) -> str:
    """``new_text`` (a torch file as a patch leaves it) with the imports the patch added tidied: a line
    ``import x  # noqa: E402`` whose statement the file already has above it is dropped, and the
    ``# noqa: E402`` of the others removed. Lines that ``old_text`` (the file before the patch) has are
    left alone."""
    old_lines = set((old_text or "").splitlines())
    lines = new_text.splitlines(keepends=True)
    out, seen = [], _top_level_imports(new_text)
    for number, line in enumerate(lines, start=1):
        body = line.rstrip("\r\n")
        if _NOQA_E402.search(body) and body not in old_lines and not line.startswith((" ", "\t")):
            statement = _NOQA_E402.sub("", body)
            if seen.get(statement, number) < number:
                continue  # imported above already: the line only repeats it
            line = statement + line[len(body) :]
        out.append(line)
    return "".join(out)


def _category(module: str) -> int:
    top = module.lstrip(".").split(".")[0]
    if module.startswith("."):
        return 3
    if top == "__future__":
        return 0
    return 1 if top in sys.stdlib_module_names else 2


def usort_key(node: ast.stmt) -> tuple[int, str]:
    """usort's order of a top-level import: category (future, standard library, third party, relative),
    then the module name, case-insensitively (``import`` and ``from`` statements together)."""
    module = node.names[0].name if isinstance(node, ast.Import) else "." * node.level + (node.module or "")
    return (_category(module), module.lower())


def _names_sorted(node: ast.stmt) -> bool:
    names = [a.name for a in node.names]
    return names == sorted(names, key=str.lower)


def import_order_problems(text: str) -> list[str]:
    """Top-level import blocks (runs of imports, at most blank lines between) not in usort's order:
    categories (future, standard library, third party, relative) in that order, modules
    case-insensitively within each, ``import`` and ``from`` statements together, imported names
    case-insensitively."""
    problems, block = [], []
    body = ast.parse(text).body

    def flush():
        keys = [usort_key(n) for n in block]
        if keys != sorted(keys):
            problems.append(f"line {block[0].lineno}: imports not in usort's order")
        problems.extend(f"line {n.lineno}: imported names not sorted" for n in block if not _names_sorted(n))
        block.clear()

    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom) and "noqa" not in ast.get_source_segment(text, node):
            block.append(node)
        elif block:
            flush()
    if block:
        flush()
    return problems


def _added_lines(old: str | None, new: str) -> list[tuple[int, str]]:
    """(line number, text) of the lines of ``new`` not in ``old`` (line sets; enough for a check)."""
    old_set = set((old or "").splitlines())
    return [(i, line) for i, line in enumerate(new.splitlines(), start=1) if line not in old_set]


def problems(path: str, old: str | None, new: str) -> list[str]:
    """What PyTorch's lint would say of the lines a commit adds to ``path`` (see the module text)."""
    if not path.endswith(".py"):
        return []
    out = []
    old_stripped = {line.strip() for line in (old or "").splitlines()}
    for number, line in _added_lines(old, new):
        if len(line) <= MAX_COLUMNS:
            continue
        if path.startswith("torch/") and (line.strip() in old_stripped or len(_PRAGMA.sub("", line)) <= MAX_COLUMNS):
            continue
        out.append(f"{path}:{number}: {len(line)} columns (at most {MAX_COLUMNS})")
    if path.startswith("test/") and old is None:
        out.extend(f"{path}: {p}" for p in import_order_problems(new))
    out.extend(
        f"{path}:{n}: `# noqa: E402`, which PyTorch's flake8 ignores"
        for n, line in _added_lines(old, new)
        if _NOQA_E402.search(line)
    )
    return out
