"""A student pruned from its teacher (kdjax/models/prune.py): all kept is the teacher exactly,
fewer layers is the teacher run with those layers, narrower widths hold the teacher's values at
the kept indices, and what is dropped is what the calibration rows show unimportant."""
import dataclasses
import functools
import re

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kdjax.models import llama, prune

CFG = llama.ModelConfig(vocab_size=64, d_model=16, n_layers=4, n_heads=4, n_kv_heads=2,
                        head_dim=8, d_ff=24, remat="none")


def rows(seed=0, b=4, t=16):
  rng = np.random.default_rng(seed)
  segment_ids = np.ones((b, t), np.int32)
  segment_ids[0, t // 2:] = 2  # two documents in one row
  segment_ids[1, t - 3:] = 0  # padding
  positions = np.tile(np.arange(t, dtype=np.int32), (b, 1))
  positions[0, t // 2:] -= t // 2
  return {"tokens": rng.integers(0, 64, (b, t)).astype(np.int32), "positions": positions,
          "segment_ids": segment_ids}


@nnx.jit
def forward(model, tokens_BxT, positions_BxT, segment_ids_BxT):
  return model(tokens_BxT, positions_BxT, segment_ids_BxT)


def hidden(model, r):
  return np.asarray(forward(model, r["tokens"], r["positions"], r["segment_ids"]))


@functools.partial(nnx.jit, static_argnames="layers")
def forward_layers(model, tokens_BxT, positions_BxT, segment_ids_BxT, layers):
  """The teacher run with only `layers` (a static tuple of its blocks), as Transformer does."""
  x_BxTxD = jnp.take(model.embed_VxD[...], tokens_BxT, axis=0)
  inv_freq = llama.rope.inv_freq(model.cfg)
  for i in layers:
    x_BxTxD = model.layers[i](x_BxTxD, positions_BxT, segment_ids_BxT, inv_freq, None)
  return llama.rms_norm(x_BxTxD, model.final_norm_D[...], model.cfg.norm_eps)


def teacher(cfg=CFG, seed=0):
  return llama.Transformer(cfg, rngs=nnx.Rngs(seed))


@pytest.mark.parametrize("extras", [{}, {"attention_bias": True, "qk_norm": True,
                                         "tie_embeddings": True, "attention_sinks": True}])
def test_all_kept_is_the_teacher_exactly(extras):
  model = teacher(dataclasses.replace(CFG, **extras))
  r = rows()
  student, kept = prune.from_teacher(model, prune.student_config(model.cfg), r, batch_size=2)
  assert kept.layers == (0, 1, 2, 3)
  assert student.cfg == model.cfg
  np.testing.assert_array_equal(hidden(student, r), hidden(model, r))


def test_fewer_layers_is_the_teacher_run_with_those_layers():
  model, r = teacher(), rows()
  student, _ = prune.from_teacher(model, prune.student_config(CFG, n_layers=2), r, layers=(1, 3))
  want_BxTxD = forward_layers(model, r["tokens"], r["positions"], r["segment_ids"], (1, 3))
  np.testing.assert_array_equal(hidden(student, r), np.asarray(want_BxTxD))


def test_narrower_student_holds_the_teachers_values_at_the_kept_indices():
  model = teacher()
  cfg = prune.student_config(CFG, n_layers=3, d_model=10, n_heads=2, n_kv_heads=1, d_ff=12,
                             param_dtype="float32")
  student, kept = prune.from_teacher(model, cfg, rows())
  assert len(kept.layers) == 3 and kept.channels_D.shape == (10,)
  c = kept.channels_D
  np.testing.assert_array_equal(student.embed_VxD[...], model.embed_VxD[...][:, c])
  np.testing.assert_array_equal(student.unembed_DxV[...], model.unembed_DxV[...][c])
  np.testing.assert_array_equal(student.final_norm_D[...], model.final_norm_D[...][c])
  for j, i in enumerate(kept.layers):
    s, t = student.layers[j], model.layers[i]
    g, f = kept.groups_LxG[j], kept.neurons_LxF[j]
    heads = np.concatenate([np.arange(2 * k, 2 * k + 2) for k in g])  # R = 2
    assert s.wq_DxHxE.shape == (10, 2, 8) and s.wk_DxGxE.shape == (10, 1, 8)
    np.testing.assert_array_equal(s.wq_DxHxE[...], t.wq_DxHxE[...][c][:, heads])
    np.testing.assert_array_equal(s.wk_DxGxE[...], t.wk_DxGxE[...][c][:, g])
    np.testing.assert_array_equal(s.wv_DxGxE[...], t.wv_DxGxE[...][c][:, g])
    np.testing.assert_array_equal(s.wo_HxExD[...], t.wo_HxExD[...][heads][:, :, c])
    np.testing.assert_array_equal(s.w_gate_DxF[...], t.w_gate_DxF[...][c][:, f])
    np.testing.assert_array_equal(s.w_up_DxF[...], t.w_up_DxF[...][c][:, f])
    np.testing.assert_array_equal(s.w_down_FxD[...], t.w_down_FxD[...][f][:, c])
    np.testing.assert_array_equal(s.attn_norm_D[...], t.attn_norm_D[...][c])
    np.testing.assert_array_equal(s.mlp_norm_D[...], t.mlp_norm_D[...][c])
  assert np.all(np.isfinite(hidden(student, rows())))


def zero(param, index):
  param[...] = param[...].at[index].set(0.0)


def test_what_is_dropped_is_what_the_rows_show_unimportant():
  model = teacher()
  zero(model.layers[2].wo_HxExD, ...)  # block 2 adds nothing: its output is its input
  zero(model.layers[2].w_down_FxD, ...)
  zero(model.layers[1].wv_DxGxE, (slice(None), 0))  # layer 1's kv group 0 outputs zeros
  zero(model.layers[0].w_up_DxF, (slice(None), 5))  # layer 0's neuron 5 is always 0
  zero(model.embed_VxD, (slice(None), 7))  # residual channel 7 is never written: always 0
  for block in model.layers:
    zero(block.wo_HxExD, (slice(None), slice(None), 7))
    zero(block.w_down_FxD, (slice(None), 7))
  importance = prune.measure(model, rows(), batch_size=4)
  assert importance.block_L[2] < 1e-6 < importance.block_L.min(initial=1, where=np.arange(4) != 2)
  assert importance.groups_LxG[1, 0] == 0 and importance.neurons_LxF[0, 5] == 0
  assert importance.channels_D[7] == 0
  cfg = prune.student_config(CFG, n_layers=3, d_model=15, n_heads=2, n_kv_heads=1, d_ff=23)
  kept = prune.choose(importance, cfg)
  assert kept.layers == (0, 1, 3)
  assert list(kept.groups_LxG[1]) == [1] and 5 not in kept.neurons_LxF[0]
  assert 7 not in kept.channels_D


def test_padding_does_not_count():
  model, r = teacher(), rows()
  other = {k: v.copy() for k, v in r.items()}
  other["tokens"][r["segment_ids"] == 0] = 3  # different tokens, but only in the padding
  a, b = prune.measure(model, r, 4), prune.measure(model, other, 4)
  for name in ("block_L", "groups_LxG", "neurons_LxF", "channels_D"):
    np.testing.assert_allclose(getattr(a, name), getattr(b, name), rtol=1e-6)


@pytest.mark.parametrize("values, message", [
    ({"d_model": 32}, "student.d_model (32) must be in [1, the teacher's 16]"),
    ({"n_heads": 2}, "student.n_heads (2) must be 2 x student.n_kv_heads (2)"),
    ({"head_dim": 4}, "a pruned student sets only"),
])
def test_student_config_refusals(values, message):
  with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(")
                     .replace(")", r"\)")):
    prune.student_config(CFG, **values)


def test_moe_teacher_is_refused():
  moe_cfg = dataclasses.replace(CFG, n_experts=4, experts_per_token=2)
  with pytest.raises(ValueError, match="mixture-of-experts"):
    prune.student_config(moe_cfg, n_layers=2)


@pytest.mark.parametrize("layers, message", [
    ((0, 1), "lists 2 layers but student.n_layers is 3"),
    ((0, 1, 4), "indices of the teacher's 4 layers"),
    ((2, 1, 3), "distinct and in increasing order"),
])
def test_layer_choices_are_checked(layers, message):
  with pytest.raises(ValueError, match=message):
    prune.check_layers(layers, 4, 3)


def test_config_checks_of_init():
  from kdjax import config
  c = config.base()
  c.init.from_teacher = True
  c.teacher.update(n_layers=4, d_model=64, n_heads=4, n_kv_heads=2, d_ff=128)
  c.student.update(n_layers=2, d_model=32, n_heads=2, n_kv_heads=1, d_ff=64)
  config.validate(c)
  for group, field, value, message in [
      ("student", "d_ff", 256, "student.d_ff (256) must be in [1, the teacher's 128]"),
      ("student", "hf_path", "/x", "set student.hf_path=''"),
      ("init", "layers", (0, 1, 2), "init.layers lists 3 layers but student.n_layers is 2"),
      ("init", "layers", (0, 4), "indices of the teacher's 4 layers"),
      ("init", "calibration_rows", 0, "init.calibration_rows must be >= 1")]:
    bad = c.copy_and_resolve_references()
    bad[group][field] = value
    with pytest.raises(ValueError, match=re.escape(message)):
      config.validate(bad)


@pytest.mark.slow
def test_demo_student_pruned_from_the_pretrained_teacher_starts_far_better(tmp_path):
  """configs/demo.py:smoke with init.from_teacher: the pretrained teacher (2 layers, d_model 64,
  4 heads, d_ff 128) pruned to 1 layer, d_model 48, 2 heads, d_ff 96 starts far closer to the
  teacher than a random init of those shapes."""
  import json
  import os
  import subprocess
  import sys

  from kdjax import cache, evaluate
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  workdir = tmp_path / "w"
  out = subprocess.run(
      [sys.executable, "-m", "kdjax.main", f"--config={root}/configs/demo.py:smoke",
       f"--config.workdir={workdir}", "--config.init.from_teacher=True",
       "--config.stages=('data', 'pretrain', 'cache', 'train', 'eval')",
       "--config.pretrain.steps=12", "--config.eval.max_seqs=16", "--config.student.d_model=48",
       "--config.student.d_ff=96"],
      capture_output=True, text=True, cwd=root, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert out.returncode == 0, out.stderr[-4000:]
  assert "student pruned from its teacher" in out.stderr
  results = json.load(open(workdir / "eval.json"))
  assert set(results) == {"student_init", "teacher", "student"}
  shapes = json.load(open(workdir / "config.json"))["student"]
  random_cfg = llama.ModelConfig.from_config(shapes, vocab_size=512)  # the smoke tokenizer
  random = evaluate.evaluate(llama.Transformer(random_cfg, rngs=nnx.Rngs(0)),
                             cache.open(str(workdir / "cache" / "eval.zarr")), batch_size=8,
                             max_seqs=16, chunk_size=None)
  pruned = results["student_init"]
  assert pruned["kl"] < 0.7 * random["kl"] and pruned["ce"] < random["ce"]
