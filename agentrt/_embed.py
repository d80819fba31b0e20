"""`agentrt.embed`: embeddings for the current program, in-process or through `agentrt.connect`.

    vectors = await agentrt.embed(["doc one", "doc two"])    # a list of vectors
    query = await agentrt.embed("question")                  # one vector

Each input is one call of the program (engine.pooling: the prompt's final hidden states pooled as the
checkpoint declares, else the last token's; L2-normalized unless `normalize=False`; `dimensions` keeps
the first D values first), scheduled and accounted with the program's other calls. Against a server
it is `POST /v1/embeddings` with the program's id.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from agentrt._context import current_runtime
from agentrt._errors import InvalidCallError

Inputs = str | list[int] | Sequence[str] | Sequence[list[int]]


def embed_inputs(inputs: Any) -> tuple[bool, list[str | list[int]]]:
    """(one input was given, the inputs as a list); InvalidCallError naming a bad one."""
    def token_ids(x: Any) -> bool:
        return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

    if isinstance(inputs, str) or token_ids(inputs):
        return True, [inputs]
    if isinstance(inputs, (list, tuple)) and inputs and (all(isinstance(x, str) for x in inputs)
                                                        or all(map(token_ids, inputs))):
        return False, list(inputs)
    raise InvalidCallError(f"embed inputs must be a string, a non-empty list of token ids, or a non-empty list of "
                           f"either, got {inputs!r:.80}")


async def embed(inputs: Inputs, *, dimensions: int | None = None, normalize: bool = True,
                priority: int = 0, model: str | None = None) -> list[float] | list[list[float]]:
    """The embedding of `inputs` (one vector for one input, a list of vectors for a list) as calls of
    the current program; `model`: a LoRA adapter's name (None: the base model)."""
    rt = current_runtime()
    assert rt is not None
    return await rt.embed(inputs, dimensions=dimensions, normalize=normalize, priority=priority, model=model)
