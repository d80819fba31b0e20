"""Chat prompts as token ids: a conversation under the model's chat template, and each program's
last prompt + reply kept so its next prompt reuses the ids the engine generated.

Options as vLLM's chat endpoint has them (engine.chat_template): `add_generation_prompt`,
`continue_final_message`, `chat_template_kwargs`, and a `chat_template` of the call's own; the in-process
chat calls take them by the same names. A template that renders tools (`renders_tools`) is given them.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

from agentrt._errors import InvalidCallError
from agentrt.engine import chat_template as templates
from agentrt.engine.outputs import RequestOutput

TEMPLATE_OPTIONS = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs", "chat_template")


def pop_template_options(kw: dict[str, Any]) -> dict[str, Any]:
    """The chat template's options among a chat call's keyword arguments (taken out of them)."""
    return {k: kw.pop(k) for k in TEMPLATE_OPTIONS if k in kw}


@functools.lru_cache(maxsize=64)
def renders_tools(template: str | None) -> bool:
    """Whether a Jinja chat template renders tools: its source reads the `tools` variable (a template that
    does not compile reads nothing; rendering it reports the error)."""
    import jinja2
    from jinja2 import meta

    if not template:
        return False
    try:
        tree = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateSyntaxError:
        return False
    return "tools" in meta.find_undeclared_variables(tree)


class ChatPrompts:
    """Renders and tokenizes conversations; per program (until `forget`), its latest prompt and its
    last prompt + reply."""

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer  # the running engine's: the runtime sets it when its engine starts
        self.convs: dict[str, tuple[str, list[int]]] = {}  # program id -> (text, ids): last prompt + reply
        self.prompts: dict[str, tuple[str, list[int]]] = {}  # program id -> its latest prompt (text, ids)

    def token_ids(self, messages: Sequence[dict[str, Any]], program_id: str | None = None, **options: Any) -> list[int]:
        """Token ids of `messages` under the chat template. InvalidCallError names a bad argument."""
        return self.prompt(messages, program_id, **options)[1]

    def prompt(
        self, messages: Sequence[dict[str, Any]], program_id: str | None = None, *, add_generation_prompt: bool = True,
        continue_final_message: bool = False, chat_template_kwargs: Mapping[str, Any] | None = None,
        chat_template: str | None = None, tools: list[dict[str, Any]] | None = None,
    ) -> tuple[str, list[int]]:
        """The text of `messages` under the chat template and its token ids; `tools` (OpenAI function specs)
        for a template that renders them."""
        def bad(message: str, param: str) -> InvalidCallError:
            return InvalidCallError(message, program_id=program_id, param=param)

        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
            raise bad(f"messages must be a non-empty list of {{role, content}} dicts, got {messages!r}", "messages")
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise bad(f"each message needs a str 'role' and 'content', got {m!r}", "messages")
        problem = templates.option_error(messages, add_generation_prompt, continue_final_message, chat_template_kwargs)
        if problem is not None:
            raise bad(*problem)
        tok = self.tokenizer
        kwargs = dict(chat_template_kwargs or {})
        if tools is not None:  # apply_chat_template's own argument, past the check on the caller's kwargs
            kwargs["tools"] = tools
        try:
            text = templates.render(tok, messages, add_generation_prompt=add_generation_prompt,
                                    continue_final_message=continue_final_message,
                                    template_kwargs=kwargs, chat_template=chat_template)
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
        return text, ids

    def template_source(self, chat_template: str | None = None,
                        tools: list[dict[str, Any]] | None = None) -> str | None:
        """The source of the template a prompt renders with: `chat_template` (a template, or the name of one
        of the tokenizer's), else the tokenizer's (its "tool_use" one, when it has one, for a call with
        tools, as transformers picks); None when there is none."""
        try:
            source = self.tokenizer.get_chat_template(chat_template, tools)
        except Exception:  # noqa: BLE001 - no template: rendering the prompt names the problem
            return None
        return source if isinstance(source, str) else None

    def remember_reply(self, program_id: str, out: RequestOutput | None) -> None:
        """Keep a chat call's prompt and reply as (text, ids) so the program's next prompt reuses the ids
        the engine generated instead of re-tokenizing their text: a re-tokenization that differs at the
        reply boundary would end the prefix hit there."""
        prompt = self.prompts.pop(program_id, None)
        if prompt is None or out is None or not out.outputs or list(out.prompt_token_ids) != prompt[1]:
            return
        ids = list(out.outputs[0].token_ids)
        self.convs[program_id] = (prompt[0] + self.tokenizer.decode(ids), prompt[1] + ids)

    def forget(self, program_id: str) -> None:
        self.convs.pop(program_id, None)
        self.prompts.pop(program_id, None)
