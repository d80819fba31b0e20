"""`agentrt.connect(url)`: the same program code, run against an `agentrt serve` server.

    async with agentrt.connect("http://127.0.0.1:8000", api_key=None):
        print(await react("..."))        # an unchanged @agentrt.program

Inside, `agentrt.chat` / `generate` (and their `_stream` forms) become HTTP calls to the server's
OpenAI-compatible endpoints carrying the calling program's id and thread id (`X-Program-Id`,
`X-Thread-Id`), so the server schedules them as one program. When a program ends, the server is
told (`DELETE /v1/programs/{id}`) and releases what it holds for it. Sampling arguments are
checked here, by the same `SamplingParams` the engine uses, before anything is sent.
"""

from __future__ import annotations

import contextvars
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

import anyio
import httpx

from agentrt._chat import openai_names
from agentrt._chat_prompt import pop_template_options
from agentrt._context import _runtime
from agentrt._embed import embed_inputs
from agentrt._errors import (
    AgentrtError,
    CallAbortedError,
    CallFailedError,
    InvalidCallError,
    NoRuntimeError,
    ProgramNotFoundError,
)
from agentrt._messages import chat_messages
from agentrt._process_table import ProcessTable, ProgramInfo, ProgramStatus
from agentrt._program import ProgramHandle, current
from agentrt._results import Choice, Chunk, Result, TokenLogprob, TopLogprob, Usage, remote_logprobs, wants_result
from agentrt._toolcalls import ToolCall, tool_specs
from agentrt.engine.sampling_params import SamplingParams

_FIELDS = ("max_tokens", "temperature", "top_k", "top_p", "seed", "stop", "ignore_eos", "n", "logprobs", "top_logprobs",
           "include_stop_str_in_output", "skip_special_tokens", "presence_penalty", "frequency_penalty",
           "repetition_penalty", "min_p", "min_tokens", "priority", "allowed_token_ids", "bad_words",
           "truncate_prompt_tokens")
_DEFAULTS = SamplingParams()


class RemoteRuntime:
    """A runtime whose engine is a server; see the module docstring. An async context manager."""

    def __init__(self, url: str, api_key: str | None = None, *, timeout_s: float = 600.0,
                 headers: dict[str, str] | None = None) -> None:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise InvalidCallError(f"url must be an http(s) URL, got {url!r}")
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.timeout_s = timeout_s
        if headers is not None and not (isinstance(headers, dict) and all(
                isinstance(k, str) and isinstance(v, str) for k, v in headers.items())):
            raise InvalidCallError(f"headers must be a dict of str to str, got {headers!r}")
        self.headers = dict(headers or {})  # sent with every request (e.g. a W3C `traceparent`)
        self.programs = ProcessTable()  # this client's programs, their records as the server keeps them (_copy_record)
        self._remote: set[str] = set()  # programs the server has heard of (they made a call)
        self._refreshing: set[str] = set()  # programs whose record is being read back from the server
        self._stale: set[str] = set()  # of those, programs a call of which ended since the read began
        self._ending: dict[str, anyio.Event] = {}  # ended programs whose final record is on its way back
        self._client: httpx.AsyncClient | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._token: contextvars.Token | None = None

    async def __aenter__(self) -> RemoteRuntime:
        headers = {**self.headers, **({"Authorization": f"Bearer {self.api_key}"} if self.api_key else {})}
        self._client = httpx.AsyncClient(base_url=self.url, headers=headers, timeout=self.timeout_s)
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._token = _runtime.set(self)  # type: ignore[arg-type]
        return self

    async def __aexit__(self, *exc: Any) -> None:
        assert self._token is not None and self._tg is not None and self._client is not None
        _runtime.reset(self._token)
        try:
            await self._tg.__aexit__(None, None, None)  # the pending program ends reach the server
        finally:
            await self._client.aclose()
            self._token = self._tg = self._client = None

    # --- what @program needs ------------------------------------------------------------------
    def program_started(self, info: ProgramInfo) -> None:
        self.programs.start(info)

    def tool_started(self, info: ProgramInfo | None, tool: str, ttl_s: float | None = None) -> None:
        """Nothing to do here: the server times the gap between a program's calls itself."""

    def program_exited(self, handle: ProgramHandle, state: ProgramStatus, error: str | None) -> None:
        """The program ended here: the server is told (`DELETE /v1/programs/{id}`), and its answer, the final
        record, is copied into the program's (`program_settled` waits for it)."""
        self.programs.end(handle.info, state, error)
        pid = handle.program_id
        if pid in self._remote and self._tg is not None:
            self._remote.discard(pid)
            self._ending[pid] = done = anyio.Event()
            self._tg.start_soon(self._end_program, handle.info, done)

    async def program_settled(self, handle: ProgramHandle) -> None:
        """Until the ended program's record is final: the server's answer to its end is in (or failed)."""
        done = self._ending.get(handle.program_id)
        if done is not None:
            await done.wait()

    async def _end_program(self, info: ProgramInfo, done: anyio.Event) -> None:
        try:
            r = await self._http().delete(f"/v1/programs/{info.program_id}")
            if r.status_code == 200:
                _copy_record(info, r.json())
        except (httpx.HTTPError, ValueError):
            pass  # the server ends idle programs by itself
        finally:
            self._ending.pop(info.program_id, None)
            done.set()

    def _call_ended(self, pid: str) -> None:
        """A call of the program ended: its record is read back from the server, off the caller's path (one
        read at a time per program; another after it when more calls ended meanwhile)."""
        if self._tg is None or pid not in self.programs:
            return
        if pid in self._refreshing:
            self._stale.add(pid)
            return
        self._refreshing.add(pid)
        self._tg.start_soon(self._refresh, pid)

    async def _refresh(self, pid: str) -> None:
        try:
            while True:
                self._stale.discard(pid)
                r = await self._http().get(f"/v1/programs/{pid}")
                info = self.programs.get(pid)
                if info is None or info.state != "running":  # ended: its final record comes with its end
                    return
                if r.status_code == 200:
                    _copy_record(info, r.json())
                if pid not in self._stale:
                    return
        except (httpx.HTTPError, ValueError):
            pass  # the record stays as it was; the next call's end reads it again
        finally:
            self._refreshing.discard(pid)

    # --- calls --------------------------------------------------------------------------------
    async def chat(
        self, messages: Sequence[dict[str, Any]], *, tools: Any = None, tool_choice: Any = None,
        response_format: Any = None, full: bool = False, **sampling: Any,
    ) -> str | Result:
        body = {"messages": chat_messages(messages, _pid()), **pop_template_options(sampling),
                **self._sampling(sampling)}
        extra = {"tools": tool_specs(tools), "tool_choice": tool_choice, "response_format": response_format}
        body.update({k: v for k, v in extra.items() if v is not None})
        data = await self._post("/v1/chat/completions", body)
        if not any(v is not None for v in extra.values()) and not wants_result(sampling, full):
            return data["choices"][0]["message"]["content"] or ""
        choices = []
        for c in data["choices"]:
            calls = [ToolCall(t["id"], t["function"]["name"], t["function"]["arguments"])
                     for t in c["message"].get("tool_calls") or []]
            choices.append(Choice(c["index"], c["message"].get("content"), c.get("finish_reason"), calls,
                                  remote_logprobs(c.get("logprobs")), c.get("token_ids"), c.get("stop_reason"),
                                  c["message"].get("reasoning")))
        return Result(choices, _usage(data))

    async def embed(self, inputs: Any, *, dimensions: int | None = None, normalize: bool = True,
                    priority: int = 0, model: str | None = None) -> list[float] | list[list[float]]:
        one, items = embed_inputs(inputs)
        body = {"input": items, "normalize": normalize, "priority": priority}
        if model is not None:
            body["model"] = model
        if dimensions is not None:
            body["dimensions"] = dimensions
        data = await self._post("/v1/embeddings", body)
        vectors = [d["embedding"] for d in sorted(data["data"], key=lambda d: d["index"])]
        return vectors[0] if one else vectors

    async def generate(self, prompt: str | list[int], *, full: bool = False, **sampling: Any) -> str | Result:
        data = await self._post("/v1/completions", {"prompt": prompt, **self._sampling(sampling, completions=True)})
        if not wants_result(sampling, full):
            return data["choices"][0]["text"]
        choices = [Choice(c["index"], c["text"], c.get("finish_reason"), [], _completion_logprobs(c.get("logprobs")),
                          c.get("token_ids"), c.get("stop_reason")) for c in data["choices"]]
        return Result(choices, _usage(data))

    async def beam_search(self, prompt: str | list[int], *, beam_width: int, max_tokens: int,
                          length_penalty: float = 1.0, ignore_eos: bool = False, model: str | None = None) -> Result:
        body = {"prompt": prompt, "use_beam_search": True, "n": beam_width, "max_tokens": max_tokens,
                "length_penalty": length_penalty, "ignore_eos": ignore_eos, "return_token_ids": True}
        if model is not None:
            body["model"] = model
        data = await self._post("/v1/completions", body)
        choices = [Choice(c["index"], c["text"], c.get("finish_reason"), [], None, c.get("token_ids"))
                   for c in data["choices"]]
        return Result(choices, _usage(data))

    async def chat_stream(
        self, messages: Sequence[dict[str, Any]], *, full: bool = False, **sampling: Any
    ) -> AsyncIterator[str | Chunk]:
        options = pop_template_options(sampling)
        body = {"messages": chat_messages(messages, _pid()), "stream": True, **options, **self._sampling(sampling)}
        chunks = wants_result(sampling, full)
        async for chunk in self._stream("/v1/chat/completions", body):
            for choice in chunk.get("choices", ()):
                delta = choice.get("delta", {})
                text, reasoning = delta.get("content") or "", delta.get("reasoning") or ""
                if chunks and (text or reasoning or choice.get("finish_reason")):
                    yield Chunk(choice["index"], text, choice.get("finish_reason"),
                                remote_logprobs(choice.get("logprobs")), reasoning)
                elif text and not chunks:
                    yield text

    async def generate_stream(
        self, prompt: str | list[int], *, full: bool = False, **sampling: Any
    ) -> AsyncIterator[str | Chunk]:
        body = {"prompt": prompt, "stream": True, **self._sampling(sampling, completions=True)}
        chunks = wants_result(sampling, full)
        async for chunk in self._stream("/v1/completions", body):
            for choice in chunk.get("choices", ()):
                text = choice.get("text") or ""
                if chunks and (text or choice.get("finish_reason")):
                    yield Chunk(choice["index"], text, choice.get("finish_reason"), _completion_logprobs(choice.get("logprobs")))
                elif text and not chunks:
                    yield text

    # --- plumbing -----------------------------------------------------------------------------
    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            raise NoRuntimeError("the connection is not open: use `async with agentrt.connect(url)`")
        return self._client

    def _sampling(self, sampling: dict[str, Any], completions: bool = False) -> dict[str, Any]:
        sampling = openai_names(sampling)
        model = sampling.pop("model", None)  # the served model's name or a LoRA adapter's; the server checks it
        if model is not None and not isinstance(model, str):
            raise InvalidCallError(f"model must be the served model's or a LoRA adapter's name (a str) or None, got "
                                   f"{model!r}", program_id=_pid(), param="model")
        try:
            params = SamplingParams(**sampling)
        except (TypeError, ValueError) as e:
            raise InvalidCallError(f"bad sampling arguments {sampling!r}: {e}", program_id=_pid()) from None
        unsent = [f for f in params.__slots__ if f not in (*_FIELDS, "stop_token_ids", "logit_bias")
                  and getattr(params, f) != getattr(_DEFAULTS, f)]
        if unsent:  # refused rather than silently dropped
            raise InvalidCallError(f"sampling arguments {unsent} are not supported through agentrt.connect",
                                   program_id=_pid())
        body = {f: getattr(params, f) for f in _FIELDS if f in sampling}
        body["return_token_ids"] = True  # a Result's choices carry them, as in-process
        if model is not None:
            body["model"] = model
        if params.stop_token_ids:
            body["stop_token_ids"] = list(params.stop_token_ids)
        if params.logit_bias:  # OpenAI's shape: token ids as strings
            body["logit_bias"] = {str(k): v for k, v in params.logit_bias.items()}
        cur = current()
        if cur is not None and cur[0].info.priority and not params.priority:  # the program's class, as in-process
            body["priority"] = cur[0].info.priority
        if completions:  # /v1/completions: logprobs is the number of alternatives
            body.pop("top_logprobs", None)
            body["logprobs"] = params.top_logprobs if params.wants_logprobs else None
        return {k: v for k, v in body.items() if v is not None}

    def _headers(self) -> dict[str, str]:
        cur = current()
        if cur is None:
            return {}
        handle, thread_id = cur
        self._remote.add(handle.program_id)
        return {"X-Program-Id": handle.program_id, "X-Thread-Id": thread_id, "X-Program-Name": handle.info.name}

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        headers = self._headers()
        pid = headers.get("X-Program-Id")
        try:
            r = await self._http().post(path, json=body, headers=headers)
        except httpx.HTTPError as e:
            raise CallFailedError(f"request to {self.url}{path} failed: {e!r}", program_id=pid) from None
        finally:
            if pid is not None:
                self._call_ended(pid)
        if r.status_code != 200:
            raise _error(r.status_code, r.content, pid)
        return r.json()

    async def _stream(self, path: str, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        headers = self._headers()
        pid = headers.get("X-Program-Id")
        try:
            async with self._http().stream("POST", path, json=body, headers=headers) as r:
                if r.status_code != 200:
                    raise _error(r.status_code, await r.aread(), pid)
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        return
                    chunk = json.loads(data)
                    if "error" in chunk:
                        raise _error(500, data.encode(), pid)
                    yield chunk
        except httpx.HTTPError as e:
            raise CallFailedError(f"request to {self.url}{path} failed: {e!r}", program_id=pid) from None
        finally:
            if pid is not None:
                self._call_ended(pid)


def _pid() -> str | None:
    cur = current()
    return None if cur is None else cur[0].program_id


RECORD_FIELDS = ("calls_waiting", "calls_running", "calls_done", "service_s", "critical_path_s", "wait_s",
                 "num_prompt_tokens", "num_output_tokens", "num_prefix_hit_tokens", "num_threads")


def _copy_record(info: ProgramInfo, view: dict[str, Any]) -> None:
    """The server's record of a program (`/v1/programs/{id}`: calls, service, tokens, threads) into the client's.
    Its state, times, parent, children and tool durations are the client's own; its KV (`kv`) stays None."""
    for name in RECORD_FIELDS:
        value = view.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            setattr(info, name, value)


def _usage(data: dict[str, Any]) -> Usage | None:
    u = data.get("usage")
    if not u:
        return None
    return Usage(u["prompt_tokens"], u["completion_tokens"], (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0))


def _completion_logprobs(data: dict[str, Any] | None) -> list[TokenLogprob] | None:
    """A completions choice's `logprobs` object (tokens, token_logprobs, top_logprobs) as TokenLogprobs."""
    if not data or data.get("tokens") is None:
        return None
    tops = data.get("top_logprobs") or [None] * len(data["tokens"])
    return [TokenLogprob(t, lp, None, [TopLogprob(a, b) for a, b in (top or {}).items()])
            for t, lp, top in zip(data["tokens"], data["token_logprobs"], tops)]


def _error(status: int, body: bytes, program_id: str | None) -> AgentrtError:
    try:
        err = json.loads(body)["error"]
        message, code, param = err.get("message", ""), err.get("code"), err.get("param")
    except (ValueError, KeyError, TypeError, AttributeError):
        message, code, param = body[:200].decode(errors="replace"), None, None
    message = f"server answered {status}: {message}"
    if status == 400 or code == "model_not_found":  # what the in-process runtime refuses as InvalidCallError
        return InvalidCallError(message, program_id=program_id, param=param if isinstance(param, str) else None)
    if status == 404 and code == "program_not_found":
        return ProgramNotFoundError(message, program_id=program_id)
    if code == "call_aborted":
        return CallAbortedError(message, program_id=program_id)
    return CallFailedError(message, program_id=program_id)


def connect(url: str, api_key: str | None = None, *, timeout_s: float = 600.0,
            headers: dict[str, str] | None = None) -> RemoteRuntime:
    """A runtime that runs `@agentrt.program` code against the server at `url`:
    `async with agentrt.connect("http://127.0.0.1:8000"): ...`. `headers` go with every request: a W3C
    `traceparent` there makes the programs' spans (a server with --otlp-traces-endpoint) join that trace."""
    return RemoteRuntime(url, api_key, timeout_s=timeout_s, headers=headers)
