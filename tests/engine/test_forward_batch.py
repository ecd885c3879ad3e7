"""`build_batch`, the host-described view of a forward: positions continue each request's prefix, KV
slots come from its row of the request-to-token map, and the logit rows follow the one row-count rule
(an extend's last rows, every row when asked, a decode's one row, a verify's W rows per request)."""

from __future__ import annotations

import pytest
import torch

from mleagle.engine.executor.forward_batch import ForwardMode, build_batch

R2T = torch.arange(4 * 100, dtype=torch.int32).view(4, 100) + 1000  # slot of (request row r, position p)


def test_an_extend_continues_each_prefix_in_its_own_row() -> None:
    b = build_batch(ForwardMode.EXTEND, input_ids=[7, 8, 9, 5, 6], req_pool_indices=[2, 0], prefix_lens=[4, 0],
                    extend_lens=[3, 2], req_to_token=R2T, rids=("a", "b"))
    assert b.input_ids.tolist() == [7, 8, 9, 5, 6] and b.input_ids.dtype == torch.int64
    assert b.positions.tolist() == [4, 5, 6, 0, 1]
    assert b.out_cache_loc.tolist() == [1204, 1205, 1206, 1000, 1001]
    assert b.req_pool_indices.tolist() == [2, 0] and b.seq_lens.tolist() == [7, 2]
    assert b.logit_rows.tolist() == [2, 4]  # each request's last row
    assert b.max_seq_len == 7 and b.extend_lens == [3, 2] and b.prefix_lens == [4, 0] and b.rids == ("a", "b")
    every = build_batch(ForwardMode.EXTEND, input_ids=torch.tensor([7, 8, 9, 5, 6], dtype=torch.int32),
                        req_pool_indices=[2, 0], prefix_lens=[4, 0], extend_lens=[3, 2], req_to_token=R2T,
                        all_logit_rows=True)
    assert every.logit_rows.tolist() == [0, 1, 2, 3, 4] and every.input_ids.dtype == torch.int64


def test_uniform_modes_take_width_rows_per_request() -> None:
    d = build_batch(ForwardMode.DECODE, input_ids=[3, 4, 5], req_pool_indices=[1, 3, 0], prefix_lens=[10, 0, 5],
                    extend_lens=[1, 1, 1], req_to_token=R2T)
    assert d.positions.tolist() == [10, 0, 5] and d.out_cache_loc.tolist() == [1110, 1300, 1005]
    assert d.logit_rows.tolist() == [0, 1, 2]
    v = build_batch(ForwardMode.TARGET_VERIFY, input_ids=[1, 2, 3, 4], req_pool_indices=[1, 2], prefix_lens=[6, 9],
                    extend_lens=[2, 2], req_to_token=R2T, width=2)
    assert v.positions.tolist() == [6, 7, 9, 10] and v.logit_rows.tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="exactly 2 rows"):
        build_batch(ForwardMode.TARGET_VERIFY, input_ids=[1, 2, 3], req_pool_indices=[1, 2], prefix_lens=[6, 9],
                    extend_lens=[2, 1], req_to_token=R2T, width=2)
