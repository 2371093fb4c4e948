"""Would top-k student logits read back from the bf16 softmax numerator E be accurate enough?

A kernel that writes only E = exp(z / tau - shift) in bf16 from the logits matmul (see
kdjax/kernels/mgpu.py) cannot also hand out the exact float32 logits at the teacher's top-k
ids; they would be recovered as shift + tau * log(E), with up to 2^-8 relative error in each
q_k, which then enters the loss and the exact dL/dz entries a * q_k - p_k. This distils the demo
student (configs/demo.py, bf16 matmuls) both ways, impl "xla" with that recovery patched in
(arm "from_e") or not ("exact"), per seed, and prints the held-out KL and CE.

    python -m experiments.archive.topk_from_e_ab [--seeds 0,1] [--out runs/topk_from_e_ab]
"""
import contextlib
import os

import jax
import jax.numpy as jnp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments.studies import demo_ab
from kdjax.loss import chunked, objectives


def from_e(chunk_terms):
  """chunk_terms with the top-k and label logits recovered from the bf16 E (when E exists)."""

  def patched(hidden_CxD, lm_head_DxV, ids_CxK, logp_CxK, labels_C, spec, project, dtype,
              stats=False, axis=None):
    out = chunk_terms(hidden_CxD, lm_head_DxV, ids_CxK, logp_CxK, labels_C, spec, project, dtype,
                      stats, axis)
    if out.e_CxV is None:
      return out
    shift_C = jnp.max(out.logits_CxV, axis=-1)  # exp_pass_reference shifts by the row maximum
    tiny = jnp.finfo(out.e_CxV.dtype).tiny

    def recover(ids_CxJ):
      e_CxJ = jnp.take_along_axis(out.e_CxV, ids_CxJ, axis=-1).astype(jnp.float32)
      return shift_C[:, None] + spec.temperature * jnp.log(jnp.maximum(e_CxJ, tiny))

    gathered = out.gathered._replace(zk_CxK=recover(ids_CxK),
                                     zl_C=recover(labels_C[:, None])[:, 0])
    # The per-position statistics (stats) stay the exact pass's.
    terms = dict(out.terms, **objectives.row_terms(*gathered, logp_CxK, spec))
    return out._replace(gathered=gathered, terms=terms)

  return patched


@contextlib.contextmanager
def arm_terms(arm: str):
  """Within: the chunked loss reads its top-k logits the way `arm` says ("exact" or "from_e").
  JAX's caches are cleared on the way in and out: the train step is jitted once for the process
  (training.train.grad_step), so an arm would otherwise rerun the program an earlier arm traced."""
  exact = chunked.chunk_terms
  chunked.chunk_terms = exact if arm == "exact" else from_e(exact)
  jax.clear_caches()
  try:
    yield
  finally:
    chunked.chunk_terms = exact
    jax.clear_caches()


def main():
  args = demo_ab.parse_args(__doc__, "runs/topk_from_e_ab")
  prep = demo_ab.prepare(args.out)
  results = {}
  for seed in args.seeds:
    for arm in ("exact", "from_e"):
      results[f"{arm}_seed{seed}"] = demo_ab.distil(
          prep, args.out, f"{arm}_seed{seed}", seed, lambda c: setattr(c.loss, "impl", "xla"),
          train_only=lambda arm=arm: arm_terms(arm))
      demo_ab.report(results, args.out)


if __name__ == "__main__":
  main()
