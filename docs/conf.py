"""Sphinx configuration: the user guides (Markdown, through MyST) and the API reference
(autodoc of the public modules).  Built by tests/test_docs.py with warnings as errors:
``python -m sphinx -W -b html docs build/docs``."""

import os
import sys

sys.path.insert(0, os.path.abspath(".."))

project = "shmtensor"
author = "the shmtensor authors"
extensions = ["sphinx.ext.autodoc", "myst_parser"]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "benchmarks.md", "architecture.md", "channel-design.md"]
autodoc_default_options = {"members": True, "undoc-members": False, "show-inheritance": True}
autodoc_typehints = "description"
autodoc_mock_imports = ["cupy", "ray", "torch"]
myst_heading_anchors = 3
nitpicky = False
html_theme = "alabaster"
