"""A griffe extension: render specdraft's reST-flavoured docstrings as Markdown for mkdocstrings.

specdraft's docstrings are written for people reading the source (and ``help()``), in a light
reST dialect: Sphinx roles (``:class:`~specdraft.tree.TokenTree```), double-backtick code,
definition lists (a line holding only ````name```` followed by an indented description),
``::`` literal blocks, ``>>>`` examples and the odd simple table. mkdocstrings renders
docstrings as Markdown, where an indented description becomes a code block, ``>>>`` a nested
quote and a role its raw text. Rather than rewrite every docstring for the site, this extension
translates those few constructs when the site is built:

* a role becomes a cross-reference to the object it names, resolved from the docstring's own
  scope (imports included) like Sphinx would; it is emitted *optional*, so a target that the
  reference does not document renders as plain code instead of failing the strict build;
* a definition list becomes a Markdown definition list (``def_list`` is enabled in mkdocs.yml);
* ``::`` blocks, ``>>>`` examples and simple tables become fenced code blocks.

* an underlined heading (numpy's ``Parameters`` over ``----------``) becomes a bold line, and
  the ``name:`` entries under it a definition list.

griffe's own section parsing is off (``docstring_style: null`` in mkdocs.yml): the prose is
not in Google or numpy sections, and a numpy section would swallow every paragraph after it.
"""

from __future__ import annotations

import html
import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:class|func|meth|attr|data|mod|exc|obj):`(~?)([^`<>]+?)`")
_DEF_TERM = re.compile(r"^(\s*)(``[^`]+``(?:\s*,\s*``[^`]+``)*)\s*$")
_TABLE_RULE = re.compile(r"^\s*=+(\s+=+)+\s*$")
_UNDERLINE = re.compile(r"^\s*(-{3,}|={3,}|~{3,})\s*$")
_FIELD = re.compile(r"^(\s*)([A-Za-z_]\w*(?:\s*,\s*[A-Za-z_]\w*)*)\s*(?::\s*(.*?))?\s*$")


def _lookup(obj: Any, first: str) -> str | None:
    """The full path of ``first`` as seen from ``obj``'s scope (members and imports), or None."""
    scope = obj
    while scope is not None:
        if getattr(scope, "name", None) == first and not scope.is_module:
            return scope.path
        members = getattr(scope, "members", {}) or {}
        if first in members:
            member = members[first]
            return member.target_path if member.is_alias else member.path
        scope = scope.parent
    return None


def _resolve(obj: Any, name: str) -> str | None:
    if name.startswith("specdraft"):
        return name
    first, _, rest = name.partition(".")
    base = _lookup(obj, first)
    if base is None:
        return None
    return f"{base}.{rest}" if rest else base


def _roles(obj: Any, text: str) -> str:
    def repl(match: re.Match[str]) -> str:
        tilde, name = match.group(1), match.group(2).strip()
        title = name.rsplit(".", 1)[-1] if tilde else name
        target = _resolve(obj, name)
        code = f"<code>{html.escape(title)}</code>"
        if target is None or not target.startswith("specdraft"):
            return code
        return f'<autoref identifier="{html.escape(target)}" optional>{code}</autoref>'

    return _ROLE.sub(repl, text)


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


_LIST_ITEM = re.compile(r"^\s*(?:[*+-]|\d+[.)]|>>>|\.\.)\s")


def _term(line: str, previous: str, in_section: bool) -> str | None:
    """The Markdown term of a reST definition-list term line, or None if ``line`` is not one."""
    text = line.strip()
    follows = (not previous.strip() or _UNDERLINE.match(previous) is not None
               or _indent(previous) > _indent(line))  # a blank line, a heading, or the last entry
    if not text or not follows or _LIST_ITEM.match(line) or text.endswith(("::", ".", ",", ";")):
        return None
    if _DEF_TERM.match(line):
        return text.replace("``", "`")
    if in_section and (field := _FIELD.match(line)):
        kind = f" ({field.group(3)})" if field.group(3) else ""
        return ", ".join(f"`{n.strip()}`" for n in field.group(2).split(",")) + kind
    if len(text) <= 60 and not text.endswith(":"):
        return f"**{text}**"
    return None


def _blocks(text: str) -> str:
    """Definition lists, ``::`` blocks, ``>>>`` examples and simple tables, as Markdown."""
    lines = text.split("\n")
    out: list[str] = []
    in_section = False
    i = 0
    while i < len(lines):
        line = lines[i]
        # ">>>" examples (with their "..." continuations and output lines up to a blank line)
        if line.lstrip().startswith(">>>"):
            pad = " " * _indent(line)
            out += ["", pad + "```pycon"]
            while i < len(lines) and lines[i].strip():
                out.append(lines[i])
                i += 1
            out += [pad + "```", ""]
            continue
        # simple tables: from one rule line to the third (or to a blank line after the second)
        if _TABLE_RULE.match(line):
            pad = " " * _indent(line)
            out += ["", pad + "```text"]
            rules = 0
            while i < len(lines) and (lines[i].strip() or rules < 2):
                rules += bool(_TABLE_RULE.match(lines[i]))
                out.append(lines[i])
                i += 1
                if rules == 3:
                    break
            out += [pad + "```", ""]
            continue
        # "text::" then an indented literal block
        if line.rstrip().endswith("::") and not line.strip().startswith(".."):
            base = _indent(line)
            out.append(line.rstrip()[:-1])  # "Hence::" -> "Hence:"
            i += 1
            block: list[str] = []
            while i < len(lines) and (not lines[i].strip() or _indent(lines[i]) > base):
                block.append(lines[i])
                i += 1
            while block and not block[-1].strip():
                block.pop()
            out += ["", " " * base + "```text"] + block + [" " * base + "```", ""]
            continue
        # an underlined section heading ("Parameters" over "----------") becomes a bold line; the
        # "name:" entries under it become a definition list (below)
        if (line.strip() and i + 1 < len(lines) and _UNDERLINE.match(lines[i + 1])
                and not _TABLE_RULE.match(lines[i + 1])):
            out += ["", f"**{line.strip()}**", ""]
            in_section = True
            i += 2
            continue
        # definition list: a term line (``names``, a few words, or in a section "name: type")
        # followed by a more indented description; the description is translated in turn
        term = _term(line, lines[i - 1] if i else "", in_section)
        if term is not None and i + 1 < len(lines) and lines[i + 1].strip() and _indent(lines[i + 1]) > _indent(line):
            pad = " " * _indent(line)
            i += 1
            body: list[str] = []
            while i < len(lines) and (not lines[i].strip() or _indent(lines[i]) > _indent(line)):
                body.append(lines[i])
                i += 1
            while body and not body[-1].strip():
                body.pop()
            cut = min(_indent(b) for b in body if b.strip())
            inner = _blocks("\n".join(b[cut:] for b in body)).strip("\n").split("\n")
            out += ["", pad + term, pad + ":   " + inner[0]]
            out += [(pad + "    " + b) if b.strip() else "" for b in inner[1:]]
            out.append("")
            continue
        out.append(line)
        i += 1
    return "\n".join(out)


class RstDocstrings(griffe.Extension):
    """Translate the reST constructs above in every docstring of the loaded package."""

    def on_object(self, *, obj: Any, **kwargs: Any) -> None:
        if obj.is_alias or obj.docstring is None:
            return
        value = obj.docstring.value
        obj.docstring.value = _roles(obj, _blocks(value))
