"""The package's layers: every import points down, read and write never meet, no cycles;
and the tests' own rule: no test module imports another (shared helpers live in conftest).

The imports are read from the source (every ``import`` statement, also the
ones inside functions), so a lazy import counts like any other. Layers, from
the bottom (docs/design.md, "Module boundaries"):

0. core: the format, errors, the stored encodings, progress bars, the checked page
   reader (pagefile), opening a pack on it (packfile), the pack directory;
1. the read side (``lmdbfolder.read``, BasicSR's pair geometry ``read.pairs`` included)
   and the write side (``lmdbfolder.write``), which share only the core;
2. the tools (``lmdbfolder.tools``);
3. the PyTorch layer: the package ``lmdbfolder.torch`` (the dataset, its
   options, loader, batches, transform plan, fused crop, fused crops of several
   fields (``joint``), transport, gpu, sampler) and the public paths ``fused``, ``sampler``, ``gpu``, ``transport``
   that re-export from it;
4. the benchmarks and the demo (``lmdbfolder.bench``);
5. the command line (``lmdbfolder.cli``) and the package's public surface.

A module in no layer fails the test: a new module is placed on purpose (an
old-path re-export in the package root, ``lmdbfolder/reader.py`` beside
``lmdbfolder/read/reader.py``, is in none).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import lmdbfolder

PACKAGE = Path(lmdbfolder.__file__).parent
CORE = {
    "_version",
    "errors",
    "format",
    "encodings",
    "progress",
    "pagefile",
    "packfile",
    "packdir",
    "text",
    "remote",
}
TORCH = {"torch", "fused", "sampler", "gpu", "transport", "replay"}
TOP = {"", "__main__", "cli"}
TESTS = Path(__file__).parent


def layer_of(module: str) -> tuple[int, str]:
    """(layer number, side) of ``lmdbfolder.<module>``; side tells read from write."""
    rel = module[len("lmdbfolder") :].lstrip(".")
    head = rel.split(".")[0]
    if head in CORE:
        return 0, "core"
    if head in ("read", "write"):
        return 1, head
    if head == "tools":
        return 2, "tools"
    if head in TORCH:
        return 3, "torch"
    if head == "bench":
        return 4, "bench"
    if head in TOP:
        return 5, "top"
    raise AssertionError(f"{module} is in no layer: add it to tests/test_layers.py (and docs/design.md)")


def all_modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(("lmdbfolder", *parts))] = path
    return out


MODULES = all_modules()


def imports_of(path: Path) -> set[str]:
    """The lmdbfolder modules that the file imports (anywhere in it)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: use absolute imports"
            base = node.module or ""
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        else:
            continue
        for name in names:
            if name == "lmdbfolder" or name.startswith("lmdbfolder."):
                # ``import lmdbfolder.a.b`` depends on lmdbfolder.a.b (the package
                # __init__ files on the way hold no code that matters here).
                while name not in MODULES:
                    name = name.rsplit(".", 1)[0]
                found.add(name)
    return found


GRAPH = {name: imports_of(path) - {name} for name, path in MODULES.items()}


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_imports_point_down(module: str) -> None:
    level, side = layer_of(module)
    for target in sorted(GRAPH[module]):
        t_level, t_side = layer_of(target)
        assert t_level <= level, f"{module} (layer {level}) imports {target} (layer {t_level}): an upward import"
        if level == t_level == 1:
            assert side == t_side, f"{module} imports {target}: the read and write sides share only the core"


def test_no_import_cycles() -> None:
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(GRAPH[node]):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt) :] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for module in sorted(GRAPH):
        if module not in state:
            visit(module)


def test_the_checker_sees_lazy_and_from_imports(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text(
        "def f():\n    from lmdbfolder.write.writer import pack\n    import lmdbfolder.read.reader\n"
        "from lmdbfolder import packdir\n"
    )
    assert imports_of(source) == {"lmdbfolder.write.writer", "lmdbfolder.read.reader", "lmdbfolder.packdir"}


def test_no_test_module_imports_another() -> None:
    """Helpers shared by test files live in conftest.py: a test file that imports
    another inherits that file's imports (torch, say) and module-level setup,
    and renaming or splitting one test file breaks the other."""
    test_modules = {path.stem for path in TESTS.glob("test_*.py")}
    for path in sorted(TESTS.glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                assert top not in test_modules, (
                    f"{path.name} imports the test module {top}: move the helper to conftest.py"
                )


def test_an_old_flat_path_is_in_no_layer() -> None:
    # The re-exports of the old flat layout (lmdbfolder/reader.py beside
    # lmdbfolder/read/reader.py, ...) are gone; one coming back fails here.
    for old in ("lmdbfolder.reader", "lmdbfolder.writer", "lmdbfolder.decoders", "lmdbfolder.ray"):
        with pytest.raises(AssertionError, match="is in no layer"):
            layer_of(old)


def test_the_modules_of_samples_of_several_fields_have_their_layers() -> None:
    # Issue 35: the format of the fields is the core's, their reading and writing each side's,
    # their checks a tool's, the dataset the torch layer's (the only one importing torch).
    assert layer_of("lmdbfolder.format.fields") == (0, "core")
    assert layer_of("lmdbfolder.read.fields") == (1, "read")
    assert layer_of("lmdbfolder.write.fields") == layer_of("lmdbfolder.write.dataset_fields") == (1, "write")
    assert layer_of("lmdbfolder.tools.fields") == (2, "tools")
    assert layer_of("lmdbfolder.torch.fields") == (3, "torch")
    for module in ("lmdbfolder.format.fields", "lmdbfolder.read.fields", "lmdbfolder.write.fields"):
        assert module in GRAPH
