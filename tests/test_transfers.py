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
    h.count_drafter_calls()
    h.count_drafter_calls()
    h.fetch(torch.zeros(1), drafter=True)  # the drafter's stop check: counted apart
    h.new_step()
    h.fetch(torch.zeros(1))
    a = h.audit
    assert (a.steps, a.host_copies_max, a.drafter_calls_max, a.drafter_reads_max) == (2, 2, 2, 1)


def test_to_device_keeps_shapes_and_dtypes_and_is_counted():
    h = HostCopies("cpu")
    h.new_step()
    rows, mask, lens = h.to_device(np.array([[3, 1], [2, 0]], dtype=np.int32), np.array([True, False]), [7, 8, 9])
    assert rows.dtype == torch.int32 and rows.tolist() == [[3, 1], [2, 0]]
    assert mask.dtype == torch.bool and mask.tolist() == [True, False]
    assert lens.dtype == torch.int64 and lens.tolist() == [7, 8, 9]
    (x,) = h.to_device(np.array([0.25, -1.5], dtype=np.float32))
    assert x.dtype == torch.float32 and x.tolist() == [0.25, -1.5]
    assert h.audit.host_to_device_max == 2


PARSE_MODULE = """
import numpy as np
import torch

def staged(host):
    return host.to_device(np.arange(4))[0]

def pageable(dev):
    a = torch.from_numpy(np.arange(4)).to(dev)
    b = torch.as_tensor([1, 2], device=dev)
    c = torch.zeros(3).to(torch.float64)  # a dtype cast, no move
    return a, b, c
"""


def test_pageable_copies_of_parse_code_are_counted_and_staged_ones_are_not():
    """What the watch counts: explicit moves to the device made by PARSE's modules outside
    `to_device` (on a CPU host, where host and device are one, every such move)."""
    import types

    mod = types.ModuleType("parse_vllm._pageable_example")
    exec(compile(PARSE_MODULE, "<parse code>", "exec"), mod.__dict__)
    h = HostCopies("cpu", watch_pageable=True)
    h.new_step()
    with h.watching():
        mod.staged(h)
        torch.from_numpy(np.arange(3)).to("cpu")  # not PARSE's code (this test module)
    assert h.audit.pageable_copies_max == 0
    with h.watching():
        mod.pageable("cpu")
    assert h.audit.pageable_copies_max == 2
    h.new_step()
    assert h.pageable.count == 0 and h.audit.pageable_copies_max == 2  # a high-water mark
