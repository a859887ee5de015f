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
        # definition list: a line of ``names`` (or, in a section, of bare names) followed by a
        # more indented description
        term = _DEF_TERM.match(line)
        if term is None and in_section:
            field = _FIELD.match(line)
            if field:
                kind = f" ({field.group(3)})" if field.group(3) else ""
                names = ", ".join(f"``{n.strip()}``" for n in field.group(2).split(","))
                term = re.match(r"^(\s*)(.*)$", field.group(1) + names + kind)
        if term and i + 1 < len(lines) and lines[i + 1].strip() and _indent(lines[i + 1]) > _indent(line):
            base = _indent(line)
            pad = " " * base
            out += ["", pad + term.group(2).replace("``", "`")]
            i += 1
            first = True
            while i < len(lines) and (not lines[i].strip() or _indent(lines[i]) > base):
                body = lines[i].strip()
                if not body:
                    out.append("")
                elif first:
                    out.append(pad + ":   " + body)
                    first = False
                else:
                    out.append(pad + "    " + body)
                i += 1
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
