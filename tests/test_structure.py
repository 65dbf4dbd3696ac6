"""The package's layers, read from the source: which part may import which
(module-level and lazy imports alike), no import cycle at module level, and no
top-level module of a3b_backend/ outside the bottom layer."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from a3b_backend.profiles import PROJECT_ROOT

# The shared vocabulary: it imports nothing else of ours.
BOTTOM = ("a3b_backend.profiles", "a3b_backend.contract", "a3b_backend.quant.format", "a3b_backend.quant.checkpoint")
# Part of the tree (the longest matching prefix of a module's name) -> what it may import of ours,
# besides itself. bench/ and perf/ may import anything.
MAY_IMPORT: dict[str, tuple[str, ...]] = {
    **{module: () for module in BOTTOM},
    "a3b_backend.serving": BOTTOM,
    "a3b_backend.engine": BOTTOM,
    # the one module that runs the kernels
    "a3b_backend.engine.a3b_method": (*BOTTOM, "a3b_kernels"),
    "a3b_backend.quant": BOTTOM,
    "a3b_backend.prepare": BOTTOM,
    # the LoRA files it renders (a3b_backend/serving/lora.py, no torch)
    "a3b_backend.deploy": (*BOTTOM, "a3b_backend.serving.lora"),
    "a3b_backend.bench": ("a3b_backend",),
    "a3b_kernels": ("a3b_backend.quant.format",),
    "model_repository": (*BOTTOM, "a3b_backend.serving", "a3b_backend.engine"),
    "perf": ("a3b_backend", "a3b_kernels"),
}
OURS = ("a3b_backend", "a3b_kernels")


def module_name(path: Path) -> str:
    rel = path.relative_to(PROJECT_ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[0] == "kernels":
        parts[0] = "a3b_kernels"
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path, module_level_only: bool = False) -> set[str]:
    """Every name imported (module.name for `from module import name`); absolute imports only."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if module_level_only else ast.walk(tree)
    names = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def rule_for(module: str) -> str | None:
    matches = [prefix for prefix in MAY_IMPORT if within(module, prefix)]
    return max(matches, key=len) if matches else None


SOURCES = sorted(p for folder in ("a3b_backend", "kernels", "model_repository", "perf")
                 for p in (PROJECT_ROOT / folder).rglob("*.py"))
# The package's folders: every import of a submodule passes through their __init__, which imports nothing.
PACKAGES = {module_name(p) for p in (PROJECT_ROOT / "a3b_backend").rglob("__init__.py")}


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PROJECT_ROOT)))
def test_each_part_imports_only_the_layers_below_it(path: Path):
    module = module_name(path)
    if module in PACKAGES:
        assert not imports(path) - {"__future__", "__future__.annotations"}, \
            f"{path.relative_to(PROJECT_ROOT)} imports; a package's __init__ stays empty"
        return
    rule = rule_for(module)
    assert rule is not None, f"{module} belongs to no layer: add its part to MAY_IMPORT"
    allowed = (rule, *MAY_IMPORT[rule]) if rule not in BOTTOM else (rule,)
    ours = {name for name in imports(path) if any(within(name, root) for root in OURS)}
    foreign = sorted(name for name in ours - PACKAGES if not any(within(name, a) for a in allowed))
    assert not foreign, f"{path.relative_to(PROJECT_ROOT)} ({rule}) imports {foreign}; allowed: {allowed}"


def test_no_import_cycle_at_module_level():
    paths = {module_name(p): p for p in SOURCES if rule_for(module_name(p)) not in ("perf", "model_repository")}
    graph = {module: {name for name in imports(path, module_level_only=True) if name in paths and name != module}
             for module, path in paths.items()}
    done: set[str] = set()

    def visit(module: str, trail: list[str]) -> None:
        if module in trail:
            raise AssertionError("import cycle: " + " -> ".join(trail[trail.index(module):] + [module]))
        if module in done:
            return
        for imported in sorted(graph[module]):
            visit(imported, trail + [module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])


def test_only_the_bottom_layer_sits_at_the_top_of_the_package():
    top = {module_name(p) for p in (PROJECT_ROOT / "a3b_backend").glob("*.py")} - {"a3b_backend"}
    assert top <= set(BOTTOM), f"top-level modules outside the bottom layer: {sorted(top - set(BOTTOM))}"


def test_no_top_level_kernels_package_is_imported():
    for path in SOURCES + sorted((PROJECT_ROOT / "tests").rglob("*.py")):
        bare = {m for m in imports(path) if within(m, "kernels")}
        assert not bare, f"{path.relative_to(PROJECT_ROOT)} imports {sorted(bare)}; the package is a3b_kernels"


def test_a3b_kernels_is_the_installed_kernels_folder():
    import a3b_kernels

    assert Path(a3b_kernels.__file__).resolve().parent == PROJECT_ROOT / "kernels"
