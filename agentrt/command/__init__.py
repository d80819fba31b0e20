"""The `agentrt` command: serve | generate | run FILE | demo | bench NAME | simulate (= bench simulate).

The top floor of the house: it may start example programs (`programs/`) and benchmarks (`agentrt/bench/`),
which the runtime library `agentrt` never imports. `serve` and `generate` are the library's own
commands (`agentrt.cli`, also `python -m agentrt.cli`).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from agentrt import cli as lib_cli
from agentrt.command import programs
from agentrt._cli_options import (
    DETERMINISTIC_HELP,
    add_kv_tier_options,
    kv_tier_options,
    one_line_usage_errors,
    usage_error,
)
from agentrt.policies import POLICY_KWARGS_HELP, POLICY_NAMES, policy_options

BENCHES = {
    "throughput": "agentrt.bench.throughput",
    "decode-cpu": "agentrt.bench.decode_cpu",
    "priority": "agentrt.bench.priority",
    "kernels": "agentrt.bench.kernels",
    "prefix": "agentrt.bench.prefix",
    "programs": "agentrt.bench.programs",
    "simulate": "agentrt.bench.simulate",
    "calibrate": "agentrt.bench.calibrate",
    "simcheck": "agentrt.bench.simcheck",
    "serve": "agentrt.bench.serve",
    "countdown": "agentrt.bench.countdown",
    "retention": "agentrt.bench.retention",
    "sampling": "agentrt.bench.sampling",
    "structured": "agentrt.bench.structured",
    "embed": "agentrt.bench.embed",
    "lora": "agentrt.bench.lora",
    "replicas": "agentrt.bench.replicas",
    "tiers": "agentrt.bench.tiers",
    "fanout": "agentrt.bench.fanout",
    "quant": "agentrt.bench.quant",
    "paging": "agentrt.bench.paging",
    "agent-loop": "agentrt.bench.agent_loop",
}


def _run(a: argparse.Namespace) -> int:
    from agentrt.command.run import run_file

    args = a.args[1:] if a.args[:1] == ["--"] else a.args
    if a.deterministic is not None and a.url is not None:
        return usage_error("agentrt run", "--[no-]deterministic sets the in-process engine; with --url give it to "
                                          "agentrt serve")
    tiers = kv_tier_options(a)
    if tiers and a.url is not None:
        return usage_error("agentrt run", "the KV tier flags set the in-process engine; with --url give them to "
                                          "agentrt serve")
    if a.policy_kwargs is not None and a.url is not None:
        return usage_error("agentrt run", "--policy-kwargs sets the in-process engine's policy; with --url give it "
                                          "to agentrt serve")
    try:
        policy_kwargs = policy_options(a.policy, a.policy_kwargs)
    except ValueError as e:
        return usage_error("agentrt run", str(e))
    return run_file(a.file, args, url=a.url, api_key=a.api_key, model=a.model, policy=a.policy,
                    policy_kwargs=policy_kwargs, deterministic=a.deterministic, engine=tiers)


def main(argv: list[str] | None = None) -> int:
    with one_line_usage_errors():
        return _main(list(sys.argv[1:] if argv is None else argv))


def _main(argv: list[str]) -> int:
    if argv[:1] == ["simulate"]:
        argv = ["bench", *argv]
    if argv[:1] == ["demo"]:
        return _user_errors("agentrt demo", lambda: importlib.import_module("agentrt.programs.demo").main(argv[1:]))
    if argv[:1] == ["bench"]:
        if argv[1:2] in (["-h"], ["--help"]):
            print(f"usage: agentrt bench {{{','.join(BENCHES)}}} [options]  (agentrt bench NAME --help)")
            return 0
        if len(argv) < 2 or argv[1] not in BENCHES:
            got = f"unknown benchmark {argv[1]!r}" if len(argv) > 1 else "no benchmark named"
            return usage_error("agentrt bench", f"{got}: give one of {', '.join(BENCHES)} (agentrt bench NAME --help)")
        return _user_errors(f"agentrt bench {argv[1]}", lambda: importlib.import_module(BENCHES[argv[1]]).main(argv[2:]))
    ap = argparse.ArgumentParser(prog="agentrt", description="agent-program runtime with its own LLM engine")
    sub = ap.add_subparsers(dest="cmd", required=True)
    lib_cli.add_commands(sub)
    sub.add_parser("demo", help="serve the default model and run the example programs against it, with a live "
                   "table (agentrt demo --help)")
    r = sub.add_parser("run", help="run a program file: its `main(argv)` inside an in-process runtime, "
                       "or against a server with --url", description=_RUN_HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("--url", default=None, help="run against this `agentrt serve` server (agentrt.connect)")
    r.add_argument("--api-key", default=None, help="API key for --url (default: $AGENTRT_API_KEY)")
    r.add_argument("--model", default=None, help="in-process: HF directory or .gguf file (default: SmolLM2-135M-Instruct)")
    r.add_argument("--policy", default="plas", choices=POLICY_NAMES, help="in-process policy")
    r.add_argument("--policy-kwargs", default=None, metavar="JSON", help=f"in-process: {POLICY_KWARGS_HELP}")
    r.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=None,
                   help=f"in-process: {DETERMINISTIC_HELP}")
    add_kv_tier_options(r)
    r.add_argument("file")
    r.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the file's main (after --)")
    r.set_defaults(fn=_run)
    sub.add_parser("bench", help=f"benchmarks: {', '.join(BENCHES)} (agentrt bench NAME --help)")
    sub.add_parser("simulate", help="the program-scheduling benchmark in virtual time (agentrt simulate --help)")
    programs.add_parser(sub)
    return lib_cli.dispatch(ap.parse_args(argv))


def _user_errors(prog: str, run) -> int:
    """Run a command; a user error (a `SystemExit` with a message, an `InvalidRequestError`, a model that
    is not there) prints one line and exits 2, never a traceback."""
    from agentrt.engine.errors import InvalidRequestError
    from agentrt.engine.loader import ModelNotFoundError

    try:
        return run()
    except SystemExit as e:
        if isinstance(e.code, str):
            print(f"{prog}: error: {e.code}", file=sys.stderr)
            return 2
        raise
    except (InvalidRequestError, ModelNotFoundError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2


_RUN_HELP = """\
Run FILE with agentrt:

  agentrt run programs/mcts.py -- --budget 8                 # in-process engine
  agentrt run --url http://127.0.0.1:8000 programs/mcts.py   # the same code against agentrt serve

When FILE defines `main(argv)` (or `main()`), it runs with the arguments after `--` inside the runtime
this command enters (agentrt.Runtime, or agentrt.connect(URL) with --url): an `async def main` is
awaited, a plain `def main` is called in a worker thread. What main returns decides the outcome: an int
is the exit code, None exits 0, anything else (an answer string) is printed and exits 0. A FILE
without a main runs as a plain script (`__name__ == "__main__"`).
"""
