"""docs/architecture.md stays true: its rooms name every module of the package and no
other, and the imports keep to its table (down only, never the other device's rooms,
never another module's private names)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "numba_rope"


def _rooms() -> tuple[dict[str, str], dict[str, set[str]]]:
    """``(room of each module path, rooms each room may import)`` from the doc's table."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    room_of: dict[str, str] = {}
    allowed: dict[str, set[str]] = {}
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[1].startswith("`numba_rope/"):
            continue
        room, modules, may_import = cells
        for path in re.findall(r"`([^`]+\.py)`", modules):
            room_of[path] = room
        allowed[room] = {name.strip() for name in may_import.split(",")}
    return room_of, allowed


ROOM_OF, ALLOWED = _rooms()


def _module_name(path: str) -> str:
    name = path.removesuffix(".py").replace("/", ".")
    return name.removesuffix(".__init__")


MODULE_ROOM = {_module_name(path): room for path, room in ROOM_OF.items()}
MODULE_ROOM["numba_rope"] = "public"  # `import numba_rope` uses the public functions


def test_the_doc_names_every_module_and_only_existing_ones():
    on_disk = {str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py")}
    assert set(ROOM_OF) - on_disk == set(), "named in docs/architecture.md but missing"
    assert on_disk - set(ROOM_OF) == set(), "modules missing from docs/architecture.md"
    for room, may_import in ALLOWED.items():
        assert may_import <= set(ALLOWED), f"{room} may import unknown rooms"


def _imports(tree: ast.AST, module: str) -> list[tuple[str, list[str]]]:
    """``(imported module, names taken from it)`` of every numba_rope import."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names if a.name.startswith("numba_rope")]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.startswith("numba_rope"):
                found.append((node.module, [a.name for a in node.names]))
    return found


def _is_module(name: str) -> bool:
    path = ROOT / name.replace(".", "/")
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


@pytest.mark.parametrize("path", sorted(ROOM_OF), ids=str)
def test_imports_keep_to_the_rooms(path):
    module = _module_name(path)
    room = ROOM_OF[path]
    tree = ast.parse((ROOT / path).read_text())
    for imported, names in _imports(tree, module):
        targets = [imported]
        for name in names:  # `from numba_rope import _cpu`: the submodule is the target
            if _is_module(f"{imported}.{name}"):
                targets.append(f"{imported}.{name}")
            elif name.startswith("_") and not name.startswith("__"):
                pytest.fail(f"{path} imports the private name {name} from {imported}")
        target = targets[-1] if len(targets) > 1 else imported
        target_room = MODULE_ROOM.get(target)
        assert target_room is not None, f"{path} imports {target}, which the doc does not place"
        if target_room != room:
            assert target_room in ALLOWED[room], (
                f"{path} ({room}) imports {target} ({target_room}); {room} may import "
                f"{sorted(ALLOWED[room])} (docs/architecture.md)"
            )


@pytest.mark.parametrize("path", sorted(ROOM_OF), ids=str)
def test_no_private_attributes_of_other_modules(path):
    """``backend._helper``-style uses of another module's private names."""
    tree = ast.parse((ROOT / path).read_text())
    aliases = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("numba_rope"):
            aliases |= {
                a.asname or a.name for a in node.names if _is_module(f"{node.module}.{a.name}")
            }
        elif isinstance(node, ast.Import):
            aliases |= {a.asname or a.name for a in node.names if a.name.startswith("numba_rope")}
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            pytest.fail(
                f"{path} uses {node.value.id}.{node.attr}, a private name of another module"
            )
