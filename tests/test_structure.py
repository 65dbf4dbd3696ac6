"""The package layout's rules, read from the source: imports between the kernels
and the serving package go one way, and the served models never import the
benchmark tooling."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FORMAT = "a3b_backend.quant.format"
# The one module of the serving package that runs the kernels.
KERNEL_USER = ROOT / "a3b_backend" / "vllm_a3b.py"


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def sources(*parts: str) -> list[Path]:
    return sorted((ROOT.joinpath(*parts)).rglob("*.py"))


def test_kernels_read_only_the_format_of_the_serving_package():
    for path in sources("kernels"):
        foreign = {m for m in imported_modules(path) if m.startswith("a3b_backend")
                   and not (m.startswith(FORMAT) or m in ("a3b_backend.quant", "a3b_backend.quant.format"))}
        assert not foreign, f"{path.relative_to(ROOT)} imports {sorted(foreign)}"


def test_only_the_vllm_method_imports_the_kernels():
    for path in sources("a3b_backend"):
        if path != KERNEL_USER:
            kernels = {m for m in imported_modules(path) if m.startswith("a3b_kernels")}
            assert not kernels, f"{path.relative_to(ROOT)} imports {sorted(kernels)}"


def test_no_top_level_kernels_package_is_imported():
    for path in sources("a3b_backend") + sources("kernels") + sources("tests") + sources("perf"):
        bare = {m for m in imported_modules(path) if m == "kernels" or m.startswith("kernels.")}
        assert not bare, f"{path.relative_to(ROOT)} imports {sorted(bare)}; the package is a3b_kernels"


def test_served_code_does_not_import_benchmark_tooling():
    served = [p for p in sources("a3b_backend") if "bench" not in p.relative_to(ROOT).parts]
    served += sources("model_repository")
    for path in served:
        tooling = {m for m in imported_modules(path) if m.startswith("a3b_backend.bench")}
        assert not tooling, f"{path.relative_to(ROOT)} imports {sorted(tooling)}"


def test_a3b_kernels_is_the_installed_kernels_folder():
    import a3b_kernels

    assert Path(a3b_kernels.__file__).resolve().parent == ROOT / "kernels"
