"""Chat prompts as token ids: a conversation under the model's chat template, and each program's
last prompt + reply kept so its next prompt reuses the ids the engine generated.

Options as vLLM's chat endpoint has them: `add_generation_prompt` (open the assistant's turn, the
default), `continue_final_message` (the last message is an assistant message the model goes on
writing: nothing closes it), and `template_kwargs` (extra variables for the template).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from agentrt._errors import InvalidCallError
from engine.outputs import RequestOutput

# apply_chat_template's own arguments: a template variable of these names would change how the call
# renders or what it returns, not what the template sees
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})


class ChatPrompts:
    """Renders and tokenizes conversations; per program (until `forget`), its latest prompt and its
    last prompt + reply."""

    def __init__(self, tokenizer: Callable[[], Any]) -> None:
        self._tokenizer = tokenizer  # the running engine's (the runtime's property)
        self.convs: dict[str, tuple[str, list[int]]] = {}  # program id -> (text, ids): last prompt + reply
        self.prompts: dict[str, tuple[str, list[int]]] = {}  # program id -> its latest prompt (text, ids)

    def token_ids(
        self, messages: Sequence[dict[str, Any]], program_id: str | None = None, *, add_generation_prompt: bool = True,
        continue_final_message: bool = False, template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of `messages` under the chat template. InvalidCallError names a bad argument."""
        def bad(message: str, param: str) -> InvalidCallError:
            return InvalidCallError(message, program_id=program_id, param=param)

        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
            raise bad(f"messages must be a non-empty list of {{role, content}} dicts, got {messages!r}", "messages")
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise bad(f"each message needs a str 'role' and 'content', got {m!r}", "messages")
        if continue_final_message:
            if add_generation_prompt:
                raise bad("continue_final_message and add_generation_prompt cannot both be true: set "
                          "add_generation_prompt to false to continue the last message", "continue_final_message")
            if messages[-1]["role"] != "assistant":
                raise bad(f"continue_final_message continues an assistant message, but the last message's role is "
                          f"{messages[-1]['role']!r}", f"messages[{len(messages) - 1}].role")
        kwargs = dict(template_kwargs or {})
        reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(kwargs))
        if reserved:
            raise bad(f"chat_template_kwargs may not set {reserved[0]!r} (an argument of the call itself)",
                      f"chat_template_kwargs.{reserved[0]}")
        tok = self._tokenizer()
        try:
            text = tok.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=add_generation_prompt,
                                           continue_final_message=continue_final_message, **kwargs)
            conv = self.convs.get(program_id) if program_id is not None else None
            if conv is not None and text.startswith(conv[0]):  # the program's last prompt + reply, then more
                ids = conv[1] + tok(text[len(conv[0]) :], add_special_tokens=False)["input_ids"]
            else:
                ids = tok(text, add_special_tokens=False)["input_ids"]
        except (TypeError, ValueError, UnicodeError) as e:  # e.g. a lone surrogate in a message
            raise bad(f"messages cannot be tokenized: {e}", "messages") from None
        except Exception as e:  # jinja's errors: a template that cannot render these messages or variables
            raise bad(f"messages cannot be rendered by the chat template: {e}", "messages") from None
        if program_id is not None:
            self.prompts[program_id] = (text, ids)
        return ids

    def remember_reply(self, program_id: str, out: RequestOutput | None) -> None:
        """Keep a chat call's prompt and reply as (text, ids) so the program's next prompt reuses the ids
        the engine generated instead of re-tokenizing their text: a re-tokenization that differs at the
        reply boundary would end the prefix hit there."""
        prompt = self.prompts.pop(program_id, None)
        if prompt is None or out is None or not out.outputs or list(out.prompt_token_ids) != prompt[1]:
            return
        ids = list(out.outputs[0].token_ids)
        self.convs[program_id] = (prompt[0] + self._tokenizer().decode(ids), prompt[1] + ids)

    def forget(self, program_id: str) -> None:
        self.convs.pop(program_id, None)
        self.prompts.pop(program_id, None)
