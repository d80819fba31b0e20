"""Output processing beside the step (vLLM v1's OutputProcessor): what a model step returns becomes
requests' state and stream deltas. Sampled tokens are appended and checked against the stop conditions
(EOS, stop ids, stop strings, a finished grammar, max_tokens, the context), detokenized incrementally,
with their log-probs; a request about to fork takes one token per completion; prompt log-probs and
pooled rows are recorded. An error while handling one request fails that request alone.

Not thread-safe: the engine core's thread drives it, between steps.
"""

from __future__ import annotations

import logging
import time

from agentrt.engine.outputs import CompletionOutput, Detokenizer, RequestMetrics, RequestOutput, StreamDelta
from agentrt.engine.request import Request, RequestStatus
from agentrt.engine.runner import ModelOutput
from agentrt.engine.scheduler import Scheduler
from agentrt.engine.structured import allows_no_token

logger = logging.getLogger("agentrt.engine")


class OutputProcessor:
    """Turns model outputs into deltas for the requests the engine core tracks (`requests`: unfinished, by
    id; `detok`: each completion's detokenizer, until its output is taken; both shared with the core)."""

    def __init__(self, scheduler: Scheduler, vocab_size: int, requests: dict[str, Request],
                 detok: dict[str, Detokenizer]) -> None:
        self.scheduler = scheduler  # ends requests (frees their blocks) and adds forks
        self.vocab_size = vocab_size
        self.requests = requests
        self.detok = detok

    def unschedulable(self, failed: list[Request]) -> list[StreamDelta]:
        """The final deltas of requests the scheduler failed (they could never fit), and of their forks."""
        deltas = []
        for req in failed:
            deltas.append(self.delta(req, []))
            deltas += self.end_unstarted_forks(req)
        return deltas

    def fail_batch(self, reqs: list[Request], error: Exception) -> list[StreamDelta]:
        """Fail every unfinished request of a step whose forward raised `error`."""
        deltas = []
        for req in reqs:
            if not req.finished:
                deltas += self.fail(req, f"the engine step serving request {req.request_id!r} failed: {error!r}")
        return deltas

    def process(self, result: ModelOutput) -> list[StreamDelta]:
        """The deltas of one executed step: prompt log-probs recorded, pooling requests' rows added (ended
        once their prompt is computed), sampled tokens appended."""
        deltas: list[StreamDelta] = []
        for p in result.prompt_logprobs or ():
            _add_prompt_logprobs(p.req, p.first_token, p.logprobs, p.top, p.ranks)
        for req, start, rows in result.pooled or ():
            deltas += self._pool(req, start, rows)
        now = time.monotonic()
        for i, req in enumerate(result.sampled_reqs):
            if req.finished:
                continue
            tokens = result.token_ids[i]
            none = [None] * len(tokens)
            lps = result.logprobs[i] if result.logprobs is not None and req.sampling.wants_logprobs else none
            tops = result.top_logprobs[i] if result.top_logprobs is not None else none
            try:
                deltas += self._take_tokens(req, tokens, lps, tops, now)
            except Exception as e:
                logger.exception("request %r failed", req.request_id)
                deltas += self.fail(req, f"request {req.request_id!r} failed in the engine: {e!r}")
        return deltas


    @staticmethod
    def end_unstarted_forks(root: Request) -> list[StreamDelta]:
        """A parent that ended before its first token takes its never-started forks with it."""
        deltas = []
        for c in root.children:
            if root.finished and not c.finished and not c.block_ids and not c.output_token_ids:
                c.status, c.finish_reason, c.error = root.status, root.finish_reason, root.error
                deltas.append(StreamDelta(c.request_id, c.fork_index, [], "", True, c.finish_reason, c.error))
        return deltas

    def _pool(self, req: Request, start: int, rows) -> list[StreamDelta]:
        """Add a pooling request's rows of this step; once its prompt is computed, its embedding, and it ends."""
        if req.finished:
            return []
        if start == 0:  # its first chunk, or computing again after a preemption
            req.pooled = None
        if rows is not None:
            req.pooled = rows if req.pooled is None else req.pooled + rows
        if req.num_computed_tokens < req.num_prompt_tokens:
            return []
        try:
            req.embedding = req.sampling.pooling.finish(req.pooled, req.num_prompt_tokens)
        except Exception as e:
            logger.exception("request %r failed", req.request_id)
            return self.fail(req, f"request {req.request_id!r} failed in the engine: {e!r}")
        req.pooled = None
        req.first_token_time = time.monotonic()
        self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED, "stop")
        delta = self.delta(req, [])
        delta.embedding = req.embedding
        return [delta]

    def _take_tokens(self, req: Request, tokens: list[int], lps: list, tops: list, now: float) -> list[StreamDelta]:
        """Append a request's sampled tokens (n for a request about to fork: one per completion)."""
        deltas = []
        if req.children and req.num_output_tokens == 0:
            for child, tok, lp, top in zip(req.children, tokens[1:], lps[1:], tops[1:]):
                self.requests[child.request_id] = child
                self.scheduler.add_forked(req, child)
                deltas += self._append_or_fail(child, tok, lp, top, now)
            deltas += self._append_or_fail(req, tokens[0], lps[0], tops[0], now)
        else:
            for tok, lp, top in zip(tokens, lps, tops):  # several when drafts were accepted
                deltas += self._append_or_fail(req, tok, lp, top, now)
                if req.finished:
                    break
        return deltas

    def _append_or_fail(self, req: Request, token: int, logprob, top, now: float) -> list[StreamDelta]:
        try:
            return [self._append(req, token, logprob, top, now)]
        except Exception as e:
            logger.exception("request %r failed", req.request_id)
            return self.fail(req, f"request {req.request_id!r} failed in the engine: {e!r}")

    def _append(
        self, req: Request, token: int, logprob: float | None, top: list[tuple[int, float]] | None, now: float
    ) -> StreamDelta:
        if req.first_token_time is None:
            req.first_token_time = now
        if req.matcher is not None and not req.matcher.accept_token(token):
            if allows_no_token(req.matcher, self.vocab_size):
                # a dead end: no token of the vocabulary continues the grammar (e.g. a regex character whose
                # bytes no token spells), so the sampled row was all -inf. The vocabulary is the limit: the
                # output ends here, as at max_tokens
                logger.info("request %r: its grammar allows no next token; ending it", req.request_id)
                self.scheduler.finish(req, RequestStatus.FINISHED_LENGTH, "length")
                return self.delta(req, [])
            raise RuntimeError(f"the grammar refused token {token} that its own mask allowed")
        req.append_token(token, logprob, top)
        p = req.sampling
        if req.waiting_matcher is not None:
            after = p.constraint.after
            if req.output_token_ids[-len(after):] == list(after):  # e.g. the thinking ended: the grammar starts
                req.matcher, req.waiting_matcher = req.waiting_matcher, None
        eos = not p.ignore_eos and token in req.eos_token_ids
        stop_id = token in p.stop_token_ids
        detok = self.detok[req.request_id]
        stop_hit = detok.add([token], stop_terminated=eos or stop_id)
        grammar_done = req.matcher is not None and req.matcher.is_terminated()
        if eos or grammar_done:
            detok.stop_reason = None  # vLLM's: EOS ends it, whatever else the token did
            self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED, "stop")
        elif stop_id or stop_hit:
            if stop_id:
                detok.stop_reason = token
            self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED, "stop")
        elif req.num_output_tokens >= p.max_tokens or req.num_tokens >= req.max_model_len:
            self.scheduler.finish(req, RequestStatus.FINISHED_LENGTH, "length")
        return self.delta(req, [token], None if logprob is None else [logprob], None if top is None else [top])

    def fail(self, req: Request, error: str) -> list[StreamDelta]:
        """End one request with FINISHED_ERROR (its blocks go back); its final delta, and its
        never-started forks' (the text it held back is dropped: its detokenizer may be what failed)."""
        req.error = error
        req.spec_token_ids = []
        if req.finished:  # it had just ended when the error came: its blocks are already back
            req.status, req.finish_reason = RequestStatus.FINISHED_ERROR, "error"
        else:
            self.scheduler.finish(req, RequestStatus.FINISHED_ERROR, "error")
        self.requests.pop(req.request_id, None)
        return [StreamDelta(req.request_id, req.fork_index, [], "", True, "error", error), *self.end_unstarted_forks(req)]

    def delta(
        self, req: Request, tokens: list[int], logprobs: list[float] | None = None,
        top_logprobs: list[list[tuple[int, float]]] | None = None,
    ) -> StreamDelta:
        detok = self.detok[req.request_id]
        text = detok.take(final=req.finished)
        if req.finished:
            self.requests.pop(req.request_id, None)
        delta = StreamDelta(
            req.request_id, req.fork_index, tokens, text, req.finished, req.finish_reason, req.error, logprobs, top_logprobs
        )
        if req.finished and req.finish_reason == "stop":
            delta.stop_reason = detok.stop_reason
        first = bool(tokens) and req.num_output_tokens == len(tokens)
        if first:
            delta.num_cached_tokens = (req.parent or req).num_prefix_hit_tokens
        if req.sampling.prompt_logprobs is not None and first:
            src = req.parent or req  # forks share their parent's prompt, which only the parent computed
            delta.prompt_logprobs = list(src.prompt_logprobs)
            if req.sampling.prompt_logprobs:
                delta.prompt_top_logprobs = list(src.prompt_top_logprobs)
        return delta

    def request_output(self, req: Request) -> RequestOutput:
        """The full output of a finished request (with its forks); forgets the request and its forks."""
        comps = []
        for r in [req, *req.children]:
            self.requests.pop(r.request_id, None)
            detok = self.detok.pop(r.request_id, None)
            p = r.sampling
            comps.append(
                CompletionOutput(
                    index=r.fork_index, text=detok.text if detok else "", token_ids=list(r.output_token_ids),
                    finish_reason=r.finish_reason, logprobs=list(r.output_logprobs) if p.wants_logprobs else None,
                    error=r.error, top_logprobs=list(r.output_top_logprobs) if p.top_logprobs else None,
                    stop_reason=detok.stop_reason if detok and r.finish_reason == "stop" else None,
                )
            )
        metrics = RequestMetrics(
            req.arrival_time, req.first_scheduled_time, req.first_token_time, req.finish_time,
            sum(r.service_s for r in [req, *req.children]), req.num_prefix_hit_tokens, req.num_preemptions,
            req.num_tier_loaded_tokens, [(at, back) for at, back in req.preemptions],
        )
        out = RequestOutput(req.request_id, list(req.prompt_token_ids), comps, metrics, embedding=req.embedding)
        if req.sampling.prompt_logprobs is not None:
            out.prompt_logprobs = list(req.prompt_logprobs)
            out.prompt_ranks = list(req.prompt_ranks)
            if req.sampling.prompt_logprobs:
                out.prompt_top_logprobs = list(req.prompt_top_logprobs)
        return out


def _add_prompt_logprobs(req: Request, first: int, lps: list[float], top: list | None, ranks: list[int]) -> None:
    """Record prompt tokens' log-probs (and ranks) from `first` on; positions already recorded (computed
    again after a preemption) are skipped."""
    if not req.prompt_logprobs:
        req.prompt_logprobs.append(None)
        req.prompt_top_logprobs.append(None)
        req.prompt_ranks.append(None)
    skip = len(req.prompt_logprobs) - first
    if skip < 0:
        raise RuntimeError(f"prompt log-probs of request {req.request_id!r} from token {first} skip tokens")
    req.prompt_logprobs.extend(lps[skip:])
    req.prompt_ranks.extend(ranks[skip:])
    if top is not None:
        req.prompt_top_logprobs.extend(top[skip:])
