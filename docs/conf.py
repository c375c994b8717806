# Sphinx configuration of fusetrain's documentation: Markdown pages through
# MyST, the furo theme, the Python reference from docstrings (autodoc), and
# the config and C++ references generated from the code (_ext/fusetrain_docs.py).
# Build: `make docs` (sphinx-build -W --keep-going docs build/docs/html).
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "_ext"))

import fusetrain  # the installed package: autodoc documents it, and it gives the version

project = "fusetrain"
release = version = fusetrain.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "fusetrain_docs",
]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "README.md"]

myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 4

html_theme = "furo"
html_title = "fusetrain"

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": True}
# The package is imported as installed (make build leaves it importable from
# .venv); nothing is mocked, so a reference that does not import fails the build.
