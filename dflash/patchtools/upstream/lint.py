"""PyTorch's lint, as far as the kit's own additions go: imports as usort sorts them, 88 columns.

PyTorch formats Python with usort and a formatter at 88 columns, and its flake8 ignores E402 (a
module-level import not at the top), so a ``# noqa: E402`` is noise there. The kit tidies the
imports the series adds to torch's files (:func:`tidy_imports`: an import the module already has at
the top is dropped, a redundant ``# noqa: E402`` comment removed, one added to the leading imports
moved where usort puts it) and checks every commit
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
    return _sort_added_leading_imports("".join(out), old_lines)


def _sort_added_leading_imports(text: str, old_lines: set[str]) -> str:
    """``text`` with each one-line import the patch added to the module's leading imports, below one
    usort sorts after it (``import torch`` above an added ``import threading``), moved where usort
    puts it."""
    for _ in range(text.count("\nimport ") + text.count("\nfrom ") + 1):  # each pass places one
        lines = text.splitlines(keepends=True)
        imports = leading_imports(ast.parse(text))
        misplaced = next(
            (
                n
                for i, n in enumerate(imports)
                if n.lineno == n.end_lineno
                and lines[n.lineno - 1].rstrip("\r\n") not in old_lines
                and any(usort_key(p) > usort_key(n) for p in imports[:i])
            ),
            None,
        )
        if misplaced is None:
            return text
        at = misplaced.lineno - 1
        statement, rest = lines[at], lines[:at] + lines[at + 1 :]
        if 0 < at < len(rest) and rest[at - 1].lstrip().startswith("#") and not rest[at].strip():
            del rest[at]  # a comment that introduced the imports keeps to the code below it
        text = insert_imports("".join(rest), [statement])
    return text


def leading_imports(tree: ast.Module) -> list[ast.stmt]:
    """The top-level imports before the module's first other statement (its docstring aside)."""
    out = []
    for i, node in enumerate(tree.body):
        if isinstance(node, ast.Import | ast.ImportFrom):
            out.append(node)
        elif not (i == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)):
            break
    return out


def insert_imports(text: str, statements: list[str]) -> str:
    """``text`` with each import statement of ``statements`` put where usort sorts it among the
    top-level imports of ``text`` (a blank line where it starts a category of its own)."""
    for statement in statements:
        node = ast.parse(statement).body[0]
        key = usort_key(node)
        lines = text.splitlines(keepends=True)
        imports = leading_imports(ast.parse(text))
        after = next((n for n in imports if usort_key(n) > key), None)
        before = [n for n in imports if after is None or n.end_lineno < after.lineno]
        if before and usort_key(before[-1])[0] == key[0]:  # after the last of its own category
            at = before[-1].end_lineno
            lines[at:at] = [statement.rstrip("\n") + "\n"]
        elif after is not None:
            separate = key[0] != usort_key(after)[0]
            at = after.lineno - 1
            lines[at:at] = [statement.rstrip("\n") + "\n" + ("\n" if separate else "")]
        else:
            at = imports[-1].end_lineno if imports else 0
            separate = bool(imports) and usort_key(imports[-1])[0] != key[0]
            lines[at:at] = [("\n" if separate else "") + statement.rstrip("\n") + "\n"]
        text = "".join(lines)
    return text


def _category(module: str) -> int:
    top = module.lstrip(".").split(".")[0]
    if module.startswith("."):
        return 3
    if top == "__future__":
        return 0
    return 1 if top in sys.stdlib_module_names else 2


def usort_key(node: ast.stmt) -> tuple[int, str, int, str]:
    """usort's order of a top-level import: category (future, standard library, third party, relative),
    then the module name, case-insensitively (``import`` and ``from`` statements together; for one
    module ``import`` first), then the first name imported."""
    module = node.names[0].name if isinstance(node, ast.Import) else "." * node.level + (node.module or "")
    return (_category(module), module.lower(), isinstance(node, ast.ImportFrom), node.names[0].name.lower())


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
