#!/usr/bin/env bash
# Build the documentation site, serve it on localhost and take headless-browser screenshots of a
# few pages, to check by eye what `mkdocs build --strict` cannot: that math is typeset, tables
# and the API reference render, images load. Needs Chromium (Debian: apt-get install chromium).
#
#   bash scripts/screenshots.sh [OUT_DIR] [PAGE ...]
#
# OUT_DIR defaults to a new temporary directory ($SCREENSHOT_HEIGHT: a taller window, e.g. 12000); PAGEs are site paths (default: the home page,
# a tutorial, the exactness page, the API reference and the results page). Screenshots are for
# looking at, not for committing.
set -euo pipefail

cd "$(dirname "$0")/.."
out="${1:-$(mktemp -d)}"
shift || true
pages=("$@")
if [ ${#pages[@]} -eq 0 ]; then
    pages=("" "tutorials/first-generation/" "concepts/exactness/" "reference/decoder/"
           "reference/sources/" "results/")
fi
browser="$(command -v chromium || command -v chromium-browser || command -v google-chrome || true)"
if [ -z "$browser" ]; then
    echo "no Chromium found (Debian: apt-get install chromium)" >&2
    exit 1
fi

site="$(mktemp -d)"
profile="$(mktemp -d)"
bash scripts/build_docs.sh "$site" >/dev/null

port="${SCREENSHOT_PORT:-8765}"
python3 -m http.server "$port" --bind 127.0.0.1 --directory "$site" >/dev/null 2>&1 &
server=$!
trap 'kill "$server" 2>/dev/null || true; rm -rf "$site" "$profile"' EXIT
for _ in $(seq 50); do
    python3 - "$port" <<'EOF' && break
import sys, urllib.request
urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/", timeout=1)
EOF
    sleep 0.2
done

mkdir -p "$out"
for page in "${pages[@]}"; do
    name="$(echo "${page:-home}" | tr '/' '_' | sed 's/_$//')"
    # --virtual-time-budget lets the page's scripts (MathJax) finish before the shot is taken
    "$browser" --headless --no-sandbox --disable-gpu --disable-background-networking \
        --disable-component-update --disable-sync --no-first-run --hide-scrollbars \
        --user-data-dir="$profile" --virtual-time-budget=5000 --window-size=1280,"${SCREENSHOT_HEIGHT:-1600}" \
        --screenshot="$out/$name.png" "http://127.0.0.1:$port/$page" >/dev/null 2>&1
    echo "$out/$name.png"
done
