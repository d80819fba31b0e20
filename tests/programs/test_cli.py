"""`agentrt run FILE` in-process and with --url against a live server, for each example program, on a
tiny random model (the plumbing; `test_examples.py` runs them on the real model). A random model
writes garbage, which is the malformed-output case: every program must still end normally."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

import agentrt
from agentrt.command import main as cli
from agentrt.programs.countdown import PUZZLES
from agentrt.programs.mcts import mcts
from agentrt.programs.react import react
from tests.server.live import live_server, tiny_config

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = {
    "mcts": ["--budget", "4", "--width", "2"],
    "react": ["--max-steps", "2", "What is 2 + 2?"],
    "chat": ["--max-tokens", "6", "Hi", "Bye"],
}


@pytest.fixture(autouse=True)
def _keep_sys(monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(sys, "argv", list(sys.argv))


def test_missing_file_fails_clearly(capsys):
    assert cli(["run", "no/such/file.py"]) == 2
    assert "no such file: no/such/file.py" in capsys.readouterr().err


def test_unreadable_or_mainless_files_fail_clearly(tmp_path, capsys):
    bad = tmp_path / "bad.py"
    bad.write_text("def (:\n")
    assert cli(["run", str(bad)]) == 2
    assert "cannot read" in capsys.readouterr().err
    plain = tmp_path / "plain.py"
    plain.write_text("import sys\nprint('plain', __name__, sys.argv[1:])\n")
    assert cli(["run", "--url", "http://127.0.0.1:9", str(plain)]) == 2
    assert "--url needs" in capsys.readouterr().err
    assert cli(["run", str(plain), "--", "a", "b"]) == 0  # no main: a plain script
    assert "plain __main__ ['a', 'b']" in capsys.readouterr().out


def test_unreachable_server_is_an_error_not_a_traceback(tmp_path, capsys):
    f = tmp_path / "one.py"
    f.write_text("import agentrt\n\nasync def main(argv):\n    await agentrt.generate('hi', max_tokens=1)\n")
    assert cli(["run", "--url", "http://127.0.0.1:9", str(f)]) == 1
    assert "agentrt run: error" in capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_examples_run_in_process(name, tiny_model_path, capsys):
    assert cli(["run", "--model", str(tiny_model_path), str(ROOT / "programs" / f"{name}.py"), "--",
                *EXAMPLES[name]]) == 0
    out = capsys.readouterr().out
    assert {"mcts": "(verified)", "react": "LLM calls", "chat": "> Bye"}[name] in out


@pytest.fixture(scope="module")
def server(tiny_model_path):
    with live_server(tiny_config(tiny_model_path)) as s:
        yield s


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_examples_run_against_a_server(name, server, capsys):
    assert cli(["run", "--url", server.url, str(ROOT / "programs" / f"{name}.py"), "--", *EXAMPLES[name]]) == 0
    assert "(verified)" in capsys.readouterr().out if name == "mcts" else True
    programs = httpx.get(f"{server.url}/v1/programs").json()["data"]
    assert programs and programs[0]["state"] == "finished" and programs[0]["calls_done"] >= 1
    if name == "mcts":
        assert programs[0]["num_threads"] >= 2  # the proposals were threads of one program


@pytest.mark.anyio
async def test_garbage_from_the_model_never_crashes_a_program(tiny_model_path):
    async with agentrt.Runtime(str(tiny_model_path), num_blocks=256):
        r = await mcts(PUZZLES[0], budget=6, width=3, max_tokens=8)
        assert r.calls <= 6 and r.proposals == r.calls and r.solved == (r.score == 1.0)
        a = await react("What is 2 + 2?", max_steps=3, max_tokens=12)
        assert 1 <= a.steps <= 3 and isinstance(a.answer, str)
