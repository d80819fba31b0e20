"""What a request must pass before the engine takes it, on the caller's thread (so a bad one is refused
before it reaches the engine's worker thread): its prompt (tokenized, in the vocabulary, fitting the
context), its SamplingParams (re-checked, token ids against the vocabulary, bad_words tokenized), its
output grammar (compiled and cached) and its LoRA adapter (loaded and kept). Each failure is an
InvalidRequestError (a ValueError) naming the field and the value.

Thread-safe: the grammar cache and the adapter registry take locks; the rest reads only.
"""

from __future__ import annotations

import dataclasses
import numbers
import threading
from dataclasses import dataclass
from typing import Any

from agentrt.engine.config import EngineConfig
from agentrt.engine.errors import InvalidRequestError, InvalidRequestTypeError, show_value
from agentrt.engine.lora import LoRAAdapter, LoRARegistry, LoRARequest, load_adapter
from agentrt.engine.model import interleave_rope_rows
from agentrt.engine.model_args import ModelArgs
from agentrt.engine.sampling_params import SamplingParams, truncate_prompt
from agentrt.engine.structured import Constraint, GrammarCache


@dataclass(frozen=True, slots=True)
class RequestOwner:
    """Who a request belongs to: what travels together from the caller to the scheduler and the KV cache."""

    program_id: str | None = None  # the program it is a call of (reservations, pins, the policy's service)
    thread_id: str | None = None  # the program's thread making it
    cache_salt: str | None = None  # tenant salt: its blocks are shared only with requests of the same salt


@dataclass(slots=True)
class CheckedRequest:
    """A request that passed every check (`EngineCore.admit`): the engine core adds it without checking again."""

    request_id: str  # free, with the ids of its n - 1 forks
    prompt_token_ids: list[int]  # in the vocabulary, fitting the context (truncated as asked)
    params: SamplingParams  # a checked copy, its grammar compiled and bad_words tokenized
    owner: RequestOwner
    lora: LoRAAdapter | None  # the adapter, loaded (None: the base model)


class RequestChecks:
    """The checks of one engine's requests: its tokenizer, model shape, context and EOS ids."""

    def __init__(self, config: EngineConfig, tokenizer: Any, args: ModelArgs, max_model_len: int,
                 eos_token_ids: frozenset[int]) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.args = args
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self._grammars: GrammarCache | None = None  # built on the first constrained request
        self._grammars_lock = threading.Lock()
        self.loras = LoRARegistry(config.max_loras, self._load_lora) if config.enable_lora else None

    @property
    def grammars(self) -> GrammarCache:
        """The compiled grammars (after a `compile_constraint`): matchers for constrained requests."""
        assert self._grammars is not None, "compile_constraint first"
        return self._grammars

    def validate_prompt(self, prompt: str | list[int], truncate_prompt_tokens: int | None = None) -> list[int]:
        """Token ids of a prompt that can run, its last `truncate_prompt_tokens` only when set (vLLM's rule:
        sampling_params.truncate_prompt); InvalidRequestError (a ValueError) naming what is wrong otherwise:
        not a str or list of ints (bytes included), empty, a lone surrogate, an id out of the vocabulary, no
        room left in the context."""
        if isinstance(prompt, str):
            ids = self._tokenize(prompt)
        elif isinstance(prompt, (list, tuple)):
            ids = self._check_token_ids(prompt)
        else:
            hint = " (decode bytes to str first)" if isinstance(prompt, (bytes, bytearray, memoryview)) else ""
            raise InvalidRequestTypeError(f"prompt must be a str or a list of token ids, got {show_value(prompt)}{hint}",
                                          parameter="prompt", value=prompt)
        if truncate_prompt_tokens is not None:
            ids = truncate_prompt(ids, truncate_prompt_tokens, self.max_model_len)
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt of {len(ids)} tokens does not fit the model's context of {self.max_model_len} tokens "
                "(at least one token must remain for the output)", parameter="prompt", value=len(ids))
        return ids

    def _tokenize(self, text: str) -> list[int]:
        if not text:
            raise InvalidRequestError("prompt is empty", parameter="prompt", value=text)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise InvalidRequestError(
                f"prompt has a lone surrogate {text[e.start]!r} at character {e.start}: text must be valid Unicode",
                parameter="prompt", value=text) from None
        ids = self.tokenizer(text)["input_ids"]
        if not ids:
            raise InvalidRequestError(f"prompt {text[:40]!r} is empty once tokenized", parameter="prompt", value=text)
        return ids

    def _check_token_ids(self, prompt: list[int] | tuple[int, ...]) -> list[int]:
        if not prompt:
            raise InvalidRequestError("prompt is empty", parameter="prompt", value=prompt)
        for i, t in enumerate(prompt):
            if isinstance(t, bool) or not isinstance(t, numbers.Integral):
                raise InvalidRequestTypeError(f"prompt token ids must be ints, got {show_value(t)} at position {i}",
                                              parameter="prompt", value=t)
        vocab = self.args.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"prompt token ids out of range [0, {vocab}): {show_value(bad[:5], False)}",
                                      parameter="prompt", value=bad)
        return [int(t) for t in prompt]

    def validate_params(self, params: SamplingParams | None) -> SamplingParams:
        """A checked copy of `params` (None = the defaults): every field re-checked, in case it was
        changed after construction, and token ids against the vocabulary; bad_words tokenized."""
        if params is None:
            return SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestTypeError(f"params must be SamplingParams, got {show_value(params)}",
                                          parameter="params", value=params)
        params = dataclasses.replace(params)  # runs validate(); fresh lists, so later edits by the caller do not reach us
        vocab = self.args.vocab_size
        for name, what, ids in (("stop_token_ids", "", params.stop_token_ids),
                                ("logit_bias", " keys", params.logit_bias or ()),
                                ("allowed_token_ids", "", params.allowed_token_ids or ()),
                                ("constraint", ".after", () if params.constraint is None else params.constraint.after)):
            bad = [t for t in ids if t >= vocab]
            if bad:
                should = "be token ids < the vocabulary size" if name == "constraint" else "be < the vocabulary size"
                raise InvalidRequestError(f"SamplingParams.{name}{what} must {should} {vocab}, "
                                          f"got {show_value(bad[:5], False)}", parameter=name, value=bad)
        if params.bad_words:
            params.bad_words_token_ids = self._bad_words_token_ids(params.bad_words)
        if params.pooling is not None:
            params.pooling = dataclasses.replace(params.pooling)  # checked again, and ours
            hidden = self.args.hidden_size
            if (params.pooling.dimensions or 0) > hidden:
                raise InvalidRequestError(f"PoolingParams.dimensions must be <= the model's hidden size {hidden}, "
                                          f"got {params.pooling.dimensions}", parameter="pooling.dimensions",
                                          value=params.pooling.dimensions)
        return params

    def _bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """vLLM's tokenization of bad_words: each word with its leading spaces stripped, and again after one
        space where that gives a sequence of as many tokens starting with another token (the word inside a
        text rather than at its start)."""
        out: list[list[int]] = []
        vocab = self.args.vocab_size
        for word in words:
            plain, spaced = (self.tokenizer(text, add_special_tokens=False)["input_ids"]
                             for text in (word.lstrip(), " " + word.lstrip()))
            if not plain:
                raise InvalidRequestError(f"SamplingParams.bad_words: {word!r} is empty once tokenized",
                                          parameter="bad_words", value=word)
            if any(t >= vocab for t in plain + spaced):
                raise InvalidRequestError(f"SamplingParams.bad_words: {word!r} tokenizes to ids outside the model's "
                                          f"vocabulary of {vocab}", parameter="bad_words", value=word)
            out.append(plain)
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                out.append(spaced)
        return out

    def lora_adapter(self, lora_request: LoRARequest | LoRAAdapter | None) -> LoRAAdapter | None:
        """The adapter a request names, loaded on first use (InvalidRequestError when it cannot serve)."""
        if lora_request is None:
            return None
        if self.loras is None:
            raise InvalidRequestError(f"lora_request {getattr(lora_request, 'lora_name', lora_request)!r}: this engine "
                                      "serves no LoRA adapters (start it with enable_lora=True, `--enable-lora`)",
                                      parameter="lora_request", value=lora_request)
        return self.loras.get(lora_request)

    def _load_lora(self, req: LoRARequest) -> LoRAAdapter:
        return load_adapter(req, self.args, self.config.torch_dtype, self.config.device,
                            self.config.max_lora_rank, interleave_rope_rows)

    def compile_constraint(self, constraint: Constraint) -> None:
        """Compile (cached) an output grammar; InvalidRequestError if it does not compile."""
        if self._grammars is None:
            with self._grammars_lock:
                if self._grammars is None:
                    self._grammars = GrammarCache(self.tokenizer, self.args.vocab_size, sorted(self.eos_token_ids))
        try:
            self._grammars.compile(constraint)
        except ValueError as e:
            raise InvalidRequestError(f"SamplingParams.constraint: {e}", parameter="constraint", value=constraint) from None
