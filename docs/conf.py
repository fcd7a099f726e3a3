"""Sphinx configuration for the d3p documentation."""

import os
import sys

sys.path.insert(0, os.path.abspath(".."))

from d3p.version import VERSION  # noqa: E402

project = "d3p"
author = "The d3p authors"
copyright = "2026, The d3p authors"
release = VERSION

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.doctest",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
    "myst_parser",
    "matplotlib.sphinxext.plot_directive",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build"]
myst_heading_anchors = 3
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": False}
nitpicky = False
suppress_warnings = ["myst.xref_missing"]
plot_include_source = False
plot_html_show_source_link = False
plot_html_show_formats = False
plot_formats = [("png", 100)]
html_theme = "alabaster"
html_title = f"d3p {VERSION}"
