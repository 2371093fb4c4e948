"""Teacher cache writing: top-k against a dense float64 reference, crash and resume, checks."""
import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kdjax import cache, peers, teacher
from kdjax.cache import identity
from kdjax.models import documents, llama

V, T, D, K = 61, 12, 16, 7  # V, T, K: conftest's make_data and write; D: make_teacher's width


def make_teacher(vocab=V, seed=0):
  """A one-layer Llama whose embeddings are scaled up so the teacher is confident (no near-ties)."""
  cfg = llama.ModelConfig(vocab_size=vocab, d_model=D, n_layers=1, n_heads=2, n_kv_heads=1,
                          head_dim=8, d_ff=32, rope_theta=1e4, rope_scaling=None, norm_eps=1e-5,
                          tie_embeddings=True, qk_norm=False)
  model = llama.Transformer(cfg, rngs=nnx.Rngs(seed))
  model.embed_VxD[...] = model.embed_VxD[...] * 100.0
  return model


def test_topk_matches_dense_reference(tmp_path, make_data, write):
  model = make_teacher()
  data = make_data(tmp_path / "data")
  write(model, data, tmp_path / "cache")
  got = cache.open(tmp_path / "cache", vocab_size=V, k=K, seq_len=T, tokenizer_hash="tok")
  rows = data.read(slice(0, 10))
  out = got.read(slice(0, 10))
  hidden = np.asarray(model(rows["tokens"], rows["positions"], rows["segment_ids"]), np.float64)
  logits = hidden @ np.asarray(model.lm_head_DxV(), np.float64)
  m = logits.max(-1, keepdims=True)
  logprobs = logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))
  ids = np.argsort(-logprobs, axis=-1)[..., :K]
  real = rows["segment_ids"] > 0
  np.testing.assert_array_equal(out["topk_ids"][real], ids[real])
  np.testing.assert_allclose(out["topk_logprobs"][real],
                             np.take_along_axis(logprobs, ids, -1)[real], rtol=0, atol=2e-5)
  assert np.isfinite(out["topk_logprobs"]).all()
  for name in ("tokens", "segment_ids", "positions", "loss_mask"):
    np.testing.assert_array_equal(out[name], rows[name])
  assert got.attrs["teacher_hash"] == "tiny" and got.attrs["data"]["source"] == "test"


def test_resume_after_a_crash_equals_an_uninterrupted_run(tmp_path, monkeypatch, make_data,
                                                          store_files, write):
  model = make_teacher()
  data = make_data(tmp_path / "data")
  write(model, data, tmp_path / "whole")

  real_write = cache.Store.write
  calls = []

  def crashing_write(self, start, batch):
    calls.append(start)
    if len(calls) == 3:
      raise KeyboardInterrupt("killed")
    real_write(self, start, batch)

  monkeypatch.setattr(cache.Store, "write", crashing_write)
  with pytest.raises(KeyboardInterrupt):
    write(model, data, tmp_path / "resumed")
  monkeypatch.setattr(cache.Store, "write", real_write)
  with pytest.raises(cache.CacheError, match="2 of 4 regions"):
    cache.open(tmp_path / "resumed")
  write(model, data, tmp_path / "resumed")
  assert store_files(tmp_path / "resumed") == store_files(tmp_path / "whole")


@pytest.mark.parametrize("layout_name", ["float32", "compact", "dictionary"])
def test_parallel_writers_write_the_same_bytes_and_resume(tmp_path, monkeypatch, make_data,
                                                          store_files, write, layout_name):
  model = make_teacher()
  data = make_data(tmp_path / "data")
  write(model, data, tmp_path / "one", layout=layout_name)
  write(model, data, tmp_path / "three", layout=layout_name, writers=3)
  assert store_files(tmp_path / "three") == store_files(tmp_path / "one")
  real_write = cache.Store.write

  def crashing_write(self, start, batch):
    if start >= data.region_rows:  # every region but the first fails
      raise KeyboardInterrupt("killed")
    real_write(self, start, batch)

  monkeypatch.setattr(cache.Store, "write", crashing_write)
  with pytest.raises(KeyboardInterrupt):
    write(model, data, tmp_path / "resumed", layout=layout_name, writers=3)
  monkeypatch.setattr(cache.Store, "write", real_write)
  assert cache.open(tmp_path / "resumed", allow_partial=True).missing_regions() == [1, 2, 3]
  write(model, data, tmp_path / "resumed", layout=layout_name, writers=3)
  assert store_files(tmp_path / "resumed") == store_files(tmp_path / "one")


def test_sigterm_to_one_writer_stops_it_and_resumes(tmp_path, make_data, store_files, write):
  """SIGTERM to a lone cache writer (kdjax.peers.Stop, as the pipeline runs it) stops it at once,
  as Ctrl-C does, its finished regions written; the same call again writes the rest, byte for
  byte an uninterrupted cache. (Of several processes: tests/test_failures.py.)"""
  model = make_teacher()
  data = make_data(tmp_path / "data")
  write(model, data, tmp_path / "whole")
  with peers.Stop("cache") as stop:
    def before_region():
      stop.before_region()
      if stop.regions == 2:  # as the second region begins
        os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(KeyboardInterrupt):
      write(model, data, tmp_path / "resumed", before_region=before_region)
  assert signal.getsignal(signal.SIGTERM) is not stop._on_sigterm
  assert cache.open(tmp_path / "resumed", allow_partial=True).missing_regions() == [1, 2, 3]
  write(model, data, tmp_path / "resumed")
  assert store_files(tmp_path / "resumed") == store_files(tmp_path / "whole")


def test_lm_head_narrower_than_vocab_is_refused(tmp_path, make_data, write):
  data = make_data(tmp_path / "data")
  with pytest.raises(cache.CacheError, match="fewer than the vocabulary"):
    write(make_teacher(V - 1), data, tmp_path / "cache")


def test_resume_with_another_k_is_refused(tmp_path, make_data, write):
  data = make_data(tmp_path / "data")
  write(make_teacher(), data, tmp_path / "cache")
  with pytest.raises(cache.CacheError, match="different spec"):
    write(make_teacher(), data, tmp_path / "cache", k=K - 1)


def test_a_sinks_teachers_cache_from_before_the_spans_fix_is_not_reused(tmp_path, make_data,
                                                                          write):
  """A gpt-oss-class cache lacking teacher.revision_attrs (written before b87bcf6, wrong at
  several rows per call) is refused by the cache stage with what to do, finished or not; one that
  has them, or another teacher's, is taken as usual."""
  data = make_data(tmp_path / "data")
  sinks = identity.revision_attrs(llama.ModelConfig(attention_sinks=True))
  assert identity.revision_attrs(llama.ModelConfig()) == {}
  old, new = tmp_path / "old", tmp_path / "new"
  write(make_teacher(), data, old)
  write(make_teacher(), data, new, attrs={"teacher_hash": "tiny", **sinks})
  attrs = {"teacher_hash": "tiny", **sinks}
  holds = lambda path, attrs: identity.holds_top_k(str(path), K, "float32", attrs, 0, data)
  with pytest.raises(cache.CacheError, match="Delete .*old and run the cache stage again"):
    holds(old, attrs)
  assert holds(new, attrs)
  assert holds(old, {"teacher_hash": "tiny"})  # a teacher without sinks: as before
  assert not holds(old, {"teacher_hash": "other", **sinks})  # another teacher's: not reused


@pytest.mark.parametrize("blocks", [(64,), teacher.TOPK_BLOCKS, (128, 16, 2), (128, 16, 4)])
@pytest.mark.parametrize("rows,vocab,k", [(37, 12571, 100), (3, 201088, 100), (8, 12345, 7),
                                          (4, 300, 100)])
def test_exact_top_k_equals_top_k(rows, vocab, k, blocks, rng):
  """The blocked top-k against jax.lax.top_k: the same values and ids (random logits, no ties),
  V not a multiple of the block; also with the largest entries crowded into a few blocks, and
  with one of them in each of 2k blocks."""
  x = rng.standard_normal((rows, vocab)).astype(np.float32)
  x[0, 1000:1000 + 2 * k] += 10.0  # the top k of row 0 in adjacent columns
  x[-1, 7:7 + 2 * k * 61:61] += 10.0  # row -1's in 2k columns 61 apart (few per block)
  want = jax.lax.top_k(jnp.asarray(x), k)
  got = teacher.exact_top_k(jnp.asarray(x), k, blocks)
  for a, b in zip(got, want):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("rows,vocab,k", [(37, 12571, 100), (5, 49152, 100), (4, 300, 100)])
def test_top_k_logprobs_equals_log_softmax(rows, vocab, k, rng):
  """Log-softmax of the top k, normalised from the blocks' maxima and sums, against a float64
  numpy log_softmax + top_k; logits of a wide range (a real teacher's span ~40)."""
  x = (8.0 * rng.standard_normal((rows, vocab))).astype(np.float32)
  x[1, 5] = 90.0  # one row with a dominant entry
  values, ids = teacher.top_k_logprobs(jnp.asarray(x), k)
  x64 = x.astype(np.float64)
  shift = x64.max(axis=-1, keepdims=True)
  want = x64 - shift - np.log(np.sum(np.exp(x64 - shift), axis=-1, keepdims=True))
  want_ids = np.argsort(-x, axis=-1, kind="stable")[:, :k]
  np.testing.assert_array_equal(np.asarray(ids), want_ids)
  np.testing.assert_allclose(np.asarray(values), np.take_along_axis(want, want_ids, axis=-1),
                             rtol=1e-6, atol=2e-5)


def test_top_k_blocks_must_nest():
  with pytest.raises(ValueError, match="must divide"):
    teacher.exact_top_k(jnp.zeros((2, 4096)), 4, (64, 24))


def test_one_documents_bound_for_the_whole_pass(tmp_path, monkeypatch, make_data, write):
  """Regions with different numbers of documents share one compiled step, bounded by the most."""
  data = make_data(tmp_path / "data", num_seqs=10, region_rows=3)
  rows = data.read(slice(0, 10))
  segment_ids = rows["segment_ids"].copy()
  segment_ids[7, T // 2:] = 2  # only region 2 (rows 6..8) holds a second document
  segment_ids[8, 1:] = np.arange(2, T + 1) % 6  # five documents, and padding (0) between
  positions = rows["positions"]
  mixed = cache.create(tmp_path / "mixed", num_seqs=10, seq_len=T, k=0, vocab_size=V,
                       attrs={"tokenizer_hash": "tok", "source": "test"}, region_rows=3)
  mixed.write(0, {**rows, "segment_ids": segment_ids, "positions": positions,
                  "loss_mask": segment_ids > 0})
  mixed = cache.open(tmp_path / "mixed")
  assert documents.store_documents_bound(mixed, [(0, 6)]) == 1
  assert documents.store_documents_bound(mixed, [(0, 10)]) == 8
  assert documents.store_documents_bound(mixed, [(0, 10)], positions_per_read=2 * T) == 8
  model = make_teacher()
  bounds = []
  step = teacher.topk_batch
  monkeypatch.setattr(teacher, "topk_batch",
                      lambda *a, max_documents, **kw: bounds.append(max_documents) or step(
                          *a, max_documents=max_documents, **kw))
  write(model, mixed, tmp_path / "cache")
  assert set(bounds) == {8} and len(bounds) == 4  # 4 regions of one batch each
  # Every row as the dense model computes it with the documents of that row.
  got = cache.open(tmp_path / "cache").read(slice(0, 10))
  hidden = np.asarray(model(rows["tokens"], positions, segment_ids, 8), np.float64)
  logits = hidden @ np.asarray(model.lm_head_DxV(), np.float64)
  ids = np.argsort(-logits, axis=-1)[..., :K]
  real = segment_ids > 0
  np.testing.assert_array_equal(got["topk_ids"][real], ids[real])
