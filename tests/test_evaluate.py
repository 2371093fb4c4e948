"""kdjax.evaluate against a float64 dense reference: a real tiny Llama, a real cache store."""
import dataclasses

import jax
import numpy as np
from flax import nnx

from kdjax import cache, evaluate
from kdjax.data.packing import next_token_labels
from kdjax.models import llama

V, T, K, N = 97, 11, 7, 5  # T and V odd: no chunk or tile divides them


CFG = llama.ModelConfig(vocab_size=V, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1,
                       head_dim=8, d_ff=32, attention_impl="einsum")


def write_cache(tmp_path, rng) -> dict:
  """A cache of N rows (two documents in one, padding in another) at tmp_path/c.zarr; its rows."""
  segment_ids_NxT = np.ones((N, T), np.int32)
  segment_ids_NxT[0, 6:] = 2  # a second document
  segment_ids_NxT[1, 8:] = 0  # padding
  positions_NxT = np.where(segment_ids_NxT == 2, np.arange(T) - 6, np.arange(T)).astype(np.int32)
  teacher_NxTxV = rng.normal(size=(N, T, V)) * 2
  logp_NxTxV = teacher_NxTxV - np.log(np.exp(teacher_NxTxV).sum(-1, keepdims=True))
  ids_NxTxK = np.argsort(-logp_NxTxV, -1)[..., :K].astype(np.int32)
  rows = {"tokens": rng.integers(0, V, (N, T), dtype=np.int32), "segment_ids": segment_ids_NxT,
          "positions": positions_NxT,
          "loss_mask": (segment_ids_NxT > 0) & (rng.random((N, T)) < 0.8),
          "topk_ids": ids_NxTxK,
          "topk_logprobs": np.take_along_axis(logp_NxTxV, ids_NxTxK, -1).astype(np.float32)}
  rows["loss_mask"][:, -1] = False
  store = cache.create(tmp_path / "c.zarr", num_seqs=N, seq_len=T, k=K, vocab_size=V,
                       attrs={"teacher_hash": "t", "tokenizer_hash": "tok"})
  store.write(0, rows)
  return rows


def test_matches_dense_float64_reference(tmp_path, rng):
  model = llama.Transformer(CFG, rngs=nnx.Rngs(int(rng.integers(1 << 30))))
  rows = write_cache(tmp_path, rng)
  ids_NxTxK = rows["topk_ids"]

  got = evaluate.evaluate(model, cache.open(tmp_path / "c.zarr"), batch_size=2, max_seqs=0,
                          chunk_size=4)

  hidden_NxTxD = np.asarray(model(rows["tokens"], rows["positions"], rows["segment_ids"]),
                            np.float64)
  z_NxTxV = hidden_NxTxD @ np.asarray(model.lm_head_DxV(), np.float64)
  logq_NxTxV = z_NxTxV - np.log(np.exp(z_NxTxV).sum(-1, keepdims=True))
  p_NxTxK = np.exp(rows["topk_logprobs"].astype(np.float64))
  kl_NxT = np.sum(p_NxTxK * (rows["topk_logprobs"] - np.take_along_axis(logq_NxTxV, ids_NxTxK,
                                                                          -1)), -1)
  labels_NxT = np.asarray(next_token_labels(rows["tokens"]))
  ce_NxT = -np.take_along_axis(logq_NxTxV, labels_NxT[..., None], -1)[..., 0]
  top1_NxT = z_NxTxV.argmax(-1) == ids_NxTxK[..., 0]
  mask = rows["loss_mask"]
  assert got["positions"] == mask.sum()
  np.testing.assert_allclose(got["kl"], kl_NxT[mask].mean(), rtol=1e-4)
  np.testing.assert_allclose(got["ce"], ce_NxT[mask].mean(), rtol=1e-5)
  np.testing.assert_allclose(got["top1_agreement"], top1_NxT[mask].mean())


def test_fresh_and_restored_models_share_one_program(tmp_path, rng):
  """A freshly built model's arrays are uncommitted, a restored checkpoint's committed to their
  device: the pipeline's student before and after training are evaluated by one compiled
  program (they compiled it twice)."""
  write_cache(tmp_path, rng)
  store = cache.open(tmp_path / "c.zarr")
  fresh = llama.Transformer(CFG, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(llama.Transformer(CFG, rngs=nnx.Rngs(1)))
  restored = nnx.merge(graphdef, jax.device_put(params, jax.devices()[0]))
  before = evaluate._batch_sums._cache_size()
  for model in (fresh, restored):
    evaluate.evaluate(model, store, batch_size=N, max_seqs=0, chunk_size=4)
  assert evaluate._batch_sums._cache_size() == before + 1


def test_every_batch_shares_one_program(tmp_path, rng):
  """One bound on the documents per row for the whole evaluation and the last, shorter batch
  padded: row 0 holds two documents, the others one, 5 rows go in batches of 2, and one program
  runs them all (a bound per batch compiled one per distinct bound, the last batch one more:
  minutes each for a 128K model on a GPU)."""
  write_cache(tmp_path, rng)
  store = cache.open(tmp_path / "c.zarr")
  # a shape no other test uses, so no program of theirs is in jit's cache
  model = llama.Transformer(dataclasses.replace(CFG, d_ff=40), rngs=nnx.Rngs(2))
  before = evaluate._batch_sums._cache_size()
  evaluate.evaluate(model, store, batch_size=2, max_seqs=0, chunk_size=4)
  assert evaluate._batch_sums._cache_size() == before + 1


def test_online_matches_dense_float64_reference(tmp_path, rng):
  """evaluate_online on a k = 0 data store: full KL to a second tiny Llama run online, top-1
  agreement, CE and ECE, against float64 computed from the two models' hidden states."""
  def tiny(d_model, seed):
    cfg = llama.ModelConfig(vocab_size=V, d_model=d_model, n_layers=1, n_heads=2, n_kv_heads=1,
                            head_dim=8, d_ff=32, attention_impl="einsum")
    return llama.Transformer(cfg, rngs=nnx.Rngs(seed))
  student, teacher = tiny(16, int(rng.integers(1 << 30))), tiny(24, int(rng.integers(1 << 30)))
  segment_ids_NxT = np.ones((N, T), np.int32)
  segment_ids_NxT[2, 7:] = 0
  rows = {"tokens": rng.integers(0, V, (N, T), dtype=np.int32), "segment_ids": segment_ids_NxT,
          "positions": np.tile(np.arange(T, dtype=np.int32), (N, 1)),
          "loss_mask": (segment_ids_NxT > 0) & (rng.random((N, T)) < 0.8)}
  rows["loss_mask"][:, -1] = False
  store = cache.create(tmp_path / "d.zarr", num_seqs=N, seq_len=T, k=0, vocab_size=V,
                       attrs={"tokenizer_hash": "tok"})
  store.write(0, rows)

  def logprobs(model):
    hidden = np.asarray(model(rows["tokens"], rows["positions"], rows["segment_ids"]), np.float64)
    z = hidden @ np.asarray(model.lm_head_DxV(), np.float64)
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))
  logq, logp = logprobs(student), logprobs(teacher)
  mask = rows["loss_mask"]
  labels = np.asarray(next_token_labels(rows["tokens"]))
  # The true token's rank among the teacher's predictions; split_k is their median, so both
  # sides of the split hold positions whatever the random models rank (a fixed split_k = 7 of
  # V = 97 left one side empty for about one seed in a thousand).
  teacher_ce = -np.take_along_axis(logp, labels[..., None], -1)[..., 0]
  rank = (logp > -teacher_ce[..., None]).sum(-1)
  rank_sorted = np.sort(rank[mask])
  split_k = max(int(rank_sorted[len(rank_sorted) // 2]), int(rank_sorted[0]) + 1)

  got = evaluate.evaluate_online(student, teacher, cache.open(tmp_path / "d.zarr"), batch_size=2,
                                 max_seqs=0, chunk_size=6, split_k=split_k)
  kl = (np.exp(logp) * (logp - logq)).sum(-1)
  ce = -np.take_along_axis(logq, labels[..., None], -1)[..., 0]
  confidence, correct = np.exp(logq.max(-1)), logq.argmax(-1) == labels
  bins = np.minimum((confidence * 15).astype(int), 14)
  ece = sum(abs(correct[mask & (bins == b)].sum() - confidence[mask & (bins == b)].sum())
            for b in range(15)) / mask.sum()
  assert got["positions"] == mask.sum()
  np.testing.assert_allclose(got["full_kl"], kl[mask].mean(), rtol=1e-4)
  np.testing.assert_allclose(got["ce"], ce[mask].mean(), rtol=1e-5)
  np.testing.assert_allclose(got["top1_agreement"],
                             (logq.argmax(-1) == logp.argmax(-1))[mask].mean())
  np.testing.assert_allclose(got["ece"], ece, rtol=1e-4, atol=1e-6)
  # The CE split by whether the true token is among the teacher's split_k most likely.
  outside = mask & (rank >= split_k)
  assert 0 < outside.sum() < mask.sum()
  np.testing.assert_allclose(got["teacher_ce"], teacher_ce[mask].mean(), rtol=1e-5)
  np.testing.assert_allclose(got["outside_top_k"], outside.sum() / mask.sum())
  np.testing.assert_allclose(got["ce_outside_top_k"], ce[outside].mean(), rtol=1e-5)
  np.testing.assert_allclose(got["ce_inside_top_k"], ce[mask & ~outside].mean(), rtol=1e-5)
  np.testing.assert_allclose(got["teacher_ce_outside_top_k"], teacher_ce[outside].mean(),
                             rtol=1e-5)
