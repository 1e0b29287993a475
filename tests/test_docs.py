"""The docs as user guides.

- Every ```python block of README.md and docs/ runs on the CPU (the blocks of one page share a
  namespace), unless its fence says why it cannot: ```python no-cpu: <reason>.
- The user pages (README.md, docs/*.md) cite no run, issue or session: history belongs in
  git. (docs/results/ holds experiment reports; they are not checked for it.)
- Every repository file a page names exists, and every relative link resolves.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
USER_PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^```python([^\n]*)\n(.*?)^```", re.DOTALL | re.MULTILINE)
NOT_RUN = re.compile(r" no-cpu: \S.*")  # the info string of a block that needs a GPU
HISTORY = re.compile(
    r"\bruns? \d+(?![\d.,]*\s*(?:%|x\b|[mµ]?s\b|min\b|K\b|steps?\b|times\b|tokens?\b))"
    # "run 9", "runs 9 and 11", not "runs 12% slower"
    r"|\bissues? #?\d+"  # "issue 24"
    r"|(?<![\w&])#\d+\b(?!-)"  # "#24" (not an anchor such as "#24-with-asps")
    r"|\bsessions?\b",
    re.IGNORECASE)
REPO_PATH = re.compile(r"\b(?:benchmarks|docs|examples|tests|sparse_training)/[\w./-]*\w\.\w+")
LINK = re.compile(r"\]\(([^)\s#]*)(?:#([^)\s]*))?\)")  # (target#anchor), either may be empty


def relative(path: Path) -> str:
    return str(path.relative_to(ROOT))


def python_blocks(page: Path) -> list[tuple[str, str]]:
    """(info after ``python``, code) of every ```python block of ``page``."""
    return FENCE.findall(page.read_text())


@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(p)], ids=relative)
def test_page_examples_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__docs__"}
    for info, block in python_blocks(page):
        if info:
            assert NOT_RUN.fullmatch(info), (
                f"{relative(page)}: a python block's fence reads 'python{info}'; use 'python' "
                f"(run by this test) or 'python no-cpu: <why it cannot run on a CPU>'")
            continue
        exec(compile(block, str(page), "exec"), namespace)


@pytest.mark.parametrize("page", USER_PAGES, ids=relative)
def test_user_pages_cite_no_runs_issues_or_sessions(page):
    lines = [f"{n}: {line.strip()}" for n, line in enumerate(page.read_text().splitlines(), 1)
             if HISTORY.search(line)]
    assert not lines, (f"{relative(page)} cites runs, issues or sessions (history stays in "
                       f"git):\n" + "\n".join(lines))


def anchors(page: Path) -> set[str]:
    """The anchors of ``page``'s headings as GitHub makes them: lower case, punctuation
    dropped, spaces as hyphens."""
    headings = re.findall(r"^#+ (.+)$", page.read_text(), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
            for heading in headings}


@pytest.mark.parametrize("page", PAGES, ids=relative)
def test_named_files_and_links_exist(page):
    text = page.read_text()
    missing = sorted({path for path in REPO_PATH.findall(text) if not (ROOT / path).exists()})
    for target, anchor in LINK.findall(text):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        linked = (page.parent / target).resolve() if target else page
        if not linked.exists():
            missing.append(target)
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            missing.append(f"{target}#{anchor}")
    assert not missing, f"{relative(page)} names files or headings that do not exist: {missing}"
