"""Damage to a finished store is found, named by region, and repaired by rewriting that region."""
import os

import numpy as np
import pytest

from kdjax import cache
from kdjax.cache import __main__ as cli, integrity


def flip_byte(path, offset):
  with open(path, "r+b") as f:
    f.seek(offset)
    byte = f.read(1)[0]
    f.seek(offset)
    f.write(bytes([byte ^ 0x10]))


@pytest.mark.parametrize("name", ["topk_logprobs", "topk_ids", "tokens", "loss_mask"])
def test_flipped_byte_is_found_and_repaired(store_and_rows, capsys, name, take):
  store, rows = store_and_rows
  shard = store.shard_path(name, 1)
  flip_byte(shard, 7)
  problems = integrity.verify(store)
  assert [p.region for p in problems] == [1] and "checksum" in problems[0].what
  assert cli.main(["verify", store.path]) == 1
  assert "region 1 (rows 4..8)" in capsys.readouterr().out
  with pytest.raises(cache.CacheError, match="corrupt"):
    store.read(np.arange(4, 8))  # the chunk's crc32c fails too
  assert cli.main(["verify", "--fix", store.path]) == 1
  assert store.missing() == [(4, 8)]
  with pytest.raises(cache.CacheError, match="1 of 3 regions"):
    cache.open(store.path)
  store.write(4, take(rows, slice(4, 8)))
  assert cli.main(["verify", store.path]) == 0
  np.testing.assert_array_equal(cache.open(store.path).read(np.arange(10))["topk_ids"],
                                rows["topk_ids"])


def test_truncated_or_deleted_shard_is_refused_at_open(store_and_rows):
  store, _ = store_and_rows
  shard = store.shard_path("topk_ids", 2)
  with open(shard, "r+b") as f:
    f.truncate(os.path.getsize(shard) // 2)
  with pytest.raises(cache.CacheError, match=r"damaged.*region 2 \(rows 8..10\).*bytes"):
    cache.open(store.path)
  os.unlink(store.shard_path("tokens", 0))
  with pytest.raises(cache.CacheError, match=r"region 0 .*missing"):
    cache.open(store.path)


def test_edited_manifest_record_is_found(store_and_rows):
  store, _ = store_and_rows
  path = store.region_record_path(0)
  with open(path) as f:
    text = f.read()
  with open(path, "w") as f:
    f.write(text.replace('"stop": 4', '"stop": 5'))
  assert "checksum" in integrity.verify(store, decode=False)[0].what


def test_info_prints_shape_completeness_and_bytes(tmp_path, capsys, make_rows, new_store):
  store = new_store(tmp_path / "s")
  store.write(0, make_rows(np.random.default_rng(1), 4))
  assert cli.main(["info", store.path]) == 0
  out = capsys.readouterr().out
  assert "1 of 3 regions" in out and "B/position" in out and "teacher_hash" in out
  assert cli.main(["info", str(tmp_path / "nothing")]) == 2


def test_loader_raises_on_a_damaged_chunk_and_retries_the_same_batch(store_and_rows):
  store, _ = store_and_rows
  flip_byte(store.shard_path("topk_logprobs", 0), 7)
  loader = cache.Loader(store, batch_size=10, seed=0)
  with pytest.raises(cache.CacheError, match="corrupt"):
    next(loader)
  assert (loader.state()["epoch"], loader.state()["step"]) == (0, 0)
  with pytest.raises(cache.CacheError, match="corrupt"):
    next(loader)  # the same batch again, not the next one
  loader.close()


def test_recode_writes_the_rows_again_in_another_layout_and_resumes(tmp_path, capsys, monkeypatch,
                                                                    make_rows, new_store):
  """`recode` of a float32 store to the dictionary layout equals a direct dictionary write of the
  same rows, keeps what the store holds (teacher, tokenizer) and resumes after an interruption;
  an unfinished source is refused with nothing written."""
  rows = make_rows(np.random.default_rng(2), 10)
  new_store(tmp_path / "f32").write(0, rows)
  new_store(tmp_path / "direct", layout_name="dictionary").write(0, rows)
  real_write = cache.Store.write

  def stop_after_the_first_region(self, start, batch):
    if start > 0:
      raise KeyboardInterrupt("stopped")
    real_write(self, start, batch)

  monkeypatch.setattr(cache.Store, "write", stop_after_the_first_region)
  with pytest.raises(KeyboardInterrupt):
    cli.main(["recode", str(tmp_path / "f32"), str(tmp_path / "new")])
  monkeypatch.setattr(cache.Store, "write", real_write)
  assert cache.open(tmp_path / "new", allow_partial=True).missing() == [(4, 8), (8, 10)]
  assert cli.main(["recode", str(tmp_path / "f32"), str(tmp_path / "new")]) == 0
  assert "layout dictionary" in capsys.readouterr().out
  new = cache.open(tmp_path / "new", vocab_size=300, tokenizer_hash="tok1")
  assert new.attrs["teacher_hash"] == "t1" and new.attrs["recoded_from"] == "float32"
  got, want = new.read(slice(0, 10)), cache.open(tmp_path / "direct").read(slice(0, 10))
  for name in want:
    np.testing.assert_array_equal(got[name], want[name])
  new_store(tmp_path / "partial").write(0, make_rows(np.random.default_rng(3), 4))
  assert cli.main(["recode", str(tmp_path / "partial"), str(tmp_path / "other")]) == 2
  assert "incomplete" in capsys.readouterr().err and not (tmp_path / "other").exists()
