"""engine.huge_pages: tensors in 2 MB pages where the OS gives them (bench paging), zeros either way."""

import pytest
import torch

from agentrt.engine import huge_pages


def test_zeros_reads_zero_and_takes_writes():
    x = huge_pages.zeros((3, 2, 512, 16, 4, 64), torch.bfloat16)
    assert x.shape == (3, 2, 512, 16, 4, 64) and x.dtype == torch.bfloat16 and x.is_contiguous()
    assert not x.any()
    x[1, 0, 7] = 2.5
    x[2, 1, 511, 15, 3, 63] = -1
    assert x.float().sum().item() == 2.5 * 16 * 4 * 64 - 1
    assert x[1, 0, 7].eq(2.5).all() and not x[0].any()


def test_small_tensors_are_plain_zeros():
    small = huge_pages.zeros((4, 4), torch.float32)
    assert not small.any() and not _advised(small.data_ptr())


def _advised(addr: int) -> bool:
    """Does the mapping holding `addr` carry MADV_HUGEPAGE ("hg" in its VmFlags, /proc/self/smaps)?"""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "VmFlags:":
                return "hg" in line.split()[1:]
    return False


@pytest.mark.skipif(not huge_pages.supported(), reason="no transparent huge pages here")
def test_large_tensor_is_2mb_aligned_and_advised():
    x = huge_pages.zeros((4 << 20,), torch.float32)  # 16 MiB
    assert x.data_ptr() % huge_pages.HUGE_PAGE == 0
    assert _advised(x.data_ptr())
    x.fill_(1.0)
    assert x.sum().item() == 4 << 20
