"""The docs stay true to the tree: docs/design.md's layout lists every module of polyrl/,
backends/ and algos/ (and nothing that is gone), every file path the docs and the README
name exists, and the README's list of gin experiments is gin/experiments/*.gin."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Where each top-level directory of the layout lives in the repository.
TOPS = {"polyrl/": ROOT / "polyrl", "backends/": ROOT / "backends", "algos/": ROOT / "algos"}
ENTRY = re.compile(r"^[\w.]+(/|\.py)$")


def _layout() -> list[str]:
    """The lines of design.md's "Layout" code block."""
    text = (ROOT / "docs" / "design.md").read_text()
    section = text.split("## Layout", 1)[1]
    return section.split("```", 2)[1].splitlines()


def _span(lines: list[str], start: int) -> tuple[int, int]:
    """Lines ``start``..end of the entry at ``start``: up to the next entry indented as
    far or less (descriptions continue on deeper-indented lines)."""
    indent = len(lines[start]) - len(lines[start].lstrip())
    end = start + 1
    while end < len(lines):
        line = lines[end]
        words = line.split()
        if words and ENTRY.match(words[0]) and len(line) - len(line.lstrip()) <= indent:
            break
        end += 1
    return start, end


def _entries(lines: list[str], lo: int, hi: int) -> dict[str, int]:
    """The entries directly inside lines lo..hi (the shallowest indentation there)."""
    found = {}
    depth = None
    for i in range(lo, hi):
        words = lines[i].split()
        if not words or not ENTRY.match(words[0]):
            continue
        indent = len(lines[i]) - len(lines[i].lstrip())
        depth = indent if depth is None else depth
        if indent == depth:
            found[words[0]] = i
    return found


def _modules(directory: Path) -> list[Path]:
    return sorted(
        p
        for p in directory.rglob("*.py")
        if p.name != "__init__.py" and "__pycache__" not in p.parts
    )


def test_design_layout_lists_every_module():
    """Each module is named in the section of its package (``weight_sync/`` under
    ``polyrl/``): a new module without a line in docs/design.md fails here."""
    lines = _layout()
    tops = _entries(lines, 0, len(lines))
    missing = []
    for top, directory in TOPS.items():
        assert top in tops, f"docs/design.md's layout has no {top} entry"
        for module in _modules(directory):
            lo, hi = _span(lines, tops[top])
            for package in module.relative_to(directory).parts[:-1]:
                inner = _entries(lines, lo + 1, hi)
                if f"{package}/" not in inner:
                    lo = None
                    break
                lo, hi = _span(lines, inner[f"{package}/"])
            named = lo is not None and re.search(
                rf"(?<![\w/]){re.escape(module.name)}\b", "\n".join(lines[lo:hi])
            )
            if not named:
                missing.append(str(module.relative_to(ROOT)))
    assert not missing, f"docs/design.md's layout does not list: {missing}"


def test_design_layout_names_only_what_exists():
    lines = _layout()
    stale = []

    def walk(lo: int, hi: int, directory: Path) -> None:
        for name, i in _entries(lines, lo, hi).items():
            path = directory / name.rstrip("/")
            if not path.exists():
                stale.append(str(path.relative_to(ROOT)))
            elif name.endswith("/"):
                walk(*(_span(lines, i)[0] + 1, _span(lines, i)[1]), path)

    tops = _entries(lines, 0, len(lines))
    for top, directory in TOPS.items():
        walk(_span(lines, tops[top])[0] + 1, _span(lines, tops[top])[1], directory)
    assert not stale, f"docs/design.md's layout names what does not exist: {stale}"


# A repository path in prose: a top-level directory, then a path; not a pattern
# (``*``, ``<name>``, ``{a,b}``) and not an output under runs/ or $OUT.
PATH = re.compile(
    r"(?<![\w./$-])((?:polyrl|backends|algos|tests|experiments|gin|docs|requirements)/[\w./-]*\w)"
    r"(?![\w*<{])"
)


# Reward data_source names look like paths; validation.md shows a typo's error message.
NOT_PATHS = {
    "polyrl/addition",
    "polyrl/copy",
    "polyrl/guess",
    "polyrl/calc",
    "gin/algos/grpoo.gin",
}


def test_every_path_in_the_docs_exists():
    missing = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for match in PATH.finditer(doc.read_text()):
            path = match.group(1)
            if path not in NOT_PATHS and not (ROOT / path).exists():
                missing.append(f"{doc.name}: {path}")
    assert not missing, f"paths named in the docs that do not exist: {missing}"


def test_readme_lists_every_gin_experiment():
    """README's "Experiments are gin files" block names each gin/experiments/*.gin (by
    stem, comma-separated, remarks in parentheses)."""
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"^gin/experiments/\*\.gin(.*?)^gin/", readme, re.S | re.M)
    assert block, "README.md has no gin/experiments/*.gin line"
    listed = {n.strip() for n in re.sub(r"\([^)]*\)", "", block.group(1)).split(",")}
    on_disk = {p.stem for p in (ROOT / "gin" / "experiments").glob("*.gin")}
    assert listed - {""} == on_disk
