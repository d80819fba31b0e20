"""The runtime: an in-process engine, the process table, and the calls programs make.

    async with agentrt.Runtime(policy="plas") as rt:   # becomes the current runtime
        text = await agentrt.chat([{"role": "user", "content": "hi"}], max_tokens=32)

`chat` / `generate` find the runtime and the calling program through context variables. A call
made outside any program is a one-call program of its own.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import anyio

import agentrt.policies  # noqa: F401  (registers plas / atlas / mlfq with the engine)
from agentrt._beam import BeamSearchCall, beam_search_in_program, submit_beam_search
from agentrt._call import Call
from agentrt._chat import PreparedCall, SamplingFor, merge_sampling, openai_names, prepare_chat
from agentrt._chat_plan import ChatPlan, Reply, ReplyStreamer
from agentrt._chat_prompt import ChatPrompts, pop_template_options
from agentrt._config import RuntimeConfig
from agentrt._context import _runtime
from agentrt._embed import embed_inputs
from agentrt._errors import (
    ConfigError,
    InvalidCallError,
    NoRuntimeError,
    UsageError,
)
from agentrt._lora import LoRAModules, parse_lora_modules
from agentrt._messages import chat_messages
from agentrt._process_table import ProcessTable, ProgramInfo, ProgramStatus
from agentrt._program import ProgramHandle, calling_program, current
from agentrt._programs import ANY_OWNER, ProgramManager, RuntimeObserver
from agentrt._reasoning import reasoning_parser as make_reasoning_parser
from agentrt._results import Choice, Chunk, Result, Usage, token_logprobs, wants_result
from agentrt._retention import RetentionConfig, RetentionPolicy
from agentrt._timeline import Timeline, TimelineKeeper, build_timeline, in_flight
from agentrt._toolcalls import response_format_constraint, tool_specs
from agentrt._toolparsers import tool_call_parser as make_tool_parser
from agentrt.engine import AsyncEngine, EngineConfig, SamplingParams, SchedulingPolicy, make_policy
from agentrt.engine.beam_search import BeamSearchParams
from agentrt.engine.client import EngineInfo, EngineStats
from agentrt.engine.kv_cache_manager import OwnerKV
from agentrt.engine.lora import LoRARequest
from agentrt.engine.outputs import RequestOutput, StreamDelta
from agentrt.engine.pooling import ClassificationOutput, PoolingParams
from agentrt.engine.sampling_params import truncate_prompt
from agentrt.engine.structured import Constraint


class Runtime:
    """Owns an in-process `AsyncEngine` and the process table; an async context manager.

    Arguments:
        model: model directory or .gguf file; None = the default model. Or a `RuntimeConfig` holding
            every argument below (a server's `ServerConfig` is one), and then nothing else.
        policy: scheduling policy name ("plas", "atlas", "mlfq", "fcfs") or a policy instance.
        policy_kwargs: arguments for a policy given by name (e.g. `{"beta": 4.0}`).
        reasoning_parser: vLLM's `--reasoning-parser` ("qwen3", "deepseek_r1"): chat replies come
            with the thinking apart from the answer (agentrt._reasoning); None: the text as written.
        tool_call_parser: vLLM's `--tool-call-parser` ("hermes", "llama3_json", "mistral", "pythonic"):
            the format tool calls are read in (agentrt._toolparsers); "auto": the format the chat
            template teaches when it renders tools, else Hermes (ours, described in the system message).
        lora_modules: LoRA adapters served by name (vLLM's `--lora-modules`): {name: directory}, or
            `name=path` strings; a call names one as its model (`chat(..., model="sql")`). Giving any
            turns on the engine's enable_lora (adapters loaded later: `load_lora_adapter`).
        **engine_config: any other `engine.EngineConfig` field (num_blocks, max_num_seqs, ...).
    """

    def __init__(
        self,
        model: str | RuntimeConfig | None = None,
        policy: str | SchedulingPolicy = "plas",
        *,
        policy_kwargs: dict[str, Any] | None = None,
        program_idle_timeout_s: float | None = None,
        retention: RetentionConfig | bool = True,
        reasoning_parser: str | None = None,
        tool_call_parser: str | None = "auto",
        lora_modules: Any = None,
        trace: bool | str = False,
        **engine_config: Any,
    ) -> None:
        if isinstance(model, RuntimeConfig):
            given = (policy != "plas", policy_kwargs, program_idle_timeout_s, retention is not True, reasoning_parser,
                     tool_call_parser != "auto", lora_modules, trace, engine_config)
            if any(given):
                raise ConfigError("give a RuntimeConfig or keyword arguments, not both")
            config = model
        else:
            try:
                config = RuntimeConfig(model, policy, policy_kwargs, dict(engine_config), program_idle_timeout_s,
                                       retention, reasoning_parser, tool_call_parser, lora_modules, trace)
            except (TypeError, ValueError) as e:
                if isinstance(e, ConfigError):
                    raise
                raise ConfigError(f"bad runtime configuration: {e}") from None
        self.config = config
        self.model_names = config.model_names()  # what a call's `model` may name the base model by (as `serve` does)
        self.loras = LoRAModules()  # adapter name -> engine.LoRARequest
        for name, path, base in parse_lora_modules(config.lora_modules):
            try:
                self.loras.add(name, path, base)
            except ValueError as e:
                raise ConfigError(f"bad lora_modules: {e}") from None
        engine_config = dict(config.engine)
        if self.loras:
            engine_config.setdefault("enable_lora", True)
        try:
            self.reasoning = make_reasoning_parser(config.reasoning_parser)  # splits chat replies' thinking off
            self.tool_parser = make_tool_parser(config.tool_call_parser)  # reads chat replies' calls; None: per template
            self.retention_config = config.retention  # KV pins across tool calls, reservations (agentrt._retention)
            self.policy = make_policy(config.policy, **(config.policy_kwargs or {}))
            self.engine_config = EngineConfig(model=config.model, policy=self.policy, **engine_config)
        except (TypeError, ValueError) as e:
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(f"bad runtime configuration: {e}") from None
        self.program_idle_timeout_s = config.program_idle_timeout_s  # programs keyed by id end after this long idle
        self.engine: AsyncEngine | None = None
        self._chat = ChatPrompts()  # per program: its last chat prompt and reply
        # programs, their calls in flight, retention, observers (agentrt._programs)
        self.program_manager = ProgramManager(self.policy, self, self._chat)
        self.programs: ProcessTable = self.program_manager.table
        self.observers: list[RuntimeObserver] = self.program_manager.observers  # told of program starts / ends, call ends
        self.timelines = TimelineKeeper() if config.trace else None  # `timeline`'s records (trace=True)
        if self.timelines is not None:
            self.observers.append(self.timelines)
        self.tracer: Any = None  # agentrt._tracing.OtlpTracer while it runs with trace=URL
        self._token: contextvars.Token | None = None
        self._stack: contextlib.AsyncExitStack | None = None

    async def __aenter__(self) -> Runtime:
        stack = contextlib.AsyncExitStack()
        try:
            engine = AsyncEngine(self.engine_config)
            stack.callback(engine.close)  # after the engine stops serving: its thread goes (engine/engine_thread.py)
            self.engine = await stack.enter_async_context(engine)
            for req in self.loras.requests():  # a bad adapter fails the start, naming it
                try:
                    await engine.load_lora(req)
                except ValueError as e:
                    raise ConfigError(str(e)) from None
            pm = self.program_manager
            pm.engine_started(engine, self.retention_config)
            if isinstance(self.config.trace, str):
                self.start_tracing(self.config.trace)
                stack.callback(self.stop_tracing)  # after the programs still running ended
            self._chat.tokenizer = engine.tokenizer
            if self.program_idle_timeout_s is not None:
                tg = await stack.enter_async_context(anyio.create_task_group())
                stack.callback(tg.cancel_scope.cancel)  # runs before the group exits
                tg.start_soon(pm.reap_idle, self.program_idle_timeout_s)
        except BaseException:
            await stack.aclose()
            raise
        self._stack = stack
        self._token = _runtime.set(self)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._stack is not None and self._token is not None
        _runtime.reset(self._token)
        try:
            self.program_manager.end_all("cancelled", "the runtime stopped")
            await self._stack.aclose()
        finally:
            self.program_manager.engine_stopped()
            self._stack = self._token = None

    def start_tracing(self, endpoint: str) -> None:
        """Export a span per program and call to the OTLP/HTTP traces `endpoint` from now on (agentrt._tracing)."""
        from agentrt._tracing import OtlpTracer

        if self.tracer is None:
            self.tracer = OtlpTracer(endpoint, self.programs, model=self.model_names[0],
                                     policy=getattr(self.policy, "name", str(self.config.policy)))
            self.observers.append(self.tracer)

    def stop_tracing(self) -> None:
        """End the open program spans and flush them."""
        tracer, self.tracer = self.tracer, None
        if tracer is not None:
            self.observers.remove(tracer)
            tracer.shutdown()

    def timeline(self, program_id: str, *, owner: Any = ANY_OWNER) -> Timeline:
        """The program's timeline (agentrt._timeline): its calls in flight now, and its ended calls when this
        runtime keeps them (`Runtime(trace=True)`; UsageError otherwise)."""
        if self.timelines is None:
            raise UsageError("program timelines are kept with Runtime(trace=True); this runtime has trace=False")
        info = self.program(program_id, owner=owner)
        to_wall = time.time() - time.monotonic()
        calls = [*self.timelines.calls.get(program_id, ()), *in_flight(info, self.engine, to_wall)]
        return build_timeline(program_id, info.name, info.state, info.start_time + to_wall,
                              None if info.end_time is None else info.end_time + to_wall, calls)

    @property
    def tokenizer(self) -> Any:
        return self._engine().tokenizer

    @property
    def engine_info(self) -> EngineInfo:
        """The served model and the engine's settings (engine.client.EngineInfo); NoRuntimeError when stopped."""
        return self._engine().info

    def check_prompt(self, prompt: str | list[int]) -> list[int]:
        """The token ids of a prompt the engine can run; InvalidRequestError (a ValueError) naming what is wrong."""
        return self._engine().check_prompt(prompt)

    async def engine_stats(self) -> EngineStats:
        """A snapshot of the engine's state between steps (engine.client.EngineStats)."""
        return await self._engine().stats()

    @property
    def retention(self) -> RetentionPolicy | None:
        """KV pins across tool calls and reservations (agentrt._retention), while the engine runs."""
        return self.program_manager.retention

    async def load_lora_adapter(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """Serve the LoRA adapter at `path` under `name` from now on (vLLM's /v1/load_lora_adapter); the
        engine needs enable_lora. Its files are read and checked here, in a worker thread; a bad adapter or
        a taken name raises InvalidCallError and leaves nothing behind."""
        try:
            req = self.loras.add(name, path, base_model_name)
        except ValueError as e:
            raise InvalidCallError(str(e), param="lora_name") from None
        try:
            await self._engine().load_lora(req)
        except BaseException as e:
            self.loras.remove(name)
            if isinstance(e, ValueError):
                raise InvalidCallError(str(e), param="lora_path") from None
            raise
        return req

    def unload_lora_adapter(self, name: str) -> LoRARequest:
        """Stop serving the adapter `name` (calls running with it finish with it); KeyError if none has it."""
        req = self.loras.remove(name)
        self._engine().unload_lora(req.lora_int_id)
        return req

    async def classifications(self, pooled: list[list[float]]) -> list[ClassificationOutput]:
        """Class probabilities of pooled last-token states through the model's score head (on the engine's
        thread): what /classify answers. InvalidCallError when the model has no score head."""
        if not self.engine_info.has_score_head:
            raise InvalidCallError(f"the served model {self.engine_info.model_name!r} has no classification head")
        return await self._engine().classify([str(i) for i in range(len(pooled))], pooled)

    def resolve_model(self, model: Any, program_id: str | None = None) -> LoRARequest | None:
        """The LoRA adapter a call's `model` names; None for the base model: no model, or one of `model_names`
        (its name as `agentrt serve` serves it, its path). InvalidCallError naming any other."""
        return self.loras.resolve(model, program_id, self.model_names)

    def kv_stats(self) -> Any:
        return self._engine().kv_stats()

    async def reset_prefix_cache(self) -> bool:
        """Forget the engine's cached prefixes that no call holds (vLLM's reset_prefix_cache; programs' pins
        stay): later calls compute them again. True when nothing cached is left."""
        return await self._engine().reset_prefix_cache()

    def _engine(self) -> AsyncEngine:
        if self.engine is None:
            raise NoRuntimeError("the runtime is not running: enter it with `async with`")
        return self.engine

    # --- programs (agentrt._programs.ProgramManager) ------------------------------------------
    def program_started(self, info: ProgramInfo) -> None:
        """A `@program` function's program starts (agentrt._context.Host)."""
        self.program_manager.program_started(info)

    def program_exited(self, handle: ProgramHandle, state: ProgramStatus, error: str | None) -> None:
        """A program ends: its calls in flight are aborted, all it holds released (agentrt._context.Host)."""
        self.program_manager.program_exited(handle, state, error)

    async def program_settled(self, handle: ProgramHandle) -> None:
        """Nothing to wait for: an ended program's record is final when it exits (agentrt._context.Host)."""

    def abort_program(self, program_id: str) -> int:
        """Abort every in-flight call of a program (its awaiting `chat`s raise `CallAbortedError`)."""
        return self.program_manager.abort_program(program_id, self._engine())

    def start_program(self, program_id: str | None = None, *, name: str = "program", owner: str | None = None,
                      priority: int = 0) -> ProgramInfo:
        """Start a program known by id rather than by a running `@program` function (the server's
        programs). Its calls go through `submit(..., program_id=...)`; it ends with `end_program`,
        or by itself after `program_idle_timeout_s` without calls. An id whose program has ended may
        be started again (a new record replaces the old). `priority`: its calls' scheduling class."""
        return self.program_manager.start_program(program_id, name=name, owner=owner, priority=priority).info

    def end_program(self, program_id: str, *, owner: Any = ANY_OWNER, state: ProgramStatus = "finished") -> ProgramInfo:
        """End a program started by id: abort its calls in flight and release all it holds."""
        return self.program_manager.end_program(program_id, owner=owner, state=state)

    def program(self, program_id: str, *, owner: Any = ANY_OWNER) -> ProgramInfo:
        """A program's record (running or ended, while the process table keeps it)."""
        return self.program_manager.program(program_id, owner)

    def program_queue_level(self, program_id: str) -> int | None:
        """The best (lowest) queue level among the program's calls in the engine; None if it has none
        or the policy has no levels."""
        return self.program_manager.program_queue_level(program_id)

    def credit_service(self, program_id: str, attained_s: float, critical_s: float = 0.0) -> None:
        """The service `program_id` received on other replicas (totals): PLAS / ATLAS order its calls here
        by that plus what this engine gave it. A Ray replica's sync calls it; any thread."""
        self.policy.credit_service(program_id, attained_s, critical_s)

    def program_kv_blocks(self, program_id: str) -> int:
        """KV blocks the program's calls in the engine hold now (blocks its threads share count once)."""
        return self.program_manager.program_kv_blocks(program_id)

    def program_kv(self, program_id: str) -> OwnerKV | None:
        """The program's KV in the engine now: blocks held, pinned, reserved; its TTL hits, misses,
        expiries and recomputed prefill tokens (None when the engine is not running)."""
        return self.program_manager.program_kv(program_id)

    def tool_started(self, info: ProgramInfo | None, tool: str, ttl_s: float | None = None) -> None:
        """The program runs `tool` now: its KV is pinned for the tool's TTL (`ttl_s` if given)."""
        if info is not None:
            info.last_tool = tool  # its next call's record names it (program timelines)
        retention = self.program_manager.retention
        if info is not None and retention is not None and info.state == "running":
            retention.tool_started(info.program_id, tool, ttl_s)

    def num_waiting_calls(self) -> int:
        """Calls submitted that have produced no token yet (queued or in prefill)."""
        return self.program_manager.num_waiting

    # --- calls --------------------------------------------------------------------------------
    def chat_token_ids(self, messages: Sequence[dict[str, Any]], program_id: str | None = None,
                       **options: Any) -> list[int]:
        """Token ids of `messages` under the model's chat template, ready for the assistant's turn
        (`options`: add_generation_prompt, continue_final_message, chat_template_kwargs; agentrt._chat_prompt)."""
        return self._chat.token_ids(messages, program_id, **options)

    def chat_prompt(self, messages: Sequence[dict[str, Any]], program_id: str | None = None,
                    **options: Any) -> tuple[str, list[int]]:
        """The prompt text of `messages` and its token ids, as `chat_token_ids` (`tools` too: for a template
        that renders them, `ChatPlan.template_tools`)."""
        return self._chat.prompt(messages, program_id, **options)

    async def prepare_chat(self, messages: Any, *, tools: list[dict[str, Any]] | None = None, tool_choice: Any = None,
                           output: Constraint | None = None, output_param: str = "response_format",
                           program_id: str | None = None, tools_when_none: bool = True,
                           truncate_prompt_tokens: int | None = None, sampling: SamplingFor | None = None,
                           **options: Any) -> PreparedCall:
        """A chat call's plan, prompt ids and sampling parameters, prepared in a worker thread
        (agentrt._chat.prepare_chat): the template fitted, the prompt rendered, tokenized and cut, reasoning
        set up, the output grammar compiled, `sampling(prompt_len, constraint)` built."""
        def prepare() -> PreparedCall:
            return prepare_chat(self, messages, tools=tools, tool_choice=tool_choice, output=output,
                                output_param=output_param, program_id=program_id, tools_when_none=tools_when_none,
                                truncate_prompt_tokens=truncate_prompt_tokens, sampling=sampling, **options)

        return await anyio.to_thread.run_sync(prepare)

    @property
    def max_model_len(self) -> int:
        """The longest prompt plus output the engine takes."""
        return self._engine().info.max_model_len

    def plan_template(self, plan: ChatPlan, chat_template: str | None = None) -> ChatPlan:
        """Fit a chat call's plan to the template its prompt renders with (`chat_template`, else the
        tokenizer's): the tools, calls and results go to a template that renders tools as they are, and
        the reply's calls are read by this runtime's tool-call parser (`ChatPlan.use_template`)."""
        specs = [t.spec() for t in plan.tools] or None
        return plan.use_template(self._chat.template_source(chat_template, specs), self.tool_parser)

    def tag_ids(self, tag: str) -> list[int]:
        """The token ids of a tag (e.g. `</think>`) as the model writes it: no special tokens added."""
        return self.tokenizer(tag, add_special_tokens=False)["input_ids"]

    def compile_constraint(self, constraint: Constraint, param: str | None = None) -> None:
        """Compile (and cache) an output grammar now, so a bad one fails here, naming `param`, and a good
        one costs nothing when its call is added. Blocking: the server runs it in a thread."""
        try:
            self._engine().compile_constraint(constraint)
        except (TypeError, ValueError) as e:
            raise InvalidCallError(str(e), param=param) from None

    def submit(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        program_id: str | None = None,
        thread_id: str | None = None,
        owner: str | None = None,
        cache_salt: str | None = None,
        kind: str = "generate",
        last_call: bool = False,
        name: str = "program",
        model: str | None = None,
    ) -> Call:
        """Submit one call for the program `program_id` (started if unknown; None: a one-call
        program). Bad input raises `InvalidCallError` here; see `agentrt._call.Call`. `last_call`: the
        program makes no more calls, so nothing of it is pinned when this one ends. `name`: the name of
        a program this call starts. `model`: a LoRA adapter's name (None: the base model)."""
        lora = self.resolve_model(model, program_id)
        pm = self.program_manager
        if program_id is None:
            handle = pm.start_program(name=kind, owner=owner, one_call=True)
            return self.submit_call(handle, None, prompt, params, kind, cache_salt, one_call=True, lora=lora)
        handle = pm.handle_for(program_id, owner, name)
        return self.submit_call(handle, thread_id, prompt, params, kind, cache_salt, last_call=last_call, lora=lora)

    def submit_beam_search(self, prompt_ids: list[int], params: BeamSearchParams, *, program_id: str | None = None,
                           owner: str | None = None, cache_salt: str | None = None, model: str | None = None,
                           name: str = "beam_search") -> BeamSearchCall:
        """A beam search (vLLM's use_beam_search) as calls of the program `program_id` (None: a program of
        its own); see agentrt._beam. Bad input raises InvalidCallError here."""
        return submit_beam_search(self, prompt_ids, params, program_id=program_id, owner=owner, cache_salt=cache_salt,
                                  model=model, name=name)

    async def beam_search(self, prompt: str | list[int], *, beam_width: int, max_tokens: int,
                          length_penalty: float = 1.0, ignore_eos: bool = False, model: str | None = None) -> Result:
        """A beam search of `prompt` as calls of the current program (outside one: a program of its own), each
        step one batch of its live beams (agentrt._beam): a `Result` whose choices are the beams, best first."""
        return await beam_search_in_program(self, _check_prompt(prompt), beam_width=beam_width, max_tokens=max_tokens,
                                            length_penalty=length_penalty, ignore_eos=ignore_eos, model=model)

    def submit_call(
        self, handle: ProgramHandle, thread_id: str | None, prompt: str | list[int], params: SamplingParams,
        kind: str, cache_salt: str | None, one_call: bool = False, last_call: bool = False,
        lora: LoRARequest | None = None,
    ) -> Call:
        """Submit one call of the program `handle` (running; `submit` finds or starts it by id). `one_call`: the
        program is the call's own, ended with it. Bad input raises InvalidCallError here."""
        engine = self._engine()
        pid = handle.info.program_id
        thread_id = thread_id or f"{pid}.t0"
        rid = self.programs.new_call_id(handle.info)  # numbered within the program: its first call is {pid}-c1
        if handle.info.priority and not params.priority:  # the program's class, unless the call names its own
            params = dataclasses.replace(params, priority=handle.info.priority)
        try:
            if isinstance(prompt, str):
                prompt = self.tokenizer(prompt)["input_ids"]
            if params.truncate_prompt_tokens is not None:  # as counted
                prompt = truncate_prompt(prompt, params.truncate_prompt_tokens, engine.info.max_model_len)
            retention, ttl = self.program_manager.retention, None
            if retention is not None and not one_call:  # before the add: the TTL its end pins for is in place first
                ttl = retention.call_submitted(pid, time.monotonic(), last=last_call)
            stream = engine.add_request(prompt, params, request_id=rid, program_id=pid, thread_id=thread_id,
                                        cache_salt=cache_salt, lora_request=lora)
        except (TypeError, ValueError, UnicodeError) as e:
            if one_call:
                self.program_exited(handle, "failed", repr(e))
            raise InvalidCallError(str(e), program_id=pid, request_id=rid, param=getattr(e, "parameter", None)) from None
        record = self.program_manager.call_submitted(handle, rid, thread_id, len(prompt))
        record.pin_ttl_s, record.priority = ttl, params.priority
        call = Call(self.program_manager, handle.info, thread_id, rid, kind, stream, record, len(prompt))
        call.one_call = handle if one_call else None
        call.model = lora.lora_name if lora is not None else None
        return call

    # --- what a beam search (agentrt._beam) asks ---------------------------------------------
    def result_of(self, out: RequestOutput) -> Result:
        """A finished call's output as `generate` returns it in full: a `Result`."""
        return self._result(out)

    async def _call(
        self, prompt: str | list[int], sampling: dict[str, Any], kind: str, out: list[RequestOutput]
    ) -> AsyncIterator[StreamDelta]:
        """Run one LLM call for the current program (or as a one-call program); yield its deltas,
        append the final output to `out`."""
        self._engine()
        with calling_program(kind) as (prog, thread_id):
            lora = self.resolve_model(sampling.pop("model", None), prog.program_id)
            params = _sampling_params(merge_sampling(self.engine_info.generation_defaults, openai_names(sampling)),
                                      prog.program_id)
            async with self.submit_call(prog, thread_id, prompt, params, kind, None, lora=lora) as call:
                async for delta in call:
                    yield delta
                out.append(await call.result())

    async def chat(
        self, messages: Sequence[dict[str, Any]], *, tools: Any = None, tool_choice: Any = None,
        response_format: Any = None, full: bool = False, **sampling: Any,
    ) -> str | Result:
        """The reply's text; a `Result` (every choice, logprobs, usage, finish reasons, tool calls) when
        the call asks for more than a text: n > 1, logprobs, top_logprobs, prompt_logprobs, `tools`,
        `tool_choice`, `response_format`, or `full=True` (agentrt._results). Tools are specs or Python
        functions (`@agentrt.tool`); see `agentrt._toolcalls`. The chat template's options
        (add_generation_prompt, continue_final_message, chat_template_kwargs) go with the sampling ones."""
        options = pop_template_options(sampling)
        plain = tools is None and tool_choice is None and response_format is None
        pid = _pid()
        prepared = await self.prepare_chat(chat_messages(messages, pid), tools=tool_specs(tools),
                                           tool_choice=tool_choice, output=response_format_constraint(response_format),
                                           program_id=pid, **options)
        plan, ids = prepared.plan, prepared.prompt_ids
        if plan.constraint is not None:
            sampling["constraint"] = plan.constraint
        if plan.special_tokens:
            sampling["skip_special_tokens"] = False  # the format's markup: the plan reads it
        out = await self._collect(ids, sampling, "chat")
        if plain and not wants_result(sampling, full):
            return plan.split(out.text).content or "" if plan.splits else out.text
        return self._result(out, plan)

    async def embed(self, inputs: Any, *, dimensions: int | None = None, normalize: bool = True,
                    priority: int = 0, model: str | None = None) -> list[float] | list[list[float]]:
        """Embeddings of the inputs, each one call (agentrt._embed), all at once; `model`: a LoRA adapter's
        name (None: the base model)."""
        one, items = embed_inputs(inputs)
        try:
            pooling = PoolingParams(self.engine_info.pooling_method, normalize, dimensions)
        except ValueError as e:
            raise InvalidCallError(str(e)) from None
        vectors: list[Any] = [None] * len(items)

        async def run(i: int, x: str | list[int]) -> None:
            out = await self._collect(x, {"max_tokens": 1, "priority": priority, "pooling": pooling, "model": model},
                                      "embedding")
            vectors[i] = out.embedding

        async with anyio.create_task_group() as tg:
            for i, x in enumerate(items):
                tg.start_soon(run, i, x)
        return vectors[0] if one else vectors

    async def generate(self, prompt: str | list[int], *, full: bool = False, **sampling: Any) -> str | Result:
        """The completion's text; a `Result` under the same rule as `chat`."""
        out = await self._collect(_check_prompt(prompt), sampling, "generate")
        return self._result(out) if wants_result(sampling, full) else out.text

    async def chat_stream(
        self, messages: Sequence[dict[str, Any]], *, full: bool = False, **sampling: Any
    ) -> AsyncIterator[str | Chunk]:
        """Text pieces as generated; `Chunk`s (with their choice's index) under `chat`'s rule for a `Result`.
        With a reasoning parser the pieces are the answer's, and chunks carry the thinking's apart."""
        pid = _pid()
        options = pop_template_options(sampling)
        prepared = await self.prepare_chat(chat_messages(messages, pid), program_id=pid, **options)
        plan = prepared.plan if prepared.plan.splits else None
        if prepared.plan.special_tokens:
            sampling["skip_special_tokens"] = False
        pieces = self._pieces(prepared.prompt_ids, sampling, "chat", wants_result(sampling, full), plan)
        async with contextlib.aclosing(pieces) as gen:
            async for piece in gen:
                yield piece

    async def generate_stream(
        self, prompt: str | list[int], *, full: bool = False, **sampling: Any
    ) -> AsyncIterator[str | Chunk]:
        pieces = self._pieces(_check_prompt(prompt), sampling, "generate", wants_result(sampling, full))
        async with contextlib.aclosing(pieces) as gen:
            async for piece in gen:
                yield piece

    async def _pieces(
        self, prompt: str | list[int], sampling: dict[str, Any], kind: str, chunks: bool, plan: ChatPlan | None = None
    ) -> AsyncIterator[str | Chunk]:
        streamers: dict[int, ReplyStreamer] = {}  # with a plan: per choice, its splitter
        async with contextlib.aclosing(self._call(prompt, sampling, kind, [])) as gen:
            async for d in gen:
                reasoning, text = "", d.new_text
                if plan is not None:
                    streamer = streamers.setdefault(d.index, plan.streamer())
                    reasoning, text = streamer.feed(d.new_text)
                    if d.finished:
                        rest = streamer.finish()
                        reasoning, text = reasoning + rest.reasoning, text + rest.content
                if not chunks:
                    if text:
                        yield text
                elif d.new_text or d.finished:
                    lps = token_logprobs(self._token_text, d.new_token_ids, d.new_logprobs, d.new_top_logprobs)
                    yield Chunk(d.index, text, d.finish_reason if d.finished else None, lps, reasoning)

    async def _collect(self, prompt: str | list[int], sampling: dict[str, Any], kind: str) -> RequestOutput:
        out: list[RequestOutput] = []
        async with contextlib.aclosing(self._call(prompt, sampling, kind, out)) as gen:
            async for _ in gen:
                pass
        return out[0]

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _result(self, out: RequestOutput, plan: ChatPlan | None = None) -> Result:
        choices = []
        for c in out.outputs:
            reply = plan.split(c.text) if plan is not None else Reply(None, c.text, [])
            reason = "tool_calls" if reply.tool_calls else c.finish_reason
            lps = token_logprobs(self._token_text, c.token_ids, c.logprobs, c.top_logprobs)
            choices.append(Choice(c.index, reply.content, reason, reply.tool_calls, lps, list(c.token_ids),
                                  c.stop_reason, reply.reasoning))
        return Result(choices, Usage(out.num_prompt_tokens, out.num_output_tokens, out.num_cached_tokens), out.prompt_logprobs)


def _pid() -> str | None:
    cur = current()
    return None if cur is None else cur[0].program_id


def _check_prompt(prompt: Any) -> str | list[int]:
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return prompt
    raise InvalidCallError(f"prompt must be a non-empty str or list of token ids, got {prompt!r}", program_id=_pid())


def _sampling_params(sampling: dict[str, Any], program_id: str) -> SamplingParams:
    try:
        return SamplingParams(**sampling)
    except (TypeError, ValueError) as e:
        raise InvalidCallError(f"bad sampling arguments {sampling!r}: {e}", program_id=program_id) from None
