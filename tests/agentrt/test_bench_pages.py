"""docs/benchmarks/ (issue 48): one page per `agentrt bench NAME`, newest run first with its machine, command
and date, a replaced run moved under History; every benchmark's `--docs` / `--write-docs` writes its own page.
The index's and pages' links resolve."""

import importlib
import re
from pathlib import Path

import pytest

from agentrt.bench import _common
from tests.test_readme import heading_anchors, local_links

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted((ROOT / "docs" / "benchmarks").glob("*.md"))
WRITERS = sorted(m.stem for m in (ROOT / "agentrt" / "bench").glob("*.py")
                 if "write_section(" in m.read_text() and m.stem != "_common")


def test_every_writer_is_a_benchmark_with_a_page():
    from agentrt.command import BENCHES

    assert len(WRITERS) >= 15, WRITERS
    for module in WRITERS:
        name = _common.bench_name(f"agentrt.bench.{module}")
        assert BENCHES.get(name) == f"agentrt.bench.{module}", name
    assert _common.page("decode-cpu") == ROOT / "docs" / "benchmarks" / "decode-cpu.md"
    with pytest.raises(ValueError, match="'agentrt.bench' is not a benchmark module"):
        _common.bench_name("agentrt.bench")


@pytest.mark.parametrize("module", WRITERS)
def test_each_writer_writes_its_own_page(module, tmp_path, monkeypatch):
    """`write_section` called from the benchmark's module lands on docs/benchmarks/NAME.md (here in tmp)."""
    monkeypatch.setattr(_common, "DOCS", tmp_path)
    monkeypatch.setattr(_common, "machine", lambda: "test machine")
    mod = importlib.import_module(f"agentrt.bench.{module}")
    exec("written = write_section('A run', 'first')", {"write_section": _common.write_section, "__name__": mod.__name__},
         out := {})
    name = _common.bench_name(mod.__name__)
    assert out["written"] == tmp_path / f"{name}.md"
    text = out["written"].read_text()
    assert text.startswith(f"# `agentrt bench {name}`") and "Machine: test machine" in text and "Date: " in text


def test_newest_first_and_the_replaced_run_moves_into_history(tmp_path, monkeypatch):
    monkeypatch.setattr(_common, "machine", lambda: "m")
    page = tmp_path / "x.md"
    for title, body in (("A", "a1"), ("B", "b1"), ("A", "a2"), ("A", "a3")):
        _common.write_section(title, f"| t |\n|---|\n| {body} |", page)
    text = page.read_text()
    current, history = text.split("\n## History\n")
    assert re.findall(r"(?m)^## (\w)", current) == ["A", "B"]
    assert "a3" in current and "b1" in current and "a2" not in current and "a1" not in current
    assert history.index("a2") < history.index("a1") and re.findall(r"(?m)^### (A) \(\d{4}-\d\d-\d\d\)", history) == ["A", "A"]
    assert text.count("Command: `") == 4


def test_a_benchmark_writes_its_page_end_to_end(tmp_path, monkeypatch, tiny_model_path):
    """`agentrt bench decode-cpu --docs` on the tiny model: its section lands first on decode-cpu.md."""
    from agentrt.kernels import cpu

    if not cpu.available():
        pytest.skip("decode-cpu needs the C++ CPU kernels")
    monkeypatch.setattr(_common, "DOCS", tmp_path)
    (tmp_path / "decode-cpu.md").write_text("# `agentrt bench decode-cpu`\n\n## Decode step (CPU old)\n\nDate: 2020-01-01\n\nold\n")
    from agentrt.command import main

    argv = ["bench", "decode-cpu", "--model", str(tiny_model_path), "--contexts", "8", "--steps", "2", "--repeats", "2",
            "--docs"]
    monkeypatch.setattr("sys.argv", ["agentrt", *argv])  # what the page's Command line reads
    assert main(argv) == 0
    text = (tmp_path / "decode-cpu.md").read_text()
    assert text.index(f"## Decode step (CPU {cpu.kind()})") < text.index("## Decode step (CPU old)")
    assert "Command: `agentrt bench decode-cpu" in text


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_benchmark_page_links_resolve(page):
    for target, anchor in local_links(page):
        assert target.exists(), f"{page.name} links to {target}, which does not exist"
        if anchor and target.suffix == ".md":
            assert anchor in heading_anchors(target), f"{page.name} links to {target.name}#{anchor}"
