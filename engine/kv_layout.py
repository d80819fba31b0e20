"""How a model's layers share the KV pool: layer groups (vLLM's hybrid KV manager, Jenga's pages).

Layers that keep their keys by the same rule (full attention, or a sliding window of W positions) form
groups of equally many layers; one physical block ("page") of the pool holds `page_layers` layers' K/V of
one group for `block_size` tokens, so every group allocates from one pool of one page size and a page is
the unit of hashing, eviction, tiers and copy-on-write as before. A request keeps one block table per
group. A window group's table frees the blocks that left the window (entries become `NULL_BLOCK`), so a
32k-token Gemma 3 conversation keeps its 15 local layers' last 512 positions instead of all 32k.
Recurrent layers (`layer_kinds` "linear_attention") keep no pages at all.

Grouping: the attention layers of each rule, in layer order, cut into groups of `page_layers` =
gcd of the rules' layer counts (Gemma 3 270M: 3 full + 15 local -> page of 3 layers, 1 full group and 5
window groups). A model of one rule is one group of all its layers: the layout the engine always had.
Full-attention groups come first, so group 0 is a full group wherever the model has one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

NULL_BLOCK = -1  # a window group's table entry for a block that left the window (never read)


@dataclass(frozen=True, slots=True)
class KVGroup:
    window: int | None  # positions a query sees (HF's sliding window); None = all of them
    layers: tuple[int, ...]  # the model layers whose K/V its pages hold, by page slot


@dataclass(frozen=True, slots=True)
class KVLayout:
    groups: tuple[KVGroup, ...]
    page_layers: int  # layers per page (the pool tensor's first dimension)
    num_layers: int  # the model's layers (recurrent ones included)

    @classmethod
    def single(cls, num_layers: int) -> KVLayout:
        """Every layer in one full group: the layout without layer rules (tests, simulation)."""
        return cls((KVGroup(None, tuple(range(num_layers))),), num_layers, num_layers)

    @classmethod
    def from_args(cls, args, swa_full: bool = False) -> KVLayout:
        """The layout of a model (`engine.model_args.ModelArgs`): attention layers grouped by window; with
        `swa_full` (llama.cpp's --swa-full) every attention layer keeps every block, in one group."""
        n = args.num_layers
        kinds = tuple(getattr(args, "layer_kinds", ()) or ("attention",) * n)
        windows = tuple(args.windows or (None,) * n)
        attention = [i for i in range(n) if kinds[i] != "linear_attention"]
        if not attention:
            raise ValueError("a model with no attention layer has no KV to page")
        if swa_full or len({windows[i] for i in attention}) == 1:
            w = windows[attention[0]] if not swa_full else None
            return cls((KVGroup(w, tuple(attention)),), len(attention), n)
        by_rule: dict[int | None, list[int]] = {}
        for i in attention:
            by_rule.setdefault(windows[i], []).append(i)
        page = math.gcd(*(len(v) for v in by_rule.values()))
        rules = sorted(by_rule, key=lambda w: (w is not None, w or 0))  # full first, then by window
        groups = tuple(KVGroup(w, tuple(by_rule[w][k : k + page])) for w in rules
                       for k in range(0, len(by_rule[w]), page))
        return cls(groups, page, n)

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def windowed(self) -> bool:
        """Some group frees the blocks that left its window."""
        return any(g.window is not None for g in self.groups)

    def layer_slots(self) -> list[tuple[int, int] | None]:
        """Per model layer: (group, slot in the page), or None for a layer without KV (recurrent)."""
        out: list[tuple[int, int] | None] = [None] * self.num_layers
        for g, group in enumerate(self.groups):
            for j, layer in enumerate(group.layers):
                out[layer] = (g, j)
        return out

    def live_blocks(self, group: int, num_tokens: int, block_size: int) -> int:
        """At most how many blocks `group` holds for a sequence of `num_tokens` tokens between steps (a window
        group: those its window still sees, plus the one being filled)."""
        n = -(-num_tokens // block_size)
        w = self.groups[group].window
        return n if w is None else min(n, -(-(w - 1) // block_size) + 1)

    def first_needed_block(self, group: int, position: int, block_size: int) -> int:
        """The first block a query at `position` reads in `group` (the blocks before it can go)."""
        w = self.groups[group].window
        return 0 if w is None else max(0, position - w + 1) // block_size
