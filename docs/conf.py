"""Sphinx configuration for the d3p documentation.

Build from the repository root with warnings as errors, as CI does
(``tests/test_docs.py``)::

    python -m sphinx -W --keep-going -b html docs docs/_build/html
"""

import os
import sys

# Document the d3p of this checkout, not an installed copy.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from d3p.version import VERSION  # noqa: E402

project = "d3p"
author = "The d3p authors"
copyright = "2026, The d3p authors"
release = VERSION

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
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
# Show default values as written in the source (``rng_suite=d3p.random``), not
# as their repr, which for a module names the file it was loaded from.
autodoc_preserve_defaults = True
# A signature longer than this gets one parameter per line (narrow screens).
python_maximum_signature_line_length = 60
# The API index lists the modules with their summaries; their pages are written
# by hand (docs/api/), so nothing is generated.
autosummary_generate = False
nitpicky = False
# The example and benchmark READMEs are included as pages but are written for
# reading in the repository, where they may link to scripts and data files
# next to them. Those files are not pages of this site, so such links cannot
# resolve here; links to documents and anchors are still checked.
nitpick_ignore_regex = [("myst", r"[\w./-]+\.(py|csv|json|toml|cfg|txt)(#.*)?")]
plot_include_source = False
plot_html_show_source_link = False
plot_html_show_formats = False
plot_formats = [("png", 100)]
html_theme = "furo"
html_title = f"d3p {VERSION}"
html_static_path = ["_static"]
html_css_files = ["d3p.css"]
