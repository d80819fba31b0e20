"""The HTTP API's contract: msgspec Structs mirroring OpenAI's API field for field.

Validation happens once, when a body is decoded into these types (constraints live in the types);
the OpenAPI document at `/openapi.json` is generated from the same types (`openapi.py`). A wrong type
is a 400 naming the field. Unknown top-level fields are ignored, as vLLM ignores them (its request models
allow extra fields and log their names): clients send fields of their own (the SDKs' `extra_body`, newer
OpenAI fields such as `store`, `metadata`, `service_tier`), and a client written for vLLM must keep working.
Each unknown field's name is logged once per request type (`decode`), so a misspelt one is not silent.
Extra fields agentrt understands as vLLM has them (`GenerationExtras`: logits processors, output-text
options, structured outputs, `allowed_token_ids`, `bad_words`, `truncate_prompt_tokens`, `cache_salt`,
`return_tokens_as_token_ids`; `ignore_eos`, `top_k`, `stop_token_ids`, `prompt_logprobs`; on chat the
template's options, `continue_final_message` among them) and the program keys `program_id` /
`thread_id` (also accepted as `X-Program-Id` / `X-Thread-Id` headers).
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from agentrt.engine.errors import InvalidRequestError

# ids that clients choose travel in URLs, headers and request ids: keep them plain
ProgramId = Annotated[str, Meta(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:\-]*$")]
Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
Seed = Annotated[int, Meta(ge=0, le=2**63 - 1)]
PositiveInt = Annotated[int, Meta(ge=1)]
PromptLogprobsCount = Annotated[int, Meta(ge=0, le=20)]  # most likely tokens besides the prompt's own
TruncatePromptTokens = Annotated[int, Meta(ge=-1)]  # keep the prompt's last k tokens; -1: what the context takes
# (the engine refuses 0: engine.sampling_params.truncate_prompt)
Priority = Annotated[int, Meta(ge=-(2**31 - 1), le=2**31 - 1)]  # a scheduling class (engine.SamplingParams.priority)
CacheSalt = Annotated[str, Meta(min_length=1, max_length=256)]  # vLLM's cache_salt (calls.engine_salt)
Stop = str | list[str]
logger = logging.getLogger("agentrt.server")


# --- shared ---------------------------------------------------------------------------------
class StreamOptions(Struct):
    include_usage: bool = False  # a last chunk with `usage` (and empty `choices`) before [DONE]
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries the usage so far


class PromptTokensDetails(Struct):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (KV computed by an earlier call)


class Usage(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class ErrorInfo(Struct):
    message: str
    type: str  # "invalid_request_error" | "authentication_error" | "not_found_error" | ...
    param: str | None = None
    code: str | None = None


class ErrorResponse(Struct):
    error: ErrorInfo


# --- chat -----------------------------------------------------------------------------------
class ContentPart(Struct):
    type: str  # only "text" parts are understood
    text: str | None = None


class FunctionCall(Struct):
    name: str
    arguments: str  # JSON text


class ToolCall(Struct):
    id: str
    function: FunctionCall
    type: str = "function"


class ChatMessage(Struct):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class FunctionSpec(Struct):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # JSON schema of the arguments object
    strict: bool | None = None


class Tool(Struct):
    function: FunctionSpec
    type: Literal["function"] = "function"


class NamedFunction(Struct):
    name: str


class ToolChoiceFunction(Struct):
    function: NamedFunction
    type: Literal["function"] = "function"


class JSONSchemaFormat(Struct):
    name: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(Struct):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputs(Struct):
    """vLLM's `structured_outputs` (its newer name for the guided_* fields): one of these."""

    json: dict[str, Any] | str | None = None  # a JSON schema (or its text)
    regex: str | None = None
    choice: list[str] | None = None  # the output is one of these strings
    grammar: str | None = None  # EBNF (xgrammar's dialect)
    json_object: bool | None = None  # any JSON object


class GenerationExtras(Struct, kw_only=True):
    """Fields both completion endpoints take beyond OpenAI's core ones: logits processors (OpenAI's
    penalties and logit_bias; vLLM's repetition_penalty, min_p, min_tokens, allowed_token_ids, bad_words;
    the engine checks their ranges and names a bad one), vLLM's truncate_prompt_tokens and output-text
    options, and vLLM's structured outputs (which `response_format` also gives; one of them per request)."""

    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None  # None: the model's generation config, else 1.0
    min_p: float | None = None  # None: the model's generation config, else 0.0
    min_tokens: int = 0
    logit_bias: dict[str, float] | None = None  # token id (as a string, as OpenAI sends it) -> bias
    allowed_token_ids: list[int] | None = None  # only these token ids may be sampled
    bad_words: list[str] | None = None  # words never generated (engine.SamplingParams.bad_words)
    truncate_prompt_tokens: TruncatePromptTokens | None = None  # keep the prompt's last k tokens (-1: all that fit)
    include_stop_str_in_output: bool = False  # keep the stop string (or stop token's text) that ended the output
    return_token_ids: bool = False  # the prompt's and the output's token ids in the response
    priority: Priority = 0  # scheduling class: smaller first, ahead of the policy's order (vLLM's)
    skip_special_tokens: bool = True  # leave special tokens out of the text
    spaces_between_special_tokens: bool = True  # vLLM's; accepted, no effect: the tokenizers' decode (transformers
    # >= 5, and any fast tokenizer before) joins special tokens' text as it is, and ignores the option
    cache_salt: CacheSalt | None = None  # vLLM's: mixed into the prefix cache's hashes, so calls with another salt
    # (or none) never share cached blocks with this one; always apart from other API keys' (calls.engine_salt)
    return_tokens_as_token_ids: bool | None = None  # vLLM's: log-probs name tokens "token_id:{id}" (a token
    # that is not whole UTF-8 alone still says which it is); None: the server's --return-tokens-as-token-ids
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None
    structured_outputs: StructuredOutputs | None = None
    use_beam_search: bool = False  # vLLM's: the n best beams of a beam search (no streaming, log-probs, echo
    # or output grammar; engine.beam_search)
    length_penalty: float = 1.0  # vLLM's: a beam search ranks beams by cum_logprob / len ** length_penalty

    def sampling_args(self) -> dict[str, Any]:
        """These fields as SamplingParams arguments (the output constraint apart: see calls.output_constraint);
        repetition_penalty and min_p only when set (else the model's generation config: calls.sampling_params)."""
        bias = None
        if self.logit_bias:
            bad = [k for k in self.logit_bias if not k.strip().lstrip("-").isdigit()]
            if bad:
                raise InvalidRequestError(f"SamplingParams.logit_bias keys must be token ids, got {bad[0]!r}",
                                          parameter="logit_bias", value=bad[0])
            bias = {int(k): v for k, v in self.logit_bias.items()}
        given = {k: v for k, v in (("repetition_penalty", self.repetition_penalty), ("min_p", self.min_p))
                 if v is not None}
        return {**given, "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
                "min_tokens": self.min_tokens,
                "logit_bias": bias, "include_stop_str_in_output": self.include_stop_str_in_output,
                "skip_special_tokens": self.skip_special_tokens, "priority": self.priority,
                "allowed_token_ids": self.allowed_token_ids, "bad_words": self.bad_words or [],
                "truncate_prompt_tokens": self.truncate_prompt_tokens}


class ChatCompletionRequest(GenerationExtras):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    model: str | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction | None = None
    parallel_tool_calls: bool = True  # several calls may come back in "auto"; a forced call is one call
    response_format: ResponseFormat | None = None
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None  # OpenAI's newer name; wins over max_tokens
    temperature: Temperature | None = None  # None = 1.0
    top_p: TopP | None = None
    top_k: int | None = None  # -1 = off
    n: PositiveInt = 1
    stop: Stop | None = None
    stop_token_ids: list[int] | None = None  # extra token ids that end a completion (vLLM)
    seed: Seed | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    prompt_logprobs: PromptLogprobsCount | None = None  # vLLM's: the prompt tokens' log-probs (no streaming)
    ignore_eos: bool = False
    echo: bool = False  # vLLM's: the reply starts with the last message's content when that is an assistant's
    add_generation_prompt: bool = True  # vLLM's: open the assistant's turn after the messages
    continue_final_message: bool = False  # vLLM's: the last (assistant) message goes on, left open
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: extra variables for the chat template
    chat_template: str | None = None  # vLLM's: this call's own Jinja template (--trust-request-chat-template)
    user: str | None = None
    program_id: ProgramId | None = None
    thread_id: ProgramId | None = None


class TopLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = []


class ChoiceLogprobs(Struct):
    content: list[TokenLogprob] | None = None


class ChatResponseMessage(Struct):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None
    reasoning: str | None = None  # vLLM's, with --reasoning-parser: the thinking before the answer
    reasoning_content: str | None = None  # the same, under its older name (clients read either)


class ToolCallDelta(Struct, omit_defaults=True):
    index: int
    id: str | None = None
    type: str | None = None
    function: FunctionCall | None = None


class PromptLogprob(Struct):
    """vLLM's entry of `prompt_logprobs`: one token at one prompt position."""

    logprob: float
    rank: int | None = None  # 1 + how many tokens the model found more likely there
    decoded_token: str | None = None


# per prompt position (None for the first: nothing comes before it), token id (as a string) -> entry:
# the prompt's own token and the `prompt_logprobs` most likely ones
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class ChatChoice(Struct):
    index: int
    message: ChatResponseMessage
    finish_reason: str | None
    logprobs: ChoiceLogprobs | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or stop token id that ended it (None: EOS)
    token_ids: list[int] | None = None  # vLLM's, with return_token_ids: the generated token ids


class ChatCompletion(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"
    program_id: str | None = None  # the program the call ran in (agentrt)
    prompt_logprobs: PromptLogprobs | None = None  # with the request's prompt_logprobs (vLLM)
    prompt_token_ids: list[int] | None = None  # vLLM's, with return_token_ids


class ChatDelta(Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None
    reasoning: str | None = None  # vLLM's, with --reasoning-parser: a piece of the thinking
    reasoning_content: str | None = None  # the same, under its older name


class ChatChunkChoice(Struct):
    index: int
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # with return_token_ids: the tokens since the choice's last chunk


class ChatCompletionChunk(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    object: str = "chat.completion.chunk"
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None  # with return_token_ids, on the first chunk


# --- completions ----------------------------------------------------------------------------
class CompletionRequest(GenerationExtras):
    # text, token ids, or a list of either (one choice set each); empty is a 400
    prompt: Annotated[str, Meta(min_length=1)] | Annotated[list[str | int | list[int]], Meta(min_length=1)]
    model: str | None = None
    max_tokens: Annotated[int, Meta(ge=0)] = 16  # 0 only with echo: the prompt scored, nothing generated
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: int | None = None
    n: PositiveInt = 1
    stop: Stop | None = None
    stop_token_ids: list[int] | None = None  # extra token ids that end a completion (vLLM)
    seed: Seed | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None  # top alternatives per token (OpenAI: <= 5)
    prompt_logprobs: PromptLogprobsCount | None = None  # vLLM's: the prompt tokens' log-probs (no streaming)
    echo: bool = False  # each choice's text starts with its prompt (and its log-probs with the prompt's)
    response_format: ResponseFormat | None = None
    ignore_eos: bool = False
    user: str | None = None
    program_id: ProgramId | None = None
    thread_id: ProgramId | None = None


class CompletionLogprobs(Struct):
    tokens: list[str]
    token_logprobs: list[float | None]  # None for an echoed prompt's first token (nothing before it)
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]


class CompletionChoice(Struct):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None
    prompt_logprobs: PromptLogprobs | None = None  # with the request's prompt_logprobs (vLLM)
    stop_reason: int | str | None = None  # vLLM's: the stop string or stop token id that ended it (None: EOS)
    prompt_token_ids: list[int] | None = None  # vLLM's, with return_token_ids (streamed: on the choice's first chunk)
    token_ids: list[int] | None = None  # vLLM's, with return_token_ids (streamed: the tokens since the last chunk)


class Completion(Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    object: str = "text_completion"
    program_id: str | None = None


# --- models ---------------------------------------------------------------------------------
class Model(Struct):
    id: str
    created: int
    owned_by: str = "agentrt"
    object: str = "model"
    max_model_len: int | None = None
    root: str | None = None  # a LoRA adapter's directory (vLLM's model card)
    parent: str | None = None  # a LoRA adapter's base model


class ModelList(Struct):
    data: list[Model]
    object: str = "list"


class Version(Struct):
    version: str  # agentrt's


# --- the tokenizer (vLLM's /tokenize and /detokenize) ----------------------------------------
class TokenizeRequest(Struct):
    model: str | None = None
    prompt: str | None = None  # text, tokenized as /v1/completions does; or
    messages: Annotated[list[ChatMessage], Meta(min_length=1)] | None = None  # a conversation, as /v1/chat/completions renders it
    tools: list[Tool] | None = None  # with messages: the tools the chat endpoint would describe in the prompt
    add_special_tokens: bool = True  # with prompt
    add_generation_prompt: bool = True  # with messages: end with the assistant's turn opened
    continue_final_message: bool = False  # with messages: the last (assistant) message left open
    chat_template_kwargs: dict[str, Any] | None = None  # with messages: extra variables for the chat template
    chat_template: str | None = None  # with messages: the call's own template (--trust-request-chat-template)
    return_token_strs: bool = False


class TokenizeResponse(Struct):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None  # each token's text, when return_token_strs


class DetokenizeRequest(Struct):
    tokens: list[Annotated[int, Meta(ge=0)]]
    model: str | None = None


class DetokenizeResponse(Struct):
    prompt: str


class PrefixCacheReset(Struct):
    reset: bool  # nothing cached is left (False: blocks in use by running calls or programs' pins kept theirs)


class Health(Struct):
    status: str  # "ok" | "draining"


def decode(body: bytes, type_: type) -> Any:
    """Decode a request body (raises msgspec.ValidationError / DecodeError); its top-level fields that `type_`
    does not define are ignored, each logged the first time a request of `type_` brings it."""
    obj = msgspec.json.decode(body, type=type_)
    unknown = [k for k in unknown_fields(body, type_) if (type_, k) not in _logged]
    if unknown and len(_logged) < _MAX_LOGGED:
        _logged.update((type_, k) for k in unknown)
        logger.warning("request fields ignored, not part of %s: %s (vLLM ignores them too; logged once each)",
                       type_.__name__, ", ".join(unknown))
    return obj


_MAX_LOGGED = 10_000  # (type, field) pairs remembered as logged; beyond, new ones go unlogged
_logged: set[tuple[type, str]] = set()
_known: dict[type, frozenset[str]] = {}


def unknown_fields(body: bytes, type_: type) -> list[str]:
    """The top-level fields of a JSON object `body` that the Struct `type_` does not define, in body order."""
    known = _known.get(type_)
    if known is None:
        if not (isinstance(type_, type) and issubclass(type_, Struct)):
            return []
        known = _known[type_] = frozenset(f.encode_name for f in msgspec.structs.fields(type_))
    try:
        fields = msgspec.json.decode(body, type=dict[str, msgspec.Raw])  # values skipped, not built
    except msgspec.MsgspecError:
        return []
    return [k for k in fields if k not in known]
