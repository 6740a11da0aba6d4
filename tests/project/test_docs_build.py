"""The Sphinx documentation builds without warnings, its examples pass as doctests, and every test
that docs/guarantees.rst names exists.

The two builds need the ``docs`` extra (Sphinx, furo, myst-parser) and are skipped without it.
"""

from __future__ import annotations

import ast
import importlib.util
import pathlib
import re
import subprocess
import sys

import pytest

from tests.helpers import ROOT

DOCS = ROOT / "docs"
TEST_REFERENCE = re.compile(r"``(tests/[\w/]+\.py)::(\w+)``")


def _defined_names(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):  # TestMachine = Machine.TestCase
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def test_every_test_named_on_the_guarantees_page_exists():
    references = TEST_REFERENCE.findall((DOCS / "guarantees.rst").read_text(encoding="utf-8"))
    assert len(references) > 20
    missing = []
    for file, name in sorted(set(references)):
        path = ROOT / file
        if not path.is_file() or name not in _defined_names(path):
            missing.append(f"{file}::{name}")
    assert missing == [], f"docs/guarantees.rst names tests that do not exist: {missing}"


def _needs_sphinx():
    for module in ("sphinx", "furo", "myst_parser"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"the docs build needs {module}: pip install -e '.[docs]'")


def _sphinx(builder: str, out: pathlib.Path) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", builder]
    command += ["-d", str(out / "doctrees"), str(DOCS), str(out / builder)]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_html_build_has_no_warnings(tmp_path):
    _needs_sphinx()
    result = _sphinx("html", tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


@pytest.mark.slow
def test_doctests_pass(tmp_path):
    _needs_sphinx()
    result = _sphinx("doctest", tmp_path)
    report = (tmp_path / "doctest" / "output.txt").read_text(encoding="utf-8")
    assert result.returncode == 0, report[-4000:] + result.stderr[-2000:]
    assert "0 failures in tests" in report
