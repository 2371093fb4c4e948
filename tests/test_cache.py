"""Sequence stores: round trips, crash-safety records, boundary checks, the loader."""
import json
import os
import shutil

import numpy as np
import pytest
import tensorstore as ts

from kdjax import cache
from kdjax.cache import layout, store as store_lib

V, T, K = 300, 8, 5  # conftest's make_rows and new_store: vocabulary, positions, top-k
OLD_CACHES = os.path.join(os.path.dirname(__file__), "fixtures", "old_caches")


@pytest.mark.parametrize("k", [0, K])
def test_float32_round_trip_is_exact(tmp_path, k, make_rows, new_store, take):
  rows = make_rows(np.random.default_rng(0), 10, k=k)
  store = new_store(tmp_path / "s", k=k)
  assert store.missing() == [(0, 4), (4, 8), (8, 10)]
  store.write(0, take(rows, slice(0, 10)))
  assert store.missing() == []
  back = cache.open(tmp_path / "s", vocab_size=V, k=k, seq_len=T, tokenizer_hash="tok1")
  assert (back.num_seqs, back.seq_len, back.k, back.attrs["teacher_hash"]) == (10, T, k, "t1")
  got = back.read([7, 2, 2, 9])
  for name, arr in rows.items():
    np.testing.assert_array_equal(got[name], arr[[7, 2, 2, 9]])
  assert got["tokens"].dtype == np.int32


def test_compact_round_trip_within_half_a_step(tmp_path, make_rows, new_store):
  rows = make_rows(np.random.default_rng(1), 10)
  store = new_store(tmp_path / "s", layout_name="compact")
  store.write(0, rows)
  got = cache.open(tmp_path / "s").read(slice(0, 10))
  np.testing.assert_array_equal(got["topk_ids"], rows["topk_ids"])
  assert got["topk_ids"].dtype == np.int32 and got["topk_logprobs"].dtype == np.float32
  err = np.abs(got["topk_logprobs"] - rows["topk_logprobs"]).max()
  assert err <= layout.LOGPROB_SCALE / 2 + 1e-5


def test_packed_round_trip_keeps_ids_exact_and_each_probability_within_its_bound(tmp_path, rng):
  """Packed: ids exact up to gpt-oss's vocabulary and beyond 2**17; |p' - p| <= (p + p0) s / 2
  (and the encoder's float32 rounding: layout.encode_topk), the p = 0 level read as p0 s / 4;
  entries still by descending probability."""
  vocab, n, k = 201088, 6, 64
  ids = np.stack([rng.permutation(vocab)[:k] for _ in range(n * T)]).reshape(n, T, k)
  ids[0, 0, [0, 1, -1]] = [vocab - 1, 2**17, 2**16]
  logprobs = -np.sort(rng.exponential(2.0, (n, T, k)), -1)
  logprobs[0, 0, [0, 1, -1]] = [0.0, -1e-9, -200.0]
  rows = {"tokens": ids[..., 0], "segment_ids": np.ones((n, T), np.int32),
          "positions": np.tile(np.arange(T, dtype=np.int32), (n, 1)),
          "loss_mask": np.ones((n, T), bool), "topk_ids": ids.astype(np.int32),
          "topk_logprobs": logprobs.astype(np.float32)}
  cache.create(tmp_path / "s", num_seqs=n, seq_len=T, k=k, vocab_size=vocab, attrs={},
               layout="packed", region_rows=4).write(0, rows)
  store = cache.open(tmp_path / "s")
  assert store.dtypes["topk_ids"] == "uint32" and store.attrs["prob_offset"] == layout.PACKED_OFFSET
  got = store.read(slice(0, n))
  np.testing.assert_array_equal(got["topk_ids"], rows["topk_ids"])
  assert got["topk_logprobs"].dtype == np.float32
  assert np.all(np.diff(got["topk_logprobs"], axis=-1) <= 0)
  p, back = np.exp(rows["topk_logprobs"].astype(np.float64)), np.exp(got["topk_logprobs"])
  s, p0 = layout.PACKED_SCALE, layout.PACKED_OFFSET
  assert np.all(np.abs(back - p) <= (p + p0) * np.expm1(0.502 * s) + 1e-7 * p)
  assert back[0, 0, 0] == pytest.approx(1.0, abs=1e-6)
  assert back[0, 0, -1] == pytest.approx(p0 * s / 4, rel=1e-6)
  # A vocabulary of 2**16 ids or fewer keeps uint16 ids.
  assert layout.array_dtypes(k, 2**16, "packed")["topk_ids"] == "uint16"


def _dictionary_reference(ids_SxTxK, vocab, size):
  """The dictionary layout's codes and orders, one id at a time (layout.py's docstring)."""
  codes, orders = np.empty_like(ids_SxTxK), []
  for row, ids in enumerate(ids_SxTxK):
    values, counts = np.unique(ids, return_counts=True)
    seen = [int(v) for _, v in sorted(zip(-counts, values))]  # by count, ties: smaller id first
    order = (seen + [v for v in range(vocab) if v not in set(seen)])[:size]
    table = order + sorted(set(range(vocab)) - set(order))
    place = {v: i for i, v in enumerate(table)}
    codes[row] = np.vectorize(place.get)(ids)
    orders.append(order)
  return codes, np.array(orders)


@pytest.mark.parametrize("vocab, size", [(50, 8), (50, 50), (300, 40), (70000, 3)])
def test_dictionary_codes_match_the_reference_and_decode_exactly(rng, vocab, size):
  """Rows of fewer, as many and more distinct ids than the order holds (codes past it escape),
  ties of counts, vocabularies above 2**16."""
  ids = rng.zipf(1.3, (3, 7, 5)) % vocab
  ids[1] = rng.integers(0, vocab, (7, 5))
  dtype = np.uint16 if vocab <= 2**16 else np.uint32
  codes, orders = layout.dictionary_encode(ids.astype(dtype), vocab, size)
  want_codes, want_orders = _dictionary_reference(ids, vocab, size)
  np.testing.assert_array_equal(codes, want_codes)
  np.testing.assert_array_equal(orders, want_orders)
  assert codes.dtype == orders.dtype == dtype
  np.testing.assert_array_equal(layout.dictionary_decode(codes, orders, vocab), ids)


def test_dictionary_store_round_trip_is_exact_at_any_k(tmp_path, rng, monkeypatch):
  """A dictionary store: ids exact (escapes past a short order, ids up to gpt-oss's vocabulary
  and past 2**17), log-probs exactly packed's, a smaller k reads the first entries, and a damaged
  order is refused at read."""
  monkeypatch.setattr(layout, "MIN_ORDER", 16)
  vocab, n, k = 201088, 6, 12
  ids = rng.zipf(1.2, (n, T, k)) % vocab
  ids[0, 0, [0, 1, -1]] = [vocab - 1, 2**17, 2**16]
  logprobs = -np.sort(rng.exponential(2.0, (n, T, k)), -1).astype(np.float32)
  rows = {"tokens": ids[..., 0].astype(np.int32), "segment_ids": np.ones((n, T), np.int32),
          "positions": np.tile(np.arange(T, dtype=np.int32), (n, 1)),
          "loss_mask": np.ones((n, T), bool), "topk_ids": ids.astype(np.int32),
          "topk_logprobs": logprobs}
  for name in ("packed", "dictionary"):
    cache.create(tmp_path / name, num_seqs=n, seq_len=T, k=k, vocab_size=vocab, attrs={},
                 layout=name, region_rows=4).write(0, rows)
  store = cache.open(tmp_path / "dictionary")
  assert store.attrs["order_size"] == 16 and store.dtypes["topk_order"] == "uint32"
  got, packed = store.read([5, 0, 0]), cache.open(tmp_path / "packed").read([5, 0, 0])
  np.testing.assert_array_equal(got["topk_ids"], ids[[5, 0, 0]])
  np.testing.assert_array_equal(got["topk_logprobs"], packed["topk_logprobs"])
  first = cache.open(tmp_path / "dictionary", k=3).read(slice(0, n))
  np.testing.assert_array_equal(first["topk_ids"], ids[..., :3])
  path = str(tmp_path / "dictionary" / "topk_order")
  order = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": path}}).result()
  twice = order[2].read().result()
  twice[1] = twice[0]
  order[2].write(twice).result()
  with pytest.raises(cache.CacheError, match="repeats an id.*row 2"):
    store.read(slice(0, n))


@pytest.mark.parametrize("layout_name", ["float32", "dictionary"])
def test_an_id_past_the_vocabulary_on_disk_is_refused_at_read(tmp_path, layout_name, make_rows,
                                                             new_store):
  """A stored id (a float32 store's, here in the entry its unsorted row ranks first, read at
  k = 2) or dictionary code past the vocabulary fails the read, naming its row."""
  rows = make_rows(np.random.default_rng(3), 10)
  if layout_name == "float32":
    rows["topk_logprobs"] = rows["topk_logprobs"][..., ::-1].copy()  # ascending: last is top
  new_store(tmp_path / "s", layout_name=layout_name).write(0, rows)
  path = str(tmp_path / "s" / "topk_ids")
  ids = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": path}}).result()
  row = ids[6].read().result()
  row[3, -1] = V + 5
  ids[6].write(row).result()
  with pytest.raises(cache.CacheError, match="ids must lie in.*row 6"):
    cache.open(tmp_path / "s", k=2 if layout_name == "float32" else None).read(slice(0, 10))


def test_stores_of_the_earlier_layouts_still_open_and_read_the_same(make_rows, take):
  """float32 and compact stores written by the code before the packed layout (main at 9c93f6d),
  a packed one by the code before the dictionary layout (main at 5d326b3), a dictionary one by
  the code before its zstd levels changed (main at 7820aab; tests/fixtures/old_caches/make.py)
  open and read the rows they were written with."""
  rows = make_rows(np.random.default_rng(0), 10)
  for name in ("float32", "compact", "packed", "dictionary"):
    store = cache.open(os.path.join(OLD_CACHES, f"{name}.zarr"), vocab_size=V, k=K, seq_len=T)
    assert store.layout == name
    assert ("prob_offset" in store.attrs) == (name in ("packed", "dictionary"))
    got = store.read(slice(0, 10))
    for key, want in rows.items():
      if name == "compact" and key == "topk_logprobs":
        assert np.abs(got[key] - want).max() <= layout.LOGPROB_SCALE / 2 + 1e-5
      elif name in ("packed", "dictionary") and key == "topk_logprobs":
        p, back = np.exp(want.astype(np.float64)), np.exp(got[key])
        s, p0 = layout.PACKED_SCALE, layout.PACKED_OFFSET
        assert np.all(np.abs(back - p) <= (p + p0) * np.expm1(0.502 * s) + 1e-7 * p)
      else:
        np.testing.assert_array_equal(got[key], want)


def test_a_store_resumed_keeps_the_codecs_it_was_created_with(tmp_path, make_rows, new_store,
                                                              take):
  """Writing into a store made by earlier code uses the metadata on disk, not today's defaults:
  the old dictionary store's log-probs keep blosc clevel 5 (new ones take 2), and the region
  rewritten reads back as it was written."""
  path = tmp_path / "old.zarr"
  shutil.copytree(os.path.join(OLD_CACHES, "dictionary.zarr"), path)
  clevel = lambda store_path: json.loads((store_path / "topk_logprobs" / "zarr.json").read_text())[
      "codecs"][0]["configuration"]["codecs"][1]["configuration"]["clevel"]
  want = cache.open(path).read(slice(0, 10))
  new_store(path, layout_name="dictionary").write(4, take(make_rows(np.random.default_rng(0), 10),
                                                          slice(4, 8)))
  assert clevel(path) == 5
  new_store(tmp_path / "new", layout_name="dictionary")
  assert clevel(tmp_path / "new") == 2
  got = cache.open(path).read(slice(0, 10))
  for key in want:
    np.testing.assert_array_equal(got[key], want[key])


def test_unaligned_writes_complete_regions(tmp_path, make_rows, new_store, take):
  rows = make_rows(np.random.default_rng(2), 10)
  store = new_store(tmp_path / "s")
  store.write(0, take(rows, slice(0, 3)))
  assert store.missing() == [(3, 4), (4, 8), (8, 10)]
  store.write(3, take(rows, slice(3, 9)))
  assert store.missing() == [(9, 10)]
  store.write(9, take(rows, slice(9, 10)))
  assert store.missing() == [] and store.complete_regions() == {0, 1, 2}
  np.testing.assert_array_equal(cache.open(tmp_path / "s").read(slice(0, 10))["topk_ids"],
                                rows["topk_ids"])


def test_missing_splits_regions_by_rank(tmp_path, new_store):
  store = new_store(tmp_path / "s", num_seqs=23, region_rows=2)
  parts = [store.missing(rank, 3) for rank in range(3)]
  flat = sorted(r for part in parts for r in part)
  assert flat == store.missing() and len(flat) == 12
  assert not set(parts[0]) & set(parts[1])


def test_incomplete_store_is_refused(tmp_path, make_rows, new_store, take):
  rows = make_rows(np.random.default_rng(3), 10)
  store = new_store(tmp_path / "s")
  store.write(4, take(rows, slice(4, 8)))
  with pytest.raises(cache.CacheError, match="2 of 3 regions"):
    cache.open(tmp_path / "s")
  partial = cache.open(tmp_path / "s", allow_partial=True)
  assert partial.missing() == [(0, 4), (8, 10)]


def test_resume_with_another_spec_is_refused(tmp_path, new_store):
  new_store(tmp_path / "s")
  new_store(tmp_path / "s")  # same spec: resumes
  with pytest.raises(cache.CacheError, match="different spec"):
    new_store(tmp_path / "s", k=K + 1)
  with pytest.raises(cache.CacheError, match="teacher_hash"):
    new_store(tmp_path / "s", attrs={"teacher_hash": "t2", "tokenizer_hash": "tok1"})


@pytest.mark.parametrize("expect, match", [
    ({"vocab_size": V + 1}, "vocab_size"), ({"k": K + 1}, "cache.k to at most"),
    ({"k": 0}, "cache.k to at most"), ({"seq_len": T * 2}, "seq_len"),
    ({"tokenizer_hash": "other"}, "tokenizer_hash")])
def test_open_checks_what_the_caller_expects(tmp_path, expect, match, make_rows, new_store):
  new_store(tmp_path / "s").write(0, make_rows(np.random.default_rng(4), 10))
  with pytest.raises(cache.CacheError, match=match):
    cache.open(tmp_path / "s", **expect)


@pytest.mark.parametrize("layout_name", ["float32", "compact", "packed", "dictionary"])
def test_a_larger_cache_reads_as_its_top_k(tmp_path, layout_name, make_rows, new_store):
  rows = make_rows(np.random.default_rng(14), 10)
  if layout_name == "float32":  # entries written in another order are still read as the top k
    rows["topk_ids"], rows["topk_logprobs"] = rows["topk_ids"][..., ::-1], rows["topk_logprobs"][
        ..., ::-1]
  new_store(tmp_path / "s", layout_name=layout_name).write(0, rows)
  full = cache.open(tmp_path / "s").read(slice(0, 10))
  order = np.argsort(-full["topk_logprobs"], axis=-1, kind="stable")[..., :2]
  store = cache.open(tmp_path / "s", k=2)
  assert (store.k, store.read_k) == (K, 2)
  got = next(iter(cache.Loader(store, batch_size=10, seed=0, shuffle=False)))
  for name in ("topk_ids", "topk_logprobs"):
    np.testing.assert_array_equal(got[name], np.take_along_axis(full[name], order, -1))


@pytest.mark.parametrize("name, value, match", [
    ("topk_logprobs", np.nan, "NaN"), ("topk_logprobs", np.inf, "NaN"),
    ("topk_logprobs", 0.5, "<= 0"), ("topk_ids", V, r"\[0, 300\)"), ("topk_ids", -1, r"\[0, 300\)"),
    ("tokens", V, r"\[0, 300\)")])
def test_bad_values_are_refused_at_write(tmp_path, name, value, match, make_rows, new_store):
  rows = make_rows(np.random.default_rng(5), 4)
  rows[name] = rows[name].astype(np.float32 if name == "topk_logprobs" else np.int64)
  rows[name][2, 3, ...] = value
  store = new_store(tmp_path / "s")
  with pytest.raises(cache.CacheError, match=match):
    store.write(0, rows)
  assert store.missing()[0] == (0, 4)


def test_nan_on_disk_is_refused_at_read(tmp_path, make_rows, new_store):
  new_store(tmp_path / "s").write(0, make_rows(np.random.default_rng(6), 10))
  kvstore = {"driver": "file", "path": str(tmp_path / "s" / "topk_logprobs")}
  arr = ts.open({"driver": "zarr3", "kvstore": kvstore}).result()
  arr[5, 1, 0].write(np.nan).result()
  store = cache.open(tmp_path / "s")
  store.read([0, 1])
  with pytest.raises(cache.CacheError, match="NaN"):
    store.read([4, 5])


def test_loader_order_is_a_seeded_permutation_per_epoch(tmp_path, make_rows, new_store):
  rows = make_rows(np.random.default_rng(7), 10)
  new_store(tmp_path / "s").write(0, rows)
  store = cache.open(tmp_path / "s")
  loader = cache.Loader(store, batch_size=3, seed=11)
  firsts = [next(loader)["tokens"][:, 0] for _ in range(9)]  # 3 batches per epoch, 3 epochs
  for epoch in range(3):
    seen = np.concatenate(firsts[3 * epoch:3 * epoch + 3])
    expected = rows["tokens"][loader.order(epoch)[:9], 0]
    np.testing.assert_array_equal(seen, expected)
  assert not np.array_equal(loader.order(0), loader.order(1))
  again = cache.Loader(store, batch_size=3, seed=11)
  np.testing.assert_array_equal(next(again)["tokens"][:, 0], firsts[0])
  other = cache.Loader(store, batch_size=3, seed=12)
  assert not np.array_equal(other.order(0), loader.order(0))
  loader.close(), again.close(), other.close()


def test_loader_restore_continues_exactly(tmp_path, make_rows, new_store):
  new_store(tmp_path / "s").write(0, make_rows(np.random.default_rng(8), 10))
  store = cache.open(tmp_path / "s")
  loader = cache.Loader(store, batch_size=4, seed=3)
  for _ in range(3):
    next(loader)
  state = loader.state()
  expected = [next(loader) for _ in range(4)]
  resumed = cache.Loader(store, batch_size=4, seed=3)
  resumed.restore(state)
  for want in expected:
    got = next(resumed)
    for name in want:
      np.testing.assert_array_equal(got[name], want[name])
  with pytest.raises(cache.CacheError, match="seed"):
    cache.Loader(store, batch_size=4, seed=4).restore(state)
  loader.close(), resumed.close()


def test_compact_clips_log_probs_below_its_range(tmp_path, make_rows, new_store):
  rows = make_rows(np.random.default_rng(9), 4)
  rows["topk_logprobs"][0, 0] = [-1.0, -2.0, -40.0, -100.0, -1000.0]
  new_store(tmp_path / "s", layout_name="compact").write(0, rows)
  got = cache.open(tmp_path / "s", allow_partial=True).read([0])["topk_logprobs"][0, 0]
  floor = -layout.MAX_GAP * layout.LOGPROB_SCALE
  np.testing.assert_allclose(got, [-1.0, -2.0, floor, floor, floor], atol=layout.LOGPROB_SCALE)


def test_overwriting_a_finished_region_unrecords_it_until_written(tmp_path, monkeypatch, make_rows,
                                                                   new_store):
  rows = make_rows(np.random.default_rng(10), 10)
  store = new_store(tmp_path / "s")
  store.write(0, rows)
  new = make_rows(np.random.default_rng(11), 2)

  def killed(*args):
    raise KeyboardInterrupt

  real = cache.Store._record_region
  monkeypatch.setattr(cache.Store, "_record_region", killed)
  with pytest.raises(KeyboardInterrupt):
    store.write(5, new)  # dies after the data, before the record
  assert store.missing() == [(5, 7)]
  monkeypatch.setattr(cache.Store, "_record_region", real)
  store.write(5, new)
  assert store.missing() == []
  got = cache.open(tmp_path / "s").read(slice(0, 10))["topk_ids"]
  np.testing.assert_array_equal(got[5:7], new["topk_ids"])
  np.testing.assert_array_equal(got[[4, 7]], rows["topk_ids"][[4, 7]])


@pytest.mark.parametrize("layout_name", ["packed", "dictionary"])
def test_the_notebook_decodes_a_cache(tmp_path, make_rows, new_store, monkeypatch, layout_name):
  """notebooks/explore_cache.ipynb reads a packed or dictionary cache with plain tensorstore /
  zarr-python and its own decoding: every top-1 is p = 0.5 here, and it reports that; its ids are
  the rows'."""
  nbformat = pytest.importorskip("nbformat")
  nbclient = pytest.importorskip("nbclient")
  rows = make_rows(np.random.default_rng(0), 10)
  rows["topk_logprobs"] = np.minimum(rows["topk_logprobs"], np.log(0.4))  # still sorted
  rows["topk_logprobs"][..., 0] = np.log(0.5)
  new_store(tmp_path / "s", layout_name=layout_name).write(0, rows)
  np.save(tmp_path / "want_ids.npy", rows["topk_ids"])
  path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "notebooks",
                      "explore_cache.ipynb")
  notebook = nbformat.read(path, as_version=4)
  notebook.cells.append(nbformat.v4.new_code_cell(
      'assert np.array_equal(ids, np.load("want_ids.npy")); print("ids as written")'))
  monkeypatch.setenv("KDJAX_CACHE", str(tmp_path / "s"))
  nbclient.NotebookClient(notebook, timeout=120, kernel_name="python3",
                          resources={"metadata": {"path": str(tmp_path)}}).execute()
  text = "".join(out.get("text", "") for cell in notebook.cells if cell.cell_type == "code"
                 for out in cell.outputs)
  assert "top-1 probability      mean 0.500" in text and "ids as written" in text, text


@pytest.mark.parametrize("layout_name", ["float32", "compact", "packed", "dictionary"])
def test_a_write_encoded_in_pieces_equals_one_row_at_a_time(tmp_path, layout_name, monkeypatch,
                                                            make_rows, new_store, take):
  """store.write checks and encodes its rows in pieces on several threads: the stored values
  are those of writes of one row each, and a bad value names its own row, nothing written."""
  monkeypatch.setattr(store_lib, "ENCODE_THREADS", 4)
  rows = make_rows(np.random.default_rng(8), 10)
  whole = new_store(tmp_path / "whole", layout_name=layout_name, region_rows=10)
  whole.write(0, rows)
  single = new_store(tmp_path / "single", layout_name=layout_name, region_rows=10)
  for row in range(10):
    single.write(row, take(rows, slice(row, row + 1)))
  got, want = whole.read(slice(0, 10)), single.read(slice(0, 10))
  for name in want:
    np.testing.assert_array_equal(got[name], want[name])
  rows["topk_logprobs"][7, 2, 1] = np.nan
  with pytest.raises(cache.CacheError, match="row 7, position 2, entry 1"):
    new_store(tmp_path / "bad", layout_name=layout_name, region_rows=10).write(0, rows)
  assert cache.open(tmp_path / "whole").missing() == []
