"""Every Python block of README.md and of the docs/*.md pages runs as written, and the README stays a
short front door whose links lead somewhere. The test fills the placeholders only: the default model
is the tiny test model, the server the blocks talk to is a live one on the tiny model (its URL
replaces http://127.0.0.1:8000), and `react`, which the connect snippet uses without defining one, is
a one-call program. Each page's blocks run in order in one namespace of their own."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import anyio
import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
URL = "http://127.0.0.1:8000"
README_MAX_LINES = 150
LINK = re.compile(r"\]\(([^)\s]+)\)")


def python_blocks(page: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", page.read_text(), flags=re.S | re.M)


def heading_anchors(page: Path) -> set[str]:
    """The anchors GitHub gives the page's headings (lower case, punctuation dropped, spaces as '-')."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    anchors: set[str] = set()
    for title in re.findall(r"^#+ (.+)$", text, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
        n = 0
        while (candidate := slug if n == 0 else f"{slug}-{n}") in anchors:
            n += 1
        anchors.add(candidate)
    return anchors


def local_links(page: Path) -> list[tuple[Path, str]]:
    """(target file, anchor or '') of every link of `page` that is not to another site."""
    links = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        links.append(((page.parent / path).resolve() if path else page, anchor))
    return links


def test_readme_has_python_blocks():
    assert any("anyio.run(main)" in b for b in python_blocks(README))  # the tour runs its main
    assert sum(len(python_blocks(p)) for p in PAGES) >= 4


def test_readme_is_a_short_front_door():
    assert len(README.read_text().splitlines()) <= README_MAX_LINES


def test_readme_links_every_docs_page():
    linked = {target for target, _ in local_links(README)}
    assert [p.name for p in PAGES[1:] if p.resolve() not in linked] == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_link_resolves(page):
    for target, anchor in local_links(page):
        assert target.exists(), f"{page.name} links to {target}, which does not exist"
        if anchor and target.suffix == ".md":
            assert anchor in heading_anchors(target), f"{page.name} links to {target.name}#{anchor}: no such heading"


def test_every_python_block_runs(tiny_model_path, monkeypatch, capsys):
    import agentrt
    import agentrt.engine.engine_core as core
    from tests.server.live import live_server, tiny_config

    resolve = core.resolve_model
    monkeypatch.setattr(core, "resolve_model", lambda model: resolve(tiny_model_path if model is None else model))

    @agentrt.program
    async def react(question: str) -> str:
        return await agentrt.chat([{"role": "user", "content": question}], max_tokens=4)

    config = tiny_config(tiny_model_path, served_model_name="SmolLM2-135M-Instruct")
    with live_server(config) as srv:
        for page in PAGES:
            ns: dict = {"agentrt": agentrt, "react": react}
            for i, block in enumerate(python_blocks(page)):
                run_block(block.replace(URL, srv.url), f"{page.relative_to(ROOT)} python block {i}", ns)
    out = capsys.readouterr().out
    assert out.strip()  # the blocks print their results


def run_block(source: str, name: str, ns: dict) -> None:
    code = compile(source, name, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    try:
        result = eval(code, ns)  # a coroutine when the block awaits at top level
        if result is not None:
            anyio.run(lambda r=result: r)
    except Exception as e:
        pytest.fail(f"{name} failed: {e!r}\n{source}")
