"""The Responses API's contract (`POST /v1/responses`), msgspec Structs after OpenAI's reference.

Input items are decoded into one permissive Struct (`InputItem`: a message, a `function_call` or a
`function_call_output`, told apart by `type` / `role`) and checked item by item, so a malformed
item is a 400 naming it. Output items are a tagged union on `type`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import Meta, Struct

from agentrt.server.schemas import CacheSalt, ProgramId, Temperature, TopP


class InputPart(Struct):
    type: str  # "input_text" | "output_text" | "text"
    text: str | None = None


class InputItem(Struct):
    type: str | None = None  # "message" (or absent, with a role) | "function_call" | "function_call_output"
    # | "reasoning" (an earlier reply's thinking, sent back: skipped, as templates leave it out of earlier turns)
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[InputPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[InputPart] | None = None
    id: str | None = None
    status: str | None = None


class FunctionTool(Struct):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(Struct):
    type: Literal["function"]
    name: str


class TextFormat(Struct):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class TextConfig(Struct):
    format: TextFormat | None = None


class ResponseCreate(Struct):
    input: str | list[InputItem]
    model: str | None = None
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: Annotated[int, Meta(ge=1)] | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    text: TextConfig | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    program_id: ProgramId | None = None
    cache_salt: CacheSalt | None = None  # vLLM's: the prefix cache's salt, as on chat completions


class OutputText(Struct, tag="output_text", tag_field="type"):
    text: str
    annotations: list[Any] = []


class OutputMessage(Struct, tag="message", tag_field="type"):
    id: str
    content: list[OutputText]
    status: str = "completed"
    role: str = "assistant"


class FunctionCallItem(Struct, tag="function_call", tag_field="type"):
    id: str
    call_id: str
    name: str
    arguments: str
    status: str = "completed"


class ReasoningText(Struct, tag="reasoning_text", tag_field="type"):
    text: str


class ReasoningItem(Struct, tag="reasoning", tag_field="type"):
    """The thinking before the answer, with a reasoning parser (`agentrt serve --reasoning-parser`)."""

    id: str
    content: list[ReasoningText]
    summary: list[Any] = []  # no summaries: the reasoning comes whole, in `content`
    status: str = "completed"


OutputItem = ReasoningItem | OutputMessage | FunctionCallItem


class InputTokensDetails(Struct, frozen=True):
    cached_tokens: int = 0


class OutputTokensDetails(Struct, frozen=True):
    reasoning_tokens: int = 0


class ResponseUsage(Struct):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails = InputTokensDetails()
    output_tokens_details: OutputTokensDetails = OutputTokensDetails()


class IncompleteDetails(Struct):
    reason: str  # "max_output_tokens"


class ResponseObject(Struct):
    id: str
    created_at: int
    model: str
    output: list[OutputItem]
    status: str  # "completed" | "incomplete" | "in_progress"
    usage: ResponseUsage | None
    object: str = "response"
    instructions: str | None = None
    tools: list[FunctionTool] = []
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    text: TextConfig | None = None
    error: Any = None
    incomplete_details: IncompleteDetails | None = None
    metadata: dict[str, str] = {}
    store: bool = True
    program_id: str | None = None  # the program the response chain runs in (agentrt)


class ItemText(Struct):
    type: str  # "input_text" (user, system) | "output_text" (assistant)
    text: str


class InputMessageItem(Struct, tag="message", tag_field="type"):
    id: str
    role: str  # "user" | "system" | "assistant"
    content: list[ItemText]
    status: str = "completed"


class FunctionCallOutputItem(Struct, tag="function_call_output", tag_field="type"):
    id: str
    call_id: str
    output: str
    status: str = "completed"


class ResponseInputItems(Struct):
    """`GET /v1/responses/{response_id}/input_items`: what the model read, earlier turns of the chain included
    (instructions are not an item), one page of it."""

    data: list[InputMessageItem | FunctionCallItem | FunctionCallOutputItem]
    first_id: str | None
    last_id: str | None
    has_more: bool
    object: str = "list"


class ResponseDeleted(Struct):
    """The answer to `DELETE /v1/responses/{response_id}`."""

    id: str
    object: str = "response"
    deleted: bool = True


class ResponseStreamEvent(Struct):
    """One event of a streamed response (`data:` of each server-sent event; its `event:` is `type`)."""

    type: str  # "response.created" | "response.output_text.delta" | ... | "response.completed" | "error"
    sequence_number: int
    response: ResponseObject | None = None
    output_index: int | None = None
    item: OutputItem | None = None
    item_id: str | None = None
    content_index: int | None = None
    part: OutputText | ReasoningText | None = None
    delta: str | None = None
    text: str | None = None
    arguments: str | None = None
    code: str | None = None
    message: str | None = None
    param: str | None = None
