"""Hidden-state matching: the loss term against float64 references, the teacher's cached hidden
states (whole and randomly projected), their store checks, and training with the term."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kdjax import cache, config, teacher
from kdjax.cache import layout
from kdjax.loss import LossSettings, hidden
from kdjax.models import llama
from kdjax.training import train

V, T = 61, 12  # conftest's make_data
TEACHER_D = 16


def reference_nmse(h_NxD, target_NxH, mask_N, w_DxH=None):
  """Value and gradients (d hidden, d projection) in float64, written out by hand."""
  h = np.asarray(h_NxD, np.float64)
  g = np.asarray(target_NxH, np.float64)
  pred = h if w_DxH is None else h @ np.asarray(w_DxH, np.float64)
  m = np.asarray(mask_N, np.float64)[:, None]
  energy = (m * g ** 2).sum()
  value = (m * (pred - g) ** 2).sum() / energy
  d_pred = 2.0 * m * (pred - g) / energy
  if w_DxH is None:
    return value, d_pred, None
  return value, d_pred @ np.asarray(w_DxH, np.float64).T, h.T @ d_pred


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("dims", [(24, 24), (24, 10), (7, 13)])  # D, H: equal, smaller, odd
def test_hidden_nmse_matches_float64_reference(rng, dtype, dims):
  dim, width = dims
  batch = (3, 11)
  h = jnp.asarray(rng.normal(size=batch + (dim,)), dtype)
  target = jnp.asarray(rng.normal(size=batch + (width,)), jnp.bfloat16)  # as cached
  mask = rng.random(batch) < 0.7
  w = None if dim == width else jnp.asarray(rng.normal(size=(dim, width)) / np.sqrt(dim),
                                            jnp.float32)
  args = (h, target, jnp.asarray(mask)) + ((w,) if w is not None else ())
  value, grads = jax.value_and_grad(hidden.hidden_nmse, argnums=(0, 3) if w is not None else 0)(
      *args)
  ref_value, ref_dh, ref_dw = reference_nmse(np.asarray(h, np.float64).reshape(-1, dim),
                                            np.asarray(target, np.float64).reshape(-1, width),
                                            mask.reshape(-1), w)
  tol = 1e-5 if dtype == "float32" else 2e-2  # bf16: the projection's inputs are rounded
  np.testing.assert_allclose(float(value), ref_value, rtol=tol)
  dh = grads[0] if w is not None else grads
  scale = np.abs(ref_dh).max()
  np.testing.assert_allclose(np.asarray(dh, np.float64).reshape(-1, dim), ref_dh,
                             atol=tol * scale * 4)
  if w is not None:
    np.testing.assert_allclose(np.asarray(grads[1], np.float64), ref_dw,
                               atol=tol * np.abs(ref_dw).max() * 4)


def test_hidden_nmse_with_nothing_masked_in_is_zero(rng):
  h = jnp.asarray(rng.normal(size=(2, 5, 4)), jnp.float32)
  assert float(hidden.hidden_nmse(h, h + 1, jnp.zeros((2, 5), bool))) == 0.0
  with pytest.raises(ValueError, match="cache.hidden_dim"):
    hidden.hidden_nmse(h, jnp.zeros((2, 5, 3)), jnp.ones((2, 5), bool))


def tiny_llama(d_model, seed):
  cfg = llama.ModelConfig(vocab_size=V, d_model=d_model, n_layers=1, n_heads=2, n_kv_heads=1,
                          head_dim=8, d_ff=32, rope_theta=1e4, rope_scaling=None, norm_eps=1e-5,
                          tie_embeddings=False, qk_norm=False)
  return llama.Transformer(cfg, rngs=nnx.Rngs(seed)), cfg


@pytest.mark.parametrize("hidden_dim", [TEACHER_D, 6])  # whole; a random projection
def test_teacher_caches_its_final_hidden_states(tmp_path, make_data, write, hidden_dim):
  model, _ = tiny_llama(TEACHER_D, 0)
  data = make_data(tmp_path / "data")
  write(model, data, tmp_path / "cache", hidden_dim=hidden_dim)
  store = cache.open(tmp_path / "cache", hidden=True)
  rows, out = data.read(slice(0, 10)), store.read(slice(0, 10))
  assert out["hidden"].dtype == layout.decode_hidden(np.zeros(1, np.uint16)).dtype  # bfloat16
  assert store.read(slice(0, 2), hidden=False).keys() == set(store.dtypes) - {"hidden"}
  h = np.asarray(model(rows["tokens"], rows["positions"], rows["segment_ids"]), np.float64)
  if hidden_dim != TEACHER_D:
    projection = np.asarray(teacher.hidden_projection_DxH(TEACHER_D, hidden_dim), np.float64)
    h = h @ projection
    assert store.attrs["hidden_projection"]["from_width"] == TEACHER_D
    # the projection is fixed: the same matrix every time, columns of squared norm ~ D / H
    np.testing.assert_array_equal(projection, teacher.hidden_projection_DxH(TEACHER_D,
                                                                            hidden_dim))
  else:
    assert "hidden_projection" not in store.attrs
  real = rows["segment_ids"] > 0
  got = np.asarray(out["hidden"], np.float64)
  np.testing.assert_allclose(got[real], h[real], rtol=2**-8, atol=1e-6 * np.abs(h).max())
  assert (got[~real] == 0).all()  # padding


def test_store_checks_hidden_states(tmp_path, make_rows):
  rng = np.random.default_rng(0)
  rows = make_rows(rng, 4)
  rows["hidden"] = rng.normal(size=(4, rows["tokens"].shape[1], 5)).astype(np.float32)
  store = cache.create(tmp_path / "s", num_seqs=4, seq_len=rows["tokens"].shape[1], k=5,
                      vocab_size=300, attrs={}, hidden_dim=5)
  bad = dict(rows, hidden=rows["hidden"].copy())
  bad["hidden"][2, 3, 1] = np.nan
  with pytest.raises(cache.CacheError, match="NaN/Inf teacher hidden states.*row 2, position 3"):
    store.write(0, bad)
  store.write(0, rows)
  np.testing.assert_array_equal(
      np.asarray(cache.open(tmp_path / "s").read(slice(0, 4))["hidden"], np.float32),
      rows["hidden"].astype(layout.decode_hidden(np.zeros(1, np.uint16)).dtype).astype(np.float32))
  with pytest.raises(cache.CacheError, match="different spec"):
    cache.create(tmp_path / "s", num_seqs=4, seq_len=rows["tokens"].shape[1], k=5,
                 vocab_size=300, attrs={}, hidden_dim=6)
  cache.create(tmp_path / "plain", num_seqs=4, seq_len=rows["tokens"].shape[1], k=5,
               vocab_size=300, attrs={}).write(0, {n: a for n, a in rows.items() if n != "hidden"})
  with pytest.raises(cache.CacheError, match="cache.hidden_states=True"):
    cache.open(tmp_path / "plain", hidden=True)


def hidden_cache(tmp_path, make_data, write, hidden_dim):
  model, _ = tiny_llama(TEACHER_D, 0)
  write(model, make_data(tmp_path / "data"), tmp_path / "cache", hidden_dim=hidden_dim)
  return cache.open(tmp_path / "cache", hidden=True)


def test_step_loss_adds_the_weighted_term_and_trains_the_projection(tmp_path, make_data, write):
  """loss_fn with hidden_weight w: the KL loss plus w times the float64 reference term, and the
  projection's gradient is the reference's."""
  store = hidden_cache(tmp_path, make_data, write, hidden_dim=6)
  student, _ = tiny_llama(32, 1)
  graphdef, params = nnx.split(student)
  rows = store.read(np.arange(4))
  batch = {k: jnp.asarray(v[0]) for k, v in train.to_step_batch(rows, 1, False).items()}
  proj = jnp.asarray(np.random.default_rng(1).normal(size=(32, 6)) / np.sqrt(32), jnp.float32)
  settings = LossSettings("tail", 1.0, 0.0, "xla", 5, "float32", hidden_weight=0.5)
  plain = LossSettings("tail", 1.0, 0.0, "xla", 5, "float32")
  grad_fn = jax.value_and_grad(train.loss_fn, has_aux=True)
  (value, metrics), grads = grad_fn({"params": params, "hidden_proj": proj}, graphdef, batch,
                                    settings, 1)
  value_0, _ = train.loss_fn({"params": params}, graphdef, batch, plain, 1)
  h = np.asarray(student(batch["tokens"], batch["positions"], batch["segment_ids"])).reshape(-1, 32)
  ref, _, ref_dw = reference_nmse(h, np.asarray(batch["hidden"], np.float64).reshape(-1, 6),
                                 np.asarray(batch["loss_mask"]).reshape(-1), proj)
  np.testing.assert_allclose(float(value) - float(value_0), 0.5 * ref, rtol=1e-4)
  np.testing.assert_allclose(float(metrics["hidden_nmse"]), ref, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(grads["hidden_proj"]), 0.5 * ref_dw, rtol=1e-4,
                             atol=1e-6 * np.abs(ref_dw).max())


@pytest.mark.parametrize("student_d", [32, TEACHER_D])  # learned projection; none
def test_training_with_the_hidden_term(tmp_path, make_data, write, student_d):
  store = hidden_cache(tmp_path, make_data, write, hidden_dim=TEACHER_D)
  student, cfg = tiny_llama(student_d, 1)
  loss = config.base().loss
  loss.update(objective="tail", hidden_weight=1.0, chunk_size=5)
  opt = config.opt_group(steps=12, batch_size=2, warmup_steps=1, log_every=1, ckpt_every=6,
                         lr=2e-2)
  train.fit(name="s", model=student, model_cfg=cfg, store=store, workdir=str(tmp_path / "s"),
            opt=opt, loss_cfg=loss, hard_labels=False, seed=0)
  from kdjax.plots import read_metrics
  lines = read_metrics(tmp_path / "s" / "metrics.jsonl")
  nmse = [line["hidden_nmse"] for line in lines]
  assert len(nmse) == 12 and all(np.isfinite(nmse))
  assert np.mean(nmse[-3:]) < 0.8 * np.mean(nmse[:3])
  # the finished run restores as a plain model (the projection is not part of it)
  from kdjax.training import checkpoints
  assert checkpoints.restore_finished(str(tmp_path / "s"), cfg, 12) is not None


def test_config_checks_the_hidden_term():
  c = config.base()
  c.loss.hidden_weight = 1.0
  with pytest.raises(ValueError, match="cache.hidden_states=True"):
    config.validate(c)
  c.cache.hidden_states = True
  config.validate(c)
  c.cache.hidden_dim = -1
  with pytest.raises(ValueError, match="cache.hidden_dim must be >= 0"):
    config.validate(c)
