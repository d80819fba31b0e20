"""Model runner: one flat batch per step (token ids, positions, slot mapping, block tables,
query/context lengths), one forward, one sampling call; or, for a batch the scheduler runs as several
greedy decode steps (`SchedulerOutput.num_steps`), the model's own loop of them."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from agentrt import kernels
from agentrt.engine import huge_pages
from agentrt.engine.block_table import BlockTables
from agentrt.engine.kv_layout import KVLayout
from agentrt.engine.request import Request
from agentrt.engine.sampling import RowContext, SamplerOutput, TokenHistory, sample
from agentrt.engine.sampling_params import SamplingParams
from agentrt.engine.scheduler import SchedulerOutput
from agentrt.engine.spec_decode import verify
from agentrt.engine.structured import apply_constraints


@dataclass(slots=True)
class ModelOutput:
    sampled_reqs: list[Request]  # requests that produced a token this step
    token_ids: list[list[int]]  # per sampled request: one token, n for a request about to fork,
    # or the accepted drafts plus one for a request that speculated, or a multi-step decode's tokens
    logprobs: list[list[float]] | None  # same shape, when any request asked for them
    step_time_s: float  # wall time of input prep + forward + sampling
    num_rejected: list[int] | None = None  # per scheduled request (SchedulerOutput order): rejected drafts,
    # or of a multi-step decode the steps after the request's stop token
    top_logprobs: list[list[list[tuple[int, float]] | None]] | None = None  # same shape as token_ids: per token,
    # its request's top_logprobs best (token id, log-prob), or None where the request asked for none
    prompt_logprobs: list[PromptLogprobs] | None = None  # for requests with sampling.prompt_logprobs whose
    # prompt positions were computed this step
    pooled: list[tuple[Request, int, torch.Tensor | None]] | None = None  # per pooling request in the step:
    # (request, first prompt position computed, fp32 sum of the final-norm rows its pooling reads, or None)


@dataclass(slots=True)
class PromptLogprobs:
    req: Request
    first_token: int  # index in the prompt of the token the first log-prob is for (>= 1)
    logprobs: list[float]  # of prompt tokens first_token, first_token + 1, ...
    top: list[list[tuple[int, float]]] | None  # per such position, the prompt_logprobs most likely tokens
    ranks: list[int]  # per such token, 1 + how many tokens the model found more likely there


class ModelRunner:
    def __init__(self, model, num_blocks: int, block_size: int, dtype: torch.dtype, device: str,
                 layout: KVLayout | None = None):
        a = model.args
        self.model = model
        self.block_size = block_size
        self.device = torch.device(device)
        self.layout = layout if layout is not None else KVLayout.single(a.num_layers)
        self.states = None  # a hybrid model's RecurrentStatePool (engine.recurrent_state), set by the engine
        model.set_kv_layout(self.layout)
        self.block_tables = BlockTables(block_size, self.layout.num_groups)  # rows kept across steps, per group
        # kv_cache: [page layers, K/V, num_blocks, block_size, kv_heads, head_dim]; a block (page) holds one layer
        # group's page_layers layers (engine.kv_layout), the model's every layer with one group. On CPU untouched
        # until used (engine.huge_pages.untouched_zeros), in 4 KB pages: a 2 MB page's first touch stalls the step
        # (with THP's defrag on "madvise" it may compact memory; ~7 ms a page measured on a VM); `bench paging`
        # measures what 2 MB pages would give the decode walk
        shape = (self.layout.page_layers, 2, num_blocks, block_size, a.num_kv_heads, a.head_dim)
        self.kv_cache = (huge_pages.untouched_zeros(shape, dtype) if self.device.type == "cpu"
                         else torch.zeros(shape, dtype=dtype, device=self.device))

    @staticmethod
    def bytes_per_block(args, block_size: int, dtype: torch.dtype, layout: KVLayout | None = None) -> int:
        layers = layout.page_layers if layout is not None else args.num_layers
        return layers * 2 * block_size * args.num_kv_heads * args.head_dim * dtype.itemsize

    def _prepare(self, out: SchedulerOutput):
        num_groups = self.layout.num_groups
        ids, starts, qsl, seq_lens, sample_rows, sample_reqs = [], [], [0], [], [], []
        prompt_rows: list[tuple[Request, int, int, int]] = []  # (request, first position, first row, rows)
        pool_rows: list[tuple[Request, int, int, int]] = []  # (request, first position, first row, rows)
        for req, n in zip(out.reqs, out.num_tokens):
            start = req.num_computed_tokens
            base = min(n, req.num_tokens - start)  # known tokens; the rest are draft tokens
            ids.extend(req.all_token_ids[start : start + base])
            ids.extend(req.spec_token_ids[: n - base])
            starts.append(start)
            if req.sampling.prompt_logprobs is not None and start < req.num_prompt_tokens - 1:
                # row of position p predicts prompt token p + 1
                prompt_rows.append((req, start, qsl[-1], min(start + base, req.num_prompt_tokens - 1) - start))
            if (pooling := req.sampling.pooling) is not None:  # a prompt alone: its rows pooled, nothing sampled
                rows = pooling.rows(start, n, req.num_prompt_tokens)
                pool_rows.append((req, start, qsl[-1] + rows[0], rows[1]) if rows else (req, start, 0, 0))
                qsl.append(qsl[-1] + n)
                seq_lens.append(start + n)
                continue
            qsl.append(qsl[-1] + n)
            seq_lens.append(start + n)
            if start + base == req.num_tokens:  # reaches the end: sample at the last row and each draft's row
                sample_rows.extend(range(qsl[-1] - 1 - (n - base), qsl[-1]))
                sample_reqs.append(req)
        step = self.block_tables.prepare(out.reqs, starts, out.num_tokens)  # positions, tables, slots per group
        dev = self.device
        query_start_loc = torch.tensor(qsl, dtype=torch.int32, device=dev)
        seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
        metas = [kernels.build_attention_metadata(
            query_start_loc=query_start_loc,
            seq_lens=seq_lens_t,
            block_tables=torch.from_numpy(group_tables).to(dev),
            max_query_len=max(out.num_tokens),
            max_seq_len=max(seq_lens),
            batch_invariant=self.model.batch_invariant,
        ) for group_tables in step.block_tables]
        slot_mappings = [torch.from_numpy(s).to(dev) for s in step.slot_mappings]
        return (
            torch.tensor(ids, dtype=torch.long, device=dev),
            torch.from_numpy(step.positions).to(dev),
            slot_mappings[0] if num_groups == 1 else slot_mappings,
            metas[0] if num_groups == 1 else metas,
            torch.tensor(sample_rows, dtype=torch.long, device=dev),
            sample_reqs,
            prompt_rows,
            pool_rows,
        )

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelOutput:
        t0 = time.perf_counter()
        if out.block_copies:
            kernels.copy_blocks(self.kv_cache, torch.tensor(out.block_copies, dtype=torch.long, device=self.device))
        if not out.reqs:
            self.block_tables.release_ended()
            return ModelOutput([], [], None, time.perf_counter() - t0)
        if out.num_steps > 1:
            return self._execute_steps(out, t0)
        input_ids, positions, slot_mapping, meta, sample_rows, sample_reqs, prompt_rows, pool_rows = self._prepare(out)
        # a hybrid model's recurrent states: each request's slot, the snapshots this step saves (engine.recurrent_state)
        step = self.states.prepare(out.reqs, out.num_tokens) if self.states is not None else None
        try:
            with (self.model.lora.use([r.lora for r in out.reqs], out.num_tokens, self.device),
                  self.model.recurrent.use(step)):
                hidden = self.model(input_ids, positions, self.kv_cache, meta, slot_mapping)
        except BaseException:
            if step is not None:
                self.states.abandon(step)
            raise
        if step is not None:
            self.states.commit(step)
        tokens, logprobs, tops, rejected = [], None, None, None
        prompt_lps = [self._prompt_logprobs(hidden, *p) for p in prompt_rows] if prompt_rows else None
        pooled = [(req, start, self.model.norm(hidden[row : row + count]).float().sum(dim=0).cpu() if count else None)
                  for req, start, row, count in pool_rows] or None
        if sample_reqs:
            logits = self.model.compute_logits(hidden[sample_rows])
            # Per logits row, the requests sampling from it: a request with n > 1 samples its first
            # token once per completion from the same row; a speculating request has one row per draft + 1.
            row_reqs: list[list[Request]] = []
            sizes: list[int] = []  # samples per sampled request
            for r in sample_reqs:
                if r.children and r.num_output_tokens == 0:
                    row_reqs.append([r, *r.children])
                    sizes.append(1 + len(r.children))
                else:
                    row_reqs.extend([r] for _ in range(1 + len(r.spec_token_ids)))
                    sizes.append(1 + len(r.spec_token_ids))
            flat = [r for g in row_reqs for r in g]
            if len(flat) > logits.shape[0]:
                logits = logits.repeat_interleave(torch.tensor([len(g) for g in row_reqs], device=logits.device), dim=0)
            params = [r.sampling for r in flat]
            if any(r.matcher is not None for r in flat):
                logits = logits.float()  # the masks write -inf into these rows
                apply_constraints(logits, [r.matcher for r in flat])
            contexts = [_context(r) for r in flat] if any(p.reads_history for p in params) else None
            s = sample(logits, params, [r.generator for r in flat], contexts, inplace=True)  # logits: ours
            t = s.token_ids.tolist()
            lp = s.logprobs.tolist() if s.logprobs is not None else None
            top = _top_lists(s, params) if s.top_token_ids is not None else None
            offsets = np.cumsum([0, *sizes])
            spans = list(zip(offsets[:-1], offsets[1:]))
            tokens = [t[a:b] for a, b in spans]
            logprobs = [lp[a:b] for a, b in spans] if lp is not None else None
            tops = [top[a:b] for a, b in spans] if top is not None else None
            if any(r.spec_token_ids for r in sample_reqs):
                num_rejected = {}
                for i, r in enumerate(sample_reqs):
                    if r.spec_token_ids:
                        tokens[i] = verify(r.spec_token_ids, tokens[i])
                        num_rejected[id(r)] = len(r.spec_token_ids) + 1 - len(tokens[i])
                        if logprobs is not None:  # row j's log-probs belong to the token sampled at row j
                            logprobs[i] = logprobs[i][: len(tokens[i])]
                        if tops is not None:
                            tops[i] = tops[i][: len(tokens[i])]
                rejected = [num_rejected.get(id(r), 0) for r in out.reqs]
        return ModelOutput(sample_reqs, tokens, logprobs, time.perf_counter() - t0, rejected, tops, prompt_lps, pooled)

    def _execute_steps(self, out: SchedulerOutput, t0: float) -> ModelOutput:
        """`out.num_steps` greedy decode steps of one row per request (slots allocated for all of
        them by the scheduler), each row's argmax its next input: the tokens up to each request's first
        EOS or stop id; the steps computed past it count as rejected."""
        reqs, k, dev = out.reqs, out.num_steps, self.device
        stops = [[*(() if r.sampling.ignore_eos else sorted(r.eos_token_ids)), *r.sampling.stop_token_ids] for r in reqs]
        # one table per layer group, -1 past a row's blocks (a window group's left blocks read as block 0)
        tables = [torch.from_numpy(_padded([r.tables[g] for r in reqs])).to(dev) for g in range(self.layout.num_groups)]
        if len(tables) == 1:
            tables = tables[0]
        stop_ids = np.full((len(reqs), max(1, max(map(len, stops)))), -1, dtype=np.int64)
        for i, ids in enumerate(stops):
            stop_ids[i, : len(ids)] = ids
        with self.model.lora.use([r.lora for r in reqs], [1] * len(reqs), dev):
            tokens, counts = self.model.decode_steps(
                torch.tensor([r.all_token_ids[r.num_computed_tokens] for r in reqs], dtype=torch.long, device=dev),
                torch.tensor([r.num_computed_tokens for r in reqs], dtype=torch.long, device=dev), self.kv_cache,
                tables, torch.from_numpy(stop_ids).to(dev), k)
        counts = counts.tolist()
        token_ids = [row[:c] for row, c in zip(tokens.tolist(), counts, strict=True)]
        return ModelOutput(reqs, token_ids, None, time.perf_counter() - t0, [k - c for c in counts])

    def _prompt_logprobs(self, hidden: torch.Tensor, req: Request, start: int, row: int, count: int) -> PromptLogprobs:
        """Log-probs of prompt tokens start + 1 .. start + count from their rows' raw logits."""
        logp = self.model.compute_logits(hidden[row : row + count]).float().log_softmax(dim=-1)  # [count, V]
        targets = torch.tensor(req.all_token_ids[start + 1 : start + 1 + count], device=logp.device)
        target_lp = logp.gather(1, targets.unsqueeze(1))  # [count, 1]
        lps = target_lp.squeeze(1).tolist()
        ranks = ((logp > target_lp).sum(dim=-1) + 1).tolist()
        n = req.sampling.prompt_logprobs
        top = None
        if n:
            vals, ids = logp.topk(n, dim=-1)
            top = [list(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
        return PromptLogprobs(req, start + 1, lps, top, ranks)


def _padded(tables: list[list[int]]) -> np.ndarray:
    """Block tables as one [rows, longest] int32 array, -1 past a row's end and block 0 for NULL_BLOCK entries
    (a window group's blocks that left the window: the kernels never attend there, block 0 reads as anything)."""
    out = np.full((len(tables), max(map(len, tables))), -1, dtype=np.int32)
    for i, t in enumerate(tables):
        row = out[i, : len(t)]
        row[:] = t
        np.maximum(row, 0, out=row)
    return out


def _context(req: Request) -> RowContext | None:
    """A row's history for penalties, min_tokens and bad_words (None when its request uses none)."""
    p = req.sampling
    if not p.reads_history:
        return None
    if req.history is None:
        req.history = TokenHistory()
    stops = list(p.stop_token_ids) if p.ignore_eos else [*req.eos_token_ids, *p.stop_token_ids]
    return RowContext(req.history.update(req.all_token_ids), req.num_prompt_tokens, stops)


def _top_lists(s: SamplerOutput, params: list[SamplingParams]) -> list[list[tuple[int, float]] | None]:
    """Per row, its request's top_logprobs best (token id, log-prob) pairs; None where it asked for none."""
    ids, lps = s.top_token_ids.tolist(), s.top_logprobs.tolist()
    return [list(zip(i[: p.top_logprobs], v[: p.top_logprobs])) if p.top_logprobs else None
            for i, v, p in zip(ids, lps, params)]

