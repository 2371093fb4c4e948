"""Packing invariants: segments, positions, loss mask, padding, splitting, nothing lost."""
import numpy as np
import pytest

from kdjax.data import packing

BOS, EOS, PAD = 1, 2, 0


def _pieces(rows):
  """(ids, row index) of every segment, in order."""
  out = []
  for r, row in enumerate(rows):
    for s in range(1, row["segment_ids"].max() + 1):
      out.append((row["tokens"][row["segment_ids"] == s], r))
  return out


def check_row(row, seq_len):
  for name, dtype in (("tokens", np.int32), ("segment_ids", np.int32), ("positions", np.int32),
                      ("loss_mask", np.bool_)):
    assert row[name].shape == (seq_len,) and row[name].dtype == dtype, name
  seg, pos, mask = row["segment_ids"], row["positions"], row["loss_mask"]
  used = int((seg != 0).sum())
  assert (seg[:used] != 0).all() and (seg[used:] == 0).all(), "padding only at the end"
  assert (row["tokens"][used:] == PAD).all() and (pos[used:] == 0).all()
  assert seg[0] == 1 and (np.diff(seg[:used]) >= 0).all() and (np.diff(seg[:used]) <= 1).all()
  for s in range(1, seg.max() + 1):
    np.testing.assert_array_equal(pos[seg == s], np.arange((seg == s).sum()))
  assert not mask[-1]
  # loss_mask[t] requires t+1 in the same (non-padding) segment.
  same = (seg[:-1] == seg[1:]) & (seg[:-1] != 0)
  assert not (mask[:-1] & ~same).any()


def test_exact_small_example():
  rows = list(packing.pack([[5, 6], [7, 8, 9]], 8, bos_id=BOS, eos_id=EOS))
  assert len(rows) == 2  # [b 5 6 e] + [b 7 8 9 e] = 4 + 5 tokens do not fit in one row of 8
  np.testing.assert_array_equal(rows[0]["tokens"], [1, 5, 6, 2, 0, 0, 0, 0])
  np.testing.assert_array_equal(rows[0]["segment_ids"], [1, 1, 1, 1, 0, 0, 0, 0])
  np.testing.assert_array_equal(rows[0]["positions"], [0, 1, 2, 3, 0, 0, 0, 0])
  np.testing.assert_array_equal(rows[0]["loss_mask"], [1, 1, 1, 0, 0, 0, 0, 0])
  np.testing.assert_array_equal(rows[1]["tokens"], [1, 7, 8, 9, 2, 0, 0, 0])


def test_documents_share_a_row_and_mask_stops_at_boundaries():
  (row,) = packing.pack([[5, 6], [7, 8]], 8, bos_id=BOS, eos_id=EOS)
  np.testing.assert_array_equal(row["tokens"], [1, 5, 6, 2, 1, 7, 8, 2])
  np.testing.assert_array_equal(row["segment_ids"], [1, 1, 1, 1, 2, 2, 2, 2])
  np.testing.assert_array_equal(row["positions"], [0, 1, 2, 3, 0, 1, 2, 3])
  # position 3 (eos of doc 1) must not predict doc 2's bos; the last position predicts nothing.
  np.testing.assert_array_equal(row["loss_mask"], [1, 1, 1, 0, 1, 1, 1, 0])


def test_long_document_is_split_with_positions_restarting():
  doc = list(range(10, 30))  # 20 tokens + bos + eos = 22
  rows = list(packing.pack([[5], doc], 8, bos_id=BOS, eos_id=EOS))
  for row in rows:
    check_row(row, 8)
  pieces = _pieces(rows)
  assert [len(p) for p, _ in pieces] == [3, 5, 8, 8, 1]  # first piece fills row 0's free space
  np.testing.assert_array_equal(np.concatenate([p for p, _ in pieces[1:]]), [BOS, *doc, EOS])
  np.testing.assert_array_equal(rows[0]["positions"], [0, 1, 2, 0, 1, 2, 3, 4])
  # A piece's last token cannot see the next piece, so it predicts nothing.
  assert not rows[0]["loss_mask"][7] and not rows[1]["loss_mask"][7]


def test_targets_select_the_loss_positions():
  ids = [5, 6, 7, 8]
  targets = [False, False, True, True]
  (row,) = packing.pack([(ids, targets)], 8, bos_id=None, eos_id=EOS)
  np.testing.assert_array_equal(row["tokens"], [5, 6, 7, 8, 2, 0, 0, 0])
  # t counts iff token t+1 is a target; eos is a target because the last token is.
  np.testing.assert_array_equal(row["loss_mask"], [0, 1, 1, 1, 0, 0, 0, 0])


def test_existing_specials_not_doubled_and_none_skipped():
  (row,) = packing.pack([[BOS, 5, EOS]], 6, bos_id=BOS, eos_id=EOS)
  np.testing.assert_array_equal(row["tokens"], [1, 5, 2, 0, 0, 0])
  (row,) = packing.pack([[5, 6]], 6, bos_id=None, eos_id=None)
  np.testing.assert_array_equal(row["tokens"], [5, 6, 0, 0, 0, 0])
  packer = packing.Packer(6, bos_id=BOS, eos_id=EOS)
  assert packer.push([5, 6], add_specials=False) == []
  np.testing.assert_array_equal(packer.close()[0]["tokens"], [5, 6, 0, 0, 0, 0])


def test_empty_documents_are_skipped():
  rows = list(packing.pack([[], [5], []], 4, bos_id=None, eos_id=None))
  assert len(rows) == 1 and rows[0]["segment_ids"].max() == 1


@pytest.mark.parametrize("seq_len", [3, 16, 64])
def test_random_documents_invariants_and_nothing_lost(seq_len):
  rng = np.random.default_rng(seq_len)
  docs = [rng.integers(3, 100, size=rng.integers(1, 3 * seq_len)).tolist() for _ in range(200)]
  targets = [rng.random(len(d)) < 0.7 for d in docs]
  rows = list(packing.pack(zip(docs, targets), seq_len, bos_id=BOS, eos_id=EOS))
  for row in rows:
    check_row(row, seq_len)
  full = [np.array([BOS, *d, EOS]) for d in docs]
  full_targets = [np.array([False, *t, t[-1]]) for t in targets]
  pieces = _pieces(rows)
  # Nothing lost or reordered: the pieces concatenated are the documents concatenated, and every
  # document boundary is a piece boundary.
  np.testing.assert_array_equal(np.concatenate([p for p, _ in pieces]), np.concatenate(full))
  piece_ends = set(np.cumsum([len(p) for p, _ in pieces]).tolist())
  assert set(np.cumsum([len(d) for d in full]).tolist()) <= piece_ends
  # Documents that fit in a row are never split.
  lengths = iter(len(p) for p, _ in pieces)
  for d in full:
    n_pieces, covered = 0, 0
    while covered < len(d):
      covered += next(lengths)
      n_pieces += 1
    assert len(d) > seq_len or n_pieces == 1
  # Loss positions: exactly the within-piece positions whose next token is a target.
  expected = []
  stream_targets = np.concatenate(full_targets)
  offset = 0
  for p, _ in pieces:
    expected.append(stream_targets[offset + 1:offset + len(p)])
    offset += len(p)
  got = [row["loss_mask"][row["segment_ids"] == s][:-1]
         for row in rows for s in range(1, row["segment_ids"].max() + 1)]
  np.testing.assert_array_equal(np.concatenate(got), np.concatenate(expected))
  # Greedy: only a document that did not fit leaves padding behind it.
  for r, row in enumerate(rows[:-1]):
    used = int((row["segment_ids"] != 0).sum())
    if used < seq_len:
      next_first = next(p for p, rr in pieces if rr == r + 1)
      assert len(next_first) > seq_len - used


def test_pack_is_lazy():
  def docs():
    yield [5, 6, 7]
    raise RuntimeError("read too far")
  rows = packing.pack(docs(), 2, bos_id=None, eos_id=None)
  np.testing.assert_array_equal(next(rows)["tokens"], [5, 6])
