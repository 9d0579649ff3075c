"""README.md is tested: its Python snippets run, and its families table agrees with the registry."""
import re
import socket
from pathlib import Path

import pytest

import zoo
from zoo.registry import get_entry

README = Path(__file__).resolve().parents[1] / "README.md"
# A snippet whose first line is one of these comments is not run, and the comment says why: it needs the
# network (the tests must pass offline) or runs longer than a test should (the suite has 15 minutes on
# a 2-core CPU).
SKIP = re.compile(r"#\s*(needs network|long run)\b")


def python_snippets(text: str) -> list[tuple[int, str]]:
    """(first line number, code) of each ```python block, in order."""
    return [(text[:m.start(1)].count("\n") + 1, m.group(1))
            for m in re.finditer(r"^```python\n(.*?)^```", text, flags=re.S | re.M)]


def families_table(text: str) -> dict[str, str]:
    """{family name: its 'shipped weights' cell} from the table under '## The families'."""
    section = text.split("## The families", 1)[1].split("\n## ", 1)[0]
    rows = [line.strip().strip("|").split("|") for line in section.splitlines() if line.startswith("| `")]
    return {cells[0].strip().strip("`"): cells[-1].strip() for cells in rows}


@pytest.fixture
def offline(monkeypatch):
    """Any attempt to reach the network fails at once (local sockets, e.g. compile workers', still work)."""
    connect = socket.socket.connect

    def refuse(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            raise OSError(f"test_docs: a README snippet not marked '# needs network' reached {address}")
        return connect(sock, address)

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_readme_has_runnable_and_marked_snippets():
    snippets = python_snippets(README.read_text())
    marked = [code for _, code in snippets if SKIP.match(code)]
    assert len(snippets) >= 4 and marked and len(marked) < len(snippets)


def test_readme_python_snippets_run(tmp_path, monkeypatch, offline):
    """The snippets run in order in one namespace, as a reader pasting them into one session would."""
    monkeypatch.chdir(tmp_path)  # snippets may write files (zoo.save)
    namespace = {"__name__": "__readme__"}
    ran = 0
    for line, code in python_snippets(README.read_text()):
        if SKIP.match(code):
            continue
        padded = "\n" * (line - 1) + code  # tracebacks then give README.md's own line numbers
        exec(compile(padded, str(README), "exec"), namespace)  # noqa: S102 - our own README
        ran += 1
    assert ran >= 3


def test_families_table_says_which_weights_ship():
    table = families_table(README.read_text())
    assert sorted(table) == sorted(zoo.list_models()), "every registered family has one row in README.md"
    for name, cell in table.items():
        entry = get_entry(name)
        if entry.default_tag is None:
            assert cell == "not yet", f"{name} ships no weights, but README.md's table says {cell!r}"
        else:
            # the cell names the shipped data set: the default tag, ignoring case and punctuation
            assert entry.weights[entry.default_tag]
            words = re.sub(r"[^a-z0-9]", "", cell.lower())
            tag = re.sub(r"[^a-z0-9]", "", entry.default_tag.lower())
            assert tag in words, f"{name} ships {entry.default_tag!r}; README.md says {cell!r}"
