"""The package's layering: the import-linter contracts in pyproject.toml hold."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent


def test_import_contracts_are_kept():
    lint_imports = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")
    result = subprocess.run([lint_imports, "--config", str(ROOT / "pyproject.toml")], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout


def test_no_function_level_imports_of_the_package_below_the_front_doors():
    """Imports inside functions would hide a cycle from the contract; only the command line
    (the ``fastdraft.cli`` package), which keeps its start-up light, imports lazily."""
    offenders = []
    for path in sorted((ROOT / "fastdraft").rglob("*.py")):
        if path.relative_to(ROOT / "fastdraft").parts[0] == "cli":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if line.startswith((" ", "\t")) and line.lstrip().startswith(("from fastdraft", "import fastdraft")):
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_no_two_modules_or_public_classes_or_functions_share_a_name():
    """A name says one thing: ``metrics.py``, ``RequestOutput`` or ``build_app()`` in two places
    make a reader (and an import) guess which is meant."""
    modules, classes, functions = defaultdict(list), defaultdict(list), defaultdict(list)
    for path in sorted((ROOT / "fastdraft").rglob("*.py")):
        where = str(path.relative_to(ROOT))
        if path.name != "__init__.py":
            modules[path.stem].append(where)
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                classes[node.name].append(where)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
                functions[node.name].append(where)
    assert not {name: paths for name, paths in modules.items() if len(paths) > 1}
    assert not {name: paths for name, paths in classes.items() if len(paths) > 1}
    assert not {name: paths for name, paths in functions.items() if len(paths) > 1}
