"""Sphinx configuration of the fsdp-guide site (built with ``-nW --keep-going``).

Build locally, from the repository root::

    PYTHONPATH=$PWD python -m sphinx -nW --keep-going -b html docs docs/_build/html

Pages that follow the repository are written at build time: the API reference by
autosummary (from each façade's ``__all__``), the command line reference by sphinx-argparse,
the CLI examples' output by sphinxcontrib-programoutput, and what lives outside ``docs/``
(lesson copies, benchmark tables) or needs the planner (the "will it fit" table) by
``docs/_ext/fsdp_docs.py``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the docs build on 3.11
    import tomli as tomllib

DOCS_DIR = Path(__file__).resolve().parent
# The package is imported from the checkout, installed or not.
sys.path.insert(0, str(DOCS_DIR.parent))
sys.path.insert(0, str(DOCS_DIR / "_ext"))

from fsdp_links import api_context  # noqa: E402

import fsdp_guide  # noqa: E402

PROJECT_URLS = tomllib.loads((DOCS_DIR.parent / "pyproject.toml").read_text())["project"]["urls"]

project = "fsdp-guide"
author = "fsdp-guide developers"
copyright = "fsdp-guide developers"
release = fsdp_guide.__version__
version = release

extensions = [
    "fsdp_strict",  # docs/_ext: a Python warning during the build fails it (-W), first
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.intersphinx",
    "sphinx.ext.viewcode",
    "sphinx_copybutton",
    "sphinxarg.ext",  # sphinx-argparse: the command line reference
    "sphinxcontrib.programoutput",  # the CLI page's examples, run while the site builds
    "fsdp_docs",  # docs/_ext: lessons and benchmark results copied in from the repository
    "fsdp_links",  # docs/_ext: lesson <-> API links, found in the lessons' imports
    "fsdp_refs",  # docs/_ext: references resolved through Python's own name lookup
]
templates_path = ["_templates"]

exclude_patterns = [
    "_build",
    "_generated",  # only reached through {include}
    "**.ipynb_checkpoints",
    "Thumbs.db",
    ".DS_Store",
]

# -- Notebooks (myst-nb) ------------------------------------------------------------------
# Lessons are rendered with the outputs committed in notebooks/; the site never runs them,
# so it needs neither a GPU nor minutes of CPU.
nb_execution_mode = "off"
nb_merge_streams = True
# Markdown outputs (the measured-vs-ZeRO tables of the lessons) are parsed as MyST, which has
# tables; myst-nb's default, CommonMark, has none and shows the raw "| a | b |" text.
nb_render_markdown_format = "myst"
myst_enable_extensions = ["colon_fence", "deflist", "dollarmath"]
myst_heading_anchors = 3

# -- Command output (sphinxcontrib-programoutput) -------------------------------------------
# ``python`` in a {command-output} is the interpreter building the site, venv or not.
os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])
programoutput_prompt_template = "$ {command}\n{output}"

# -- API reference (autosummary, autodoc, napoleon) ------------------------------------------
# docs/api/index.rst lists the modules; autosummary writes one page per module with
# _templates/autosummary/facade.rst, which documents the names of the module's __all__.
autosummary_generate = True
autosummary_ignore_module_all = False
autosummary_context = api_context()
autodoc_member_order = "bysource"
# Types live in annotations; autodoc shows them next to each documented argument and as the
# return type (what sphinx-autodoc-typehints did, whose Sphinx 9 port warned 92 times).
autodoc_typehints = "description"
autodoc_typehints_description_target = "all"
autodoc_typehints_format = "short"
autodoc_class_signature = "separated"
# A long signature lists one parameter per line: it fits a phone, and reads better anywhere.
python_maximum_signature_line_length = 60
# Methods inherit no docstring from torch or Lightning base classes: theirs cross-reference
# names in those projects' own documentation that our site cannot resolve.
autodoc_inherit_docstrings = False
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_use_ivar = True  # "Attributes:" as a field list; dataclass fields are documented once

# -- Cross-references ---------------------------------------------------------------------
# ``-n`` (nitpicky) makes every unresolved reference a warning and ``-W`` an error. We keep
# that strict for our own names: a reference to ``fsdp_guide.*`` must resolve.
#
# Third-party targets are linked through intersphinx where an inventory is reachable:
# Read the Docs has internet, CI and this machine do not. An unreachable inventory is
# itself a warning (so an error under -W), hence remote inventories are switched on only
# on Read the Docs (READTHEDOCS=True) or when FSDP_GUIDE_DOCS_ONLINE=1 is set locally.
# Offline, references to other packages stay plain text instead of failing the build.
#
# Even online, some third-party names cannot resolve: type hints name the class where
# it is defined (``torch.nn.modules.module.Module``), while the torch inventory lists its
# public alias (``torch.nn.Module``). So references whose target is not ours are never
# nitpicked, online or offline; those an inventory knows still become links.
ONLINE = os.environ.get("READTHEDOCS") == "True" or os.environ.get("FSDP_GUIDE_DOCS_ONLINE") == "1"
intersphinx_mapping = (
    {
        "python": ("https://docs.python.org/3", None),
        "torch": ("https://docs.pytorch.org/docs/stable", None),
        "lightning": ("https://lightning.ai/docs/pytorch/stable", None),
        "numpy": ("https://numpy.org/doc/stable", None),
    }
    if ONLINE
    else {}
)
intersphinx_timeout = 30
nitpicky = True
_NOT_OURS = r"(?!fsdp_guide\b)[A-Za-z_][\w]*\..*"
# Unqualified third-party names (``linecache``, ``Ellipsis``, ``Tensor``) are told apart from
# our own by docs/_ext/fsdp_refs.py (``warn-missing-reference``), which a regex cannot do.
# Lightning's Accelerator is imported for type checking only: no object to link to offline.
nitpick_ignore = [("py:class", "Accelerator")]
nitpick_ignore_regex = [
    (r"py:.*", _NOT_OURS),
    # Private names (``_COMMANDS``) are deliberately not in the API reference, nor is what
    # only a private module defines: a type hint naming ``fsdp_guide.comm._stats.CommStats``
    # links to the public entry when there is one (docs/_ext/fsdp_refs.py) and else stays
    # text. A public path (``fsdp_guide.comm.CommStats``) must still resolve.
    (r"py:.*", r"(.*\.)?_[A-Za-z]\w*(\..*)?"),
]
# A benchmark result written by another script may skip a heading level (# then ###);
# that is its author's style, not a broken page.
suppress_warnings = ["myst.header"]

# -- HTML ---------------------------------------------------------------------------------
# "[source]" links. Following imports would send data such as ``__version__`` (a str) to a
# page for ``builtins`` that viewcode lists but never writes; nothing here is re-exported
# under another name in the API pages, so there is nothing to follow.
viewcode_follow_imported_members = False

html_theme = "sphinx_book_theme"
html_title = "fsdp-guide"
html_static_path = ["_static"]
html_css_files = ["custom.css"]
html_js_files = ["custom.js"]
html_theme_options = {
    # Every page that offers a download also links the repository, where the notebooks,
    # the package and the install instructions (install.md) live.
    "repository_url": PROJECT_URLS["Repository"],
    "repository_branch": "main",
    "use_repository_button": True,
    "use_download_button": True,  # notebooks download as .ipynb from every lesson page
    "use_fullscreen_button": True,
    "show_toc_level": 2,
    "home_page_in_toc": True,
    "navigation_with_keys": False,
}
html_last_updated_fmt = ""
copybutton_prompt_text = r">>> |\.\.\. |\$ "
copybutton_prompt_is_regexp = True
