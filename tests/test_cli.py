"""The problems issue 17 found as a new user, each now doing what it says or failing at once with one
line that names the bad value (exit 2, no traceback). `agentrt run` of a missing file and of every
example is tested in tests/programs/test_cli.py, the README's blocks in tests/test_readme.py,
`AsyncEngine("/path")` and the model cache in tests/engine/test_llm_api.py."""

from __future__ import annotations

import importlib
import json
import re
import sys
from pathlib import Path

import pytest

import agentrt
from agentrt.command import BENCHES
from agentrt.command import main as cli

ROOT = Path(__file__).resolve().parent.parent


def one_line_error(capsys, *needles: str) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    for n in needles:
        assert n in err, err
    return err


@pytest.mark.parametrize("args, needles", [
    (["--policies", "nope"], ["'nope'", "fcfs"]),
    (["--policies", "plas,atlas:zz"], ["'zz'"]),
    (["--rate", "0"], ["--rate", "0.0"]),
    (["--rate", "-1"], ["--rate", "-1.0"]),
    (["--programs", "0"], ["--programs", "0"]),
])
def test_simulate_refuses_bad_arguments(args, needles, capsys):
    assert cli(["simulate", *args]) == 2
    one_line_error(capsys, *needles)


def test_simulate_runs(capsys):
    assert cli(["simulate", "--programs", "4", "--policies", "fcfs,plas", "--json"]) == 0
    assert set(json.loads(capsys.readouterr().out)["results"]) == {"fcfs", "plas"}


def test_demo_takes_a_policy(capsys):
    with pytest.raises(SystemExit) as e:
        cli(["demo", "--policy", "fcfs", "--help"])
    assert e.value.code == 0 and "fcfs" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        cli(["demo", "--policy", "nope"])
    assert e.value.code == 2 and "'nope'" in capsys.readouterr().err


@pytest.mark.parametrize("args, needle", [
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "0"], "top_p"),
    (["--n", "0"], "SamplingParams.n"),
    (["--max-tokens", "0"], "max_tokens"),
    (["--seed", "-3"], "seed"),
    (["--model", "/no/such/model"], "/no/such/model"),
    (["--device", "tpu"], "tpu"),
])
def test_generate_checks_every_argument_before_loading(args, needle, capsys, monkeypatch):
    from agentrt import engine
    monkeypatch.setattr(engine, "LLM", lambda *a, **k: pytest.fail("the model was loaded"))
    assert cli(["generate", "hi", *args]) == 2
    one_line_error(capsys, needle)


def test_generate_options(tiny_model_path, capsys):
    base = ["generate", "Hello", "--model", str(tiny_model_path), "--max-tokens", "5"]
    assert cli([*base, "--n", "2", "--temperature", "1", "--top-p", "0.9", "--seed", "1"]) == 0
    out = capsys.readouterr()
    assert "--- completion 0" in out.out and "--- completion 1" in out.out and "output tokens" in out.err
    assert "agentrt engine: " in out.err and "KV blocks" in out.err  # the start-up line
    assert cli([*base, "--stream", "--stop", "zzz"]) == 0
    streamed = capsys.readouterr().out
    assert cli(base) == 0
    assert capsys.readouterr().out == streamed  # greedy: the stream prints the same text


def test_program_on_a_plain_function_fails_at_decoration():
    def plain(x):
        return x

    with pytest.raises(agentrt.UsageError, match=r"@agentrt\.program needs an async function"):
        agentrt.program(plain)
    with pytest.raises(agentrt.UsageError, match=r"@agentrt\.program needs an async function"):
        agentrt.program(name="p")(plain)
    with pytest.raises(agentrt.UsageError, match=r"@agentrt\.tool needs an async function"):
        agentrt.tool(plain)


def test_messages_and_docstrings_name_the_public_decorators():
    for path in (ROOT / "agentrt").rglob("*.py"):
        text = path.read_text()
        assert "agentrt._tool`" not in text and "@agentrt._tool" not in text, path
        assert "@agentrt._program" not in text, path


@pytest.mark.parametrize("name", sorted(BENCHES))
def test_benchmarks_write_docs_only_when_asked(name, capsys):
    mod = importlib.import_module(BENCHES[name])
    with pytest.raises(SystemExit):
        mod.main(["--help"])
    text = capsys.readouterr().out
    assert not re.search(r"--no-docs\s+do not write", text), text  # writing is what must be asked for
    assert "--docs" in text or "--write-docs" in text or name in ("simulate", "calibrate"), text  # these write no docs


def test_bench_sampling_leaves_docs_alone_without_docs(tiny_model_path, capsys):
    from agentrt.bench import sampling
    from tests.benchpages import pages

    before = pages()
    assert sampling.main(["--model", str(tiny_model_path), "--running", "4", "--steps", "2", "--repeats", "1",
                          "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert set(res["overhead"]) == {"every processor", "every processor + top-5 logprobs"}
    assert pages() == before


def test_loading_says_what_it_does(capsys):
    from agentrt.engine import loader

    with loader._status("converting x.gguf (first time only)", off_tty=True):
        pass
    assert "converting x.gguf (first time only)" in capsys.readouterr().err
    with loader._status("loading"):
        pass
    assert capsys.readouterr().err == ""  # off a terminal a plain load stays quiet


def test_run_file_main_is_awaited(tmp_path, tiny_model_path, capsys, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    f = tmp_path / "prog.py"
    f.write_text("import agentrt\n\nasync def main(argv):\n"
                 "    print('ran', argv, type(await agentrt.generate('Hi', max_tokens=2)).__name__)\n    return 3\n")
    assert cli(["run", "--model", str(tiny_model_path), "--policy", "fcfs", str(f), "--", "a", "b"]) == 3
    assert "ran ['a', 'b'] str" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["priority", "retention", "sampling"])
def test_a_bench_on_a_missing_model_says_so_in_one_line(name, capsys):
    assert cli(["bench", name, "--model", "/nonexistent/model"]) == 2
    one_line_error(capsys, f"agentrt bench {name}: error", "unknown model path '/nonexistent/model'")


def test_run_file_plain_main_and_returned_answers(tmp_path, tiny_model_path, capsys, monkeypatch):
    """A plain `def main` runs too (in a worker thread, reaching the runtime through anyio.from_thread), main
    may take no arguments, a returned string is printed and exits 0, an int is the exit code."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    run = ["run", "--model", str(tiny_model_path), "--policy", "fcfs"]
    plain = tmp_path / "plain.py"
    plain.write_text("import anyio, agentrt\n\ndef main(argv):\n"
                     "    text = anyio.from_thread.run(lambda: agentrt.generate('Hi', max_tokens=2))\n"
                     "    return f'answer {argv} {type(text).__name__}'\n")
    assert cli([*run, str(plain), "--", "x"]) == 0
    out = capsys.readouterr()
    assert out.out == "answer ['x'] str\n"
    assert "agentrt engine: " in out.err and "policy fcfs" in out.err  # the start-up line
    bare = tmp_path / "bare.py"
    bare.write_text("async def main():\n    return 'forty-two'\n")
    assert cli([*run, str(bare)]) == 0
    assert capsys.readouterr().out == "forty-two\n"
    code = tmp_path / "code.py"
    code.write_text("def main():\n    return 4\n")
    assert cli([*run, str(code)]) == 4
    assert capsys.readouterr().out == ""
