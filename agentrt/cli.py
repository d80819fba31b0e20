"""The runtime library's own commands: `python -m agentrt.cli serve | generate | run-batch`.

The `agentrt` command (`agentrt/command/`, the top floor) adds `run`, `demo`, `bench` and `simulate`,
which start example programs and benchmarks; this module, like the rest of `agentrt`, imports
neither `programs` nor `bench`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import TYPE_CHECKING

from agentrt import run_batch
from agentrt._cli_options import DETERMINISTIC_HELP, add_engine_options, engine_options, one_line_usage_errors
from agentrt._reasoning import REASONING_PARSERS
from agentrt._toolparsers import PARSER_CHOICES
from agentrt.engine.pooling import POOLING_METHODS
from agentrt.policies import POLICY_KWARGS_HELP, POLICY_NAMES, parse_running_cap, policy_options

if TYPE_CHECKING:
    from agentrt.server import ServerConfig

_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def _generate(a: argparse.Namespace) -> int:
    from agentrt.engine import SamplingParams, StreamDelta
    from agentrt.engine.config import EngineConfig

    # every argument is checked before the model loads (seconds)
    params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                            seed=a.seed, stop=a.stop, n=a.n)
    config = EngineConfig(model=a.model, dtype=a.dtype, device=a.device, num_scheduler_steps=a.num_scheduler_steps,
                          deterministic=a.deterministic)
    if not a.prompt:
        raise ValueError("the prompt is empty")
    from agentrt.engine import LLM
    from agentrt.engine.loader import resolve_model

    resolve_model(a.model)  # an unknown path fails here, before any conversion or load
    llm = LLM(config)
    prompt = a.prompt
    if a.chat:
        prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                   add_generation_prompt=True)
    t = time.perf_counter()
    if a.stream:
        def show(d: StreamDelta) -> None:
            if d.new_text:
                print(d.new_text if params.n == 1 else f"[{d.index}] {d.new_text!r}", end="" if params.n == 1 else "\n",
                      flush=True)

        out = llm.generate([prompt], params, progress=False, on_delta=show)[0]
        if params.n == 1:
            print()
    else:
        out = llm.generate([prompt], params, progress=False)[0]
        for c in out.outputs:
            print(c.text if params.n == 1 else f"--- completion {c.index} ({c.finish_reason})\n{c.text}")
    dt = time.perf_counter() - t
    reasons = ",".join(str(c.finish_reason) for c in out.outputs)
    print(f"[{out.num_prompt_tokens} prompt + {out.num_output_tokens} output tokens in {dt:.2f}s, "
          f"finish_reason={reasons}]", file=sys.stderr)
    return 0


def _serve(a: argparse.Namespace) -> int:
    from agentrt.server import ServerConfig, serve
    from agentrt.server.config import env_api_keys

    # every argument is checked before the model loads
    if a.model_tag is not None and a.model is not None and a.model_tag != a.model:
        raise ValueError(f"two models given: {a.model_tag!r} (positional) and {a.model!r} (--model); give one")
    engine = engine_options(a)
    cors = {name: _json_strings(flag, text) for name, flag, text in (
        ("allowed_origins", "--allowed-origins", a.allowed_origins),
        ("allowed_methods", "--allowed-methods", a.allowed_methods),
        ("allowed_headers", "--allowed-headers", a.allowed_headers)) if text is not None}
    policy_kwargs = policy_options(a.policy, a.policy_kwargs)
    if a.running_cap is not None:
        if a.policy not in ("plas", "plas+ttl", "atlas", "atlas+ttl"):
            raise ValueError(f"--running-cap needs a program-level policy (plas, atlas, +ttl), not --policy {a.policy}")
        try:
            policy_kwargs = {**(policy_kwargs or {}), "running_cap": parse_running_cap(a.running_cap)}
        except ValueError as e:
            raise ValueError(f"--running-cap {e}") from None
    config = ServerConfig(
        model=a.model_tag or a.model, policy=a.policy, policy_kwargs=policy_kwargs, engine=engine, db=a.db,
        api_keys=[*a.api_key, *env_api_keys()],
        served_model_name=a.served_model_name, program_idle_timeout_s=a.program_idle_timeout,
        otlp_traces_endpoint=a.otlp_traces_endpoint,
        max_waiting=a.max_waiting, drain_timeout_s=a.drain_timeout, max_body_bytes=a.max_body_bytes, max_n=a.max_n,
        max_tokens_limit=a.max_tokens_limit, exclude_tools_when_tool_choice_none=a.exclude_tools_when_tool_choice_none,
        chat_template=a.chat_template, trust_request_chat_template=a.trust_request_chat_template,
        allow_credentials=a.allow_credentials, reasoning_parser=a.reasoning_parser,
        tool_call_parser=a.tool_call_parser, pooling=a.pooling,
        max_embedding_inputs=a.max_embedding_inputs, lora_modules=a.lora_modules,
        return_tokens_as_token_ids=a.return_tokens_as_token_ids, **cors,
        **({} if a.allow_runtime_lora_updating is None else {"allow_runtime_lora_updating": True}),
    )
    if a.replicas is not None or a.ray_address is not None:
        return _serve_replicas(a, config)
    if a.router != "program":
        raise ValueError(f"--router {a.router} needs --replicas N (one server has nothing to route between)")
    return serve(config, a.host, a.port, a.log_level, root_path=a.root_path, ssl_keyfile=a.ssl_keyfile,
                 ssl_certfile=a.ssl_certfile, access_log=not a.disable_uvicorn_access_log)


def _serve_replicas(a: argparse.Namespace, config: ServerConfig) -> int:
    replicas = 2 if a.replicas is None else a.replicas
    if replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {replicas}")
    try:
        from agentrt.scale import ray_app
    except ImportError as e:
        raise ValueError(f"--replicas needs Ray Serve ({e.name or e} is not installed): pip install 'agentrt[ray]'") \
            from None
    from agentrt.server.startup import check_startup

    check_startup(config, host=a.host, port=a.port)  # the model, the database, the address: before Ray starts
    return ray_app.serve_replicas(config, a.host, a.port, replicas, a.router, a.ray_address)


def _json_strings(flag: str, text: str) -> list[str]:
    try:
        v = json.loads(text)
    except ValueError:
        v = None
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise ValueError(f"{flag} must be a JSON list of strings such as '[\"http://localhost:3000\"]', got {text!r}")
    return v


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Add `generate`, `serve` and `run-batch` to a command line (this one's and the `agentrt` command's)."""
    g = sub.add_parser("generate", help="generate text from one prompt with the engine")
    g.add_argument("prompt")
    g.add_argument("--model", default=None, help="HF directory or .gguf file (default: SmolLM2-135M-Instruct)")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1, help="-1 = off")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--n", type=int, default=1, help="completions")
    g.add_argument("--stream", action="store_true", help="print the text as it is generated")
    g.add_argument("--dtype", default=None)
    g.add_argument("--device", default=None)
    g.add_argument("--num-scheduler-steps", type=int, default=8,
                   help="greedy decode steps per scheduler call (vLLM's multi-step scheduling; tokens come in bursts of this many)")
    g.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=None, help=DETERMINISTIC_HELP)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.set_defaults(fn=_generate)
    s = sub.add_parser("serve", help="serve the runtime over an OpenAI-compatible HTTP API keyed by program id")
    s.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", help="the model, as --model")
    s.add_argument("--model", default=None, help="HF directory or .gguf file (default: SmolLM2-135M-Instruct)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, this machine "
                   "only; 0.0.0.0: every interface)")
    s.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    s.add_argument("--root-path", default="", metavar="PATH",
                   help="path prefix a proxy serves this server under (uvicorn's; default: none)")
    s.add_argument("--ssl-keyfile", default=None, metavar="FILE",
                   help="HTTPS: the key file (with --ssl-certfile; default: plain HTTP)")
    s.add_argument("--ssl-certfile", default=None, metavar="FILE",
                   help="HTTPS: the certificate (with --ssl-keyfile; default: plain HTTP)")
    s.add_argument("--policy", default="plas", choices=POLICY_NAMES, help="how waiting calls are ordered: "
                   f"{', '.join(POLICY_NAMES)} (default: plas, least attained service of the program first)")
    s.add_argument("--policy-kwargs", default=None, metavar="JSON", help=POLICY_KWARGS_HELP)
    s.add_argument("--running-cap", default=None, metavar="auto|N",
                   help="plas / atlas: while calls wait, run at most N calls at once, in program order, a better "
                   "waiting call displacing the worst running one; 'auto': the knee of this engine's measured step "
                   "cost, where a wider batch adds under 10%% throughput (default: none, --max-num-seqs alone)")
    s.add_argument("--db", default=None, help="SQLAlchemy URL for program and call records (default: a SQLite "
                   "file per served model under ~/.cache/agentrt/records; 'none' keeps no records). A database holds "
                   "one server's records: at start-up the programs a previous run left running become 'interrupted'")
    s.add_argument("--api-key", action="append", default=[], help="accepted API key (repeatable; also "
                   "$AGENTRT_API_KEYS); with keys set every endpoint but /health needs one (default: none, no "
                   "authentication)")
    s.add_argument("--allowed-origins", default=None, metavar="JSON", help="CORS: JSON list of origins browsers "
                   "may call from, e.g. '[\"http://localhost:3000\"]' or '[\"*\"]' (default: no CORS)")
    s.add_argument("--allowed-methods", default=None, metavar="JSON", help="CORS: JSON list of methods (default: any)")
    s.add_argument("--allowed-headers", default=None, metavar="JSON",
                   help="CORS: JSON list of request headers (default: any)")
    s.add_argument("--allow-credentials", action="store_true", help="CORS: allow cookies and credentials")
    s.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model id clients use (default: the model file's or directory's name)")
    s.add_argument("--chat-template", default=None, metavar="TEMPLATE",
                   help="Jinja chat template, or a path to one, for every chat call (default: the model's)")
    s.add_argument("--trust-request-chat-template", action="store_true",
                   help="let a request bring its own chat_template (vLLM's flag; off: such a request is a 400)")
    s.add_argument("--program-idle-timeout", type=float, default=600.0, help="seconds without calls after which "
                   "a program ends by itself (default: 600)")
    s.add_argument("--max-waiting", type=int, default=256,
                   help="queued calls beyond which new calls get 429 (default: 256)")
    s.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds in-flight requests get (default: 30)")
    s.add_argument("--max-body-bytes", type=int, default=4 << 20,
                   help="larger request bodies get 413 (default: 4194304, 4 MiB)")
    s.add_argument("--max-n", type=int, default=16, help="completions one call may ask for (n) at most (default: 16)")
    s.add_argument("--max-tokens-limit", type=int, default=None, help="largest max_tokens accepted (default: context)")
    s.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="export an OpenTelemetry span per program with a child span per call to this OTLP/HTTP "
                        "endpoint (vLLM's flag; e.g. http://localhost:4318; needs the otel extra; default: off)")
    add_engine_options(s)
    s.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                   help="leave the tools out of the prompt of a call with tool_choice 'none' (vLLM's flag; by default "
                        "they stay, so the calls of a conversation share their prompt's prefix)")
    s.add_argument("--reasoning-parser", default=None, metavar="NAME",
                   help="split reasoning models' thinking (<think>...</think>) from their answer into the reply's "
                        f"`reasoning` field (vLLM's flag; one of {', '.join(sorted(REASONING_PARSERS))}; "
                        "default: none)")
    s.add_argument("--tool-call-parser", default="auto", metavar="NAME",
                   help="the format tool calls are read in (vLLM's flag; one of " + ", ".join(PARSER_CHOICES) +
                        "); default auto: the one the chat template teaches when it renders tools, else hermes")
    s.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="log-probs name tokens as 'token_id:{id}', so tokens that are not whole UTF-8 stay "
                        "identifiable (vLLM's flag; a request's return_tokens_as_token_ids overrides it)")
    s.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM's command lines; does nothing: tool_choice 'auto' is always on")
    s.add_argument("--pooling", default=None, choices=POOLING_METHODS,
                   help="how /v1/embeddings pools a prompt's final hidden states (default: what the checkpoint's "
                        "sentence-transformers files declare, else the last token's)")
    s.add_argument("--max-embedding-inputs", type=int, default=2048,
                   help="inputs of one /v1/embeddings request at most (default: 2048)")
    s.add_argument("--allow-runtime-lora-updating", action="store_true", default=None,
                   help="answer /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM: "
                        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=true)")
    s.add_argument("--log-level", default="info", choices=_LOG_LEVELS, help="uvicorn's and the server's log level "
                   "(default: info)")
    s.add_argument("--disable-uvicorn-access-log", action="store_true", help="no uvicorn log line per request")
    s.add_argument("--replicas", type=int, default=None, metavar="N",
                   help="serve N engine replicas on Ray Serve behind one port (needs `pip install 'agentrt[ray]'`; "
                        "default: one engine, no Ray)")
    s.add_argument("--router", default="program", choices=("program", "pow2", "round-robin", "prefix"),
                   help="where each call goes among --replicas: program (a program's calls stay with its KV, with a "
                        "load guard), or Ray's own pow2, round-robin, prefix (default: program)")
    s.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="join a running Ray cluster instead of starting a local one (with --replicas; default: local)")
    s.set_defaults(fn=_serve)
    run_batch.add_command(sub)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m agentrt.cli", description="the runtime library's own commands "
                                 "(the `agentrt` command adds run, demo, bench, simulate)")
    add_commands(ap.add_subparsers(dest="cmd", required=True))
    with one_line_usage_errors():
        return dispatch(ap.parse_args(argv))


def dispatch(a: argparse.Namespace) -> int:
    try:
        return a.fn(a)
    except ValueError as e:  # bad input: say what was wrong, no stack trace
        print(f"agentrt: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
