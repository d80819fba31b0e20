"""What the engine hands back: per-request outputs, streamed deltas, incremental detokenization."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finish_time: float | None
    service_s: float  # executor time attributed to the request
    num_prefix_hit_tokens: int  # prompt tokens served from the prefix cache
    num_preemptions: int
    num_tier_loaded_tokens: int = 0  # prompt tokens the KV tiers loaded for it instead of recomputing them
    preemptions: list[tuple[float, float | None]] = field(default_factory=list)  # (preempted at, rescheduled
    # at, None if it never was), the engine's clock like the times above


@dataclass(slots=True)
class CompletionOutput:
    index: int  # which of the n completions
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"; None while running
    logprobs: list[float] | None = None  # per token, the sampled token's log-prob (logprobs or top_logprobs set)
    error: str | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per token, the top_logprobs most likely
    # (token id, log-prob), best first; None unless top_logprobs > 0
    stop_reason: int | str | None = None  # what ended a "stop": the stop string, or the stop token id;
    # None for EOS, a grammar's end, and every other finish (vLLM's)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    metrics: RequestMetrics | None = None
    prompt_logprobs: list[float | None] | None = None  # per prompt token, its log-prob given the tokens
    # before it (None for the first); None unless SamplingParams.prompt_logprobs is set
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None  # per prompt position, the
    # prompt_logprobs most likely (token id, log-prob) (None for the first); None unless prompt_logprobs > 0
    prompt_ranks: list[int | None] | None = None  # with prompt_logprobs, per prompt token 1 + how many tokens
    # the model found more likely at its position (vLLM's rank; None for the first)
    embedding: list[float] | None = None  # a pooling request's vector (engine.pooling); its one completion
    # then has no tokens and finish_reason "stop"
    prompt: str | None = None  # the prompt's text (vLLM's; LLM.chat: as the chat template rendered it);
    # None when it was given as token ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache when the request was first scheduled."""
        return self.metrics.num_prefix_hit_tokens if self.metrics is not None else 0

    @property
    def num_output_tokens(self) -> int:
        return sum(o.num_output_tokens for o in self.outputs)


@dataclass(slots=True)
class StreamDelta:
    """New output of one completion since the last step."""

    request_id: str
    index: int
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None = None
    error: str | None = None
    new_logprobs: list[float] | None = None  # per new token, its log-prob (logprobs or top_logprobs set)
    new_top_logprobs: list[list[tuple[int, float]]] | None = None  # per new token, the most likely
    # (token id, log-prob), best first; None unless top_logprobs > 0
    prompt_logprobs: list[float | None] | None = None  # on a completion's first delta with tokens, when
    # SamplingParams.prompt_logprobs is set: per prompt token, its log-prob (None for the first)
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None  # with it, per prompt position its
    # prompt_logprobs most likely (token id, log-prob) (None for the first); None unless prompt_logprobs > 0
    stop_reason: int | str | None = None  # on the last delta, CompletionOutput.stop_reason
    num_cached_tokens: int | None = None  # on a completion's first delta with tokens: prompt tokens served
    # from the prefix cache (RequestOutput.num_cached_tokens, known before the end)
    embedding: list[float] | None = None  # on a pooling request's last (and only) delta, its vector


@dataclass(slots=True)
class Detokenizer:
    """Incremental detokenization with stop strings.

    Text is released only once stable (no half UTF-8 sequence), and while stop strings are set
    the last `len(longest stop) - 1` characters are held back, so a stream never shows the start
    of a stop string that the final text then cuts off (with `include_stop` nothing is cut before a
    stop string's end, so nothing is held back)."""

    tokenizer: object
    stop: list[str] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0
    emitted: int = 0  # characters of `text` already handed out
    min_tokens: int = 0  # SamplingParams.min_tokens: no stop string ends the output before
    include_stop: bool = False  # SamplingParams.include_stop_str_in_output
    skip_special_tokens: bool = True
    stop_reason: int | str | None = None  # the stop string found, or (set by the engine) the stop token id

    def add(self, token_ids: list[int], stop_terminated: bool = False) -> bool:
        """Append tokens; True when a stop string appeared (the text is cut before it, or after it with
        `include_stop`). Stop strings are looked for once there are more than `min_tokens` tokens
        (vLLM's rule). `stop_terminated`: the last token ends the output (EOS or a stop token id); its
        text is left out unless `include_stop`."""
        if stop_terminated and not self.include_stop:
            token_ids = token_ids[:-1]
        self.ids.extend(token_ids)
        decode, skip = self.tokenizer.decode, self.skip_special_tokens
        prefix = decode(self.ids[self.prefix_offset : self.read_offset], skip_special_tokens=skip)
        full = decode(self.ids[self.prefix_offset :], skip_special_tokens=skip)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return False
        old_len = len(self.text)
        self.text += full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        if self.stop and len(self.ids) > self.min_tokens:
            start = max(0, old_len - max(len(s) for s in self.stop) + 1)
            found = [(i, s) for s in self.stop if (i := self.text.find(s, start)) >= 0]
            hits = [(i + len(s) if self.include_stop else i, s) for i, s in found]
            if hits:  # with include_stop, the output ends where the first stop string to appear ends
                end, self.stop_reason = min(hits, key=lambda h: h[0])
                self.text = self.text[:end]
                return True
        return False

    def take(self, final: bool) -> str:
        """Text not handed out yet (all of it when `final`)."""
        hold = 0 if final or not self.stop or self.include_stop else max(len(s) for s in self.stop) - 1
        end = max(self.emitted, len(self.text) - hold)
        out = self.text[self.emitted : end]
        self.emitted = end
        return out
