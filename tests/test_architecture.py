"""The seams the architecture depends on, checked so they cannot erode quietly
(docs/architecture.md): SQL only in the store, the environment only in settings and the key
helper, backend names only in the registry, layers that import downwards, small modules."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from lowtide.backends import REGISTRY

REPO = Path(__file__).resolve().parents[1]
PRODUCT = ("lowtide", "flows", "tasks")
# SQL as lowtide writes it: an upper-case statement keyword and its companion clause
SQL_START = re.compile(
    r"^\s*(SELECT\b.*\bFROM\b|SELECT \w|INSERT (OR \w+ )?INTO\b|UPDATE \w+ SET\b"
    r"|DELETE FROM\b|(CREATE|ALTER|DROP) (OR REPLACE )?(TABLE|VIEW|INDEX)\b|WITH \w+ AS\b"
    r"|COPY \(|ATTACH\b|DETACH\b)",
    re.DOTALL,
)
# allocators.py only sets two native libraries' defaults (kept when the user set them)
ENV_READERS = {"lowtide/settings.py", "lowtide/allocators.py"}
MAX_LINES = 530


def _modules(*roots: str) -> Iterator[tuple[str, ast.Module]]:
    for root in roots:
        for path in sorted((REPO / root).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            yield rel, ast.parse(path.read_text(encoding="utf-8"), filename=rel)


def _strings(tree: ast.Module) -> Iterator[tuple[int, str]]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.lineno, node.value
        elif isinstance(node, ast.JoinedStr):  # an f-string: its literal head
            head = node.values[0] if node.values else None
            if isinstance(head, ast.Constant) and isinstance(head.value, str):
                yield node.lineno, head.value


def _docstring_nodes(tree: ast.Module) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                ids.add(body[0].value.lineno)
    return ids


def test_no_sql_outside_the_store() -> None:
    found = []
    for rel, tree in _modules(*PRODUCT):
        if rel.startswith("lowtide/store/"):
            continue
        docs = _docstring_nodes(tree)
        found += [
            f"{rel}:{line}: {text.strip()[:60]!r}"
            for line, text in _strings(tree)
            if line not in docs and SQL_START.match(text)
        ]
    assert not found, "SQL outside lowtide/store/ (give the store a method):\n" + "\n".join(found)


def test_the_environment_is_read_only_by_settings_and_the_key_helper() -> None:
    found = []
    for rel, tree in _modules(*PRODUCT):
        if rel in ENV_READERS:
            continue
        for node in ast.walk(tree):
            name = None
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "environb"):
                name = node.attr
            elif isinstance(node, ast.ImportFrom) and node.module == "os":
                hits = {a.name for a in node.names} & {"environ", "getenv", "environb"}
                name = ", ".join(sorted(hits)) or None
            if name:
                found.append(f"{rel}:{node.lineno}: os.{name}")
    assert not found, "environment read outside settings/keys:\n" + "\n".join(found)


def test_flows_and_tasks_ask_capabilities_not_backend_names() -> None:
    names = set(REGISTRY)
    found = [
        f"{rel}:{line}: {text!r}"
        for rel, tree in _modules("flows", "tasks")
        for line, text in _strings(tree)
        if text in names
    ]
    assert not found, "backend names outside the registry:\n" + "\n".join(found)


# who may import whom: a layer imports only the layers below it
LAYERS = {
    "lowtide/store": {"flows", "tasks", "lowtide.backends", "lowtide.cli", "lowtide.context"},
    "lowtide/backends": {"flows", "tasks", "lowtide.store", "lowtide.cli", "lowtide.context"},
    "tasks": {"flows", "lowtide.cli"},
    "flows": {"lowtide.cli"},
    "lowtide/emulator": {"flows", "tasks", "lowtide.store", "lowtide.cli", "lowtide.context"},
}


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_layers_import_downwards(layer: str) -> None:
    banned = LAYERS[layer]
    found = []
    for rel, tree in _modules(layer):
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                targets = [node.module]
            for target in targets:
                if any(target == b or target.startswith(b + ".") for b in banned):
                    found.append(f"{rel}:{node.lineno}: imports {target}")
    assert not found, f"{layer} imports a layer above it:\n" + "\n".join(found)


def test_no_module_a_reader_cannot_hold_in_mind() -> None:
    long = [
        f"{rel}: {n} lines"
        for root in PRODUCT
        for path in sorted((REPO / root).rglob("*.py"))
        if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES
        for rel in [path.relative_to(REPO).as_posix()]
    ]
    assert not long, f"modules over {MAX_LINES} lines; split them by concern:\n" + "\n".join(long)
