"""A conversation rendered by the model's chat template, with vLLM's chat options:
`add_generation_prompt` (open the assistant's turn, the default), `continue_final_message` (the
last message is an assistant message the model goes on writing: nothing closes it) and
`template_kwargs` (extra variables for the template). `LLM.chat` and the runtime's chat calls share
it; the checks name the option at fault so each caller can report it its own way."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

# apply_chat_template's own arguments: a template variable of these names would change how the call
# renders or what it returns, not what the template sees
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})


def option_error(messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool, continue_final_message: bool,
                 template_kwargs: Mapping[str, Any] | None) -> tuple[str, str] | None:
    """The first problem with the options as (message, the field at fault), or None."""
    if continue_final_message:
        if add_generation_prompt:
            return ("continue_final_message and add_generation_prompt cannot both be true: set "
                    "add_generation_prompt to false to continue the last message", "continue_final_message")
        role = messages[-1].get("role") if messages else None
        if role != "assistant":
            return (f"continue_final_message continues an assistant message, but the last message's role is {role!r}",
                    f"messages[{len(messages) - 1}].role")
    if template_kwargs is not None and not isinstance(template_kwargs, Mapping):
        return f"chat_template_kwargs must be a dict, got {type(template_kwargs).__name__}", "chat_template_kwargs"
    reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(template_kwargs or {}))
    if reserved:
        return (f"chat_template_kwargs may not set {reserved[0]!r} (an argument of the call itself)",
                f"chat_template_kwargs.{reserved[0]}")
    return None


def syntax_error(template: str) -> str | None:
    """Why a Jinja chat template does not compile, or None (the loop controls transformers' template
    environment allows, {% break %} / {% continue %}, included)."""
    import jinja2

    try:
        jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateSyntaxError as e:
        return f"{e.message} (line {e.lineno})"
    return None


def render(tokenizer: Any, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
           continue_final_message: bool = False, template_kwargs: Mapping[str, Any] | None = None,
           chat_template: str | None = None) -> str:
    """The prompt text (options checked by `option_error` first; the template's own errors propagate)."""
    return tokenizer.apply_chat_template(list(messages), tokenize=False, chat_template=chat_template,
                                         add_generation_prompt=add_generation_prompt,
                                         continue_final_message=continue_final_message, **(template_kwargs or {}))
