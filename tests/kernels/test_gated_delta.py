"""The chunked gated delta rule (kernels.gated_delta) against the token-by-token recurrence in fp32: irregular
lengths, starts that are not chunk multiples (front padding), chunk sizes 4 / 16 / 64, several heads, a nonzero
initial state; the states kept at chunk ends equal the recurrence's at those steps; the decode step updates its
state in place."""

import pytest
import torch

from agentrt.kernels.gated_delta import chunk_gated_delta_rule, gated_delta_rule_ref, gated_delta_step, l2norm


def inputs(T, H=3, Dk=8, Dv=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(T, H, Dk, generator=g)) * Dk**-0.5
    k = l2norm(torch.randn(T, H, Dk, generator=g))
    v = torch.randn(T, H, Dv, generator=g)
    decay = -torch.rand(T, H, generator=g) * 2
    beta = torch.rand(T, H, generator=g)
    state = torch.randn(H, Dk, Dv, generator=g)
    return q, k, v, decay, beta, state


@pytest.mark.parametrize(("T", "start", "chunk"), [(1, 0, 4), (37, 0, 4), (37, 5, 4), (29, 13, 16), (70, 3, 64),
                                                   (16, 16, 16), (5, 62, 64)])
def test_chunked_equals_recurrence(T, start, chunk):
    q, k, v, g, beta, s0 = inputs(T)
    want, want_state = gated_delta_rule_ref(q, k, v, g, beta, s0)
    keep = tuple(o for o in range(1, T + 1) if (start + o) % chunk == 0)
    out, state, kept = chunk_gated_delta_rule(q, k, v, g, beta, s0, start, chunk, keep)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(state, want_state, atol=2e-5, rtol=1e-4)
    assert len(kept) == len(keep)
    for o, s in zip(keep, kept):
        torch.testing.assert_close(s, gated_delta_rule_ref(q[:o], k[:o], v[:o], g[:o], beta[:o], s0)[1], atol=2e-5,
                                   rtol=1e-4)


def test_keep_must_be_a_chunk_end():
    q, k, v, g, beta, s0 = inputs(10)
    with pytest.raises(ValueError, match="cannot keep the state after 3 of 10 steps from position 2"):
        chunk_gated_delta_rule(q, k, v, g, beta, s0, start=2, chunk=4, keep=(3,))


def test_step_updates_the_state_in_place():
    q, k, v, g, beta, s0 = inputs(2)
    state = torch.stack([s0, 2 * s0])  # two sequences, one token each
    want = [gated_delta_rule_ref(q[i : i + 1], k[i : i + 1], v[i : i + 1], g[i : i + 1], beta[i : i + 1], s)
            for i, s in enumerate(state)]
    out = gated_delta_step(q, k, v, g, beta, state)
    for i, (o, s) in enumerate(want):
        torch.testing.assert_close(out[i], o[0])
        torch.testing.assert_close(state[i], s)
