"""Sphinx configuration of the renate_events documentation.

Build (warnings are errors) and run every example as a doctest::

    python -m sphinx -W --keep-going -b html docs docs/_build/html
    python -m sphinx -W -b doctest docs docs/_build/doctest
"""

from __future__ import annotations

import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "_ext"))  # the project's own small directives
sys.path.insert(0, str(HERE.parent))  # the packages, also without an editable install

import renate_events  # noqa: E402

project = "renate_events"
author = "the renate_events authors"
copyright = "the renate_events authors"
release = renate_events.__version__
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.doctest",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
    "myst_parser",  # only for the included benchmark result files (docs/benchmarks/*.md)
    "renate_docs",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
# The benchmark result files are included into benchmarks.rst, not pages of their own.
exclude_patterns = ["_build", "benchmarks/*.md", "Thumbs.db", ".DS_Store"]
templates_path: list[str] = []

# -- HTML -----------------------------------------------------------------------------------------

html_theme = "furo"
html_title = f"renate_events {release}"
html_static_path: list[str] = []
pygments_style = "sphinx"
pygments_dark_style = "monokai"

# -- autodoc / napoleon ---------------------------------------------------------------------------

autodoc_default_options = {
    "members": True,
    "member-order": "bysource",
    "show-inheritance": True,
}
autodoc_typehints = "description"  # types go next to each argument, not into the signature
autodoc_typehints_description_target = "documented"
autodoc_typehints_format = "short"
autodoc_class_signature = "mixed"
autodoc_member_order = "bysource"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True  # "Attributes:" as a field list, not duplicate attribute entries
napoleon_use_rtype = False

# -- doctest --------------------------------------------------------------------------------------

# Every ``>>>`` block, docstrings included, runs in `-b doctest`. Each page sets up its own
# namespace in a ``testsetup`` block; this only keeps the runs small and repeatable.
doctest_global_setup = """
import torch
torch.set_num_threads(1)
torch.manual_seed(0)
"""

# -- MyST (only the benchmark files) --------------------------------------------------------------

myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3
