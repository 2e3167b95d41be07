"""The docs against the tree: every module has a line in the layout map of
docs/architecture.md, and every repository path the README and docs/ name (in
backticks or as a relative link) exists. Reads files only; imports nothing of
the project."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from frontend.health import PoolLoad, WorkerLoad, _status
from protocol.liveness import Verdict, WorkerState
from tests.stand_in_worker import stand_in_hello

ROOT = Path(__file__).resolve().parent.parent
ARCHITECTURE = ROOT / "docs" / "architecture.md"
MAPPED_PACKAGES = ("protocol", "frontend", "worker", "bench")
MAP_HEADING = "## Layout map"

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"`([^`\n]+)`")
_LINK = re.compile(r"\]\(([^)\s]+)\)")
# A path as the docs write one: no spaces, placeholders or globs.
_PATH_LIKE = re.compile(r"[A-Za-z0-9_.][A-Za-z0-9_./-]*")
_HEADING = re.compile(r"^#+ (.+)$", re.MULTILINE)
_FILE_SUFFIXES = (".py", ".md", ".yml", ".yaml", ".toml", ".sh", ".cpp", ".h", ".json", ".png")


def tracked_files() -> list[str]:
    """The repository's files: git's list, or the tree itself outside a checkout."""
    try:
        listed = subprocess.run(
            ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        listed = []
    if listed:
        return listed
    return [
        str(path.relative_to(ROOT))
        for path in ROOT.rglob("*")
        if path.is_file() and ".git" not in path.parts and "__pycache__" not in path.parts
    ]


def modules() -> list[str]:
    """The packages' modules, and the tests' helpers (every module of tests/ but
    the test files themselves)."""
    return sorted(
        path
        for path in tracked_files()
        if path.endswith(".py")
        and Path(path).name != "__init__.py"
        and (
            path.split("/", 1)[0] in MAPPED_PACKAGES
            or (path.startswith("tests/") and not Path(path).name.startswith("test_"))
        )
    )


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def without_code_blocks(text: str) -> str:
    return _FENCE.sub("", text)


def layout_map(text: str) -> str:
    """The map section of docs/architecture.md: its heading to the next level-2 one."""
    start = text.index(MAP_HEADING)
    end = text.find("\n## ", start + len(MAP_HEADING))
    return text[start : end if end != -1 else len(text)]


def mapped_paths(section: str) -> set[str]:
    """The paths in the first column of the map's table rows."""
    paths = set()
    for line in section.splitlines():
        if line.startswith("|"):
            first_cell = line.split("|")[1]
            paths.update(_CODE_SPAN.findall(first_cell))
    return paths


def named_paths(text: str, top_level: set[str]) -> set[str]:
    """Backticked spans outside code blocks that name a repository path: a
    relative path that starts with a top-level entry of the repository
    (`worker/serve/server.py`, `deploy/k8s/`) or ends in a source file's suffix
    (so a misspelt folder is caught too)."""
    paths = set()
    for span in _CODE_SPAN.findall(without_code_blocks(text)):
        if "/" not in span or not _PATH_LIKE.fullmatch(span):
            continue
        if span.split("/", 1)[0] in top_level or span.endswith(_FILE_SUFFIXES):
            paths.add(span)
    return paths


def anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces
    to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def exists(path: str, files: set[str]) -> bool:
    """A tracked file, or a folder holding one."""
    path = path.rstrip("/")
    return path in files or any(file.startswith(path + "/") for file in files)


def test_the_module_list_is_the_real_one() -> None:
    # Guards against a check that passes because it looked at nothing.
    found = modules()
    assert len(found) > 50
    for module in ("protocol/codec.py", "frontend/app.py", "worker/serve/server.py"):
        assert module in found
    assert not [module for module in found if module.endswith("__init__.py")]


def test_every_module_has_a_line_in_the_layout_map() -> None:
    mapped = mapped_paths(layout_map(ARCHITECTURE.read_text()))
    missing = [module for module in modules() if module not in mapped]
    assert not missing, (
        f"{ARCHITECTURE.relative_to(ROOT)} has no layout-map line for "
        f"{', '.join(missing)}: add a table row '| `path` | its one job |' under "
        f"{MAP_HEADING!r}"
    )


def test_the_layout_map_names_no_file_that_is_gone() -> None:
    files = set(tracked_files())
    mapped = mapped_paths(layout_map(ARCHITECTURE.read_text()))
    gone = sorted(path for path in mapped if not exists(path, files))
    assert not gone, f"the layout map names files that do not exist: {', '.join(gone)}"


def test_a_module_without_a_line_is_caught() -> None:
    section = "## Layout map\n\n| file | job |\n|---|---|\n| `protocol/codec.py` | codec |\n"
    mapped = mapped_paths(layout_map(section))
    assert "protocol/codec.py" in mapped
    assert "protocol/messages.py" not in mapped
    # A path named only in prose, or in another column, is not a map line.
    prose = "## Layout map\n\nSee `protocol/messages.py`.\n| `a.py` | `protocol/peer.py` |\n"
    assert mapped_paths(prose) == {"a.py"}


def test_named_paths_are_recognised() -> None:
    text = (
        "`worker/serve/server.py`, `deploy/k8s/`, `frontnd/app.py`, `Makefile`, "
        "`tcp://127.0.0.1:5555`, `POST /generate`, `/proc/cpuinfo`, `~/.cache/x`, "
        "`bench/results/{http,zmq}_<mode>.json`, `keys/`, `minibatch-serve`\n"
        "```sh\n`worker/in_a_code_block.py`\n```\n"
    )
    top_level = {"worker", "deploy", "bench", "Makefile"}
    assert named_paths(text, top_level) == {
        "worker/serve/server.py",
        "deploy/k8s/",
        "frontnd/app.py",
    }


@pytest.mark.parametrize("doc", doc_files(), ids=lambda path: str(path.relative_to(ROOT)))
def test_every_path_a_doc_names_exists(doc: Path) -> None:
    files = set(tracked_files())
    top_level = {file.split("/", 1)[0] for file in files}
    text = doc.read_text()
    missing = sorted(path for path in named_paths(text, top_level) if not exists(path, files))
    for target in _LINK.findall(without_code_blocks(text)):
        if "://" in target or target.startswith(("#", "mailto:")):
            continue
        linked = (doc.parent / target.split("#", 1)[0]).resolve()
        if not linked.is_relative_to(ROOT) or not exists(str(linked.relative_to(ROOT)), files):
            missing.append(target)
    assert not missing, f"{doc.relative_to(ROOT)} names paths that do not exist: {missing}"


@pytest.mark.parametrize("doc", doc_files(), ids=lambda path: str(path.relative_to(ROOT)))
def test_every_link_to_a_section_finds_its_heading(doc: Path) -> None:
    text = without_code_blocks(doc.read_text())
    broken = []
    for target in _LINK.findall(text):
        path, _, fragment = target.partition("#")
        if not fragment or "://" in target:
            continue
        page = (doc.parent / path) if path else doc
        headings = _HEADING.findall(without_code_blocks(page.read_text()))
        if fragment not in {anchor(heading) for heading in headings}:
            broken.append(target)
    assert not broken, f"{doc.relative_to(ROOT)} links to sections that do not exist: {broken}"


def test_anchors_are_made_as_github_makes_them() -> None:
    assert anchor("Precision (`DTYPE`, `WEIGHTS`, `BFLOAT16_PRODUCTS`)") == (
        "precision-dtype-weights-bfloat16_products"
    )
    assert anchor("tests/ helpers") == "tests-helpers"


def test_the_docs_pages_are_linked_from_the_readme() -> None:
    readme = (ROOT / "README.md").read_text()
    unlinked = [
        page.name for page in (ROOT / "docs").glob("*.md") if f"(docs/{page.name}" not in readme
    ]
    assert not unlinked, f"README.md links no page for {', '.join(unlinked)}"


def test_every_key_of_health_is_named_in_the_api_docs() -> None:
    """health.py's answer says docs/api.md names each of its keys."""
    live = Verdict(WorkerState.LIVE, "1 of 1 workers live")
    worker = WorkerLoad("tcp://127.0.0.1:1", live, False, stand_in_hello(), None, 0)
    status = _status(PoolLoad(live, worker.hello, [worker], 0, 0, 0))
    keys = {*status, *status["workers"][0], "ready"}
    docs = (ROOT / "docs" / "api.md").read_text()
    table = docs[docs.index("`GET /health`'s keys") :].split("\n\n")[1]
    assert sorted(key for key in keys if f"`{key}`" not in table) == []
