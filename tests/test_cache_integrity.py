"""Damage to a finished store is found, named by region, and repaired by rewriting that region."""
import os

import numpy as np
import pytest

from kdjax import cache
from kdjax.cache import __main__ as cli
from kdjax.cache import integrity


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
