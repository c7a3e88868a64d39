"""Check that every relative link in the repository's markdown resolves.

    python scripts/check_links.py [FILE.md ...]

Default files: README.md, docs/*.md, docs/archive/*.md. A link resolves when its path
exists relative to the file that holds it and, where it names an anchor
(``file.md#section``), the target file has a heading whose GitHub-style slug is that
anchor. Links to other sites (``http(s)://``, ``mailto:``) are listed as errors too:
the manual sends readers only to files in this repository. Links inside code spans and
code blocks are not links and are skipped. Exit status 1 when any link is broken.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_GLOBS = ("README.md", "docs/*.md", "docs/archive/*.md")

LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation removed,
    spaces to hyphens (letters, digits, ``-`` and ``_`` kept)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = text.replace("`", "").replace("*", "").lower()
    text = "".join(ch for ch in text if ch.isalnum() or ch in " -_")
    return text.replace(" ", "-")


def prose_lines(text: str, code_spans: bool = False) -> list[str]:
    """The file's lines with code blocks blanked and code spans removed (kept with
    ``code_spans``: a heading's anchor keeps their text)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            lines.append("")
            continue
        if fenced or line.startswith("    "):
            lines.append("")
        else:
            lines.append(line if code_spans else CODE_SPAN.sub("", line))
    return lines


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a markdown file; a repeated slug gets ``-1``, ``-2``... as on GitHub."""
    seen: dict[str, int] = {}
    found = set()
    for line in prose_lines(path.read_text(encoding="utf-8"), code_spans=True):
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """One message per link of ``path`` that does not resolve (or leaves ``root``, the repository)."""
    problems = []
    for number, line in enumerate(prose_lines(path.read_text(encoding="utf-8")), start=1):
        for match in LINK.finditer(line):
            target = match.group(1)
            where = f"{path.relative_to(root) if path.is_relative_to(root) else path}:{number}: {target}"
            if re.match(r"[a-z][a-z0-9+.-]*:", target):
                problems.append(f"{where}: points outside the repository")
                continue
            file_part, _, anchor = target.partition("#")
            resolved = (path.parent / file_part).resolve() if file_part else path
            if not resolved.exists():
                problems.append(f"{where}: no such file")
            elif not resolved.is_relative_to(root):
                problems.append(f"{where}: outside the repository")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                problems.append(f"{where}: no heading with anchor #{anchor}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", type=Path, help="markdown files (default: the README and docs)")
    parser.add_argument("--root", type=Path, default=ROOT, help="the repository links may not leave")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    files = [f.resolve() for f in args.files] or sorted(p for g in DEFAULT_GLOBS for p in root.glob(g))
    problems = [problem for f in files for problem in broken_links(f, root)]
    for problem in problems:
        print(problem)
    print(f"{len(files)} files checked, {len(problems)} broken links")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
