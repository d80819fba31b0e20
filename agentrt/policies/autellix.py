"""PLAS and ATLAS: program-level attained-service scheduling (Autellix, arXiv 2502.13965).

A program's priority is the service it has received so far, so short programs overtake long
ones without anyone predicting lengths:

- PLAS: priority = Σ executor service of the program's completed calls.
- ATLAS: priority = the program's longest critical path of service. A new call inherits it as its
  `start_priority`; on completion `critical = max(critical, start_priority + call service)`. Parallel
  threads of one program therefore share one priority and are scheduled together.

The priority is discretized into K queues with doubling boundaries `[0, b), [b, 2b), [2b, 4b), ...,
[2^(K-2) b, inf)`. A new call enters the queue holding its program's priority, and from then on moves
like a call in an MLFQ (see `_multilevel`). Anti-starvation: a waiting call goes to the top queue when
`(W_program + W_call) / (T_program + T_call) >= beta`, W = waiting seconds, T = service (T_program =
the program's attained service); afterwards only the call's own W and T restart from zero.

Where the paper is silent, for programs with parallel calls (all switchable, defaults measured):

- `live=True`: the program's priority also counts what its calls still in the engine have received,
  and a call never sits above the queue of that live priority. Without it, a tree search whose root
  call was short puts its whole fan-out in the top queue and keeps it there (each branch is short on
  its own), ahead of every chat that arrives meanwhile.
- W is the time a program had calls waiting and none running, counted once per program: a program
  that is being served is not starving, however many of its own parallel calls queue behind each
  other. A starving program gets one call promoted at a time.
- `order="program"`: within a queue, calls of older programs go first (the paper: FCFS by call). A
  multi-call program then keeps its place among the programs of its queue instead of going to the
  back at every call, and programs in the last queue finish one after another rather than all late.
"""

from __future__ import annotations

from typing import ClassVar

from agentrt._errors import ConfigError
from agentrt.engine.request import Request
from agentrt.policies._fit import ServiceFit
from agentrt.policies._multilevel import (
    CallState,
    MultiLevelPolicy,
    ProgramState,
    ServiceUnit,
    doubling,
    queue_of,
)

# Defaults, per service unit. The first boundary is "auto": `boundary_calls` times the median service of
# this engine's finished calls (agentrt/policies/_fit.py), and the quantum follows it in the ratio below;
# the fixed numbers are used until enough calls have finished, and whenever a number is given instead.
# Why not a constant: the 1 s boundary chosen on an older 2-core CPU (one decode step 50-150 ms, a call
# 0.3-1 s of executor time) is five to ten calls of the default model on an AVX512-BF16 one: a tree search
# then never left queue 0, where older programs go first, and PLAS became oldest-program-first (issue 47:
# `agentrt bench fanout`, short programs 1.66 s against FCFS's 0.65 s; with 0.1 s 0.09 s).
#   K = 2 queues and boundary_programs 1.5 (PLAS): the first queue ends at 1.5x the median service of the
#     latest finished programs (until 8 have finished: boundary_calls 2, two median calls' worth): a program that
#     has received less than a typical whole program goes first, every other one waits in the second queue, where
#     programs are served oldest first. More queues order the long programs among themselves by service, so a
#     newer long program overtakes an older one at every boundary and all of them finish late (processor sharing
#     among the longs): on the KV-bound agent mix below K = 4 with the program fit took the long programs' p99 to
#     1.9x fcfs, and K = 8 did the same to tree searches on the default mix (mean 0.67 / 0.61 / 0.61x fcfs at
#     0.8 / 0.9 / 1.0 of saturation against 0.57 / 0.51 / 0.47x with K = 4). Calls' worth misplaces programs
#     whose calls differ from the median call (a cold 500-token prompt receives ten cached calls' service).
#     Simulated with pins_by_rank (below), this CPU's step costs, 60 programs x seeds 0-2, mean / short programs
#     vs fcfs, against the old defaults (K = 4, calls' worth, no pins_by_rank): KV-bound agent mix (150 blocks)
#     0.71 / 0.41x against 0.78 / 0.78x; with a host tier at 0.5 programs/s 0.92 / 0.52x against 1.07 / 0.80x, at
#     0.35/s 0.97 / 0.83x against 0.96 / 0.84x; the default mix on 4 seats (96 programs, seeds 0-1) 0.68 / 0.55x
#     against 0.63 / 0.50x (its trees' p99 0.95 / 0.73x against 1.08 / 0.82x).
#   quantum = the first boundary: with `live` the program's service moves its calls down; the quantum only
#     matters for one long call, and 0.5-2x measured the same.
#   beta 32: smaller values promote long programs into the top queue early and give back the short programs'
#     gain (beta 1-2: mean 0.75-0.84x, p99 1.10-1.22x on the mix above). The reimplementation's 8 collapses
#     a KV-bound engine in overload: the long programs' wait reaches 8x their service, one promoted call after
#     another goes ahead of the new short programs (in the top queue by program age) and PLAS turns into
#     oldest-first round robin; 32, 128 and no promotion at all measured the same below, and 32 still lifts a
#     program starved for 32x its service.
#   preempt "seats": a waiting call of a better queue displaces a running one for a seat (the displaced call
#     keeps its blocks cached and resumes from them), never for blocks: displacing for blocks evicts the
#     victim's context and recomputes it, and on a KV-bound engine PLAS then spends its time recomputing.
#   protect_pins: admission takes a call only if its prompt and the first 256 tokens of its output fit
#     (`admit_output_tokens`: a watermark against admitting calls whose growth preempts others within a few
#     steps), and a new program does not take a paused program's pinned KV (engine.scheduler)...
#   pins_by_rank: a program resuming from a tool call (holding a pin) takes only the pins of programs it outranks:
#     a younger long program no longer evicts an older one's context, which then recomputes it. Simulated (KV-bound
#     agent mix below, 60 programs x 3 seeds): mean 0.88 -> 0.71x fcfs, long programs' p99 1.29 -> 0.81x. Letting a
#     new program (no pin) take outranked pins too helped the short programs there but evicted whole agent contexts
#     on the full-size GPU agents of TTL_SETTINGS (mean 120 -> 171 s at 0.10 programs/s): not done.
#   headroom and new_take_pins (issue 47's third round): on the KV-bound agent mix a short program's call waited for
#     the blocks that long programs' running calls and paused contexts held (at a step where one waited: 14 of 150
#     blocks free, 51 pinned, simulated). With both, a long program's call leaves free what a short call needs, and
#     a new program takes the pins of the long programs it outranks. Simulated, 150 blocks, seeds 0-2, mean / short
#     programs vs fcfs: 30 programs at 0.267/s 0.67 / 0.50x against 0.83 / 0.64x without them; 60 programs at
#     0.2, 0.3, 0.4/s 0.79 / 0.56x, 0.54 / 0.26x, 0.58 / 0.27x against 0.99 / 0.74x, 0.60 / 0.30x, 0.64 / 0.29x
#     (each alone helped less: 0.69 / 0.47x and 0.87 / 0.66x at 0.267/s); with 64 seats and no KV pressure identical.
#     Not in TTL_SETTINGS: new_take_pins evicted whole agent contexts there (pins_by_rank above).
#   prefill_yield (issue 47's fourth round): while calls wait for blocks, a prompt chunk of a call ranked below a call
#     decoding in the same step gets at most the smallest chunk with cap_efficiency (90%) of a long chunk's prompt
#     throughput (~130 tokens with this CPU's step cost, 9 ms + 0.64 ms a token). Before, a short call's 24 decode
#     steps each carried up to 1,024 tokens of others' prompts (~0.66 s a step against ~15 ms), it held its blocks
#     that long, and a better waiting call found no token budget left. Simulated --like-http, 150 blocks, 60
#     programs x seeds 0-2 pooled, PLAS mean vs fcfs without / with it: 0.225 programs/s 0.69 / 0.50x, 0.18/s 0.83
#     / 0.82x, 0.30/s 0.56 / 0.58x; host tier (0.48/s) 1.01 / 1.01x; with room in the cache nothing changes (the
#     gate). Fixed chunks of 64-256 tokens measured alike (0.48-0.51x at 0.225/s); 512 lost most of it (0.66x),
#     yielding only to better queues (`yield_to="queue"`) too (0.67-0.69x), and yielding without the gate (whenever a
#     better call decodes) cost 1.36x on an engine with room (1,000 blocks, 0.48/s, seed 0: new programs' prompts
#     crawled behind every decode). On the real engine over HTTP (the same mix at 0.9 of the measured knee, 60
#     programs x seeds 0-2, docs/benchmarks/programs.md): PLAS 0.68x fcfs with it, 0.70x without (per seed one each
#     way, inside the seeds' swing), long programs' p99 85 against 109 s.
# On the real engine over HTTP (issue 47's agent mix, agentrt/bench/workload.py AGENT_WAIT_MIX: 73% 2-4-call ReAct,
# 27% 8-12 steps of 4 parallel calls; 150 KV blocks, 64 seats, TTL pins on, 60 programs x seeds 0-2 at 0.9 of the
# saturation measured as the knee of a closed loop; docs/benchmarks/programs.md), with headroom, new_take_pins and
# programs presumed finished when quiet (agentrt/policies/_multilevel.py; over HTTP no client ends its programs, and
# before that PLAS's boundary never left calls' worth): mean 0.62x fcfs, short programs 0.39x, long 0.84x (p99
# 0.80x), all done 0.96x sooner (simulated --like-http: 0.59x). The second round's defaults measured 0.67x, short
# 0.82x, on 30 programs. With the host tier the same pool is compute-bound at its knee: 0.98x mean, short 0.75x,
# long 1.18x (with the headroom off over the tier: 1.15x, not kept).
#   headroom off by default (issue 47's fifth round): on a 2-core Xeon with AMX (a step costs 13.7 ms + 0.23 ms a
#     token, against the EPYC's 8.0 ms + 0.64 ms: width is worth more there) the same command in one run, fcfs /
#     plas / plas:headroom=0 at 0.307 programs/s: mean 0.78x fcfs with headroom, 0.66x without (per seed 0.61 / 0.55x,
#     1.07 / 0.81x, 1.17 / 1.02x); short programs 0.36 / 0.38x, long 1.15 / 0.91x, long p99 0.91 / 0.76x, time for all
#     1.02 / 0.97x; 2.0 against 2.4 calls running. The blocks kept free for a short program that may arrive cost the
#     long programs' steps their width, and a long program's call is short (24 tokens), so a short program that
#     finds the cache full waits for one such call, not for a program. Simulated on the same costs the two are even
#     (0.80 / 0.81x; 6 seeds 0.90 / 0.87x): the simulator misses what the width is worth here (docs/benchmarks/programs.md).
#   backfill_s 1 s (issue 47's sixth round): the admission line waited for its head, and on this mix the head was often
#     a new program's first call (34-42 blocks) while 33 of the 150 blocks were free on average whenever calls waited
#     (simulated, this CPU's costs): the calls behind it, a step program's next calls beside their pinned context or a
#     short program's resumed call, fitted but waited. Now they go in until the head has waited backfill_s; after
#     that the line waits for it, so small calls do not starve a large one. Simulated --like-http, 150 blocks, 60
#     programs at 0.307/s, mean vs fcfs: seeds 0-2 0.773 -> 0.609x (short programs 4.28 -> 3.94 s, long 36.1 -> 26.7
#     s against fcfs's 34.1: fewer blocks idle, more calls a step); seeds 0-5 0.887 -> 0.742x, long p99 82 -> 65 s.
#     0.5 and 2 s measured alike (0.79 / 0.76x on seeds 0-5, 1 s 0.74x), unbounded 0.79x (long p99 79 s). FCFS keeps
#     vLLM's line (with backfill_s 1 s it measured 1.01x its own mean; unbounded 1.46x: more calls in, more preempted).
#     With room in the cache nothing waits for blocks and nothing changes. Over a host tier (0.585/s, compute-bound)
#     1.00 -> 0.99x. Over HTTP (docs/benchmarks/programs.md, 0.322/s at 0.9 of the measured knee, a less contended run
#     than the one before: FCFS 9.3 s against 16.7): PLAS 0.83x fcfs, short programs 0.58x, long 1.04x; simulated on the
#     same workloads and refitted costs 0.67x (short programs match, 3.5 against 3.3 s; the long ones do not: 19.2
#     against 21.2 s).
DEFAULTS: dict[str, dict[str, float | None]] = {
    "time": {"num_queues": 2, "first_boundary": 1.0, "quantum": 1.0, "beta": 32.0, "boundary_calls": 2.0,
             "boundary_programs": 1.5},
    "tokens": {"num_queues": 2, "first_boundary": 128.0, "quantum": 64.0, "beta": 32.0, "boundary_calls": 2.0,
               "boundary_programs": 1.5},
}
# ATLAS ranks by critical path, which grows by one call's service per sequential step however wide the
# program is, so its boundaries sit 4x lower: half a call, and a ReAct loop or tree search reaches the last
# queue after two or three steps. With PLAS's boundaries a 34-call tree search never got there and newer
# trees kept overtaking older ones (simulated as above: mean 0.75 / 0.69 / 0.69x -> 0.64 / 0.59 / 0.54x fcfs,
# p99 1.24-1.72x -> 1.06-1.14x).
ATLAS_DEFAULTS: dict[str, dict[str, float | None]] = {
    "time": {**DEFAULTS["time"], "num_queues": 4, "first_boundary": 0.25, "quantum": 0.25, "boundary_calls": 0.5,
             "boundary_programs": None},
    "tokens": {**DEFAULTS["tokens"], "num_queues": 4, "first_boundary": 32.0, "quantum": 16.0, "boundary_calls": 0.5,
               "boundary_programs": None},
}
# PLAS composed with TTL retention (Continuum's pins, agentrt/_retention.py): `PLAS(**TTL_SETTINGS)`.
# Measured with `agentrt simulate agents` (full-size coding / ReAct agents, H100 / Llama-3.1-8B cost model,
# docs/benchmarks/retention.md "KV retention"), where the KV cache, not compute, runs out: plain PLAS ranks a new
# program's 4k-token first call above a long agent's next call, lets it displace running calls and takes
# its victims from the lowest queue, i.e. the longest contexts, so every preemption and every pin given
# way is tens of thousands of tokens recomputed, and the engine collapses into recompute. With TTL:
# - pinned_first: a program resuming from a tool call with its KV pinned goes first in its queue (Continuum);
# - preempt=False: no displacement for a higher queue (a recompute costs more than the wait it saves);
# - victim="newest": when blocks run out, the latest-started program's call is preempted (least invested);
# - protect_pins: admission control; a call goes in only if its whole prompt and output fit, and only a
#   program holding a pin may take others' pins (a new program waits instead of evicting a paused one).
# 300 programs, seed 0, mean program latency: PLAS + pins alone 449 s at 0.08 programs/s; with the first
# three 69 s at 0.08 but 419 s at 0.085 and 533 s at 0.10 (collapse); with all four 71 s / 136 s. The
# admission control carries the gain at high load: Continuum's own order (program-level FCFS, pinned
# first) goes from 288 / 393 s to 66 / 121 s with it, as good as PLAS here (the agents' latency is mostly
# their own tool time and decode, so ranking by service matters less than not thrashing the cache).
# Its queues are the four of calls' worth it was measured with: on these agents (10-40 turns, contexts of tens of
# thousands of tokens) two queues fitted to finished programs took 130 s at 0.10 programs/s against 120 s.
TTL_SETTINGS: dict[str, object] = {"pinned_first": True, "preempt": False, "victim": "newest", "protect_pins": True,
                                   "new_take_pins": False, "headroom": False, "prefill_yield": False,
                                   "backfill_s": None, "num_queues": 4, "boundary_programs": None}


class PLAS(MultiLevelPolicy):
    """Program-level attained service, discretized into K queues; see the module docstring.

    Arguments (None = the default for the service unit, see `DEFAULTS`):
        num_queues: K (None: the default, 2 for PLAS, 4 for ATLAS).
        first_boundary: upper bound of queue 0 in service units; queue i ends at `first_boundary * 2^i`.
            "auto" (the default, also None): `boundary_calls` times the median service of the engine's
            finished calls (agentrt/policies/_fit.py), the fixed default until enough calls finished.
        boundary_calls: with "auto", the first boundary in typical calls' worth of service (until enough programs
            have ended for `boundary_programs`, or always when that is None).
        boundary_programs: with "auto", the first boundary in typical programs' worth: this times the median
            service of the latest finished programs (ended by the runtime; a request without a program is a
            one-call program), once 8 have finished. None: calls' worth only. Default: the service unit's.
        quantum: service a call may receive in queue 0 before dropping a level; doubles per level. None:
            the default, which follows an "auto" first boundary in the defaults' ratio.
        beta: anti-starvation threshold on wait/service; `float("inf")` disables promotion.
        service: "time" (executor seconds) or "tokens" (`token_cost` per computed token).
        preempt: let a call of a higher queue displace a running call of a lower one (recompute): True, for a
            seat or for blocks; "seats", for a seat only (the displaced call keeps its cached blocks); False, never.
        live: count the service of the program's calls still in the engine (see the module docstring).
        order: "program" (older programs first within a queue) or "call" (FCFS by call, the paper's).
        pinned_first: calls of programs whose KV is pinned across a tool call go first within their queue
            (Continuum's order, composed with PLAS; see `TTL_SETTINGS` and MultiLevelPolicy.pinned_key).
        victim: "priority" (preempt from the lowest queue) or "newest" (a call of the latest-started program).
        protect_pins: admission control that keeps paused programs' pinned KV (engine.scheduler): while others
            run, a call goes in only if its prompt and the first `admit_output_tokens` of its output fit.
        admit_output_tokens: that horizon (None: its whole max_tokens, which for a call without max_tokens is
            the whole context, so such a call would wait until the engine is idle).
        pins_by_rank: with protect_pins, a resuming call (its program holds a pin) may make the pins of the paused
            programs it outranks give way (a worse queue, or the same queue and a younger program), and no others;
            False: anyone's.
        new_take_pins: with pins_by_rank, a new program's call (its program holds no pin) may also make the pins of
            the paused programs it outranks give way (a long program's pinned context yields to a short program's
            first call instead of keeping it waiting for blocks).
        headroom: admission keeps room for better calls: while others run, a call of the last queue goes in only if
            the blocks a better call typically needs (fitted by the engine's scheduler from the calls it admitted,
            engine.scheduler) stay free after it. Off by default (measured above: it costs the long programs' width
            more than it saves the short ones' wait).
        prefill_yield: while calls wait for KV blocks, the prompt chunks of calls ranked below a call decoding in the
            step (or below one of the best waiting calls) compute at most this many tokens per step together (an
            int), or (True) the smallest chunk with `cap_efficiency` of a long chunk's prompt throughput on this
            engine's measured step cost; False: no limit.
        yield_to: whom prompts yield to: "rank" (any better-ranked call) or "queue" (a call of a better queue).
        backfill_s: while the best waiting call that does not fit in the KV cache has waited less than this many
            seconds, the calls behind it that fit go in (engine.scheduler); after that the line waits for it. None: it
            always waits for its head.
        running_cap: the running set while calls wait: None (max_num_seqs), an int, or "auto" (the knee
            of the measured step cost, where `cap_efficiency` of a full batch's throughput is reached;
            see MultiLevelPolicy.max_running). Admission in program order stops there, and with
            `preempt` a waiting call of a better queue displaces the worst running one.
    """

    name: ClassVar[str] = "plas"
    defaults: ClassVar[dict[str, dict[str, float]]] = DEFAULTS

    def __init__(
        self,
        *,
        num_queues: int | None = None,
        first_boundary: float | str | None = None,
        boundary_calls: float | None = None,
        boundary_programs: float | None | str = "default",
        quantum: float | None = None,
        beta: float | None = None,
        service: ServiceUnit = "time",
        token_cost: float = 1.0,
        preempt: bool | str = "seats",
        live: bool = True,
        order: str = "program",
        pinned_first: bool = False,
        victim: str = "priority",
        protect_pins: bool = True,
        admit_output_tokens: int | None = 256,
        running_cap: int | str | None = None,
        cap_efficiency: float = 0.9,
        pins_by_rank: bool = True,
        new_take_pins: bool = True,
        headroom: bool = False,
        prefill_yield: bool | int = True,
        yield_to: str = "rank",
        backfill_s: float | None = 1.0,
    ) -> None:
        if service not in self.defaults:
            raise ConfigError(f"{self.name}: service must be 'time' or 'tokens', got {service!r}")
        d = self.defaults[service]
        num_queues = d["num_queues"] if num_queues is None else num_queues
        self.auto_boundary = first_boundary is None or first_boundary == "auto"
        first_boundary = d["first_boundary"] if self.auto_boundary else first_boundary
        boundary_calls = d["boundary_calls"] if boundary_calls is None else boundary_calls
        boundary_programs = d["boundary_programs"] if boundary_programs == "default" else boundary_programs
        beta = d["beta"] if beta is None else beta
        super().__init__(
            num_queues=num_queues,
            quantum=d["quantum"] if quantum is None else quantum,
            service=service,
            token_cost=token_cost,
            preempt=preempt,
            pinned_first=pinned_first,
            victim=victim,
            protect_pins=protect_pins,
            running_cap=running_cap,
            cap_efficiency=cap_efficiency,
            pins_by_rank=pins_by_rank,
            new_take_pins=new_take_pins,
            headroom=headroom,
            prefill_yield=prefill_yield,
            yield_to=yield_to,
            backfill_s=backfill_s,
        )
        if isinstance(first_boundary, str) or not first_boundary > 0:
            raise ConfigError(f"{self.name}: first_boundary must be 'auto' or a number > 0, got {first_boundary!r}")
        if isinstance(boundary_calls, str) or not boundary_calls > 0:
            raise ConfigError(f"{self.name}: boundary_calls must be > 0, got {boundary_calls!r}")
        if boundary_programs is not None and (isinstance(boundary_programs, str) or not boundary_programs > 0):
            raise ConfigError(f"{self.name}: boundary_programs must be None or > 0, got {boundary_programs!r}")
        if not beta > 0:
            raise ConfigError(f"{self.name}: beta must be > 0, got {beta!r}")
        if admit_output_tokens is not None and (not isinstance(admit_output_tokens, int) or admit_output_tokens < 1):
            raise ConfigError(f"{self.name}: admit_output_tokens must be None or an int >= 1, got {admit_output_tokens!r}")
        self.admit_output_tokens = admit_output_tokens
        self.boundaries = doubling(first_boundary, num_queues - 1)  # finite upper bounds of queues 0..K-2
        self.boundary_calls = boundary_calls
        self.quantum_ratio = d["quantum"] / d["first_boundary"] if quantum is None else None  # None: fixed
        self.boundary_programs = boundary_programs
        self.call_fit = ServiceFit() if self.auto_boundary else None
        self.program_fit = ServiceFit() if self.auto_boundary and boundary_programs is not None else None
        self.beta = beta
        self.live = live
        if order not in ("call", "program"):
            raise ConfigError(f"{self.name}: order must be 'call' or 'program', got {order!r}")
        self.order_by_program = order == "program"

    def program_priority(self, prog: ProgramState) -> float:
        return prog.attained + prog.elsewhere  # other replicas' service counts: the figure is global

    def live_priority(self, prog: ProgramState) -> float:
        """The priority counting the service its calls in the engine have received so far."""
        return prog.attained + prog.elsewhere + prog.in_flight

    def program_queue(self, prog: ProgramState | None) -> int:
        if prog is None:
            return self.num_queues
        return queue_of(self.boundaries, self.live_priority(prog) if self.live else self.program_priority(prog))

    def entry_level(self, req: Request, prog: ProgramState, st: CallState) -> int:
        st.start_priority = self.program_priority(prog)
        return queue_of(self.boundaries, self.live_priority(prog) if self.live else st.start_priority)

    def floor_level(self, prog: ProgramState, st: CallState) -> int:
        if not self.live or st.promotions:  # a call promoted by anti-starvation demotes by quantum only
            return 0
        return queue_of(self.boundaries, self.live_priority(prog))

    def starving(self, prog: ProgramState, st: CallState) -> bool:
        wait = prog.wait  # W_program + W_call: the program's wait so far includes this call's
        service = prog.attained + prog.elsewhere + st.service
        return wait >= self.beta * service if service > 0 else wait > 0

    def on_call_done(self, prog: ProgramState, st: CallState) -> None:
        prog.attained += st.total_service
        prog.critical = max(prog.critical, st.start_priority + st.total_service)
        if (self.call_fit is not None and self.call_fit.add(st.total_service)
                and (self.program_fit is None or self.program_fit.median is None)):
            self.set_first_boundary(self.boundary_calls * self.call_fit.median)

    def on_program_done(self, prog: ProgramState) -> None:
        if self.program_fit is not None and self.program_fit.add(self.program_priority(prog)):
            self.set_first_boundary(self.boundary_programs * self.program_fit.median)

    def set_first_boundary(self, first: float) -> None:
        """Queues [0, first) [first, 2 first) ...; the quantum follows unless it was given. Calls move to their
        new floors at the next schedule (a call above its program's new floor keeps its level until then)."""
        self.boundaries = doubling(first, self.num_queues - 1)
        if self.quantum_ratio is not None:
            self.quanta = doubling(first * self.quantum_ratio, self.num_queues - 1) + [float("inf")]


class ATLAS(PLAS):
    """PLAS with the program's critical path of service as its priority; see the module docstring."""

    name: ClassVar[str] = "atlas"
    defaults: ClassVar[dict[str, dict[str, float]]] = ATLAS_DEFAULTS

    def program_priority(self, prog: ProgramState) -> float:
        return max(prog.critical, prog.elsewhere_critical)

    def live_priority(self, prog: ProgramState) -> float:
        return max(prog.critical, prog.elsewhere_critical, prog.live_critical)
