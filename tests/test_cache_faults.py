"""Faults a user meets, injected by file edits and the write path's failpoints (never by timers).

Edited attributes, truncated metadata, a full disk, a file where the store should be, k above the
vocabulary, an incomplete store, bad values, a second writer of one rank, and the order of durable
writes. Every fault gives a CacheError (or exit status) naming what is wrong and what to do, and
nothing that was written correctly is deleted.
"""
import errno
import json
import os

import numpy as np
import pytest
import tensorstore as ts

from kdjax import cache
from kdjax.cache import __main__ as cli, attributes
from tests.fixtures import failpoints

V = 300  # the vocabulary of conftest's make_rows and new_store
# What tensorstore raised when a tmpfs filled up during a shard write.
DISK_FULL = ('RESOURCE_EXHAUSTED: Error writing local file "{path}": Failed writing: '
             '"{path}.__lock": Failed to write 31578 bytes to file 3: No space left on device '
             "[os_error_code='28']")


@pytest.fixture(autouse=True)
def no_armed_points():
  yield
  failpoints.disarm()


def edit_json(path, edit):
  with open(path) as f:
    obj = json.load(f)
  edit(obj)
  with open(path, "w") as f:
    json.dump(obj, f)


def set_attr(store_path, key, value):
  edit_json(os.path.join(store_path, "zarr.json"),
            lambda obj: obj["attributes"].update({key: value}))


@pytest.fixture
def everything(store_files):
  """{relative path: bytes} of every file of a store, root metadata included."""

  def files(path):
    out = store_files(path)
    with open(os.path.join(path, "zarr.json"), "rb") as f:
      out["zarr.json"] = f.read()
    return out

  return files


def test_verify_fix_leaves_a_store_with_edited_attributes_untouched(store_and_rows, capsys,
                                                                    new_store, everything):
  store, _ = store_and_rows
  set_attr(store.path, "vocab_size", 250)  # ids up to 299 would all fail the range check
  before = everything(store.path)
  assert cli.main(["verify", "--fix", store.path]) == 2
  err = capsys.readouterr().err
  assert "fail their checksum" in err and "'vocab_size': (250, 300)" in err
  assert "Undo the edit" in err and "verify --fix changed nothing" in err
  assert everything(store.path) == before
  # The writer, resuming, names the edit too (not "a different spec").
  with pytest.raises(cache.CacheError, match=r"fail their checksum.*vocab_size"):
    new_store(store.path, layout_name="compact")
  set_attr(store.path, "vocab_size", V)
  assert cli.main(["verify", store.path]) == 0


@pytest.mark.parametrize("key, value", [
    ("tokenizer_hash", "other"), ("teacher_hash", "t2"), ("layout", "float32"),
    ("logprob_scale", 2.0**-10), ("vocab_size", 2 * V), ("k", 4), ("region_rows", 5)])
def test_an_edited_attribute_is_refused_by_open_and_verify(store_and_rows, key, value):
  store, _ = store_and_rows
  set_attr(store.path, key, value)
  with pytest.raises(cache.CacheError, match=rf"fail their checksum.*'{key}'"):
    cache.open(store.path)
  assert cli.main(["verify", store.path]) == 2


def test_a_store_without_the_checksum_opens_with_a_warning(store_and_rows, caplog):
  store, rows = store_and_rows
  # What the code before the checksum wrote: no key, no copy in the manifest.
  edit_json(os.path.join(store.path, "zarr.json"),
            lambda obj: obj["attributes"].pop(attributes.CHECKSUM))
  edit_json(os.path.join(store.path, "manifest", "zarr.json"),
            lambda obj: obj["attributes"].pop(attributes.COPY))
  got = cache.open(store.path).read(slice(0, 10))
  np.testing.assert_array_equal(got["topk_ids"], rows["topk_ids"])
  assert "before stores had an attribute checksum" in caplog.text
  assert cli.main(["verify", store.path]) == 0
  # Its decoding parameters are still checked.
  set_attr(store.path, "logprob_scale", 2.0**-10)
  with pytest.raises(cache.CacheError, match=r"logprob_scale = 0.0009765625, but compact"):
    cache.open(store.path)
  set_attr(store.path, "logprob_scale", 2.0**-11)
  set_attr(store.path, "layout", "float32")
  with pytest.raises(cache.CacheError,
                     match=r"dtypes = .* but k, vocab_size, layout and hidden_dim make"):
    cache.open(store.path)


def test_verify_fix_keeps_regions_whose_files_are_as_written(store_and_rows, capsys, everything):
  store, _ = store_and_rows

  def drop_chunk_checksum(meta):  # the files now decode with the wrong codecs
    meta["codecs"][0]["configuration"]["codecs"].pop()

  edit_json(os.path.join(store.path, "topk_logprobs", "zarr.json"), drop_chunk_checksum)
  before = everything(store.path)
  assert cli.main(["verify", "--fix", store.path]) == 1
  out = capsys.readouterr().out
  assert "0 damaged; 3 inconsistent" in out and "--fix leaves them" in out
  assert everything(store.path) == before


def test_truncated_metadata_names_the_file(store_and_rows, capsys):
  store, _ = store_and_rows
  for name in ("zarr.json", "manifest/zarr.json"):
    path = os.path.join(store.path, name)
    with open(path, "r+b") as f:
      text = f.read()
      f.truncate(len(text) // 2)
    with pytest.raises(cache.CacheError, match=rf"{path} is not valid JSON"):
      cache.open(store.path)
    assert cli.main(["verify", "--fix", store.path]) == 2
    assert path in capsys.readouterr().err
    with open(path, "wb") as f:
      f.write(text)
  path = os.path.join(store.path, "topk_ids", "zarr.json")
  with open(path, "r+b") as f:
    f.truncate(10)
  with pytest.raises(cache.CacheError, match=rf"{path} cannot be opened"):
    cache.open(store.path)


def test_a_file_where_the_store_should_be(tmp_path, new_store):
  path = tmp_path / "a_file"
  path.write_text("not a folder")
  for store_path in (path, path / "train.zarr"):
    with pytest.raises(cache.CacheError, match=rf"{path} is a file.*at a directory"):
      new_store(store_path)
  with pytest.raises(cache.CacheError, match=rf"{path} is a file"):
    cache.open(path)
  assert cli.main(["info", str(path)]) == 2


def test_k_above_the_vocabulary_is_refused_before_anything_is_created(tmp_path, new_store,
                                                                      make_data, write,
                                                                      tiny_teacher):
  data = make_data(tmp_path / "data")
  with pytest.raises(cache.CacheError, match=r"cache.k = 62 must lie in 1..61, the vocabulary"):
    write(tiny_teacher(), data, tmp_path / "cache", k=62)
  with pytest.raises(cache.CacheError, match=r"k = 301 must lie in 0..vocab_size \(300\)"):
    new_store(tmp_path / "store", k=V + 1)
  assert not os.path.exists(tmp_path / "cache") and not os.path.exists(tmp_path / "store")


def test_disk_full_is_a_cache_error_and_the_same_command_resumes(tmp_path, make_data, store_files,
                                                                 write, tiny_teacher):
  data = make_data(tmp_path / "data")
  write(tiny_teacher(), data, tmp_path / "whole")

  def full():
    raise ValueError(DISK_FULL.format(path=tmp_path / "cache" / "topk_ids" / "c" / "2" / "0" / "0"))

  failpoints.arm("data", full, count=3)  # the shard write of the third region
  with pytest.raises(cache.CacheError, match=rf"{tmp_path / 'cache'}: no space left.*Free space"
                                             rf".*re-run the same command: it resumes"):
    write(tiny_teacher(), data, tmp_path / "cache")
  assert cache.open(tmp_path / "cache", allow_partial=True).missing_regions() == [2, 3]
  write(tiny_teacher(), data, tmp_path / "cache")
  assert store_files(tmp_path / "cache") == store_files(tmp_path / "whole")


def test_disk_full_while_recording_records_nothing(tmp_path, make_rows, new_store):
  store = new_store(tmp_path / "s")

  def full():
    raise OSError(errno.ENOSPC, "No space left on device")

  failpoints.arm("after_data", full)
  with pytest.raises(cache.CacheError, match="no space left"):
    store.write(0, make_rows(np.random.default_rng(1), 4))
  assert store.missing()[0] == (0, 4)


def test_verify_fails_on_an_incomplete_store(tmp_path, capsys, make_rows, new_store, take):
  rows = make_rows(np.random.default_rng(2), 10)
  store = new_store(tmp_path / "s")
  store.write(4, take(rows, slice(4, 8)))
  assert cli.main(["verify", store.path]) == 1
  out = capsys.readouterr().out
  assert "INCOMPLETE: regions 0, 2 (rows 0..4, 8..10) not written yet" in out
  assert "resumes where it stopped" in out
  with pytest.raises(cache.CacheError, match=r"2 of 3 regions are not written \(regions 0, 2"):
    cache.open(store.path)


def test_bad_values_name_the_store_row(tmp_path, make_rows, new_store, take):
  rows = make_rows(np.random.default_rng(3), 10)
  new_store(tmp_path / "s").write(0, rows)
  path = str(tmp_path / "s" / "topk_logprobs")
  arr = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": path}}).result()
  arr[5, 1, 2].write(np.nan).result()
  store = cache.open(tmp_path / "s")
  for index in ([4, 5], slice(4, 8), [9, 5, 5]):
    with pytest.raises(cache.CacheError, match=r"first at row 5, position 1, entry 2"):
      store.read(index)
  bad = take(rows, slice(0, 4))
  bad["topk_ids"] = bad["topk_ids"].copy()
  bad["topk_ids"][2, 3, 1] = V
  with pytest.raises(cache.CacheError, match=r"first at row 6, position 3, entry 1"):
    store.write(4, bad)


def test_a_second_writer_of_one_rank_is_refused(tmp_path, new_store, make_data, write,
                                                tiny_teacher):
  data = make_data(tmp_path / "data", num_seqs=4, region_rows=2)
  store = new_store(tmp_path / "s")
  lock_path = os.path.join(store.path, "writer-rank0.lock")
  with store.writer_lock(0):
    with pytest.raises(cache.CacheError, match=rf"{lock_path} is held by pid {os.getpid()} on "):
      with store.writer_lock(0):
        pass
    with store.writer_lock(1):  # other ranks write other regions
      pass
  assert not os.path.exists(lock_path)
  with open(lock_path, "w") as f:  # left by a writer killed with SIGKILL: nobody holds its flock
    f.write('{"pid": 1, "host": "elsewhere"}')
  with store.writer_lock(0):
    pass
  # The teacher takes the lock before any teacher work, after creating (or resuming) the cache.
  write(tiny_teacher(), data, tmp_path / "cache", world=2)
  cached = cache.open(tmp_path / "cache", allow_partial=True)
  with cached.writer_lock(1):
    with pytest.raises(cache.CacheError, match=r"writer-rank1.lock is held.*another writer of "
                                               r"rank 1 is running"):
      write(tiny_teacher(), data, tmp_path / "cache", rank=1, world=2)
  assert cached.missing() == [(2, 4)]
  # A rank with nothing left to write takes no lock: processes sharing a finished cache start.
  write(tiny_teacher(), data, tmp_path / "cache", rank=0, world=2)
  with cached.writer_lock(0):
    write(tiny_teacher(), data, tmp_path / "cache", rank=0, world=2)


def test_shards_are_durable_before_their_record(tmp_path, monkeypatch, make_rows, new_store):
  store = new_store(tmp_path / "s")
  events = []
  real_fsync, real_replace = os.fsync, os.replace
  monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.readlink(
      f"/proc/self/fd/{fd}"))), real_fsync(fd)))
  monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("rename", str(b))),
                                                   real_replace(a, b)))
  store.write(0, make_rows(np.random.default_rng(4), 4))
  record = events.index(("rename", store.region_record_path(0)))
  synced = {path for kind, path in events[:record] if kind == "fsync"}
  for name in store.dtypes:
    shard = store.shard_path(name, 0)
    assert {shard, os.path.dirname(shard), os.path.join(store.path, name)} <= synced, name
  assert ("fsync", os.path.join(store.path, "manifest")) in events[record:]


def test_a_writer_stopped_between_data_and_record_leaves_the_region_missing(tmp_path, make_rows,
                                                                            new_store, take):
  rows = make_rows(np.random.default_rng(5), 10)
  store = new_store(tmp_path / "s")

  def stopped():
    raise failpoints.FailpointError("after_data")

  failpoints.arm("after_data", stopped, count=2)
  store.write(0, take(rows, slice(0, 4)))
  with pytest.raises(failpoints.FailpointError):
    store.write(4, take(rows, slice(4, 8)))
  assert os.path.exists(store.shard_path("topk_ids", 1))  # its data is on disk, unrecorded
  assert store.missing() == [(4, 8), (8, 10)]
  with pytest.raises(cache.CacheError, match="incomplete"):
    cache.open(store.path)
  store.write(4, take(rows, slice(4, 10)))
  np.testing.assert_array_equal(cache.open(store.path).read(slice(0, 10))["topk_ids"],
                                rows["topk_ids"])


@pytest.mark.parametrize("layout_name", ["packed", "dictionary"])
@pytest.mark.parametrize("key, value", [("prob_offset", 2.0**-5), ("logprob_scale", 2.0**-11),
                                        ("layout", "compact"), ("order_size", 2)])
def test_an_edited_packed_attribute_is_refused(tmp_path, make_rows, new_store, key, value,
                                               layout_name):
  new_store(tmp_path / "s", layout_name=layout_name).write(
      0, make_rows(np.random.default_rng(0), 10))
  set_attr(tmp_path / "s", key, value)
  with pytest.raises(cache.CacheError, match=rf"fail their checksum.*'{key}'"):
    cache.open(tmp_path / "s")
  assert cli.main(["verify", str(tmp_path / "s")]) == 2


@pytest.mark.parametrize("layout_name, array", [("packed", "topk_logprobs"),
                                                 ("dictionary", "topk_order")])
def test_a_damaged_packed_cache_is_repaired_byte_identical(tmp_path, make_data, store_files,
                                                           write, tiny_teacher, capsys,
                                                           layout_name, array):
  """The packed and dictionary layouts through the fault path of the others: a flipped byte in
  a shard fails its checksum, verify --fix drops the region, the writer rewrites it as before."""
  data = make_data(tmp_path / "data")
  write(tiny_teacher(), data, tmp_path / "whole", layout=layout_name)
  write(tiny_teacher(), data, tmp_path / "cache", layout=layout_name)
  store = cache.open(tmp_path / "cache")
  shard = store.shard_path(array, 1)
  with open(shard, "r+b") as f:
    f.seek(3)
    byte = f.read(1)[0]
    f.seek(3)
    f.write(bytes([byte ^ 1]))
  assert cli.main(["verify", "--fix", str(tmp_path / "cache")]) == 1
  assert "DAMAGED region 1 " in capsys.readouterr().out
  assert cache.open(tmp_path / "cache", allow_partial=True).missing_regions() == [1]
  write(tiny_teacher(), data, tmp_path / "cache", layout=layout_name)
  assert store_files(tmp_path / "cache") == store_files(tmp_path / "whole")


def test_a_finished_cache_drops_the_lock_file_a_killed_writer_left(tmp_path, make_data, write,
                                                                   tiny_teacher):
  """A writer killed after its last region was recorded leaves its lock file; the next writer of
  that rank finds nothing to write and removes it (a live holder's lock stays)."""
  data = make_data(tmp_path / "data", num_seqs=4, region_rows=2)
  write(tiny_teacher(), data, tmp_path / "cache")
  lock_path = tmp_path / "cache" / "writer-rank0.lock"
  lock_path.write_text('{"pid": 1, "host": "elsewhere"}')  # nobody holds its flock
  write(tiny_teacher(), data, tmp_path / "cache")
  assert not lock_path.exists()
  with cache.open(tmp_path / "cache").writer_lock(0):
    write(tiny_teacher(), data, tmp_path / "cache")
    assert lock_path.exists()
  assert not lock_path.exists()
