#!/usr/bin/env bash
# Build the documentation site with every check on: mkdocs --strict fails on a broken link, a
# missing page, an API object the reference names that no longer exists, or a docstring
# mkdocstrings cannot render.
#
#   bash scripts/build_docs.sh [SITE_DIR]      # default: site/ (git-ignored)
#
# Installs the packages of the `docs` extra first when mkdocs or mkdocstrings is missing: those
# packages only, not specdraft itself, so the build needs no torch (mkdocstrings' griffe reads the
# API from the source, it imports nothing). The built site needs no network (MathJax is vendored
# under docs/javascripts/vendor/).
set -euo pipefail

cd "$(dirname "$0")/.."
site="${1:-site}"
python="${PYTHON:-python3}"

if ! "$python" -c "import mkdocs, material, mkdocstrings, mkdocstrings_handlers.python" 2>/dev/null; then
    # the `docs` extra's requirements, read from pyproject.toml (no tomllib before Python 3.11)
    mapfile -t reqs < <("$python" - <<'PY'
import re
text = open("pyproject.toml", encoding="utf-8").read()
extra = re.search(r'^docs\s*=\s*\[(.*?)\]\s*$', text, re.M | re.S).group(1)
print("\n".join(re.findall(r'"([^"]+)"', extra)))
PY
)
    "$python" -m pip install --quiet "${reqs[@]}"
fi
# mkdocs-material prints an advertisement on every build; it is not a warning about this site
NO_MKDOCS_2_WARNING=1 "$python" -m mkdocs build --strict --clean -d "$site"
