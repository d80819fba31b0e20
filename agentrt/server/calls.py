"""What every generation route shares (chat completions, completions, responses): the program a
call belongs to, sampling parameters from a request's fields (over the model's generation defaults and
the server's, agentrt._chat.merge_sampling), submission, results and logprobs in OpenAI's shapes, and a
chat request's messages and output constraint as the runtime's `prepare_chat` takes them."""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Any

import msgspec

from agentrt._beam import BeamSearchCall
from agentrt._call import Call
from agentrt._chat import PreparedCall, merge_sampling
from agentrt._errors import InvalidCallError
from agentrt._toolcalls import check_schema, response_format_constraint
from agentrt.engine import SamplingParams, chat_template
from agentrt.engine.beam_search import MAX_BEAM_WIDTH, BeamSearchParams
from agentrt.engine.outputs import RequestOutput
from agentrt.engine.sampling_params import truncate_prompt
from agentrt.engine.structured import Constraint
from agentrt.server.errors import APIError, bad_request, error_body, to_api_error
from agentrt.server.schemas import (
    ChatCompletionRequest,
    ChoiceLogprobs,
    CompletionLogprobs,
    GenerationExtras,
    PromptLogprob,
    PromptLogprobs,
    PromptTokensDetails,
    StreamOptions,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from agentrt.server.state import Caller, ServerState

TopList = list[tuple[int, float]]
MIN_LOGPROB = -9999.0  # what a masked token's -inf log-prob is shown as (vLLM's; JSON has no -inf)


# --- shared -----------------------------------------------------------------------------------
def max_tokens_flag(st: ServerState) -> str:
    """The flag that sets the server's max_tokens limit: --max-tokens-limit, or the context's."""
    limit = st.config.max_tokens_limit
    return "--max-tokens-limit" if limit is not None and limit <= st.max_model_len else "the context, --max-model-len"


def sampling_params(
    st: ServerState, *, max_tokens: int | None, prompt_len: int, temperature: float | None, top_p: float | None,
    top_k: int | None, n: int, stop: str | list[str] | None, stop_token_ids: list[int] | None, seed: int | None,
    ignore_eos: bool, logprobs: bool, top_logprobs: int, constraint: Constraint | None = None,
    extras: GenerationExtras | None = None, prompt_logprobs: int | None = None, max_tokens_param: str = "max_tokens",
) -> SamplingParams:
    """`extras`: the request whose penalties, min_p, min_tokens, logit_bias, allowed_token_ids, bad_words,
    truncate_prompt_tokens and output-text options apply (`prompt_len`: after the truncation). `max_tokens_param`:
    the request's name for `max_tokens` (the Responses API's max_output_tokens), which an error names."""
    if n > st.config.max_n:
        raise bad_request(f"n={n} is over the server's limit of {st.config.max_n} (--max-n)", "n")
    if max_tokens is not None and max_tokens > st.max_tokens_limit:
        raise bad_request(f"{max_tokens_param}={max_tokens} is over the server's limit of {st.max_tokens_limit} "
                          f"({max_tokens_flag(st)})", max_tokens_param)
    d = st.sampling_defaults  # the model's generation config, for what the request leaves unset
    room = max(1, min(st.max_tokens_limit, st.max_model_len - prompt_len, d.get("max_tokens", 1 << 62)))
    given = {k: v for k, v in (("max_tokens", max_tokens), ("temperature", temperature), ("top_p", top_p),
                               ("top_k", top_k)) if v is not None}
    try:
        request = {**(extras.sampling_args() if extras is not None else {}), **given, "n": n,
                   "stop": [] if stop is None else stop, "stop_token_ids": stop_token_ids or [], "seed": seed,
                   "ignore_eos": ignore_eos, "logprobs": logprobs, "top_logprobs": top_logprobs,
                   "constraint": constraint, "prompt_logprobs": prompt_logprobs}
        return SamplingParams(**merge_sampling(d, {"max_tokens": room}, request))
    except (TypeError, ValueError) as e:
        raise bad_request(str(e), _param_of(getattr(e, "parameter", None))) from None


_SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


def _param_of(parameter: str | None, default: str | None = None) -> str | None:
    """The request field of the parameter an engine error names (a sampling field keeps its name), else
    `default` (what the prompt came in: "messages" or "prompt"): the prompt, its adapter or its pooling."""
    return parameter if parameter in _SAMPLING_FIELDS else default


def truncated(st: ServerState, ids: list[int], truncate_prompt_tokens: int | None) -> list[int]:
    """A prompt's token ids cut as the engine cuts them (vLLM's truncate_prompt_tokens), so the usage, echo and
    token ids a response shows are of what ran; a 400 naming the field for a value the engine refuses."""
    try:
        return truncate_prompt(ids, truncate_prompt_tokens, st.max_model_len)
    except ValueError as e:
        raise bad_request(str(e), "truncate_prompt_tokens") from None


def check_capacity(st: ServerState) -> None:
    """503 while the server drains; 429 once --max-waiting calls wait for their first token."""
    if st.draining:
        raise APIError(503, "the server is shutting down", "service_unavailable", None, "draining",
                       {"Retry-After": "5"})
    waiting = st.runtime.programs.num_waiting
    if waiting >= st.config.max_waiting:
        raise APIError(429, f"too many queued calls ({waiting} >= --max-waiting {st.config.max_waiting})",
                       "rate_limit_error", None, "overloaded", {"Retry-After": "1"})


def submit(st: ServerState, who: Caller, ids: list[int], params: SamplingParams, prompt_param: str, *, kind: str,
           name: str = "program", cache_salt: str | None = None, tool: str | None = None,
           check: bool = True) -> Call:
    """A call of `who`'s program (`runtime.submit`; no program id: a program of its own, named `who.name`
    or `name`): the capacity checked first (`check`; a route submitting several calls checks once before
    them), the tool it answers noted (`tool`, note_tool). Input the engine refuses is a 400 naming the field."""
    if check:
        check_capacity(st)
    if tool:
        note_tool(st, who.program_id, who.owner, tool)
    try:
        call = st.runtime.submit(ids, params, program_id=who.program_id, thread_id=who.thread_id, owner=who.owner,
                                 cache_salt=engine_salt(who.owner, cache_salt), kind=kind, name=who.name or name,
                                 last_call=who.last_call, model=who.model)
    except InvalidCallError as e:
        raise bad_request(str(e), _param_of(e.param, prompt_param)) from None
    if who.traceparent is not None and call.info.traceparent is None:  # the first call's trace is the program's
        call.info.traceparent = who.traceparent
    return call


def engine_salt(owner: str | None, cache_salt: str | None) -> str | None:
    """The engine's cache salt for a call: its API key's fingerprint (`owner`), paired with the request's own
    vLLM `cache_salt` when it brings one. The pair is JSON, so it never equals a bare fingerprint nor another
    (owner, salt) pair: no salt a request chooses reaches blocks another key's calls cached."""
    return owner if cache_salt is None else json.dumps([owner, cache_salt])


def beam_search_call(st: ServerState, who: Caller, req: Any, prompt_ids: list[int],
                     params: SamplingParams) -> BeamSearchCall:
    """vLLM's use_beam_search: the request's n beams (its max_tokens, ignore_eos, temperature, length_penalty),
    a `Call`-like search whose steps are calls of the program (agentrt._beam). A 400 naming the field for
    what a beam search does not combine with: streaming, log-probs, echo, an output grammar."""
    for name, on in (("stream", req.stream), ("logprobs", params.wants_logprobs), ("echo", getattr(req, "echo", False)),
                     ("prompt_logprobs", params.prompt_logprobs is not None)):
        if on:
            raise bad_request(f"use_beam_search does not combine with {name}", name)
    if params.constraint is not None:
        raise bad_request("use_beam_search does not combine with an output grammar (response_format, structured "
                          "outputs, a forced tool call)", "use_beam_search")
    if req.n > MAX_BEAM_WIDTH:
        raise bad_request(f"n={req.n}: a beam search keeps at most {MAX_BEAM_WIDTH} beams", "n")
    check_capacity(st)
    try:
        beam = BeamSearchParams(beam_width=req.n, max_tokens=params.max_tokens, ignore_eos=params.ignore_eos,
                                temperature=params.temperature, length_penalty=req.length_penalty,
                                include_stop_str_in_output=params.include_stop_str_in_output)
        return st.runtime.submit_beam_search(prompt_ids, beam, program_id=who.program_id, owner=who.owner,
                                             cache_salt=engine_salt(who.owner, req.cache_salt), model=who.model,
                                             name=who.name or "program")
    except (TypeError, ValueError) as e:  # the penalty out of range, or a prompt the engine refuses
        raise bad_request(str(e), "length_penalty" if getattr(e, "parameter", None) == "length_penalty" else "prompt") from None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


class TokenText:
    """Token id -> its text, cached (logprob rendering). `label` is how a log-prob entry names a token: its
    text, or with `as_ids` (vLLM's return_tokens_as_token_ids) "token_id:{id}", which says which token it is
    even when its bytes are not whole UTF-8 alone; `bytes` and text offsets stay the text's."""

    def __init__(self, tokenizer: Any, as_ids: bool = False, cache: dict[int, str] | None = None) -> None:
        self.tokenizer = tokenizer
        self.as_ids = as_ids
        self._cache: dict[int, str] = {} if cache is None else cache

    def __call__(self, tok: int) -> str:
        s = self._cache.get(tok)
        if s is None:
            s = self._cache[tok] = self.tokenizer.decode([tok])
        return s

    def label(self, tok: int) -> str:
        return f"token_id:{tok}" if self.as_ids else self(tok)


def token_text(st: ServerState, as_ids: bool | None = None) -> TokenText:
    """The server's token texts; `as_ids`: a request's return_tokens_as_token_ids (None: the server's
    --return-tokens-as-token-ids)."""
    tt = getattr(st, "_token_text", None)
    if tt is None:
        tt = TokenText(st.runtime.tokenizer)
        st._token_text = tt  # type: ignore[attr-defined]
    if as_ids is None:
        as_ids = st.config.return_tokens_as_token_ids
    return tt if as_ids == tt.as_ids else TokenText(tt.tokenizer, as_ids, tt._cache)


def chat_logprobs(text: TokenText, ids: list[int], lps: list[float] | None, tops: list[TopList] | None) -> ChoiceLogprobs | None:
    if lps is None:
        return None
    content = []
    for i, (tok, lp) in enumerate(zip(ids, lps)):
        top = [TopLogprob(text.label(a), max(b, MIN_LOGPROB), list(text(a).encode()))
               for a, b in (tops[i] if tops else [])]
        content.append(TokenLogprob(text.label(tok), max(lp, MIN_LOGPROB), list(text(tok).encode()), top))
    return ChoiceLogprobs(content)


def completion_logprobs(text: TokenText, ids: list[int], lps: list[float] | None, tops: list[TopList] | None,
                        offset: int = 0) -> CompletionLogprobs | None:
    if lps is None:
        return None
    offsets = []
    for t in ids:
        offsets.append(offset)
        offset += len(text(t))
    top = [{text.label(a): max(b, MIN_LOGPROB) for a, b in tl} for tl in tops] if tops is not None else None
    shown = [lp if lp is None else max(lp, MIN_LOGPROB) for lp in lps]  # None: an echoed prompt's first token
    return CompletionLogprobs([text.label(t) for t in ids], shown, top, offsets)


def echoed_logprobs(text: TokenText, prompt_ids: list[int], lps: list[float | None] | None,
                    tops: list[TopList | None] | None, then: CompletionLogprobs | None) -> CompletionLogprobs | None:
    """An echoed prompt's log-probs (its first token's None: nothing comes before it), followed by those
    of the text generated after it (`then`, its offsets already counted from the prompt's end)."""
    if lps is None:
        return then
    head = completion_logprobs(text, prompt_ids, lps, None)
    assert head is not None
    if tops is not None:
        head.top_logprobs = [None if tl is None else {text.label(a): b for a, b in tl} for tl in tops]
    if then is not None:
        head.tokens += then.tokens
        head.token_logprobs += then.token_logprobs
        head.text_offset += then.text_offset
        if head.top_logprobs is not None and then.top_logprobs is not None:
            head.top_logprobs += then.top_logprobs
    return head


def prompt_logprobs_of(text: TokenText, out: RequestOutput, top_n: int) -> PromptLogprobs:
    """vLLM's `prompt_logprobs`: per prompt position (None for the first), its own token and the `top_n`
    most likely ones, each with its log-prob, rank and text."""
    lps, ranks, tops = out.prompt_logprobs, out.prompt_ranks, out.prompt_top_logprobs
    if lps is None or ranks is None:
        raise RuntimeError(f"request {out.request_id!r} came back without the prompt log-probs it asked for")
    result: PromptLogprobs = []
    for pos, token in enumerate(out.prompt_token_ids):
        if lps[pos] is None:
            result.append(None)
            continue
        entry = {str(token): PromptLogprob(lps[pos], ranks[pos], text(token))}
        for rank, (tid, lp) in enumerate((tops[pos] or [])[:top_n] if tops is not None else [], start=1):
            entry.setdefault(str(tid), PromptLogprob(lp, rank, text(tid)))
        result.append(entry)
    return result


class StreamUsage:
    """What a stream says of its usage (`stream_options`): a last chunk with the totals (include_usage)
    and, with vLLM's continuous_usage_stats as well, the usage so far on every chunk."""

    def __init__(self, options: StreamOptions | None, prompt_tokens: int) -> None:
        self.final = options is not None and options.include_usage
        self.continuous = self.final and options is not None and options.continuous_usage_stats
        self.prompt_tokens, self.completion_tokens = prompt_tokens, 0

    def add(self, tokens: int) -> None:
        self.completion_tokens += tokens

    def now(self) -> Usage | None:
        """The usage a chunk carries: so far when continuous, else none."""
        if not self.continuous:
            return None
        return Usage(self.prompt_tokens, self.completion_tokens, self.prompt_tokens + self.completion_tokens)


class PendingIds:
    """With vLLM's return_token_ids, each choice's token ids not sent yet: the next chunk a stream sends
    for that choice takes them, so every token is reported once whether its text showed or not."""

    def __init__(self, on: bool, n: int) -> None:
        self.on = on
        self.ids: list[list[int]] = [[] for _ in range(n)] if on else []

    def add(self, index: int, ids: list[int]) -> None:
        if self.on:
            self.ids[index] += ids

    def take(self, index: int) -> list[int] | None:
        if not self.on:
            return None
        out, self.ids[index] = self.ids[index], []
        return out


def reasoning_tokens(st: ServerState, reasoning: str | None) -> int:
    """How many tokens a reply's reasoning text takes (Responses' usage.output_tokens_details)."""
    return len(st.runtime.tokenizer(reasoning, add_special_tokens=False)["input_ids"]) if reasoning else 0


def usage_of(outs: list[RequestOutput]) -> Usage:
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
    cached = sum(o.metrics.num_prefix_hit_tokens for o in outs if o.metrics is not None)  # o.num_cached_tokens
    return Usage(prompt, completion, prompt + completion, PromptTokensDetails(cached))


def error_event(e: BaseException) -> bytes:
    return b"data: " + error_body(to_api_error(e)) + b"\n\n"


def note_tool(st: ServerState, pid: str | None, owner: str | None, name: str | None) -> None:
    """A call answering a tool names the tool its program ran since its previous call; the gap is the
    tool's duration (agentrt._retention). Only for a running program of the caller's."""
    if pid is None or not name:
        return
    info = st.runtime.programs.get(pid)
    if info is not None and info.owner == owner and info.state == "running":
        st.runtime.tool_started(info, name)


async def prepare_openai_chat(st: ServerState, who: Caller, req: ChatCompletionRequest) -> PreparedCall:
    """An OpenAI chat request prepared by the runtime's one chat path (`Runtime.prepare_chat`, in a worker
    thread): its messages, tools and tool choice, output constraint, template options, prompt cut
    (truncate_prompt_tokens) and sampling parameters (`sampling_params`, over the model's defaults)."""
    constraint, constraint_param = output_constraint(req)
    tools = [msgspec.to_builtins(t) for t in req.tools] if req.tools else None
    choice = msgspec.to_builtins(req.tool_choice) if req.tool_choice is not None else None

    def sampling(prompt_len: int, constraint: Constraint | None) -> SamplingParams:
        return sampling_params(
            st, max_tokens=req.max_completion_tokens or req.max_tokens, prompt_len=prompt_len,
            temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, n=req.n, stop=req.stop,
            stop_token_ids=req.stop_token_ids, seed=req.seed, ignore_eos=req.ignore_eos, logprobs=req.logprobs,
            top_logprobs=req.top_logprobs or 0, constraint=constraint, extras=req, prompt_logprobs=req.prompt_logprobs,
            max_tokens_param="max_completion_tokens" if req.max_completion_tokens else "max_tokens")

    return await st.runtime.prepare_chat(
        message_dicts(req.messages), tools=tools, tool_choice=choice, output=constraint,
        output_param=constraint_param or "response_format", program_id=who.program_id,
        tools_when_none=not st.config.exclude_tools_when_tool_choice_none,
        add_generation_prompt=req.add_generation_prompt, continue_final_message=req.continue_final_message,
        chat_template_kwargs=req.chat_template_kwargs, chat_template=request_template(st, req.chat_template),
        truncate_prompt_tokens=req.truncate_prompt_tokens, sampling=sampling)


def request_template(st: ServerState, template: str | None) -> str | None:
    """A chat template a request brings: only on a server started with --trust-request-chat-template
    (vLLM's rule), and only one that compiles; a 400 naming chat_template otherwise."""
    if template is None:
        return None
    if not st.config.trust_request_chat_template:
        raise bad_request("this server does not take chat templates in requests (start it with "
                          "--trust-request-chat-template)", "chat_template")
    problem = chat_template.syntax_error(template)
    if problem is not None:
        raise bad_request(f"chat_template does not compile: {problem}", "chat_template")
    return template


def output_constraint(req: Any) -> tuple[Constraint | None, str | None]:
    """A request's output constraint and the field that gave it: `response_format`, vLLM's `guided_*`
    fields or its `structured_outputs` (one of them)."""
    given = [(name, v) for name in ("guided_json", "guided_regex", "guided_grammar", "guided_choice")
             if (v := getattr(req, name)) is not None]
    if req.response_format is not None:
        given.append(("response_format", msgspec.to_builtins(req.response_format)))
    if req.structured_outputs is not None:
        so = {k: v for k, v in msgspec.to_builtins(req.structured_outputs).items() if v is not None}
        if len(so) != 1 or so.get("json_object") is False:
            raise bad_request(f"structured_outputs takes one of json, regex, choice, grammar, json_object; got "
                              f"{sorted(so) or 'none'}", "structured_outputs")
        ((key, value),) = so.items()
        given.append((f"structured_outputs.{key}", value))
    if len(given) > 1:
        raise bad_request(f"give one output constraint, got {[n for n, _ in given]}", given[1][0])
    if not given:
        return None, None
    name, value = given[0]
    kind = name.removeprefix("guided_").removeprefix("structured_outputs.")
    if name == "response_format":
        return response_format_constraint(value), name
    if kind == "json_object":
        return Constraint("json_object"), name
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise bad_request(f"{name} is not valid JSON", name) from None
        check_schema(value, name)
        return Constraint.json_schema(value), name
    if kind == "choice":
        if not value or not all(isinstance(c, str) and c for c in value):
            raise bad_request(f"{name} must be a non-empty list of non-empty strings", name)
        return Constraint("regex", "|".join(re.escape(c) for c in value)), name
    if not value:
        raise bad_request(f"{name} is empty", name)
    return Constraint("regex" if kind == "regex" else "grammar", value), name


def message_dicts(messages: list[Any]) -> list[dict[str, Any]]:
    """Chat messages (msgspec Structs) as dicts for `ChatPlan.render`; text parts joined."""
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            bad = [p.type for p in content if p.type not in ("text", "input_text", "output_text")]
            if bad:
                raise bad_request(f"message content part of type {bad[0]!r} is not supported (only text)",
                                  f"messages[{i}].content")
            content = "".join(p.text or "" for p in content)
        d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content or ""}
        if m.tool_calls:
            d["tool_calls"] = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                               for c in m.tool_calls]
        if m.role == "tool":
            if not m.tool_call_id:
                raise bad_request("a tool message needs tool_call_id", f"messages[{i}].tool_call_id")
            d["tool_call_id"] = m.tool_call_id  # for a template that renders tool results (with the name)
            if m.name:
                d["name"] = m.name
        out.append(d)
    return out
