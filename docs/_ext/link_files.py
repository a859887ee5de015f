"""mkdocs hook: a repository file a page names in a code span becomes a link to that file.

``benchmarks/README.md`` in a page's prose (a code span holding a path that exists in the
repository, outside code blocks and not already a link) is rendered as a link to the file on
the repository's site (``repo_url`` in mkdocs.yml): a blob for a file, a tree for a directory.
Paths with a wildcard or a placeholder (``examples/*.py``, ``<out>/summary.json``) are left as
they are. Pages inside ``docs/`` keep their ordinary relative links.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent

_SPAN = re.compile(r"(\[)?`([A-Za-z0-9_][A-Za-z0-9_.\-/]*)`(\]\()?")
_FENCE = re.compile(r"^\s*(```|~~~)")
_TOP_LEVEL = {"README.md", "pyproject.toml", "mkdocs.yml"}


def _target(path: str) -> Path | None:
    if path.startswith("docs/") or ("/" not in path and path not in _TOP_LEVEL):
        return None
    candidate = ROOT / path.rstrip("/")
    try:
        candidate.resolve().relative_to(ROOT)
    except ValueError:
        return None
    return candidate if candidate.exists() else None


def link_files(markdown: str, repo_url: str) -> str:
    out, fence = [], None
    for line in markdown.split("\n"):
        m = _FENCE.match(line)
        if m:
            fence = None if fence == m.group(1) else (fence or m.group(1))
            out.append(line)
            continue
        if fence or line.lstrip().startswith("<!--"):
            out.append(line)
            continue

        def sub(span: re.Match) -> str:
            if span.group(1) or span.group(3):
                return span.group(0)
            target = _target(span.group(2))
            if target is None:
                return span.group(0)
            kind = "tree" if target.is_dir() else "blob"
            rel = target.relative_to(ROOT).as_posix()
            return f"[`{span.group(2)}`]({repo_url}/{kind}/main/{rel})"

        out.append(_SPAN.sub(sub, line))
    return "\n".join(out)


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ANN001 (mkdocs API)
    repo_url = (config.get("repo_url") or "").rstrip("/")
    return link_files(markdown, repo_url) if repo_url else markdown
