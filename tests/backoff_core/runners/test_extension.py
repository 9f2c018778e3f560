"""Extension and LastRows (runners/extension.py): a row of a batch reads as the batch's row,
and the step loop gets the batch itself back when the rows are in order."""

from __future__ import annotations

import torch

from backoff_core.runners.extension import Extension, LastRows, last_rows


def test_a_batch_row_reads_as_its_row_and_in_order_rows_give_the_batch_back():
    batch = LastRows(torch.randn(4, 10), torch.randn(4, 3))
    rows = [Extension.row(batch, i) for i in range(4)]
    for i, ext in enumerate(rows):
        assert torch.equal(ext.logits, batch.logits[i : i + 1]) and torch.equal(ext.hidden, batch.hidden[i : i + 1])
        assert torch.equal(ext.last, batch.logits[i]) and ext.last.shape == (10,)
    logits, hidden = last_rows(rows)
    assert logits is batch.logits and hidden is batch.hidden  # no copy, no op per row
    picked, picked_hidden = last_rows([rows[2], rows[0]])  # not in order: stacked
    assert torch.equal(picked, batch.logits[[2, 0]]) and torch.equal(picked_hidden, batch.hidden[[2, 0]])


def test_last_is_the_logits_after_the_last_new_token():
    full = Extension(torch.randn(5, 10), None)  # k = 5 new tokens
    assert torch.equal(full.last, full.logits[-1])
    row = Extension.row(LastRows(torch.randn(2, 10), None), 1)
    assert row.logits.shape == (1, 10)  # sliced once read: last then reads the same row
    assert torch.equal(row.last, row.batch.logits[1]) and row.hidden is None
    mixed = last_rows([full, row])  # any other list: stacked, hidden only when every one has it
    assert torch.equal(mixed[0], torch.stack([full.logits[-1], row.batch.logits[1]])) and mixed[1] is None
