"""The import rules of DESIGN.md ("Packages") hold: pyproject.toml's import-linter contracts, checked.

Layers (demo over gateway | worker, over engine, over the independent policies | grammar | adapters |
kernels, over tokenization, over wire), a gateway that never loads torch, a worker that never imports
policies, no cycles inside a package, and production code that never imports the tests.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def lint_imports(config: Path) -> subprocess.CompletedProcess[str]:
    # `lint-imports` of the interpreter running the tests (the venv's), without its on-disk cache.
    return subprocess.run(
        [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
                               "sys.exit(lint_imports_command())", "--config", str(config), "--no-cache",
         "--no-logo"],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )


def test_every_import_contract_is_kept():
    result = lint_imports(REPO / "pyproject.toml")
    assert result.returncode == 0, result.stdout + result.stderr
    contracts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    assert len(re.findall(r"\bKEPT\b", result.stdout)) == len(contracts) >= 7, result.stdout


def test_a_broken_contract_fails_the_check(tmp_path):
    """Not vacuous: the same root packages, with a contract the code breaks (the worker does use the engine)."""
    session = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    roots = ", ".join(f'"{p}"' for p in session["root_packages"])
    config = tmp_path / "broken.toml"
    config.write_text(f"""
[tool.importlinter]
root_packages = [{roots}]
include_external_packages = true

[[tool.importlinter.contracts]]
name = "the worker without the engine"
type = "forbidden"
source_modules = ["worker"]
forbidden_modules = ["engine", "torch"]
""")
    result = lint_imports(config)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "BROKEN" in result.stdout and "worker.server -> engine" in result.stdout, result.stdout
