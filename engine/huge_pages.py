"""CPU memory in 2 MB pages (Linux transparent huge pages), for `agentrt bench paging`; and the engine's KV tensor,
untouched until used (`untouched_zeros`).

A decode step reads every block of every sequence through its block table; with 4 KB pages each block of a long
context costs a TLB miss or several. Transparent huge pages are on "madvise" on most distributions: memory is
backed by 2 MB pages only where a mapping asks (MADV_HUGEPAGE). The engine's own KV tensor does not ask: with
THP's defrag also on "madvise" (the usual default), every fault of an advised mapping may compact memory
synchronously, on the step path (the CI run that had the engine's tensor advised was ~5 minutes slower and one
server missed its shutdown deadline). Measured since on a 2-core Xeon VM: a 2 MB page's first touch took ~7 ms
(1 GiB in 1.5 s, against 0.4 s in 4 KB pages), so an engine's first step, which touches a block in each layer's K
and V slab, stalled ~0.4 s. `agentrt bench paging` measures decode in both page sizes with `empty`. Where the
kernel says no (THP "never", no MADV_HUGEPAGE, another OS), `zeros` is torch.zeros."""

from __future__ import annotations

import math
import mmap

import torch

HUGE_PAGE = 2 << 20


def supported() -> bool:
    """Can memory be asked for in 2 MB pages (Linux transparent huge pages on "always" or "madvise")?"""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = f.read()
    except OSError:
        return False
    return hasattr(mmap, "MADV_HUGEPAGE") and "[never]" not in mode


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized CPU tensor in a private anonymous mapping advised to be backed by 2 MB pages, its start
    aligned to 2 MB; the pages come at first touch. Needs `supported()`."""
    nbytes = math.prod(shape) * dtype.itemsize
    mm = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mm.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(mm, dtype=torch.uint8)  # keeps `mm` alive as long as a view of it lives
    off = -raw.data_ptr() % HUGE_PAGE
    return raw[off : off + nbytes].view(dtype).view(shape)


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """torch.zeros, in 2 MB pages on a CPU that supports them. Like a large torch.zeros (calloc), nothing is
    written: an anonymous mapping reads as zeros, and its pages are taken at first touch, so an engine's RSS
    grows with the blocks it uses, not with the pool."""
    if torch.device(device).type != "cpu" or not supported() or math.prod(shape) * dtype.itemsize < HUGE_PAGE:
        return torch.zeros(shape, dtype=dtype, device=device)
    return empty(shape, dtype)


def untouched_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero CPU tensor in a private anonymous mapping of ordinary (4 KB) pages, nothing written: the pages are
    taken at first touch, so the memory a KV pool holds grows with the blocks in use, and allocating it costs no
    pass over it. torch.zeros writes every page: measured here (2-core Xeon VM), 1 GiB took 0.45 s at start-up,
    and the test suite starts many engines with the default 1 GiB pool (38 in its first 136 tests). Not in 2 MB
    pages (the module's docstring): on this VM a 2 MB page's first touch took ~7 ms, so an engine's first step (a
    block in each of 60 layer slabs) would stall ~0.4 s."""
    nbytes = max(1, math.prod(shape) * dtype.itemsize)
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(mm, dtype=torch.uint8)[: math.prod(shape) * dtype.itemsize].view(dtype).view(shape)


def anon_huge_bytes() -> int:
    """This process's anonymous memory in huge pages now (0 where the kernel does not say)."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
