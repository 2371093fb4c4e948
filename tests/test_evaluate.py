"""kdjax.evaluate against a float64 dense reference: a real tiny Llama, a real cache store."""
import numpy as np
from flax import nnx

from kdjax import cache, evaluate
from kdjax.data.packing import next_token_labels
from kdjax.models import llama

V, T, K, N = 97, 11, 7, 5  # T and V odd: no chunk or tile divides them


def test_matches_dense_float64_reference(tmp_path, rng):
  cfg = llama.ModelConfig(vocab_size=V, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1,
                          head_dim=8, d_ff=32, attention_impl="einsum")
  model = llama.Transformer(cfg, rngs=nnx.Rngs(int(rng.integers(1 << 30))))
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
