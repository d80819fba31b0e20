"""Every Python block of README.md runs as written. The test fills the placeholders only: the
default model is the tiny test model, the server the blocks talk to is a live one on the tiny
model (its URL replaces http://127.0.0.1:8000), and `react`, which the connect snippet uses before
the README defines one, is a one-call program."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import anyio
import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
URL = "http://127.0.0.1:8000"


def python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def test_readme_has_python_blocks():
    blocks = python_blocks()
    assert len(blocks) >= 4
    assert any("anyio.run(main)" in b for b in blocks)  # the Use snippet runs its main


def test_every_python_block_runs(tiny_model_path, monkeypatch, capsys):
    import agentrt
    import agentrt.engine.engine_core as core
    from tests.server.live import live_server, tiny_config

    resolve = core.resolve_model
    monkeypatch.setattr(core, "resolve_model", lambda model: resolve(tiny_model_path if model is None else model))

    @agentrt.program
    async def react(question: str) -> str:
        return await agentrt.chat([{"role": "user", "content": question}], max_tokens=4)

    ns: dict = {"agentrt": agentrt, "react": react}
    config = tiny_config(tiny_model_path, served_model_name="SmolLM2-135M-Instruct")
    with live_server(config) as srv:
        for i, block in enumerate(python_blocks()):
            source = block.replace(URL, srv.url)
            code = compile(source, f"README.md python block {i}", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
            try:
                result = eval(code, ns)  # a coroutine when the block awaits at top level
                if result is not None:
                    anyio.run(lambda r=result: r)
            except Exception as e:
                pytest.fail(f"README.md python block {i} failed: {e!r}\n{block}")
    out = capsys.readouterr().out
    assert out.strip()  # the blocks print their results
