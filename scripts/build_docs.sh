#!/usr/bin/env bash
# Build the documentation site with every check on: mkdocs --strict fails on a broken link, a
# missing page, an API object the reference names that no longer exists, or a docstring
# mkdocstrings cannot render.
#
#   bash scripts/build_docs.sh [SITE_DIR]      # default: site/ (git-ignored)
#
# Installs the `docs` extra first when mkdocs or mkdocstrings is missing. The built site needs no
# network (MathJax is vendored under docs/javascripts/vendor/).
set -euo pipefail

cd "$(dirname "$0")/.."
site="${1:-site}"
python="${PYTHON:-python3}"

if ! "$python" -c "import mkdocs, material, mkdocstrings, mkdocstrings_handlers.python" 2>/dev/null; then
    "$python" -m pip install --quiet -e ".[docs]"
fi
# mkdocs-material prints an advertisement on every build; it is not a warning about this site
NO_MKDOCS_2_WARNING=1 "$python" -m mkdocs build --strict --clean -d "$site"
