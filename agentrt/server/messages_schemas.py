"""Anthropic's Messages API contract (`POST /v1/messages`), msgspec Structs after Anthropic's reference.

Input content blocks are decoded into one permissive Struct (`InputBlock`: text, tool_use or
tool_result, told apart by `type`) and checked block by block, so a malformed block is a 400 naming
it. Output blocks are a tagged union on `type`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import Meta, Struct

from agentrt.server.schemas import ProgramId, Temperature, TopP


class TextPart(Struct):
    type: str  # "text"
    text: str | None = None


class InputBlock(Struct):
    type: str  # "text" | "tool_use" | "tool_result" | "thinking" (skipped); others are refused, naming the block
    text: str | None = None
    id: str | None = None  # tool_use
    name: str | None = None  # tool_use
    input: dict[str, Any] | None = None  # tool_use
    tool_use_id: str | None = None  # tool_result
    content: str | list[TextPart] | None = None  # tool_result
    is_error: bool | None = None  # tool_result


class InputMessage(Struct):
    role: Literal["user", "assistant"]
    content: str | list[InputBlock]


class Tool(Struct):
    name: Annotated[str, Meta(min_length=1)]
    input_schema: dict[str, Any]  # JSON schema of the input object
    description: str | None = None
    type: str | None = None  # "custom" (or absent); Anthropic's server tools are refused


class ToolChoice(Struct):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # with "tool"
    disable_parallel_tool_use: bool = False  # at most one tool_use block


class OutputFormat(Struct):
    type: Literal["json_schema"]
    schema: dict[str, Any]


class OutputConfig(Struct):
    format: OutputFormat | None = None  # structured output: the text is JSON matching the schema
    effort: str | None = None  # accepted, not used


class MessagesRequest(Struct, kw_only=True):
    model: str
    messages: Annotated[list[InputMessage], Meta(min_length=1)]
    max_tokens: Annotated[int, Meta(ge=1)]
    system: str | list[TextPart] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: int | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    metadata: dict[str, Any] | None = None
    output_config: OutputConfig | None = None
    program_id: ProgramId | None = None  # agentrt's (also the X-Program-Id header)
    thread_id: ProgramId | None = None


class CountTokensRequest(Struct, kw_only=True):
    model: str
    messages: Annotated[list[InputMessage], Meta(min_length=1)]
    system: str | list[TextPart] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None


class CountTokensResponse(Struct):
    input_tokens: int


class TextBlock(Struct, tag="text"):
    text: str


class ToolUseBlock(Struct, tag="tool_use"):
    id: str
    name: str
    input: dict[str, Any]


class ThinkingBlock(Struct, tag="thinking"):
    """The thinking before the answer, with a reasoning parser (`agentrt serve --reasoning-parser`)."""

    thinking: str
    signature: str = ""  # Anthropic's proof that Claude wrote it: none here


ContentBlock = ThinkingBlock | TextBlock | ToolUseBlock


class MessageUsage(Struct):
    input_tokens: int  # prompt tokens computed for this call (not served from the prefix cache)
    output_tokens: int
    cache_read_input_tokens: int = 0  # prompt tokens served from the prefix cache
    cache_creation_input_tokens: int = 0


class Message(Struct):
    id: str
    model: str
    content: list[ContentBlock]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None
    usage: MessageUsage
    type: str = "message"
    role: str = "assistant"


class AnthropicErrorInfo(Struct):
    type: str  # "invalid_request_error" | "authentication_error" | "not_found_error" | ...
    message: str
    param: str | None = None  # agentrt's: the field at fault


class AnthropicError(Struct):
    error: AnthropicErrorInfo
    type: str = "error"


class MessageStreamEvent(Struct):
    """One event of a streamed message (`data:` of each server-sent event; its `event:` is `type`)."""

    type: str  # "message_start" | "content_block_start" | "content_block_delta" | ... | "message_stop" | "error"
    message: Message | None = None  # message_start
    index: int | None = None  # content_block_*
    content_block: ContentBlock | None = None  # content_block_start
    delta: dict[str, Any] | None = None  # content_block_delta, message_delta
    usage: MessageUsage | None = None  # message_delta
    error: AnthropicErrorInfo | None = None  # error
