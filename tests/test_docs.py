"""The documentation a clone carries: every link between its pages opens (the file, and the heading it names), no
command needs a file outside the repository, and the README stays a front page."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", ROOT / "BENCHMARKS.md", *(ROOT / "docs").rglob("*.md"),
                *(ROOT / "benchmarks" / "peers").rglob("*.md"), ROOT / "deployments" / "README.md"])
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation but '-' and '_' dropped, spaces as '-',
    a repeated one numbered."""
    seen: dict[str, int] = {}
    fence = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
        if fence or not re.match(r"#{1,6} ", line):
            continue
        slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        yield slug if n == 0 else f"{slug}-{n}"


def links(page: Path) -> list[tuple[int, str]]:
    out, fence = [], False
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if line.startswith("```"):
            fence = not fence
        if not fence:
            out += [(number, m.group(1)) for m in LINK.finditer(line)]
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_between_the_pages_opens(page):
    broken = []
    for number, target in links(page):
        if re.match(r"[a-z]+://|mailto:", target):
            continue  # outside the clone (and the tests are offline)
        path, _, anchor = target.partition("#")
        where = (page.parent / path).resolve() if path else page
        if not where.exists():
            broken.append(f"{page.relative_to(ROOT)}:{number}: {target} (no such file)")
        elif anchor and (where.is_dir() or anchor not in set(anchors(where))):
            broken.append(f"{page.relative_to(ROOT)}:{number}: {target} (no heading #{anchor} in {path or 'it'})")
    assert not broken, "\n".join(broken)


def test_no_page_needs_a_file_outside_the_repository():
    outside = [f"{page.relative_to(ROOT)}:{number}" for page in PAGES
               for number, line in enumerate(page.read_text().splitlines(), 1) if "../shared" in line]
    assert not outside, outside


def test_the_readme_is_a_front_page_that_links_every_docs_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 350  # the rest lives in docs/
    linked = {(ROOT / target.partition("#")[0]).resolve() for _, target in links(ROOT / "README.md")}
    unlinked = [p.name for p in (ROOT / "docs").glob("*.md") if p.resolve() not in linked]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"
    assert "make demo" in readme and "make test" in readme


SPAN = re.compile(r"`((?:grpo|runtime|tasks|flows|benchmarks|deployments)[./][\w./-]*\w/?)`")


def module_file(parts: list[str]) -> Path | None:
    """The file of the module (or package) `parts` names, if there is one."""
    base = ROOT.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def defines(source: str, name: str) -> bool:
    """Whether a module's source binds `name` at its top level (a def, a class, an assignment or an import)."""
    return re.search(rf"^(?:(?:async )?def |class ){name}\b|^{name}\s*[:=]|^(?:from \S+ )?import .*\b{name}\b",
                     source, re.M) is not None


def stale(span: str) -> str | None:
    """Why the project path a page names (a file or folder, `grpo/x.py`, or a dotted module and one of its names,
    `grpo.x.NAME`) does not exist; None when it does. A dotted span whose only module is the top package
    (`grpo.beta`) is a recipe setting's path (the `grpo` section), not a module's: left alone."""
    path, _, dotted = span.rstrip("/").rpartition("/")
    parts = [*(path.split("/") if path else []), *dotted.split(".")]
    if (ROOT / span).exists():
        return None
    for n in range(len(parts), 0, -1):  # the longest prefix that is a module, then a name it defines
        found = module_file(parts[:n])
        if found is None:
            continue
        if n == len(parts) or parts[n] == "py" or defines(found.read_text(), parts[n]) or (n == 1 and not path):
            return None
        return f"{found.relative_to(ROOT)} defines no {parts[n]!r}"
    return "no such file, folder or module"


def test_every_module_path_the_pages_name_exists():
    """A page that names `grpo/training/jobs.py`, `grpo.configs.recipe.STAGES` or `flows/cli/` names something the
    clone has: after a module moves, the pages that still say where it was fail here."""
    missing = []
    for page in PAGES:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            for span in SPAN.findall(line):
                if why := stale(span):
                    missing.append(f"{page.relative_to(ROOT)}:{number}: `{span}` ({why})")
    assert not missing, "\n".join(missing)
