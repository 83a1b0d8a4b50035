"""Put a concern's tests where PyTorch's CI runs them: merged into existing test files, or a new
``test/fx/`` or ``test/autograd/`` file imported from ``test/test_fx.py`` / ``test/test_autograd.py``
(``test/run_test.py`` skips both folders: their tests run through those files).

Every edit is made on the text of the file as it is in the tree (located with :mod:`ast`, never by
line numbers fixed in advance), so it follows the tree's version of each file.
"""

from __future__ import annotations

import ast
import importlib.resources

from dflash.patchtools.upstream.concerns import MethodEdit, TestPlacement, UpstreamConcern
from dflash.patchtools.upstream.lint import insert_imports
from dflash.patchtools.upstream.tree import UpstreamKitError


def test_source(name: str) -> str:
    """Text of ``upstream_tests/<name>`` shipped in this package."""
    path = importlib.resources.files("dflash.patchtools") / "upstream_tests" / name
    if not path.is_file():
        raise UpstreamKitError(f"no upstream test source {name}: add dflash/patchtools/upstream_tests/{name}")
    return path.read_text(encoding="utf-8")


def test_classes(source: str) -> list[str]:
    """Names of the top-level ``unittest`` test classes (``Test*``/``*Tests``) of a test module."""
    return [
        n.name
        for n in ast.parse(source).body
        if isinstance(n, ast.ClassDef) and (n.name.startswith("Test") or n.name.endswith("Tests"))
    ]


def _is_main_guard(node: ast.stmt) -> bool:
    return isinstance(node, ast.If) and "__name__" in ast.unparse(node.test)


def _bound_names(node: ast.stmt) -> set[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return {(a.asname or a.name).split(".")[0] for a in node.names}
    if isinstance(node, (ast.Assign, ast.AnnAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return set()


def _used_names(nodes: list[ast.stmt]) -> set[str]:
    return {n.id for node in nodes for n in ast.walk(node) if isinstance(n, ast.Name)}


def _segment(lines: list[str], node: ast.stmt) -> str:
    first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
    return "".join(lines[first - 1 : node.end_lineno])


def merge_tests(target_text: str, tests_text: str, target: str) -> str:
    """``target_text`` with the imports, helpers and test classes of ``tests_text`` added.

    Imports the inserted code needs and the target lacks go where usort sorts them among the target's
    leading imports;
    definitions go before the target's ``if __name__ == "__main__":`` block (or at the end). The module
    docstring and main guard of ``tests_text`` are dropped.

    Raises:
        UpstreamKitError: a name the tests define is already defined differently in the target.
    """
    target_tree, tests_tree = ast.parse(target_text), ast.parse(tests_text)
    target_lines = target_text.splitlines(keepends=True)
    test_lines = tests_text.splitlines(keepends=True)
    existing = {
        name: ast.unparse(node) for node in target_tree.body for name in _bound_names(node) if not _is_main_guard(node)
    }
    body = [n for n in tests_tree.body if not _is_main_guard(n) and not isinstance(n, ast.Expr)]
    imports = [n for n in body if isinstance(n, (ast.Import, ast.ImportFrom))]
    definitions = [n for n in body if n not in imports]
    used = _used_names(definitions)
    new_imports, new_definitions = [], []
    for node in imports:
        if any(name in used and name not in existing for name in _bound_names(node)):
            new_imports.append(_segment(test_lines, node))
    for node in definitions:
        clashes = [name for name in _bound_names(node) if name in existing]
        if clashes and all(existing[name] == ast.unparse(node) for name in clashes):
            continue  # the same helper, merged already (e.g. by an earlier commit)
        if clashes:
            raise UpstreamKitError(f"{target} already defines {', '.join(clashes)} differently; rename the test's")
        new_definitions.append(_segment(test_lines, node))
    guard = next((n for n in target_tree.body if _is_main_guard(n)), None)
    insert_at = guard.lineno - 1 if guard is not None else len(target_lines)
    block = "".join(f"\n\n{d.rstrip()}\n" for d in new_definitions) + ("\n\n" if guard is not None else "")
    head = "".join(target_lines[:insert_at]).rstrip("\n") + "\n"
    head = insert_imports(head, new_imports)
    return head + block + "".join(target_lines[insert_at:])


def add_package_import(runner_text: str, package: str, module: str, classes: list[str]) -> str:
    """The runner file (``test/test_fx.py``, ``test/test_autograd.py``) with ``from <package>.<module>
    import <classes>  # noqa: F401`` among its ``from <package>.test_*`` imports (sorted position), so
    PyTorch's CI, which runs ``test/<package>`` through that file, runs them."""
    tree = ast.parse(runner_text)
    lines = runner_text.splitlines(keepends=True)
    prefix = f"{package}.test_"
    siblings = [n for n in tree.body if isinstance(n, ast.ImportFrom) and (n.module or "").startswith(prefix)]
    line = f"from {package}.{module} import {', '.join(classes)}  # noqa: F401\n"
    if not siblings:
        anchor = max((n.end_lineno for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))), default=0)
    else:
        before = [n for n in siblings if n.module < f"{package}.{module}"]
        anchor = (before[-1].end_lineno) if before else siblings[0].lineno - 1
    return "".join(lines[:anchor] + [line] + lines[anchor:])


def apply_placement(placement: TestPlacement, read) -> dict[str, str]:
    """New texts (path -> text) that put ``placement``'s tests into the tree; ``read(path)`` gives a
    file's current text or None.

    Raises:
        UpstreamKitError: a file the placement needs is missing, or a name clashes.
    """
    tests_text = test_source(placement.source)
    if placement.new_file:
        out = {placement.target: tests_text}
        if placement.imported_from:
            current = read(placement.imported_from)
            if current is None:
                raise UpstreamKitError(
                    f"{placement.imported_from} is not in the tree (the kit imports its tests there)"
                )
            package, module = placement.target.removesuffix(".py").split("/")[-2:]
            out[placement.imported_from] = add_package_import(current, package, module, test_classes(tests_text))
        return out
    current = read(placement.target)
    if current is None:
        raise UpstreamKitError(f"{placement.target} is not in the tree (the kit adds tests to it)")
    return {placement.target: merge_tests(current, tests_text, placement.target)}


def _snippet_function(edit: MethodEdit) -> tuple[list[str], ast.FunctionDef]:
    """The lines of ``edit.source`` and its ``def <edit.method>(self)`` (a module, so it lints and imports)."""
    snippet = test_source(edit.source)
    func = next((n for n in ast.parse(snippet).body if isinstance(n, ast.FunctionDef) and n.name == edit.method), None)
    if func is None:
        raise UpstreamKitError(f"upstream_tests/{edit.source} has no def {edit.method}")
    return snippet.splitlines(keepends=True), func


def _reindent(lines: list[str], old: int, new: int) -> str:
    return "".join(" " * new + line[old:] if line.strip() else line for line in lines)


def apply_method_edit(edit: MethodEdit, text: str) -> str:
    """``text`` with ``edit`` applied: the method replaced by the snippet's, or the snippet's body
    statements (after its docstring) appended to the method's body.

    Raises:
        UpstreamKitError: the class or method is not in the file.
    """
    tree = ast.parse(text)
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == edit.cls), None)
    method = cls and next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == edit.method), None)
    if method is None:
        raise UpstreamKitError(f"{edit.target} has no {edit.cls}.{edit.method} to update")
    lines = text.splitlines(keepends=True)
    snippet_lines, func = _snippet_function(edit)
    if edit.mode == "append":
        statements = [s for s in func.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
        added = snippet_lines[statements[0].lineno - 1 : func.end_lineno]
        body = _reindent(added, func.body[0].col_offset, method.body[0].col_offset)
        return "".join(lines[: method.end_lineno]) + body + "".join(lines[method.end_lineno :])
    first = min([method.lineno, *(d.lineno for d in method.decorator_list)])
    body = _reindent(snippet_lines[func.lineno - 1 : func.end_lineno], func.col_offset, method.col_offset)
    return "".join(lines[: first - 1]) + body + "".join(lines[method.end_lineno :])


def test_plan(concern: UpstreamConcern) -> list[str]:
    """The commands that run ``concern``'s tests in a PyTorch checkout (the commit's ``Test Plan``)."""
    lines = []
    for placement in concern.tests:
        runner = placement.imported_from or placement.target
        classes = test_classes(test_source(placement.source))
        lines.append(f"python {runner} " + " ".join(f"-k {c}" for c in classes))
    lines += [f"python {e.target}" for e in dict.fromkeys(e for e in concern.edits)]
    return list(dict.fromkeys(lines))
