"""Beam search, as vLLM runs it: above the engine, one step at a time, every live beam one request.

    outs = llm.beam_search(prompts, BeamSearchParams(beam_width=4, max_tokens=32))
    outs[0].sequences[0].text        # the best beam (sequences are best first)

Each step asks the engine for one token of every live beam with its 2 x beam_width most likely next tokens
(`top_logprobs`, log-probs of the raw distribution); each prompt keeps the beam_width extensions with the
highest cumulative log-prob, and a beam that draws EOS (unless ignore_eos) is complete. At the end the
complete and the live beams are ranked by cum_logprob / len ** length_penalty (len counting the prompt and
not a final EOS: vLLM's `get_beam_search_score`). A beam's tokens are its prompt's plus its own, so the
prefix cache serves what the beam and its siblings computed before: a step computes about one new token
per beam (the last, partial block's tokens again).

`BeamSearch` is the algorithm alone (`next_prompts`, `advance`, `results`), driven by `LLM.beam_search`
here and by the runtime's asynchronous calls above the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from agentrt.engine.errors import InvalidRequestError, InvalidRequestTypeError, show_value
from agentrt.engine.sampling_params import MAX_TOP_LOGPROBS, SamplingParams

MAX_BEAM_WIDTH = MAX_TOP_LOGPROBS // 2  # a step's candidates are 2 x beam_width top log-probs


@dataclass(slots=True)
class BeamSearchParams:
    """vLLM's BeamSearchParams."""

    beam_width: int  # beams kept per prompt, and sequences returned, in 1..MAX_BEAM_WIDTH
    max_tokens: int  # tokens per beam at most, >= 1
    ignore_eos: bool = False  # EOS does not complete a beam
    temperature: float = 0.0  # passed to each step's request; the ranking uses the raw log-probs (as vLLM's)
    length_penalty: float = 1.0  # the final ranking divides cum_logprob by len ** length_penalty
    include_stop_str_in_output: bool = False  # keep EOS's text in a completed beam's text

    def __post_init__(self) -> None:
        for name, lo, hi in (("beam_width", 1, MAX_BEAM_WIDTH), ("max_tokens", 1, None)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise InvalidRequestTypeError(f"BeamSearchParams.{name} must be an int, got {show_value(v)}",
                                              parameter=name, value=v)
            if v < lo or (hi is not None and v > hi):
                raise InvalidRequestError(f"BeamSearchParams.{name} must be in [{lo}, {hi or 'inf'}], got {v}",
                                          parameter=name, value=v)
        for name in ("temperature", "length_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or abs(v) == float("inf"):
                raise InvalidRequestTypeError(f"BeamSearchParams.{name} must be a finite number, got {show_value(v)}",
                                              parameter=name, value=v)
        if self.temperature < 0:
            raise InvalidRequestError(f"BeamSearchParams.temperature must be >= 0, got {self.temperature}",
                                      parameter="temperature", value=self.temperature)


@dataclass(slots=True)
class BeamSearchSequence:
    """One beam: all its tokens (the prompt's first), its own tokens' log-probs and their sum."""

    tokens: list[int]
    logprobs: list[float] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None  # its own tokens' text, set on the results
    finish_reason: str | None = None  # "stop" (EOS) or "length"; set on the results


@dataclass(slots=True)
class BeamSearchOutput:
    """A prompt's beams, best first (at most beam_width)."""

    sequences: list[BeamSearchSequence]


def beam_score(seq: BeamSearchSequence, eos_token_ids: frozenset[int], length_penalty: float) -> float:
    n = len(seq.tokens) - (1 if seq.tokens and seq.tokens[-1] in eos_token_ids else 0)
    return seq.cum_logprob / (max(n, 1) ** length_penalty)


class BeamSearch:
    """The search over some prompts' token ids; `next_prompts` -> engine -> `advance`, until `done`."""

    def __init__(self, prompts: list[list[int]], params: BeamSearchParams, eos_token_ids: frozenset[int],
                 max_model_len: int) -> None:
        self.params = params
        # a step's requests are the beams: the longest must leave the context a position to sample into
        self.max_steps = min(params.max_tokens, max_model_len - max(map(len, prompts)))
        self.eos = frozenset() if params.ignore_eos else eos_token_ids
        self.prompt_lens = [len(p) for p in prompts]
        self.live: list[list[BeamSearchSequence]] = [[BeamSearchSequence(list(p))] for p in prompts]
        self.complete: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        self.steps = 0

    @property
    def done(self) -> bool:
        return self.steps >= self.max_steps or not any(self.live)

    def step_params(self) -> SamplingParams:
        """The SamplingParams of a step's requests: one token with its 2 x beam_width alternatives."""
        return SamplingParams(max_tokens=1, temperature=self.params.temperature,
                              top_logprobs=2 * self.params.beam_width, ignore_eos=True)

    def next_prompts(self) -> list[list[int]]:
        """Every live beam's tokens, prompt by prompt (the order `advance` expects its outputs in)."""
        return [b.tokens for beams in self.live for b in beams]

    def advance(self, tops: list[list[tuple[int, float]]]) -> None:
        """One step: `tops[i]`, the (token id, log-prob) candidates after `next_prompts()[i]`."""
        it = iter(tops)
        width = self.params.beam_width
        for i, beams in enumerate(self.live):
            grown = []
            for beam in beams:
                for token, lp in next(it):
                    seq = BeamSearchSequence([*beam.tokens, token], [*beam.logprobs, lp], beam.cum_logprob + lp)
                    (self.complete[i] if token in self.eos else grown).append(seq)
            grown.sort(key=lambda s: s.cum_logprob, reverse=True)
            self.live[i] = grown[:width]
        self.steps += 1

    def results(self, tokenizer: Any) -> list[BeamSearchOutput]:
        outs = []
        for i, (live, complete) in enumerate(zip(self.live, self.complete, strict=True)):
            for s in complete:
                s.finish_reason = "stop"
            for s in live:
                s.finish_reason = "length"
            ranked = sorted([*complete, *live], key=lambda s: beam_score(s, self.eos, self.params.length_penalty),
                            reverse=True)[: self.params.beam_width]
            for s in ranked:
                own = s.tokens[self.prompt_lens[i]:]
                if s.finish_reason == "stop" and not self.params.include_stop_str_in_output:
                    own = own[:-1]
                s.text = tokenizer.decode(own, skip_special_tokens=not self.params.include_stop_str_in_output)
            outs.append(BeamSearchOutput(ranked))
        return outs
