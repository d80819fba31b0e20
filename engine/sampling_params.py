"""Sampling parameters (OpenAI / vLLM semantics, validated when made; a bad one raises an
engine.errors InvalidRequestError naming it). The sampler that applies them is engine/sampling.py."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any

from agentrt.engine.errors import InvalidRequestError, InvalidRequestTypeError, show_value
from agentrt.engine.pooling import PoolingParams

MAX_TOP_LOGPROBS = 20  # most alternatives per token `top_logprobs` may ask for
MAX_N = 128  # most completions per prompt: each is a request of its own in the batch
MAX_SEED = 2**63 - 1
MAX_PRIORITY = 2**31 - 1  # |priority| at most
MAX_LOGIT_BIAS = 100.0  # |bias| at most, as OpenAI's API
GREEDY_BELOW = 1e-5  # temperatures under this decode greedily (dividing by them overflows fp32)


@dataclass(slots=True)
class SamplingParams:
    """How one request is decoded. Every field is checked on construction (and again when the request
    is added); a bad one raises `InvalidRequestError` (a ValueError) or `InvalidRequestTypeError`
    (also a TypeError) naming the field and the value."""

    max_tokens: int = 16  # tokens to generate at most, >= 1
    temperature: float = 1.0  # finite, >= 0; 0 (or under GREEDY_BELOW) = greedy
    top_k: int = -1  # -1 = off, else >= 1
    top_p: float = 1.0  # nucleus mass in (0, 1]
    seed: int | None = None  # per-request generator seed in [0, 2**63 - 1]: same seed, same tokens
    stop: list[str] = field(default_factory=list)  # stop strings (a str is one), not in the output unless
    # include_stop_str_in_output
    stop_token_ids: list[int] = field(default_factory=list)  # extra ids that end the request (< vocab, checked at add)
    ignore_eos: bool = False  # keep going past EOS (benchmarks)
    logprobs: bool = False  # return the log-probability of each sampled token
    top_logprobs: int = 0  # 0..MAX_TOP_LOGPROBS: also return the N most likely tokens at each position
    # (with their log-probs, best first), and the sampled tokens' log-probs
    n: int = 1  # completions per prompt (forks sharing the prompt's KV), 1..MAX_N
    constraint: Any = None  # engine.structured.Constraint: the output must match this grammar (None = free)
    min_p: float = 0.0  # in [0, 1]: drop tokens less likely than min_p x the top token's probability
    presence_penalty: float = 0.0  # in [-2, 2]: subtracted once from each token already in the output
    frequency_penalty: float = 0.0  # in [-2, 2]: subtracted per occurrence of a token in the output
    repetition_penalty: float = 1.0  # > 0: tokens in the prompt or output get logit / p (> 0) or logit * p
    min_tokens: int = 0  # in [0, max_tokens]: EOS, stop_token_ids and stop strings cannot end the
    # request before this many tokens
    logit_bias: dict[int, float] | None = None  # token id -> bias in [-100, 100] added to its logit
    prompt_logprobs: int | None = None  # None = off; N in 0..MAX_TOP_LOGPROBS: each prompt token's
    # log-prob (the first's is None) and the N most likely tokens at each prompt position; the request
    # then reads no cached prefix (every prompt position is computed)
    include_stop_str_in_output: bool = False  # keep the stop string that ended the output, or the text of the
    # EOS / stop_token_ids token that did (vLLM's rule: without it, neither is in the text; the ids always are)
    skip_special_tokens: bool = True  # leave special tokens (e.g. <|im_end|>) out of the output text
    priority: int = 0  # scheduling class (vLLM's request priority): a smaller class is served, admitted and
    # kept before a larger one, ahead of the policy's order within a class (engine.scheduler)
    pooling: Any = None  # engine.pooling.PoolingParams: an embedding request (prompt only, nothing sampled;
    # `LLM.embed`); then n is 1 and nothing about sampled tokens (log-probs, a grammar) may be asked
    allowed_token_ids: list[int] | None = None  # vLLM's: only these ids may be sampled (< vocab, checked at add);
    # every other logit is -inf before the log-probs and the draw, so log-probs are of that distribution
    bad_words: list[str] = field(default_factory=list)  # vLLM's: words never generated: the last token of a word
    # is banned wherever the output ends with its other tokens (a one-token word always); see bad_words_token_ids
    truncate_prompt_tokens: int | None = None  # vLLM's: keep the prompt's last k >= 1 tokens; -1: as many as the
    # context takes with one position left for the output (max_model_len - 1); None: the whole prompt
    bad_words_token_ids: list[list[int]] | None = field(default=None, init=False, repr=False, compare=False)
    # bad_words as token ids, set by the engine when it checks the request (engine.admission.RequestChecks.validate_params): each word
    # without and (where that is another token sequence of the same length) with a leading space, as vLLM does

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check (and normalize) every field; raises InvalidRequestError / InvalidRequestTypeError."""
        self.max_tokens = _int("max_tokens", self.max_tokens, 1)
        self.temperature = _real("temperature", self.temperature, 0.0)
        self.top_k = _int("top_k", self.top_k, -1, what="-1 (off) or an int >= 1")
        if self.top_k == 0:
            raise _bad("top_k", self.top_k, "must be -1 (off) or an int >= 1, got 0")
        self.top_p = _real("top_p", self.top_p, 0.0, 1.0, what="a number in (0, 1]")
        if self.top_p == 0.0:
            raise _bad("top_p", self.top_p, "must be a number in (0, 1], got 0.0")
        if self.seed is not None:
            self.seed = _int("seed", self.seed, 0, MAX_SEED, what="an int in [0, 2**63 - 1] or None")
        self.stop = _stop_strings(self.stop)
        self.stop_token_ids = _token_ids("stop_token_ids", self.stop_token_ids)
        self.ignore_eos = _bool("ignore_eos", self.ignore_eos)
        self.logprobs = _bool("logprobs", self.logprobs)
        self.top_logprobs = _int("top_logprobs", self.top_logprobs, 0, MAX_TOP_LOGPROBS)
        self.n = _int("n", self.n, 1, MAX_N)
        if self.constraint is not None:
            from agentrt.engine.structured import Constraint

            if not isinstance(self.constraint, Constraint):
                raise _bad_type("constraint", self.constraint,
                                f"must be an engine.structured.Constraint or None, got {show_value(self.constraint)}")
        self.min_p = _real("min_p", self.min_p, 0.0, 1.0)
        self.presence_penalty = _real("presence_penalty", self.presence_penalty, -2.0, 2.0)
        self.frequency_penalty = _real("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        self.repetition_penalty = _real("repetition_penalty", self.repetition_penalty, 0.0, what="a finite number > 0")
        if self.repetition_penalty == 0.0:
            raise _bad("repetition_penalty", self.repetition_penalty, "must be a finite number > 0, got 0.0")
        self.min_tokens = _int("min_tokens", self.min_tokens, 0, self.max_tokens,
                               what=f"an int in [0, max_tokens={self.max_tokens}]")
        self.logit_bias = _logit_bias(self.logit_bias)
        self.include_stop_str_in_output = _bool("include_stop_str_in_output", self.include_stop_str_in_output)
        self.skip_special_tokens = _bool("skip_special_tokens", self.skip_special_tokens)
        self.priority = _int("priority", self.priority, -MAX_PRIORITY, MAX_PRIORITY)
        if self.prompt_logprobs is not None:
            self.prompt_logprobs = _int("prompt_logprobs", self.prompt_logprobs, 0, MAX_TOP_LOGPROBS,
                                        what=f"None or an int in [0, {MAX_TOP_LOGPROBS}]")
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _token_ids("allowed_token_ids", self.allowed_token_ids)
            if not self.allowed_token_ids:
                raise _bad("allowed_token_ids", [], "must be None or a non-empty list of token ids, got []")
        self.bad_words = _bad_words(self.bad_words)
        if self.truncate_prompt_tokens is not None:
            self.truncate_prompt_tokens = _truncation(self.truncate_prompt_tokens)
        if self.pooling is not None:
            self._check_pooling()

    def _check_pooling(self) -> None:
        if not isinstance(self.pooling, PoolingParams):
            raise _bad_type("pooling", self.pooling,
                            f"must be an engine.pooling.PoolingParams or None, got {show_value(self.pooling)}")
        for name, off in (("n", 1), ("logprobs", False), ("top_logprobs", 0), ("constraint", None),
                          ("prompt_logprobs", None), ("allowed_token_ids", None), ("bad_words", [])):
            if getattr(self, name) != off:
                raise _bad(name, getattr(self, name), f"must be {off!r} for a pooling (embedding) request, "
                           f"got {show_value(getattr(self, name))}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def wants_logprobs(self) -> bool:
        """Whether the sampled tokens' log-probs are returned."""
        return self.logprobs or self.top_logprobs > 0

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def reads_history(self) -> bool:
        """Whether sampling depends on the tokens so far (penalties, min_tokens, bad_words): no drafts then."""
        return self.uses_penalties or self.min_tokens > 0 or bool(self.bad_words)

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing that needs the logits in Python (log-probs, logit_bias, penalties,
        min_tokens, bad_words, allowed_token_ids, a grammar): its tokens are argmaxes alone, so a
        multi-step decode can run it."""
        return self.greedy and not (self.wants_logprobs or self.logit_bias or self.reads_history
                                    or self.allowed_token_ids is not None or self.constraint is not None)


def _int(name: str, value: Any, lo: int, hi: int | None = None, what: str | None = None) -> int:
    if what is None:
        what = f"an int in [{lo}, {hi}]" if hi is not None else f"an int >= {lo}"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise _bad_type(name, value, f"must be {what}, got {show_value(value)}")
    value = int(value)
    if value < lo or (hi is not None and value > hi):
        raise _bad(name, value, f"must be {what}, got {show_value(value, False)}")
    return value


def _real(name: str, value: Any, lo: float, hi: float | None = None, what: str | None = None) -> float:
    if what is None:
        what = f"a finite number in [{lo}, {hi}]" if hi is not None else f"a finite number >= {lo}"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _bad_type(name, value, f"must be {what}, got {show_value(value)}")
    try:
        number = float(value)
    except OverflowError:  # an int past the float range
        number = math.inf
    if not math.isfinite(number) or number < lo or (hi is not None and number > hi):
        raise _bad(name, value, f"must be {what}, got {show_value(value, False)}")
    return number


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _bad_type(name, value, f"must be a bool, got {show_value(value)}")
    return value


def _stop_strings(stop: Any) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)):
        raise _bad_type("stop", stop, f"must be a str or a list of str, got {show_value(stop)}")
    for s in stop:
        if not isinstance(s, str):
            raise _bad_type("stop", s, f"must be a str or a list of str, got item {show_value(s)}")
        if not s:
            raise _bad("stop", s, f"must be non-empty strings, got {show_value(list(stop), False)}")
        if not _encodable(s):
            raise _bad("stop", s, f"must be valid Unicode, got {s!r} (a lone surrogate)")
    return list(stop)


def _token_ids(name: str, ids: Any) -> list[int]:
    if ids is None:
        return []
    if not isinstance(ids, (list, tuple)):
        raise _bad_type(name, ids, f"must be a list of int, got {show_value(ids)}")
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise _bad_type(name, t, f"must be a list of int, got item {show_value(t)}")
        if t < 0:
            raise _bad(name, t, f"must be token ids >= 0, got {show_value(t, False)}")
    return [int(t) for t in ids]


def _bad_words(words: Any) -> list[str]:
    if words is None:
        return []
    if not isinstance(words, (list, tuple)):
        raise _bad_type("bad_words", words, f"must be a list of str, got {show_value(words)}")
    for w in words:
        if not isinstance(w, str):
            raise _bad_type("bad_words", w, f"must be a list of str, got item {show_value(w)}")
        if not w.strip():  # vLLM tokenizes the word with its leading spaces stripped: nothing would be left
            raise _bad("bad_words", w, f"must be words with a non-space character, got {w!r}")
        if not _encodable(w):
            raise _bad("bad_words", w, f"must be valid Unicode, got {w!r} (a lone surrogate)")
    return list(words)


def _truncation(keep: Any) -> int:
    keep = _int("truncate_prompt_tokens", keep, -1, what="-1 (the context), an int >= 1 or None")
    if keep == 0:
        raise _bad("truncate_prompt_tokens", keep, "must be -1 (the context), an int >= 1 or None, got 0")
    return keep


def truncate_prompt(token_ids: list[int], truncate_prompt_tokens: int | None, max_model_len: int) -> list[int]:
    """vLLM's truncate_prompt_tokens applied to a prompt: its last k tokens (-1: its last max_model_len - 1, all
    that fits with a position left for the output; None: all of it). InvalidRequestError for another value."""
    if truncate_prompt_tokens is None:
        return token_ids
    keep = _truncation(truncate_prompt_tokens)
    if keep == -1:
        keep = max(1, max_model_len - 1)
    return token_ids[len(token_ids) - keep :] if len(token_ids) > keep else token_ids


def _logit_bias(bias: Any) -> dict[int, float] | None:
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise _bad_type("logit_bias", bias, f"must be a dict of token id -> bias or None, got {show_value(bias)}")
    out = {}
    for t, b in bias.items():
        if isinstance(t, str) and t.strip().isdigit():  # JSON object keys are strings (OpenAI's API)
            t = int(t)
        if isinstance(t, bool) or not isinstance(t, numbers.Integral) or t < 0:
            raise _bad("logit_bias", t, f"keys must be token ids >= 0, got {show_value(t)}")
        if isinstance(b, bool) or not isinstance(b, numbers.Real) or not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS:
            raise _bad("logit_bias", b, f"values must be numbers in [-100, 100], got {show_value(b)} for token {t}")
        out[int(t)] = float(b)
    return out or None


def _bad(name: str, value: Any, text: str) -> InvalidRequestError:
    """The error for a bad `name` field: "SamplingParams.{name} {text}", carrying the field and the value."""
    return InvalidRequestError(f"SamplingParams.{name} {text}", parameter=name, value=value)


def _bad_type(name: str, value: Any, text: str) -> InvalidRequestTypeError:
    """`_bad` for a value of the wrong type."""
    return InvalidRequestTypeError(f"SamplingParams.{name} {text}", parameter=name, value=value)


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
