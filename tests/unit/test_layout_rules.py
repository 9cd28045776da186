"""The package layout (docs/architecture.md, "The floors of common/" and "Where each kind
of change goes"), read from the source (an AST scan of every import):
`common` imports neither service, `coordinator` imports nothing from `site_agent` (nor
`site_agent` from `coordinator`), and only `demo`, `bench` and the tests import both.
`common` and `coordinator` stay torch-free at import: only what builds or flattens a
network (`common.models.build`, `common.models.layout`, the network modules) imports
torch. The model registry's names are its network modules' file names."""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

from common.core.errors import ConfigError
from common.models import kind_of, model_names

REPO = Path(__file__).resolve().parents[2]
PRODUCT = ("common", "coordinator", "site_agent", "demo", "bench")
FORBIDDEN = {
    "common": {"coordinator", "site_agent", "demo", "bench"},
    "coordinator": {"site_agent", "demo", "bench"},
    "site_agent": {"coordinator", "demo", "bench"},
    "demo": {"bench"},
    "bench": set(),
}
TORCH_MODULES = ("common.models.build", "common.models.layout", "common.models.probe",
                 "common.models.tables.",
                 "common.models.images.")


def _imported(path: Path) -> set[str]:
    """The top-level packages a module imports (module level or inside functions)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def _sources(package: str) -> list[Path]:
    return sorted(p for p in (REPO / package).rglob("*.py") if "proto" not in p.parts)


@pytest.mark.parametrize("package", PRODUCT)
def test_packages_import_only_what_the_layout_allows(package: str) -> None:
    sources = _sources(package)
    assert sources, f"no sources under {package}/"
    broken = {
        str(path.relative_to(REPO)): sorted(_imported(path) & FORBIDDEN[package])
        for path in sources if _imported(path) & FORBIDDEN[package]
    }
    assert not broken, f"{package}/ may not import {sorted(FORBIDDEN[package])}: {broken}"


def test_the_scan_sees_function_level_imports(tmp_path: Path) -> None:
    """The rule also covers lazy imports (the way the demo used to reach site_agent)."""
    module = tmp_path / "lazy.py"
    module.write_text("def f():\n    from site_agent.models import x\n    import coordinator\n")
    assert _imported(module) == {"site_agent", "coordinator"}


def test_both_services_are_imported_together_only_beside_them() -> None:
    both = {
        str(path.relative_to(REPO)).split("/")[0]
        for package in PRODUCT for path in _sources(package)
        if {"coordinator", "site_agent"} <= _imported(path) | {package}
    }
    assert both <= {"demo", "bench"}, both


def test_common_and_the_coordinator_are_torch_free_at_import() -> None:
    modules = [
        info.name
        for package in ("common", "coordinator")
        for info in pkgutil.walk_packages([str(REPO / package)], f"{package}.")
        if not info.name.startswith("common.proto")
        and not info.name.startswith(TORCH_MODULES)
    ]
    assert "coordinator.study_run" in modules and "common.study" in modules
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "    if 'torch' in sys.modules:\n"
        "        raise SystemExit(f'importing {name} imported torch')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                            text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_network_is_one_module_named_as_the_study_names_it() -> None:
    """A new network is one file in common/models/tables/ or images/: the registry, the
    study schema, the demo's --model and the bundle rebuild all read it from there."""
    for kind, folder in (("table", "tables"), ("images", "images")):
        files = sorted(
            p.stem.replace("_", "-") for p in (REPO / "common/models" / folder).glob("*.py")
            if not p.stem.startswith("_")
        )
        assert list(model_names(kind)) == files
        for name in files:
            assert kind_of(name) == kind
            if "-" in name:  # one name per network: the module's spelling is not another
                with pytest.raises(ConfigError, match="unknown model"):
                    kind_of(name.replace("-", "_"))


# ----------------------------------------------------------------- common/ in layers

COMMON_LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("core", ("common.core", "common.crypto")),
    ("protocol", ("common.protocol", "common.proto")),
    ("privacy", ("common.privacy",)),
    ("study", ("common.study", "common.models")),
    ("releases", ("common.releases",)),
    ("rounds", ("common.rounds",)),
    ("commands", ("common.commands",)),
)
"""common/'s floors, ground first (docs/architecture.md, "The floors of common/"): a
module imports only modules of its own floor or below, at module level, inside functions
or for type checking alike."""


def _module_name(path: Path, root: Path = REPO) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _floor(module: str) -> int | None:
    for index, (_, prefixes) in enumerate(COMMON_LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return index
    return None


def _imports_of(path: Path, known: set[str]) -> set[str]:
    """The product modules `path` imports, wherever the import stands (a `from P import
    name` counts as P.name where that is a module, else as P)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
        for name in names:
            parts = name.split(".")
            while parts and ".".join(parts) not in known:
                parts.pop()
            if parts:
                found.add(".".join(parts))
    return found


def _product_graph(root: Path = REPO,
                   packages: tuple[str, ...] = PRODUCT) -> dict[str, set[str]]:
    paths = {_module_name(p, root): p for package in packages
             for p in sorted((root / package).rglob("*.py")) if "proto" not in p.parts}
    known = set(paths)
    return {name: _imports_of(path, known) - {name} for name, path in paths.items()}


def test_common_modules_each_stand_on_a_named_floor() -> None:
    graph = _product_graph()
    unplaced = sorted(m for m in graph if m.startswith("common.") and _floor(m) is None)
    assert not unplaced, f"common/ modules on no floor of COMMON_LAYERS: {unplaced}"


def test_common_imports_only_its_own_floor_or_below() -> None:
    upward = []
    for module, imported in sorted(_product_graph().items()):
        floor = _floor(module)
        if floor is None:
            continue
        for target in sorted(imported):
            target_floor = _floor(target)
            if target_floor is not None and target_floor > floor:
                upward.append(f"{module} ({COMMON_LAYERS[floor][0]}) -> {target} "
                              f"({COMMON_LAYERS[target_floor][0]})")
    assert not upward, "imports up common/'s floors:\n" + "\n".join(upward)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work: list[tuple[str, list[str]]] = [(start, sorted(graph[start]))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, pending = work[-1]
            if pending:
                nxt = pending.pop()
                if nxt not in graph:
                    continue
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, sorted(graph[nxt])))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_circle_anywhere_in_the_product() -> None:
    cycles = _cycles(_product_graph())
    assert not cycles, f"import circles: {cycles}"


def test_the_layer_scan_sees_lazy_and_type_checking_imports(tmp_path: Path) -> None:
    """An import inside a function or under TYPE_CHECKING is an arrow too, and a circle
    of three is found."""
    pkg = tmp_path / "common"
    (pkg / "core").mkdir(parents=True)
    (pkg / "releases").mkdir()
    for folder in (pkg, pkg / "core", pkg / "releases"):
        (folder / "__init__.py").write_text("")
    (pkg / "core" / "low.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from common.releases import high\n")
    (pkg / "releases" / "high.py").write_text("def f():\n    from common.core import low\n")
    graph = _product_graph(tmp_path, ("common",))
    assert graph["common.core.low"] == {"common.releases.high"}
    assert graph["common.releases.high"] == {"common.core.low"}
    assert _cycles(graph) == [["common.core.low", "common.releases.high"]]


MAX_CLASS_LINES = 400
MAX_MODULE_LINES = 800
SIZED = ("common", "coordinator", "site_agent", "demo")
# Modules over the limit while they are being split; each must still be over it (a
# module brought under the limit leaves this list). None today.
LONG_MODULES: dict[str, int] = {}


def _sizes(root: Path = REPO, packages: tuple[str, ...] = SIZED) -> tuple[
    dict[str, int], dict[str, int]
]:
    """(module -> lines, module:Class -> lines) of every module of `packages`."""
    modules: dict[str, int] = {}
    classes: dict[str, int] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            if "proto" in path.parts:
                continue
            text = path.read_text(encoding="utf-8")
            name = str(path.relative_to(root))
            modules[name] = len(text.splitlines())
            for node in ast.walk(ast.parse(text, filename=name)):
                if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                    classes[f"{name}:{node.name}"] = node.end_lineno - node.lineno + 1
    return modules, classes


def test_no_product_class_or_module_outgrows_its_limit() -> None:
    """A class over 400 lines, or a module over 800, holds several concerns: split it
    by concern (as the round engine and the site agent were)."""
    modules, classes = _sizes()
    assert "site_agent/trainer.py:LocalTrainer" in classes
    big_classes = {name: n for name, n in classes.items() if n > MAX_CLASS_LINES}
    assert not big_classes, f"classes over {MAX_CLASS_LINES} lines: {big_classes}"
    big_modules = {name: n for name, n in modules.items()
                   if n > MAX_MODULE_LINES and name not in LONG_MODULES}
    assert not big_modules, f"modules over {MAX_MODULE_LINES} lines: {big_modules}"
    split = sorted(name for name in LONG_MODULES if modules.get(name, 0) <= MAX_MODULE_LINES)
    assert not split, f"now within {MAX_MODULE_LINES} lines: remove {split} from LONG_MODULES"


def test_the_size_scan_sees_a_long_class_and_module(tmp_path: Path) -> None:
    """The scan measures a class from its line to its end, methods included."""
    body = "".join(f"    def f{i}(self):\n        return {i}\n" for i in range(200))
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(f"import x\n\n\nclass A:\n{body}")
    modules, classes = _sizes(tmp_path, ("pkg",))
    assert classes == {"pkg/m.py:A": 401}
    assert modules == {"pkg/m.py": 404}
