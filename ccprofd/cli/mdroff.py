"""The README's Markdown as man(7) roff, for the man pages (``docgen``): the README is written as a
manual (NAME, SYNOPSIS, DESCRIPTION, COMMANDS, EXIT STATUS, FILES), so the pages carry its text
instead of a second copy that would drift.  Only the Markdown the README uses is understood:
headings, paragraphs, ``*``/``-`` bullets, fenced code, tables (kept as preformatted text),
``**bold**``, ```code``` and ``[text](link)``."""

from __future__ import annotations

import re
from pathlib import Path

#: The README next to the package (a source checkout or an editable install, which setup makes).
README = Path(__file__).resolve().parents[2] / "README.md"

_LINK = re.compile(r"\[([^\]]+)\]\([^)]+\)")
_COMMENT = re.compile(r"<!--.*?-->", re.S)


def _escape(text: str) -> str:
    """Roff-safe text: backslashes, minus signs, non-ASCII characters as ``\\[uXXXX]`` (groff
    reads its input as Latin-1 otherwise)."""
    out = text.replace("\\", "\\e").replace("-", "\\-")
    return "".join(c if ord(c) < 128 else f"\\[u{ord(c):04X}]" for c in out)


def _inline(text: str) -> str:
    """One line of Markdown prose as roff: links to their text, code and bold in bold."""
    text = _LINK.sub(r"\1", text)
    parts: list[str] = []
    pos = 0
    for m in re.finditer(r"\*\*(.+?)\*\*|`([^`]+)`", text):
        parts.append(_escape(text[pos:m.start()]))
        span = _escape(m.group(1) or m.group(2))
        if m.group(2) and len(span) > 40:  # long identifiers and paths may break after _ and /
            span = span.replace("_", "_\\:").replace("/", "/\\:")  # (else troff warns)
        parts.append("\\fB" + span + "\\fR")
        pos = m.end()
    parts.append(_escape(text[pos:]))
    line = "".join(parts)
    return "\\&" + line if line.startswith((".", "'")) else line


def to_roff(markdown: str, *, top_level: int = 2) -> str:
    """Markdown whose headings start at ``top_level`` (``##``) as roff: those headings are ``.SH``,
    deeper ones ``.SS``.  A paragraph or bullet is joined into one line first, so bold and code
    spans that wrap in the Markdown stay whole; HTML comments (the bench markers) are dropped."""
    markdown = _COMMENT.sub("", markdown)
    out: list[str] = []
    para: list[str] = []

    def flush() -> None:
        if para:
            out.append(_inline(" ".join(para)))
            para.clear()

    in_code = False
    for raw in markdown.splitlines():
        line = raw.rstrip()
        if line.startswith("```"):
            flush()
            out.append(".fi\n.in" if in_code else ".PP\n.nf\n.in +2n")
            in_code = not in_code
            continue
        if in_code:
            out.append("\\&" + _escape(line))
            continue
        if line.startswith("|"):  # a table row, kept as preformatted text
            flush()
            if not set(line) <= set("|-: "):  # (not its rule line)
                row = _LINK.sub(r"\1", line).replace("**", "").replace("`", "")  # cells: plain text
                out += [".nf", "\\&" + _escape(row), ".fi"]
            continue
        heading = re.match(r"^(#+)\s+(.*)$", line)
        bullet = re.match(r"^\s*[*-]\s+(.*)$", line)
        if heading:
            flush()
            level = len(heading.group(1))
            macro = ".SH" if level <= top_level else ".SS"
            out.append(f'{macro} "{_inline(heading.group(2)).replace(chr(34), "")}"')
        elif not line:
            flush()
            out.append(".PP")
        elif bullet:
            flush()
            out.append(".IP \\(bu 2")
            para.append(bullet.group(1))
        else:
            para.append(line.strip())
    flush()
    if in_code:
        out.append(".fi\n.in")
    # no empty paragraphs: collapse runs of .PP and drop those right after a heading
    text = "\n".join(out)
    text = text.replace(".fi\n.nf\n", "")  # table rows: one preformatted block
    text = re.sub(r"(\.PP\n)+", ".PP\n", text)
    text = re.sub(r"(\.S[HS] [^\n]*\n)\.PP\n", r"\1", text)
    return text.strip("\n").removesuffix("\n.PP")


def section(markdown: str, heading: str) -> str | None:
    """The body of the README section headed ``heading`` (any level), up to the next heading of
    the same or a higher level; None when there is none."""
    lines = markdown.splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"^(#+)\s+(.*)$", line)
        if m and m.group(2).strip() == heading:
            level = len(m.group(1))
            body: list[str] = []
            in_code = False
            for nxt in lines[i + 1:]:
                if nxt.startswith("```"):
                    in_code = not in_code
                n = None if in_code else re.match(r"^(#+)\s", nxt)
                if n and len(n.group(1)) <= level:
                    break
                body.append(nxt)
            return "\n".join(body)
    return None


def readme_section(heading: str, *, top_level: int, readme: Path = README) -> str | None:
    """A README section as roff (None without a README: a page from an installed wheel still
    renders, with the parsers' text only)."""
    try:
        text = readme.read_text(encoding="utf-8")
    except OSError:
        return None
    body = section(text, heading)
    return None if body is None else to_roff(body, top_level=top_level)
