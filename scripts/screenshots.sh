#!/usr/bin/env bash
# Build the documentation site, serve it on localhost and take a headless-browser screenshot of
# every page, to check by eye what `mkdocs build --strict` cannot: that math is typeset, tables
# fit, the API reference renders, images load and are legible, code is not cut at the edge.
# Needs Chromium (Debian: apt-get install chromium), Pillow and numpy (matplotlib's dependencies).
#
#   bash scripts/screenshots.sh [OUT_DIR] [PAGE ...]
#
# OUT_DIR defaults to a new temporary directory. PAGEs are site paths (`results/`,
# `tutorials/first-generation/`, `` for the home page); without any, every page of the built
# site is shot. Each shot is $SCREENSHOT_WIDTH (1280) pixels wide and the page's full length:
# taken $SCREENSHOT_HEIGHT (40000) pixels tall, then its blank bands collapsed.
# Screenshots are for looking at, not for committing.
set -euo pipefail

cd "$(dirname "$0")/.."
out="${1:-$(mktemp -d)}"
shift || true
pages=("$@")
browser="$(command -v chromium || command -v chromium-browser || command -v google-chrome || true)"
if [ -z "$browser" ]; then
    echo "no Chromium found (Debian: apt-get install chromium)" >&2
    exit 1
fi

site="$(mktemp -d)"
profile="$(mktemp -d)"
bash scripts/build_docs.sh "$site" >/dev/null
if [ ${#pages[@]} -eq 0 ]; then
    # every page of the built site: each directory holding an index.html (404.html is no page)
    while IFS= read -r html; do
        rel="${html#"$site"/}"
        pages+=("${rel%index.html}")
    done < <(find "$site" -name index.html -not -path "$site/assets/*" | sort)
fi

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
width="${SCREENSHOT_WIDTH:-1280}"
height="${SCREENSHOT_HEIGHT:-40000}"
for page in "${pages[@]}"; do
    name="$(echo "${page:-home}" | tr '/' '_' | sed 's/_$//')"
    # --virtual-time-budget lets the page's scripts (MathJax) finish before the shot is taken
    "$browser" --headless --no-sandbox --disable-gpu --disable-background-networking \
        --disable-component-update --disable-sync --no-first-run --hide-scrollbars \
        --user-data-dir="$profile" --virtual-time-budget=5000 --window-size="$width,$height" \
        --screenshot="$out/$name.png" "http://127.0.0.1:$port/$page" >/dev/null 2>&1
    # the window is taller than most pages and the footer sits at its bottom: collapse every
    # blank band taller than 200 rows to 40 rows, so the shot is the page and its footer
    python3 - "$out/$name.png" <<'EOF'
import sys

import numpy as np
from PIL import Image

path = sys.argv[1]
img = np.asarray(Image.open(path).convert("RGB"))
blank = (img == img[:, :1, :]).all(axis=(1, 2))  # rows of one colour
keep, run = np.ones(len(blank), bool), 0
for y, b in enumerate(np.append(blank, False)):
    if b:
        run += 1
        continue
    if run > 200:
        keep[y - run + 40:y] = False
    run = 0
Image.fromarray(img[keep]).save(path, optimize=True)
EOF
    echo "$out/$name.png"
done
