"""`agentrt` command line: generate | demo | run FILE | bench NAME | simulate (= bench simulate)."""

from __future__ import annotations

import argparse
import importlib
import runpy
import sys
import time

BENCHES = {
    "throughput": "bench.throughput",
    "kernels": "bench.kernels",
    "prefix": "bench.prefix",
    "programs": "bench.programs",
    "simulate": "bench.simulate",
}


def _generate(a: argparse.Namespace) -> int:
    from engine import LLM, SamplingParams

    llm = LLM(a.model)
    prompt = a.prompt
    if a.chat:
        prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                   add_generation_prompt=True)
    params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, seed=a.seed)
    t = time.perf_counter()
    out = llm.generate([prompt], params)[0]
    dt = time.perf_counter() - t
    print(out.text)
    print(f"[{out.num_prompt_tokens} prompt + {out.num_output_tokens} output tokens in {dt:.2f}s, "
          f"finish_reason={out.finish_reason}]", file=sys.stderr)
    return 0


def _demo(a: argparse.Namespace) -> int:
    demo = importlib.import_module("programs.demo")
    return demo.main(["--model", a.model] if a.model else [])


def _run(a: argparse.Namespace) -> int:
    sys.argv = [a.file, *a.args]
    runpy.run_path(a.file, run_name="__main__")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["simulate"]:
        argv = ["bench", *argv]
    if argv[:1] == ["bench"]:
        if len(argv) < 2 or argv[1] not in BENCHES:
            print(f"usage: agentrt bench {{{','.join(BENCHES)}}} [options]", file=sys.stderr)
            return 2
        return importlib.import_module(BENCHES[argv[1]]).main(argv[2:])
    ap = argparse.ArgumentParser(prog="agentrt", description="agent-program runtime with its own LLM engine")
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate text from one prompt with the engine")
    g.add_argument("prompt")
    g.add_argument("--model", default=None, help="HF directory or .gguf file (default: SmolLM2-135M-Instruct)")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.set_defaults(fn=_generate)
    d = sub.add_parser("demo", help="run the example agent programs in-process on the default model")
    d.add_argument("--model", default=None)
    d.set_defaults(fn=_demo)
    r = sub.add_parser("run", help="run a Python file that uses agentrt")
    r.add_argument("file")
    r.add_argument("args", nargs=argparse.REMAINDER)
    r.set_defaults(fn=_run)
    sub.add_parser("bench", help=f"benchmarks: {', '.join(BENCHES)} (agentrt bench NAME --help)")
    sub.add_parser("simulate", help="the program-scheduling benchmark in virtual time (agentrt simulate --help)")
    a = ap.parse_args(argv)
    try:
        return a.fn(a)
    except ValueError as e:  # bad input: say what was wrong, no stack trace
        print(f"agentrt: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
