"""Beam search as one call of a program (vLLM's `use_beam_search`): every step's beams are calls of the
program, submitted together so the engine batches them and the scheduler counts them as the program's,
each beam's tokens found in the prefix cache its earlier steps filled (engine/beam_search.py).

    call = runtime.submit_beam_search(prompt_ids, BeamSearchParams(beam_width=4, max_tokens=32),
                                      program_id="p1")    # bad input raises here
    async with call:
        out = await call.result()      # a RequestOutput: its outputs are the beams, best first

A search without a program id runs as a program of its own, ended with the search. In a program,
`await agentrt.beam_search(prompt, beam_width=4, max_tokens=32)` runs one as calls of the current program
(`Runtime.beam_search`): a `Result` whose choices are the beams, best first.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from agentrt._errors import InvalidCallError
from agentrt._process_table import ProcessTable, ProgramInfo, ProgramStatus
from agentrt._program import ProgramHandle, calling_program, current
from agentrt._results import Result
from agentrt.engine.beam_search import BeamSearch, BeamSearchParams
from agentrt.engine.client import EngineInfo
from agentrt.engine.lora import LoRARequest
from agentrt.engine.outputs import CompletionOutput, RequestOutput
from agentrt.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from agentrt._call import Call


class BeamRuntime(Protocol):
    """What a search needs of the runtime (`agentrt._runtime.Runtime`, which imports this module): its
    prompts checked and tokenized, its programs started, looked up and ended, its steps submitted."""

    programs: ProcessTable

    @property
    def tokenizer(self) -> Any: ...

    @property
    def engine_info(self) -> EngineInfo: ...

    def check_prompt(self, prompt: str | list[int]) -> list[int]: ...

    def resolve_model(self, model: Any, program_id: str | None = None) -> LoRARequest | None: ...

    def start_program(self, program_id: str | None = None, *, name: str = "program", owner: str | None = None,
                      priority: int = 0) -> ProgramInfo: ...

    def end_program(self, program_id: str, *, owner: Any = ..., state: ProgramStatus = "finished") -> ProgramInfo: ...

    def submit(self, prompt: str | list[int], params: SamplingParams, *, program_id: str | None = None,
               thread_id: str | None = None, owner: str | None = None, cache_salt: str | None = None,
               kind: str = "generate", last_call: bool = False, name: str = "program",
               model: str | None = None) -> Call: ...

    def submit_call(self, handle: ProgramHandle, thread_id: str | None, prompt: str | list[int],
                    params: SamplingParams, kind: str, cache_salt: str | None, one_call: bool = False,
                    last_call: bool = False, lora: LoRARequest | None = None) -> Call: ...

    def result_of(self, out: RequestOutput) -> Result: ...

_ids = itertools.count(1)


class BeamSearchCall:
    """A beam search in flight; the `Call` interface the server uses (`result`, `close`, `program_id`,
    `model`, `async with`)."""

    def __init__(self, runtime: BeamRuntime, prompt_ids: list[int], params: BeamSearchParams,
                 submit: Callable[[list[int], SamplingParams], Call], program_id: str, *, model: str | None = None,
                 own_program: bool = False) -> None:
        """`submit(prompt_ids, params)`: one call of the program `program_id`; `own_program`: the search's
        own, ended with it. InvalidCallError for a prompt the engine refuses."""
        if not isinstance(params, BeamSearchParams):
            raise InvalidCallError(f"params must be BeamSearchParams, got {params!r}")
        try:
            prompt_ids = runtime.check_prompt(prompt_ids)
        except (TypeError, ValueError) as e:
            raise InvalidCallError(str(e), param="prompt") from None
        info = runtime.engine_info
        self.runtime = runtime
        self.prompt_ids = prompt_ids
        self.search = BeamSearch([prompt_ids], params, info.eos_token_ids, info.max_model_len)
        self.program_id = program_id
        self.model = model  # the LoRA adapter's name (None: the base model)
        self.request_id = f"{program_id}-beam{next(_ids)}"
        self._submit = submit
        self._own_program = own_program
        self._calls: list[Call] = []
        self.closed = False  # close() ran

    async def result(self) -> RequestOutput:
        """Run the search to its end: the beams as completions, best first (CallAbortedError /
        CallFailedError if a step's call did not finish)."""
        search, step = self.search, self.search.step_params()
        try:
            while not search.done:
                self._calls = [self._submit(p, step) for p in search.next_prompts()]
                outs = [await c.result() for c in self._calls]  # all submitted first: one batch in the engine
                self._close_calls()
                search.advance([o.outputs[0].top_logprobs[0] for o in outs])
        finally:
            self.close()
        (found,) = search.results(self.runtime.tokenizer)
        n = len(self.prompt_ids)
        outputs = [CompletionOutput(i, s.text or "", s.tokens[n:], s.finish_reason)
                   for i, s in enumerate(found.sequences)]
        return RequestOutput(self.request_id, self.prompt_ids, outputs)

    def _close_calls(self) -> None:
        for c in self._calls:
            c.close()
        self._calls = []

    def close(self) -> None:
        """Abort the step in flight and end the search's own program (idempotent)."""
        if self.closed:
            return
        self.closed = True
        self._close_calls()
        if self._own_program:
            info = self.runtime.programs.get(self.program_id)
            if info is not None and info.state == "running":
                self.runtime.end_program(self.program_id)

    async def __aenter__(self) -> BeamSearchCall:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


def submit_beam_search(runtime: BeamRuntime, prompt_ids: list[int], params: BeamSearchParams, *, program_id: str | None,
                       owner: str | None, cache_salt: str | None, model: str | None, name: str) -> BeamSearchCall:
    """`Runtime.submit_beam_search`: the server's search, its steps calls of the keyed program `program_id`
    (None: a program of its own, ended with the search)."""
    runtime.resolve_model(model, program_id)  # an unknown adapter fails before a program starts
    own = program_id is None
    if own:
        program_id = runtime.start_program(name=name, owner=owner).program_id

    def submit(ids: list[int], sp: SamplingParams) -> Call:
        return runtime.submit(ids, sp, program_id=program_id, owner=owner, cache_salt=cache_salt, model=model,
                              kind="beam_search", name=name)

    try:
        return BeamSearchCall(runtime, prompt_ids, params, submit, program_id, model=model, own_program=own)
    except BaseException:
        if own:
            runtime.end_program(program_id, state="failed")
        raise


async def beam_search_in_program(runtime: BeamRuntime, prompt: str | list[int], *, beam_width: int, max_tokens: int,
                                 length_penalty: float, ignore_eos: bool, model: str | None) -> Result:
    """`Runtime.beam_search` (its prompt checked there): a search whose steps are calls of the current program
    (outside one: a program of its own), as `agentrt.chat`'s are; a `Result` whose choices are the beams."""
    cur = current()
    pid = cur[0].program_id if cur is not None else None
    try:
        params = BeamSearchParams(beam_width=beam_width, max_tokens=max_tokens, length_penalty=length_penalty,
                                  ignore_eos=ignore_eos)
    except (TypeError, ValueError) as e:
        raise InvalidCallError(str(e), program_id=pid) from None
    ids = runtime.tokenizer(prompt)["input_ids"] if isinstance(prompt, str) else prompt
    with calling_program("beam_search") as (prog, thread_id):
        lora = runtime.resolve_model(model, prog.program_id)
        call = BeamSearchCall(runtime, ids, params,
                              lambda p, sp: runtime.submit_call(prog, thread_id, p, sp, "beam_search", None, lora=lora),
                              prog.program_id, model=lora.lora_name if lora is not None else None)
        async with call:
            return runtime.result_of(await call.result())
