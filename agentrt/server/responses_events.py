"""A streamed response's events (`POST /v1/responses` with `stream: true`), in the order OpenAI's SDKs
parse them: created, in_progress, then each output item (added, its deltas, done), then completed.

Items come in the order of the non-streamed response's `output`: the reasoning (with a reasoning
parser: `response.reasoning_text.delta` events as the model thinks), the message (`output_text`
deltas as it answers; text that may be a tool call is held back), then the function calls, whole,
once the reply has ended.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec

from agentrt._call import Call
from agentrt._chat_plan import ChatPlan, Reply
from agentrt._errors import AgentrtError
from agentrt.engine.outputs import RequestOutput
from agentrt.server.errors import to_api_error
from agentrt.server.responses_schemas import (
    FunctionCallItem,
    OutputMessage,
    OutputText,
    ReasoningItem,
    ReasoningText,
    ResponseObject,
)

# finish(out, reply, msg_id, rs_id): the final response (stored when it asks to be), its items under these ids
Finish = Callable[[RequestOutput, Reply, str, str], ResponseObject]


class _Part:
    """One text item streamed as it grows: a reasoning item's `reasoning_text` or a message's `output_text`."""

    def __init__(self, ev: Callable[..., bytes], kind: str, item_id: str) -> None:
        self.ev, self.kind, self.item_id = ev, kind, item_id
        self.index: int | None = None  # the item's output_index once it is open
        self.sent = ""  # text streamed so far
        self.closed = False

    def _item(self, text: str | None) -> Any:
        if self.kind == "reasoning_text":
            return ReasoningItem(self.item_id, [] if text is None else [ReasoningText(text)],
                                 status="in_progress" if text is None else "completed")
        return OutputMessage(self.item_id, [] if text is None else [OutputText(text)],
                             status="in_progress" if text is None else "completed")

    def _part(self, text: str) -> Any:
        return ReasoningText(text) if self.kind == "reasoning_text" else OutputText(text)

    def open(self, index: int) -> list[bytes]:
        self.index = index
        where = {"item_id": self.item_id, "output_index": index, "content_index": 0}
        return [self.ev("response.output_item.added", output_index=index, item=self._item(None)),
                self.ev("response.content_part.added", **where, part=self._part(""))]

    def delta(self, text: str, index: int) -> list[bytes]:
        """`text` streamed, the item opened at `index` first if it is not yet."""
        out = self.open(index) if self.index is None else []
        self.sent += text
        out.append(self.ev(f"response.{self.kind}.delta", item_id=self.item_id, output_index=self.index,
                           content_index=0, delta=text))
        return out

    def close(self, text: str) -> list[bytes]:
        """The whole text: what was not streamed yet (held back), then the done events."""
        assert self.index is not None
        self.closed = True
        out = []
        rest = text[len(self.sent):] if text.startswith(self.sent) else ""
        if rest:
            out += self.delta(rest, self.index)
        where = {"item_id": self.item_id, "output_index": self.index, "content_index": 0}
        out += [self.ev(f"response.{self.kind}.done", **where, text=text),
                self.ev("response.content_part.done", **where, part=self._part(text)),
                self.ev("response.output_item.done", output_index=self.index, item=self._item(text))]
        return out


async def response_events(call: Call, plan: ChatPlan, base: ResponseObject, finish: Finish) -> AsyncIterator[bytes]:
    """The event sequence OpenAI's SDKs parse: see the module docstring."""
    seq = itertools.count()

    def ev(kind: str, **payload: Any) -> bytes:
        data = msgspec.json.encode({"type": kind, "sequence_number": next(seq), **payload})
        return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"

    yield ev("response.created", response=base)
    yield ev("response.in_progress", response=base)
    streamer = plan.streamer()
    thought = _Part(ev, "reasoning_text", f"rs_{uuid.uuid4().hex[:24]}")
    said = _Part(ev, "output_text", f"msg_{uuid.uuid4().hex[:24]}")

    async with call:
        try:
            async for d in call:
                reasoning, show = streamer.feed(d.new_text)
                for e in thought.delta(reasoning, 0) if reasoning else ():
                    yield e
                if show:
                    if thought.index is not None and not thought.closed:  # the answer began: the thinking is over
                        for e in thought.close(thought.sent):
                            yield e
                    for e in said.delta(show, 0 if thought.index is None else 1):
                        yield e
            out = await call.result()
        except AgentrtError as e:
            err = to_api_error(e)
            yield ev("error", code=err.code, message=err.message, param=err.param)
            return
    reply = plan.split(out.text)
    index = 0
    if reply.reasoning:
        if thought.index is None:
            for e in thought.open(0):
                yield e
        if not thought.closed:
            for e in thought.close(reply.reasoning):
                yield e
        index = 1
    if reply.content:
        if said.index is None:
            for e in said.open(index):
                yield e
        for e in said.close(reply.content):
            yield e
        index += 1
    done = finish(out, reply, said.item_id, thought.item_id)
    for item in done.output:
        if not isinstance(item, FunctionCallItem):
            continue
        added = msgspec.structs.replace(item, arguments="", status="in_progress")
        yield ev("response.output_item.added", output_index=index, item=added)
        yield ev("response.function_call_arguments.delta", item_id=item.id, output_index=index, delta=item.arguments)
        yield ev("response.function_call_arguments.done", item_id=item.id, output_index=index,
                 arguments=item.arguments)
        yield ev("response.output_item.done", output_index=index, item=item)
        index += 1
    # "response.completed" even when cut by max_output_tokens (its status says "incomplete"): the SDKs'
    # stream helpers wait for this event to hand out the final response
    yield ev("response.completed", response=done)
