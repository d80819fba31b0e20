"""Every `agentrt` subcommand, given a missing file, a bad flag value or a missing model, says so in one line
on stderr and exits 2: no usage block (`--help` prints that), no traceback, and nothing loads first. Where a
command reads no file or takes no model, that case does not apply."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

import agentrt

from agentrt.command import BENCHES
from agentrt.command import main as cli

NO_MODEL = "/no/such/model"
BENCHES_WITH_MODEL = ["calibrate", "countdown", "decode-cpu", "embed", "lora", "prefix", "priority", "programs",
                      "replicas", "retention", "sampling", "serve", "simcheck", "structured", "throughput"]


@pytest.fixture
def program_file(tmp_path):
    f = tmp_path / "prog.py"
    f.write_text("async def main(argv):\n    return 'never'\n")
    return str(f)


def exit_status(argv: list[str]) -> int:
    try:
        return cli(argv)
    except SystemExit as e:  # argparse's exit, as the process would see it
        return e.code if isinstance(e.code, int) else 1


def assert_one_line(argv: list[str], capsys, *needles: str) -> None:
    assert exit_status(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert "usage:" not in err and all(n in err for n in needles), err


CASES = [  # (argv, what the line names); FILE is a program file that exists
    # missing file
    (["serve", "--chat-template", "/no/such/template.jinja"], "/no/such/template.jinja"),
    (["serve", "--ssl-keyfile", "/no/key.pem", "--ssl-certfile", "/no/cert.pem"], "/no/key.pem"),
    (["serve", "--lora-modules", "a=/no/such/adapter"], "/no/such/adapter"),
    (["run", "/no/such/file.py"], "no such file: /no/such/file.py"),
    (["run-batch", "-i", "/no/such/batch.jsonl", "-o", "-"], "/no/such/batch.jsonl"),
    # bad flag value
    (["serve", "--port", "abc"], "--port: invalid int value: 'abc'"),
    (["serve", "--log-level", "loud"], "--log-level"),
    (["serve", "--tensor-parallel-size", "2"], "tensor_parallel_size must be 1"),
    (["serve", "--gpu-memory-utilization", "1.5"], "gpu_memory_utilization must be a fraction"),
    (["serve", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["serve", "--router", "pow2"], "--router pow2 needs --replicas N"),
    (["serve", "--replicas", "0"], "--replicas must be >= 1"),
    (["serve", "--running-cap", "0"], "--running-cap must be 'auto' or an integer >= 1, got '0'"),
    (["serve", "--policy", "fcfs", "--running-cap", "auto"], "--running-cap needs a program-level policy"),
    (["serve", "--router", "sticky"], "--router: invalid choice: 'sticky'"),
    (["run", "--policy", "nope", "FILE"], "'nope'"),
    (["generate", "hi", "--max-tokens", "many"], "--max-tokens: invalid int value"),
    (["run-batch", "-i", "-", "-o", "-", "--max-concurrency", "x"], "--max-concurrency"),
    (["demo", "--mcts", "x"], "--mcts: invalid int value"),
    (["simulate", "--rate", "x"], "--rate"),
    (["bench", "nope"], "unknown benchmark 'nope'"),
    # missing model
    (["serve", NO_MODEL], NO_MODEL),
    (["serve", "--model", NO_MODEL], NO_MODEL),
    (["serve", "--replicas", "2", "--model", NO_MODEL], NO_MODEL),
    (["run", "--model", NO_MODEL, "FILE"], NO_MODEL),
    (["generate", "hi", "--model", NO_MODEL], NO_MODEL),
    (["run-batch", "-i", "FILE", "-o", "-", "--model", NO_MODEL], NO_MODEL),
    (["demo", "--model", NO_MODEL], NO_MODEL),
]


@pytest.mark.parametrize("argv, needle", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_every_command_fails_in_one_line(argv, needle, program_file, capsys):
    assert_one_line([program_file if a == "FILE" else a for a in argv], capsys, needle)


@pytest.fixture
def port_in_use():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield str(s.getsockname()[1])


STARTUP_CASES = [  # (argv after `serve --model TINY`, what the line names); FILE: a file, BUSY: a port in use
    (["--kv-disk-dir", "/proc/nope"], "--kv-disk-dir '/proc/nope': cannot make the directory"),
    (["--kv-disk-dir", "FILE"], "--kv-disk-dir"),
    (["--db", "bogus://x"], "--db 'bogus://x': SQLAlchemy has no dialect 'bogus'"),
    (["--db", "sqlite:////proc/nope/records.db"], "--db 'sqlite:////proc/nope/records.db': cannot make"),
    (["--db", "/tmp/records.db"], "--db '/tmp/records.db': not a SQLAlchemy URL"),
    (["--db", "postgresql://agentrt@127.0.0.1:1/none"], "--db 'postgresql://agentrt@127.0.0.1:1/none': cannot connect"),
    (["--db", "mssql+nosuchdriver://x/y"], "--db"),
    (["--port", "70000"], "--port must be in [0, 65535]"),
    (["--port", "-1"], "--port must be in [0, 65535]"),
    (["--port", "BUSY"], "cannot listen there"),
    (["--host", "no.such.host.invalid"], "--host 'no.such.host.invalid' does not resolve"),
    (["--host", "192.0.2.1"], "--host '192.0.2.1'"),  # TEST-NET-1: no interface of this machine has it
    (["--ssl-keyfile", "FILE", "--ssl-certfile", "FILE"], "--ssl-certfile"),
    (["--ssl-keyfile", "FILE"], "--ssl-keyfile and --ssl-certfile go together"),
    (["--root-path", "/x/"], "--root-path must start with '/' and not end with one"),
    (["--generation-config", "/no/such/dir"], "--generation-config '/no/such/dir' is not a directory"),
    (["--generation-config", "FILE"], "--generation-config"),
    (["--override-generation-config", '{"temperature": -1}'], "--override-generation-config"),
    (["--override-generation-config", '{"no_such_field": 1}'], "--override-generation-config"),
    (["--max-model-len", "0"], "--max-model-len must be >= 1"),
]


@pytest.mark.parametrize("argv, needle", STARTUP_CASES, ids=[" ".join(c[0]) for c in STARTUP_CASES])
def test_serve_start_up_failures_are_one_line_before_the_model_loads(argv, needle, tiny_model_path, program_file,
                                                                     port_in_use, monkeypatch, tmp_path, capsys):
    """Each flag that names a path, a URL or an address: a bad value is one line naming the flag, exit 2, and
    nothing loads first (the app, which loads the model, is never made)."""
    import agentrt.server.app

    monkeypatch.setenv("AGENTRT_DB", str(tmp_path / "records.db"))  # the default database, checked too

    def no_load(*args, **kwargs):
        raise AssertionError("the server started loading")

    monkeypatch.setattr(agentrt.server.app, "create_app", no_load)
    given = [{"FILE": program_file, "BUSY": port_in_use}.get(a, a) for a in argv]
    assert_one_line(["serve", "--model", str(tiny_model_path), *given], capsys, needle.replace("FILE", program_file))


SHARED_CASES = [  # the same flags where run-batch, run and demo take them
    (["run-batch", "-i", "FILE", "-o", "-", "--db", "bogus://x"], "--db 'bogus://x'"),
    (["run-batch", "-i", "FILE", "-o", "-", "--kv-disk-dir", "/proc/nope"], "--kv-disk-dir '/proc/nope'"),
    (["run-batch", "-i", "FILE", "-o", "-", "--generation-config", "/no/such/dir"], "--generation-config"),
    (["run", "--kv-disk-dir", "/proc/nope", "FILE"], "--kv-disk-dir '/proc/nope'"),
    (["demo", "--url", "nope"], "--url 'nope': not an http(s) URL"),
    (["demo", "--url", "http://127.0.0.1:1"], "--url 'http://127.0.0.1:1': no server answers there"),
    (["demo", "--url", "http://127.0.0.1:1", "--keep"], "--keep keeps the server the demo starts"),
    (["demo", "--in-process", "--keep"], "--keep"),
]


@pytest.mark.parametrize("argv, needle", SHARED_CASES, ids=[" ".join(c[0]) for c in SHARED_CASES])
def test_shared_flags_fail_in_one_line_before_the_model_loads(argv, needle, tiny_model_path, program_file, monkeypatch,
                                                              capsys):
    import agentrt.server.app

    def no_load(*args, **kwargs):
        raise AssertionError("the model started loading")

    monkeypatch.setattr(agentrt.server.app, "create_app", no_load)
    monkeypatch.setattr(agentrt.Runtime, "__aenter__", no_load)
    given = [program_file if a == "FILE" else a for a in argv]
    assert_one_line([*given[:1], "--model", str(tiny_model_path), *given[1:]], capsys, needle)


@pytest.mark.parametrize("flag, value", [("--kv-disk-dir", "/proc/nope"), ("--db", "bogus://x")])
def test_the_issues_start_up_failures_as_a_process(flag, value, tiny_model_path):
    """As reported: 76 and 80 lines of traceback, exit 1, the model loaded first; now one line and exit 2."""
    p = subprocess.run([sys.executable, "-m", "agentrt.command", "serve", "--model", str(tiny_model_path), flag, value],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and f"{flag} {value!r}" in p.stderr, p.stderr
    assert p.stdout == ""  # not even "loading the model"


@pytest.mark.parametrize("name", sorted(BENCHES))
def test_every_bench_refuses_a_bad_flag_in_one_line(name, capsys):
    assert_one_line(["bench", name, "--no-such-flag", "x"], capsys, ": error: unrecognized arguments: --no-such-flag")


@pytest.mark.parametrize("name", BENCHES_WITH_MODEL)
def test_every_bench_on_a_missing_model_fails_in_one_line(name, capsys):
    assert_one_line(["bench", name, "--model", NO_MODEL], capsys, f"agentrt bench {name}: error", NO_MODEL)


def test_the_usage_is_on_help(capsys):
    with pytest.raises(SystemExit) as e:
        cli(["serve", "--help"])
    assert e.value.code == 0 and "usage: agentrt serve" in capsys.readouterr().out


def test_serve_flags_all_have_help_and_a_default():
    """`agentrt serve --help`: every flag says what it does, and every valued flag what it is when unset."""
    import argparse

    from agentrt.cli import add_commands

    ap = argparse.ArgumentParser(prog="agentrt")
    add_commands(ap.add_subparsers())
    serve = ap._subparsers._group_actions[0].choices["serve"]
    for action in serve._actions:
        if not action.option_strings or action.dest == "help":
            continue
        assert action.help, action.option_strings
        switch = isinstance(action, (argparse._StoreTrueAction, argparse.BooleanOptionalAction)) or action.nargs == 0
        named_default = "default" in action.help or "implies" in action.help or action.dest in ("api_key",)
        assert switch or named_default or action.choices, (action.option_strings, action.help)


def test_the_real_command_exits_2_in_one_line():
    """The installed command, as a process: `agentrt serve` of a missing model (was a 25-line uvicorn
    traceback and exit 3)."""
    p = subprocess.run([sys.executable, "-m", "agentrt.command", "serve", "/nope/model.gguf"], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "/nope/model.gguf" in p.stderr, p.stderr


def test_replicas_without_ray_say_how_to_get_it(monkeypatch, capsys, default_model_path):
    monkeypatch.setitem(sys.modules, "ray", None)  # as on a machine without the extra: `import ray` fails
    monkeypatch.delitem(sys.modules, "agentrt.scale.ray_app", raising=False)
    import agentrt.scale

    monkeypatch.delattr(agentrt.scale, "ray_app", raising=False)  # imported again, so `import ray` runs
    assert_one_line(["serve", "--replicas", "2", "--model", str(default_model_path)], capsys,
                    "--replicas needs Ray Serve", "pip install 'agentrt[ray]'")


def test_serve_without_replicas_never_imports_ray():
    code = ("import sys, agentrt.cli, agentrt.server, agentrt.scale; from agentrt.command import main; "
            "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr[-2000:]
