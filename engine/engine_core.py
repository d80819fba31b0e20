"""EngineCore: requests in, one step at a time, deltas out.

    out = scheduler.schedule()
    result = runner.execute(out)
    scheduler.update_from_output(out, result.step_time_s)

plus turning sampled tokens into finished requests (EOS, stop ids, stop strings, lengths).
Not thread-safe: one thread drives it (LLM directly, AsyncEngine between its worker-thread steps).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch

import kernels

from engine.config import EngineConfig
from engine.kv_cache_manager import KVCacheManager
from engine.loader import load_model, load_tokenizer, resolve_model
from engine.outputs import CompletionOutput, Detokenizer, RequestMetrics, RequestOutput, StreamDelta
from engine.policy import make_policy
from engine.request import Request, RequestStatus
from engine.runner import ModelRunner
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler
from engine.spec_decode import propose

_CPU_KV_BYTES = 1 << 30


@dataclass(slots=True)
class KVStats:
    num_blocks: int
    num_free_blocks: int
    block_size: int
    num_shared_blocks: int  # blocks held by more than one request
    prefix_queries_tokens: int
    prefix_hit_tokens: int
    dedup_merges: int
    evictions: int
    cow_copies: int
    num_preemptions: int


class EngineCore:
    def __init__(self, config: EngineConfig | None = None, **overrides):
        if config is None:
            config = EngineConfig(**overrides)
        elif overrides:
            raise TypeError("pass either an EngineConfig or keyword overrides, not both")
        self.config = config
        torch.manual_seed(config.seed)
        self.model_path = resolve_model(config.model)
        self.tokenizer = load_tokenizer(self.model_path)
        self.model, self.hf_config = load_model(self.model_path, config.torch_dtype, config.device)
        args = self.model.args
        self.max_model_len = min(config.max_model_len or args.max_position, args.max_position)
        self.eos_token_ids = _eos_ids(self.tokenizer, self.hf_config)
        num_blocks = config.num_blocks or self._blocks_from_budget()
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching, model_key=str(self.model_path))
        self.runner = ModelRunner(self.model, num_blocks, config.block_size, config.torch_dtype, config.device)
        if config.device == "cpu":
            kernels.cpu.ops()  # build (first time, ~30 s) or load the C++ CPU kernels now, not mid-request
        self.policy = make_policy(config.policy, **(config.policy_kwargs or {}))
        self.scheduler = Scheduler(config, self.kv, self.policy)
        self.requests: dict[str, Request] = {}  # unfinished, by id (forked children included)
        self._families: dict[str, Request] = {}  # root requests by id, until their output is taken
        self._detok: dict[str, Detokenizer] = {}
        self._ids = itertools.count()
        self.num_steps = 0
        self.busy_s = 0.0  # executor wall time summed over steps (input prep + forward + sampling)
        self.num_computed_tokens = 0  # tokens run through the model, drafts and recomputation included
        self.num_draft_tokens = 0  # speculative drafts scheduled
        self.num_rejected_tokens = 0  # of which rejected

    def _blocks_from_budget(self) -> int:
        c = self.config
        per_block = ModelRunner.bytes_per_block(self.model.args, c.block_size, c.torch_dtype)
        budget = c.kv_cache_bytes
        if budget is None:
            if c.device == "cpu":
                budget = _CPU_KV_BYTES
            else:
                free, _ = torch.cuda.mem_get_info(torch.device(c.device))
                budget = int(free * 0.9)
        return max(1, budget // per_block)

    # ---- requests ------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            return self.tokenizer(prompt)["input_ids"]
        ids = list(prompt)
        if not ids:
            raise ValueError("prompt is empty")
        vocab = self.model.args.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        return ids

    def validate_prompt(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a prompt that can run; ValueError naming what is wrong otherwise."""
        ids = self.tokenize(prompt)
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt of {len(ids)} tokens does not fit the model's context of {self.max_model_len} tokens "
                "(at least one token must remain for the output)"
            )
        return ids

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        program_id: str | None = None,
        thread_id: str | None = None,
        cache_salt: str | None = None,
    ) -> Request:
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        ids = self.validate_prompt(prompt)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        req = Request(
            request_id, ids, params, program_id=program_id, thread_id=thread_id, cache_salt=cache_salt,
            eos_token_ids=self.eos_token_ids, max_model_len=self.max_model_len,
        )
        for i in range(1, params.n):
            child = Request(
                f"{request_id}#{i}", ids, params, program_id=program_id, thread_id=thread_id,
                cache_salt=cache_salt, eos_token_ids=self.eos_token_ids, max_model_len=self.max_model_len,
                arrival_time=req.arrival_time, parent=req, fork_index=i,
            )
            req.children.append(child)
        self.requests[request_id] = req
        self._families[request_id] = req
        self._detok[request_id] = Detokenizer(self.tokenizer, list(params.stop))
        self.scheduler.add_request(req)
        return req

    def abort(self, request_id: str) -> list[StreamDelta]:
        """Abort a request and all its forks; the final delta of each completion it ended (none if
        the request is unknown or already finished)."""
        root = self._families.get(request_id)
        if root is None:
            return []
        deltas = []
        for r in [root, *root.children]:
            if r.request_id in self.requests and not r.finished:  # waiting or running
                self.scheduler.finish(r, RequestStatus.FINISHED_ABORTED, "abort")
                deltas.append(self._delta(r, []))
        return deltas + self._end_unstarted_forks(root)

    @staticmethod
    def _end_unstarted_forks(root: Request) -> list[StreamDelta]:
        """A parent that ended before its first token takes its never-started forks with it."""
        deltas = []
        for c in root.children:
            if not c.finished and not c.block_ids and not c.output_token_ids:
                c.status, c.finish_reason, c.error = root.status, root.finish_reason, root.error
                deltas.append(StreamDelta(c.request_id, c.fork_index, [], "", True, c.finish_reason, c.error))
        return deltas

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # ---- the step ------------------------------------------------------------------------
    def step(self) -> list[StreamDelta]:
        cfg = self.config
        if cfg.num_speculative_tokens:
            limit = cfg.speculative_disable_by_batch_size
            k = cfg.num_speculative_tokens if limit is None or len(self.scheduler.running) <= limit else 0
            for req in self.scheduler.running:  # k = 0 also clears drafts of a step that skipped the request
                propose(req, k, cfg.prompt_lookup_max, cfg.prompt_lookup_min)
        out = self.scheduler.schedule()
        self.num_draft_tokens += sum(len(r.spec_token_ids) for r in out.reqs)
        result = self.runner.execute(out)
        self.busy_s += result.step_time_s
        self.num_computed_tokens += out.total_tokens
        self.scheduler.update_from_output(out, result.step_time_s, result.num_rejected)
        if result.num_rejected is not None:
            self.num_rejected_tokens += sum(result.num_rejected)
        self.num_steps += 1
        deltas: list[StreamDelta] = []
        for req in out.failed:
            deltas.append(self._delta(req, []))
            deltas += self._end_unstarted_forks(req)
        now = time.monotonic()
        for i, req in enumerate(result.sampled_reqs):
            if req.finished:
                continue
            tokens = result.token_ids[i]
            want_lp = result.logprobs is not None and req.sampling.logprobs
            lps = result.logprobs[i] if want_lp else [None] * len(tokens)
            if req.children and req.num_output_tokens == 0:
                for child, tok, lp in zip(req.children, tokens[1:], lps[1:]):
                    self.requests[child.request_id] = child
                    self._detok[child.request_id] = Detokenizer(self.tokenizer, list(child.sampling.stop))
                    self.scheduler.add_forked(req, child)
                    deltas.append(self._append(child, tok, lp, now))
                deltas.append(self._append(req, tokens[0], lps[0], now))
            else:
                for tok, lp in zip(tokens, lps):  # several when drafts were accepted
                    deltas.append(self._append(req, tok, lp, now))
                    if req.finished:
                        break
        return deltas

    def _append(self, req: Request, token: int, logprob: float | None, now: float) -> StreamDelta:
        if req.first_token_time is None:
            req.first_token_time = now
        req.append_token(token, logprob)
        p = req.sampling
        stop_hit = self._detok[req.request_id].add([token])
        if not p.ignore_eos and token in req.eos_token_ids:
            self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED, "stop")
        elif token in p.stop_token_ids or stop_hit:
            self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED, "stop")
        elif req.num_output_tokens >= p.max_tokens or req.num_tokens >= req.max_model_len:
            self.scheduler.finish(req, RequestStatus.FINISHED_LENGTH, "length")
        return self._delta(req, [token])

    def _delta(self, req: Request, tokens: list[int]) -> StreamDelta:
        text = self._detok[req.request_id].take(final=req.finished)
        if req.finished:
            self.requests.pop(req.request_id, None)
        return StreamDelta(req.request_id, req.fork_index, tokens, text, req.finished, req.finish_reason, req.error)

    def finished_output(self, req: Request) -> RequestOutput:
        """The full output of a finished request (with its forks)."""
        self._families.pop(req.request_id, None)
        comps = []
        for r in [req, *req.children]:
            detok = self._detok.pop(r.request_id, None)
            comps.append(
                CompletionOutput(
                    index=r.fork_index, text=detok.text if detok else "", token_ids=list(r.output_token_ids),
                    finish_reason=r.finish_reason, logprobs=list(r.output_logprobs) if r.sampling.logprobs else None,
                    error=r.error,
                )
            )
        metrics = RequestMetrics(
            req.arrival_time, req.first_scheduled_time, req.first_token_time, req.finish_time,
            sum(r.service_s for r in [req, *req.children]), req.num_prefix_hit_tokens, req.num_preemptions,
        )
        return RequestOutput(req.request_id, list(req.prompt_token_ids), comps, metrics)

    def kv_stats(self) -> KVStats:
        s = self.kv.stats
        return KVStats(
            self.kv.num_blocks, self.kv.num_free_blocks, self.kv.block_size, self.kv.num_shared_blocks(),
            s.queries_tokens, s.hit_tokens, s.dedup_merges, s.evictions, s.cow_copies, self.scheduler.num_preemptions,
        )


def _eos_ids(tokenizer, hf_config) -> frozenset[int]:
    ids: set[int] = set()
    for src in (getattr(hf_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, (list, tuple)):
            ids.update(src)
    return frozenset(ids)
