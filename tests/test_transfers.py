"""transfers.HostCopies: several device tensors read back in one transfer, counted per step."""

from __future__ import annotations

import numpy as np
import torch

from parse_vllm.transfers import HostCopies, fetch


def test_fetch_returns_each_tensor_with_its_shape_and_values():
    ids = torch.tensor([[151_935, -1, 3], [0, 7, 2**31 - 1]], dtype=torch.int32)
    lens = torch.tensor([np.iinfo(np.int64).max, 4])
    a, b = fetch(ids, lens)
    assert a.dtype == np.int64 and a.shape == (2, 3) and a.tolist() == ids.tolist()
    assert b.tolist() == lens.tolist()  # int64 extremes survive: all-integer fetches stay int64
    logp = torch.tensor([-0.125, -3.0e-8, -40.5], dtype=torch.float32)
    x, y = fetch(logp, torch.tensor([5, 151_935]))
    assert x.dtype == np.float64 and np.array_equal(x.astype(np.float32), logp.numpy())
    assert y.dtype == np.int64 and y.tolist() == [5, 151_935]


def test_host_copies_count_transfers_and_drafter_calls_per_step():
    h = HostCopies("cpu")
    h.new_step()
    h.fetch(torch.zeros(3), torch.ones(2, dtype=torch.long))
    h.fetch(torch.zeros(1))
    h.count_drafter_call()
    h.count_drafter_call()
    h.fetch(torch.zeros(1), drafter=True)  # the drafter's stop check: counted apart
    h.new_step()
    h.fetch(torch.zeros(1))
    a = h.audit
    assert (a.steps, a.host_copies_max, a.drafter_calls_max, a.drafter_reads_max) == (2, 2, 2, 1)
