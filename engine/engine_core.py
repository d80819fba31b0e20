"""EngineCore: requests in, one step at a time, deltas out.

    out = scheduler.schedule()
    result = runner.execute(out)
    scheduler.update_from_output(out, result.step_time_s)
    deltas = outputs.process(result)

where the output processor (engine.output_processor) turns sampled tokens into deltas and finished
requests (EOS, stop ids, stop strings, lengths).
Input is checked before anything is queued; an error while serving one request fails that
request alone, so one bad request never hurts the others.
Not thread-safe: one thread drives it (LLM directly, AsyncEngine between its worker-thread steps).
"""

from __future__ import annotations

import itertools
import logging
import sys
import time
from collections.abc import Callable, Container
from dataclasses import dataclass, field

import torch

from agentrt import kernels
from agentrt.engine.admission import CheckedRequest, RequestChecks, RequestOwner
from agentrt.engine.config import EngineConfig, kv_budget
from agentrt.engine.errors import InvalidRequestError, InvalidRequestTypeError, show_value
from agentrt.engine.generation_config import generation_defaults
from agentrt.engine.kv_cache_manager import KVCacheManager
from agentrt.engine.kv_layout import KVLayout
from agentrt.engine.kv_host import TierStats, block_key
from agentrt.engine.kv_tiers import KVTiers
from agentrt.engine.loader import gguf_source, load_model, load_tokenizer, resolve_model
from agentrt.engine.lora import LoRAAdapter, LoRARegistry, LoRARequest
from agentrt.engine.output_processor import OutputProcessor
from agentrt.engine.outputs import Detokenizer, RequestOutput, StreamDelta
from agentrt.engine.policy import make_policy
from agentrt.engine.program_ops import ProgramOp
from agentrt.engine.recurrent_state import RecurrentStatePool
from agentrt.engine.recurrent_tiers import SNAPSHOT_SHARE, SnapshotTiers, snapshot_key
from agentrt.engine.request import Request, RequestStatus
from agentrt.engine.runner import ModelRunner
from agentrt.engine.sampling_params import SamplingParams
from agentrt.engine.scheduler import Scheduler, SchedulerOutput
from agentrt.engine.spec_decode import propose
from agentrt.engine.structured import Constraint

logger = logging.getLogger("agentrt.engine")


def announce(line: str) -> None:
    """An info line an operator needs (the start-up line): through logging when the application set it up for
    info, else on stderr, so `agentrt serve`, `run`, `generate` and a bare `LLM()` all show it."""
    if logger.hasHandlers() and logger.isEnabledFor(logging.INFO):
        logger.info("%s", line)
    else:
        print(line, file=sys.stderr, flush=True)


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
    num_pinned_blocks: int = 0  # blocks held only or also by programs' pins (engine.kv_cache_manager)
    num_reserved_blocks: int = 0  # blocks set aside by programs' reservations
    ttl_hits: int = 0  # calls admitted while their program's pin held its prefix
    ttl_misses: int = 0  # calls admitted after their program's pin expired or gave way
    pin_expiries: int = 0  # pins dropped at their deadline
    pin_blocks_given_way: int = 0  # pinned blocks released under memory pressure
    recomputed_prefill_tokens: int = 0  # prompt tokens a program had computed in its previous call, again
    tiers: dict[str, TierStats] = field(default_factory=dict)  # the KV tiers below the cache: "host", "disk"


class EngineCore:
    def __init__(self, config: EngineConfig | None = None, **overrides):
        if config is None:
            config = EngineConfig(**overrides)
        elif overrides:
            raise TypeError("pass either an EngineConfig or keyword overrides, not both")
        self.config = config
        torch.manual_seed(config.seed)
        self.model_path = resolve_model(config.model)
        # the model creator's sampling defaults for fields a request leaves unset (vLLM's generation config),
        # checked before the model loads
        self.generation_defaults = generation_defaults(self.model_path, config.generation_config,
                                                       config.override_generation_config)
        if self.generation_defaults:
            logger.info("sampling defaults from the model's generation config: %s", self.generation_defaults)
        self.tokenizer = load_tokenizer(self.model_path)
        gguf = gguf_source(config.model) if config.quantization == "gguf" else None
        self.model, self.hf_config = load_model(self.model_path, config.torch_dtype, config.device, packed_from=gguf,
                                                quantize=config.quantization if config.quantization in ("int8", "int4")
                                                else None, keep_mxfp4=config.quantization != "none")
        packed = self.model.packed_weights
        if config.quantization == "gguf" and packed is None:
            raise ValueError(f"quantization='gguf' cannot keep {self.model_path.name}'s weights packed: "
                             f"{self.model.widen_reason or 'the model is not a GGUF file'}")
        weights = packed.describe() if packed is not None else f"widened to {config.dtype}"
        args = self.model.args
        self.max_model_len = min(config.max_model_len or args.max_position, args.max_position)
        self.eos_token_ids = _eos_ids(self.tokenizer, self.hf_config)
        self.kv_layout = KVLayout.from_args(args, swa_full=config.swa_full)
        num_blocks, budget_from = (config.num_blocks, "num_blocks") if config.num_blocks else self._blocks_from_budget()
        self.tiers = self._make_tiers()
        try:
            self._build(config, num_blocks, budget_from, weights)
        except BaseException:  # a refused configuration leaves no tier writer thread behind
            self._close_tiers()
            raise

    def _build(self, config: EngineConfig, num_blocks: int, budget_from: str, weights: str) -> None:
        """The rest of the engine, once its KV tiers exist (their threads stop if this raises)."""
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching, model_key=str(self.model_path),
                                 tiers=self.tiers, layout=self.kv_layout,
                                 superblock_blocks=config.kv_superblock_blocks)
        # in-place reads (engine.kv_tiers): T1's slots are the KV tensor's blocks after the pool's
        in_place = self.tiers.host.num_slots if self.tiers is not None and self.tiers.in_place else 0
        self.runner = ModelRunner(self.model, num_blocks + in_place, config.block_size, config.torch_dtype,
                                  config.device, layout=self.kv_layout)
        if in_place:
            self.tiers.attach(self.runner.kv_cache, num_blocks)
            self.tiers.probe()
        self._attach_recurrent_states()
        if config.device == "cpu":
            kernels.cpu.ops()  # build (first time, ~30 s) or load the C++ CPU kernels now, not mid-request
        if config.deterministic and config.deterministic_default and kernels.cpu.ops() is None:
            config.deterministic = False  # the default where it cannot hold: batch-variant, as on GPU
        if config.deterministic:
            if kernels.cpu.ops() is None:
                raise ValueError(f"deterministic needs the C++ CPU kernels, which are unavailable here "
                                 f"({kernels.cpu.describe()}: no C++ compiler, or ${kernels.cpu.ENV_VAR}=0)")
            self.model.set_batch_invariant(True)
        self.policy = make_policy(config.policy, **(config.policy_kwargs or {}))
        kv_bytes = num_blocks * ModelRunner.bytes_per_block(self.model.args, config.block_size, config.torch_dtype,
                                                            self.kv_layout)
        groups = self.kv_layout.groups
        kv_shape = "" if len(groups) == 1 and groups[0].window is None else (
            f" in pages of {self.kv_layout.page_layers} layers ("
            + ", ".join(f"{sum(g.window == w for g in groups)} {'full' if w is None else f'window {w}'}"
                        for w in dict.fromkeys(g.window for g in groups)) + " layer groups)")
        self.startup_line = (f"agentrt engine: {self.model_path.name} on {config.device}, {config.dtype} "
                             f"({config.dtype_reason}), weights: {weights}, {num_blocks} KV blocks of {config.block_size} tokens{kv_shape} "
                             f"({kv_bytes / 2**20:.0f} MiB, from {budget_from}), policy "
                             f"{getattr(self.policy, 'name', type(self.policy).__name__)}"
                             + (f", kernels: {kernels.cpu.describe()}" if config.device == "cpu" else "")
                             + (", deterministic (batch-invariant)" if config.deterministic else "")
                             + (f", KV tiers: {self.tiers.describe()}" if self.tiers is not None else ""))
        announce(self.startup_line)
        self.scheduler = Scheduler(config, self.kv, self.policy)
        self.requests: dict[str, Request] = {}  # unfinished, by id (forked children included)
        self._families: dict[str, Request] = {}  # root requests by id, until their output is taken
        self._preempted: dict[str, Request] = {}  # preempted requests not yet scheduled again (_note_preemptions)
        self._detok: dict[str, Detokenizer] = {}
        self.outputs = OutputProcessor(self.scheduler, self.model.args.vocab_size, self.requests, self._detok)
        self.checks = RequestChecks(config, self.tokenizer, self.model.args, self.max_model_len, self.eos_token_ids)
        self._ids = itertools.count()
        self.num_steps = 0
        self.busy_s = 0.0  # executor wall time summed over steps (input prep + forward + sampling)
        self.num_computed_tokens = 0  # tokens run through the model, drafts and recomputation included
        self.on_schedule: Callable[[SchedulerOutput], None] | None = None  # sees each batch before it runs
        self.num_draft_tokens = 0  # speculative drafts scheduled
        self.num_rejected_tokens = 0  # of which rejected

    def _close_tiers(self) -> None:
        """Stop the writer threads of the KV tiers and of a hybrid model's snapshot tiers, without flushing."""
        if self.tiers is not None:
            self.tiers.close()
        states = getattr(getattr(self, "runner", None), "states", None)
        if states is not None and states.tiers is not None:
            states.tiers.close()

    def _attach_recurrent_states(self) -> None:
        """A hybrid model's recurrent-state pool (engine.recurrent_state), shared by the runner (slots, snapshots)
        and the KV manager (prefix hits capped at snapshots, slots freed with the KV)."""
        c = self.config
        # live slots start few and double when the running set needs more (a state is ~MiBs a sequence)
        states = RecurrentStatePool.for_model(self.model.args, min(8, c.max_num_seqs), c.recurrent_snapshots,
                                              c.block_size, c.device)
        if states is None:
            return
        if self.kv_layout.num_groups > 1 or self.kv_layout.windowed:
            raise ValueError(f"{self.model_path.name} has recurrent (linear-attention) layers and attention layers "
                             f"of several KV rules ({self.kv_layout.num_groups} layer groups): prefix hits through "
                             "state snapshots are built for one full-attention group only")
        if c.num_speculative_tokens or c.num_scheduler_steps > 1:
            raise ValueError(f"{self.model_path.name} has recurrent (linear-attention) layers, whose state cannot take "
                             "back rejected drafts or run the multi-step decode loop: set num_speculative_tokens=0 and "
                             "num_scheduler_steps=1")
        if c.enable_prefix_caching:
            states.block_hashes = self.kv.block_hashes
        if self.tiers is not None and c.enable_prefix_caching and states.num_snapshots:
            # evicted snapshots go below memory as KV blocks do, in their share of each tier (engine.recurrent_tiers)
            tiers = SnapshotTiers(states.shape, snapshot_key(str(self.model_path), states.shape),
                                  host_bytes=int(c.kv_host_gib * 2**30 * SNAPSHOT_SHARE), disk_dir=c.kv_disk_dir,
                                  disk_bytes=int(self._disk_gib() * 2**30 * SNAPSHOT_SHARE), pin=c.device != "cpu")
            states.tiers = tiers if tiers.host is not None or tiers.disk is not None else None
        logger.info("recurrent states: %.1f MiB a sequence, %d snapshots at block boundaries (%.0f MiB)%s",
                    states.shape.bytes_per_state() / 2**20, states.num_snapshots,
                    states.num_snapshots * states.shape.bytes_per_state() / 2**20,
                    f"; tiers: {states.tiers.describe()}" if states.tiers is not None else "")
        self.runner.states = self.kv.states = states

    def _make_tiers(self) -> KVTiers | None:
        """The KV hierarchy below the pool (engine.kv_tiers), if the config asks for one."""
        c, a = self.config, self.model.args
        if not c.kv_host_gib and c.kv_disk_dir is None:
            return None
        shape = (self.kv_layout.page_layers, 2, c.block_size, a.num_kv_heads, a.head_dim)
        # a hybrid model's state snapshots take their share of each tier (engine.recurrent_tiers), the blocks the rest
        share = 1.0 - SNAPSHOT_SHARE if a.linear is not None and c.recurrent_snapshots else 1.0
        in_place = self._in_place_reads()
        tiers = KVTiers(shape, c.torch_dtype, block_key(str(self.model_path), c.torch_dtype, shape),
                        host_bytes=int(c.kv_host_gib * 2**30 * share), disk_dir=c.kv_disk_dir,
                        disk_bytes=int(self._disk_gib() * 2**30 * share), pin=c.device != "cpu",
                        host_int8=c.kv_host_quantization == "int8", in_place=in_place)
        if not in_place:  # else once its slots are in the KV tensor
            tiers.probe()
        return tiers

    def _disk_gib(self) -> float:
        return 8.0 if self.config.kv_disk_gib is None else self.config.kv_disk_gib

    def _in_place_reads(self) -> bool:
        """Are T1 blocks read where they lie (engine.kv_tiers; EngineConfig.kv_host_in_place)? The config has
        refused True on GPU and with an int8 tier; a model of several KV layer groups is refused here."""
        c, layout = self.config, self.kv_layout
        if not c.kv_host_gib or c.kv_host_in_place is False or c.device != "cpu" or c.kv_host_quantization:
            return False
        if layout.num_groups > 1 or layout.windowed:
            if c.kv_host_in_place:
                raise ValueError(f"kv_host_in_place: {self.model_path.name} keeps its KV in {layout.num_groups} layer "
                                 "group(s) with windows; in-place reads of the host tier are built for one "
                                 "full-attention group only (kv_host_in_place=False copies its blocks into the pool)")
            return False
        return True

    def close(self) -> None:
        """Write what the KV cache holds to the disk tier (a restarted engine finds it there) and stop its writer;
        nothing to do without tiers. Call it on the engine's thread once it serves no more."""
        if self.tiers is None:
            return
        hashes, blocks = self.kv.cached_blocks()
        self.tiers.flush_blocks(hashes, blocks, self.runner.kv_cache)
        states = self.runner.states
        if states is not None and states.tiers is not None:  # a hybrid model's snapshots, as its blocks
            states.flush_snapshots()
        self._close_tiers()

    def _blocks_from_budget(self) -> tuple[int, str]:
        c = self.config
        per_block = ModelRunner.bytes_per_block(self.model.args, c.block_size, c.torch_dtype, self.kv_layout)
        budget, source = kv_budget(c)
        return max(1, budget // per_block), source

    # ---- requests ------------------------------------------------------------------------
    def validate_prompt(self, prompt: str | list[int], truncate_prompt_tokens: int | None = None) -> list[int]:
        """Token ids of a prompt that can run (engine.admission.RequestChecks.validate_prompt)."""
        return self.checks.validate_prompt(prompt, truncate_prompt_tokens)

    def validate_params(self, params: SamplingParams | None) -> SamplingParams:
        """A checked copy of `params` (engine.admission.RequestChecks.validate_params); None: the default
        sampling params (`default_sampling_params`)."""
        return self.checks.validate_params(self.default_sampling_params() if params is None else params)

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams of the model's generation config (engine.generation_config), else the defaults."""
        return SamplingParams(**self.generation_defaults)

    def admit(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        program_id: str | None = None,
        thread_id: str | None = None,
        cache_salt: str | None = None,
        taken: Container[str] = (),
        lora_request: LoRARequest | LoRAAdapter | None = None,
    ) -> CheckedRequest:
        """Every check a request must pass, once, without adding it: the checked request `add_checked`
        queues. `taken`: more ids to treat as in use (requests the caller has yet to add)."""
        params = self.validate_params(params)
        adapter = self.lora_adapter(lora_request) if lora_request is not None else None
        ids = self.validate_prompt(prompt, params.truncate_prompt_tokens)
        for name, value in (("program_id", program_id), ("thread_id", thread_id), ("cache_salt", cache_salt)):
            if value is not None and not isinstance(value, str):
                raise InvalidRequestTypeError(f"{name} must be a str or None, got {show_value(value)}",
                                              parameter=name, value=value)

        def in_use(rid: str) -> bool:
            return any(i in self._detok or i in taken for i in family_ids(rid, params.n))

        if request_id is None:
            request_id = f"req-{next(self._ids)}"
            while in_use(request_id):
                request_id = f"req-{next(self._ids)}"
        elif not isinstance(request_id, str):
            raise InvalidRequestTypeError(f"request_id must be a non-empty str or None, got {show_value(request_id)}",
                                          parameter="request_id", value=request_id)
        elif not request_id:
            raise InvalidRequestError("request_id must be a non-empty str or None, got ''", parameter="request_id", value="")
        elif in_use(request_id):
            raise InvalidRequestError(
                f"request id {request_id!r} (or the id of one of its n={params.n} forks) is already in use",
                parameter="request_id", value=request_id)
        if params.constraint is not None:
            self.compile_constraint(params.constraint)
        if (error := self.kv.capacity_error_of(len(ids), params.max_tokens, self.max_model_len)) is not None:
            # it would wait forever (or fail on the worker thread): refused here, as a bad max_tokens
            raise InvalidRequestError(error, parameter="max_tokens", value=params.max_tokens)
        return CheckedRequest(request_id, ids, params, RequestOwner(program_id, thread_id, cache_salt), adapter)

    def lora_adapter(self, lora_request: LoRARequest | LoRAAdapter | None) -> LoRAAdapter | None:
        """The adapter a request names, loaded on first use (InvalidRequestError when it cannot serve)."""
        return self.checks.lora_adapter(lora_request)

    @property
    def loras(self) -> LoRARegistry | None:
        """The LoRA adapters loaded (None without enable_lora)."""
        return self.checks.loras

    def compile_constraint(self, constraint: Constraint) -> None:
        """Compile (cached) an output grammar; InvalidRequestError if it does not compile."""
        self.checks.compile_constraint(constraint)

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        program_id: str | None = None,
        thread_id: str | None = None,
        cache_salt: str | None = None,
        lora_request: LoRARequest | LoRAAdapter | None = None,
    ) -> Request:
        """Queue a request, checked first (`admit`); bad input raises InvalidRequestError (a ValueError) and
        leaves no trace."""
        return self.add_checked(
            self.admit(prompt, params, request_id, program_id, thread_id, cache_salt, lora_request=lora_request))

    def add_checked(self, checked: CheckedRequest) -> Request:
        """Queue a request `admit` checked (not checked again) with its n - 1 forks; the root request."""
        ids, params, request_id, adapter = checked.prompt_token_ids, checked.params, checked.request_id, checked.lora
        o = checked.owner
        req = Request(
            request_id, ids, params, program_id=o.program_id, thread_id=o.thread_id, cache_salt=o.cache_salt,
            eos_token_ids=self.eos_token_ids, max_model_len=self.max_model_len, lora=adapter,
        )
        for i, rid in enumerate(family_ids(request_id, params.n)[1:], start=1):
            child = Request(
                rid, ids, params, program_id=o.program_id, thread_id=o.thread_id,
                cache_salt=o.cache_salt, eos_token_ids=self.eos_token_ids, max_model_len=self.max_model_len,
                arrival_time=req.arrival_time, parent=req, fork_index=i, lora=adapter,
            )
            req.children.append(child)
        if params.constraint is not None:
            for r in (req, *req.children):  # compiled by admit
                m = self.checks.grammars.matcher(params.constraint)
                if params.constraint.after:
                    r.waiting_matcher = m  # until the output holds `after` (_append)
                else:
                    r.matcher = m
        self.requests[request_id] = req
        self._families[request_id] = req
        for r in (req, *req.children):  # every id of the family is taken until its output is
            self._detok[r.request_id] = Detokenizer(
                self.tokenizer, list(params.stop), min_tokens=params.min_tokens,
                include_stop=params.include_stop_str_in_output, skip_special_tokens=params.skip_special_tokens)
        try:
            self.scheduler.add_request(req)
        except BaseException:
            self.release(request_id)
            raise
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
                self._preempted.pop(r.request_id, None)  # preempted, aborted while waiting: never scheduled again
                deltas.append(self.outputs.delta(r, []))
        return deltas + self.outputs.end_unstarted_forks(root)

    def release(self, request_id: str) -> None:
        """Abort a request and its forks if still running and forget them, without building an output."""
        root = self._families.get(request_id)
        if root is None:
            return
        try:
            self.abort(request_id)
        finally:
            del self._families[request_id]
            for r in (root, *root.children):
                self.requests.pop(r.request_id, None)
                self._detok.pop(r.request_id, None)

    def fail_all(self, error: str) -> list[StreamDelta]:
        """End every unfinished request with `error` (an engine failure outside any one request);
        the final delta of each completion it ended."""
        deltas = []
        for root in list(self._families.values()):
            for r in (root, *root.children):
                if r.request_id in self.requests and not r.finished:
                    deltas += self.outputs.fail(r, error)
                    self._preempted.pop(r.request_id, None)
            deltas += self.outputs.end_unstarted_forks(root)
        return deltas

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def expire_pins(self) -> float:
        """Drop expired pins now (an idle engine takes no steps); seconds until the next deadline (inf: none)."""
        return self.scheduler.expire_pins() - time.monotonic()

    def program_op(self, op: ProgramOp) -> None:
        """Apply a program operation (engine.program_ops: start, reserve, pin, release, end)."""
        self.scheduler.program_op(op)

    def reset_prefix_cache(self) -> bool:
        """vLLM's reset_prefix_cache: forget every cached block no one holds, so later requests compute those
        prefixes again; blocks in use (running requests, programs' pins) keep theirs. True when nothing
        cached is left. Call it between steps (AsyncEngine.reset_prefix_cache does)."""
        return self.kv.reset_prefix_cache()

    def num_tracked(self) -> dict[str, int]:
        """Entries of each per-request map (debugging, leak tests): all 0 once every output is taken."""
        s = self.scheduler
        return {"requests": len(self.requests), "families": len(self._families), "detok": len(self._detok),
                "waiting": len(s.waiting), "running": len(s.running), "preempted": len(self._preempted)}

    def _note_preemptions(self, preempted: list[Request]) -> None:
        """Each preemption's time and the time its request was scheduled again, on the request (its
        RequestMetrics.preemptions): what a program's timeline marks. Costs nothing while none happen."""
        now = self.scheduler.clock()
        for req in preempted:
            req.preemptions.append([now, None])
            self._preempted[req.request_id] = req
        for rid, req in list(self._preempted.items()):
            if req.status == RequestStatus.RUNNING:
                req.preemptions[-1][1] = now
            elif not req.finished:
                continue
            del self._preempted[rid]

    # ---- the step ------------------------------------------------------------------------
    def step(self) -> list[StreamDelta]:
        """One model step; the deltas it produced. An error while serving one request fails that
        request alone (FINISHED_ERROR, blocks freed); an error in the forward fails that step's batch."""
        cfg = self.config
        if cfg.num_speculative_tokens:
            limit = cfg.speculative_disable_by_batch_size
            k = cfg.num_speculative_tokens if limit is None or len(self.scheduler.running) <= limit else 0
            for req in self.scheduler.running:  # k = 0 also clears drafts of a step that skipped the request
                propose(req, k, cfg.prompt_lookup_max, cfg.prompt_lookup_min)
        out = self.scheduler.schedule()
        if out.preempted or self._preempted:
            self._note_preemptions(out.preempted)
        if self.on_schedule is not None:
            self.on_schedule(out)
        self.num_draft_tokens += sum(len(r.spec_token_ids) for r in out.reqs)
        deltas = self.outputs.unschedulable(out.failed)
        for r in out.failed:
            self._preempted.pop(r.request_id, None)
        try:
            if out.kv_moves:
                self.tiers.apply(out.kv_moves, self.runner.kv_cache)
            result = self.runner.execute(out)
        except Exception as e:
            logger.exception("model step failed: failing its batch of %d requests", len(out.reqs))
            return deltas + self.outputs.fail_batch(out.reqs, e)
        self.busy_s += result.step_time_s
        self.num_computed_tokens += out.total_tokens
        if self.tiers is not None and out.total_tokens >= 64:  # a prefill step: what recomputing a token costs
            t = result.step_time_s / out.total_tokens
            r = self.tiers.recompute_s_per_token
            self.tiers.recompute_s_per_token = t if r is None else 0.8 * r + 0.2 * t
        self.scheduler.update_from_output(out, result.step_time_s, result.num_rejected)
        if result.num_rejected is not None and out.num_steps == 1:  # drafts (a multi-step's are its tail)
            self.num_rejected_tokens += sum(result.num_rejected)
        self.num_steps += 1
        deltas += self.outputs.process(result)
        if self.tiers is not None and not self.scheduler.has_work():
            # the engine goes idle: the copies its last step queued (blocks written through to disk) go now, not at
            # a next step that may be long in coming (another server sharing the disk tier is looking for them)
            moves = self.kv.take_tier_moves()
            if moves:
                self.tiers.apply(moves, self.runner.kv_cache)
        return deltas

    def finished_output(self, req: Request) -> RequestOutput:
        """The full output of a finished request (with its forks); forgets the request."""
        self._families.pop(req.request_id, None)
        return self.outputs.request_output(req)

    def kv_stats(self) -> KVStats:
        s, r = self.kv.stats, self.kv.retention
        return KVStats(
            self.kv.num_blocks, self.kv.num_free_blocks, self.kv.block_size, self.kv.num_shared_blocks(),
            s.queries_tokens, s.hit_tokens, s.dedup_merges, s.evictions, s.cow_copies, self.scheduler.num_preemptions,
            self.kv.num_pinned_blocks, self.kv.num_reserved_blocks, r.ttl_hits, r.ttl_misses, r.expiries,
            r.pin_blocks_given_way, r.recomputed_prefill_tokens, self.tiers.stats() if self.tiers is not None else {},
        )


def family_ids(request_id: str, n: int) -> list[str]:
    """Ids of a request and its n - 1 forks."""
    return [request_id, *(f"{request_id}#{i}" for i in range(1, n))]


def _eos_ids(tokenizer, hf_config) -> frozenset[int]:
    ids: set[int] = set()
    for src in (getattr(hf_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, (list, tuple)):
            ids.update(src)
    return frozenset(ids)
