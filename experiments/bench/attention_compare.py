"""The packed attention of today's kdjax.models.attention against an older commit's, in one
process: is a change to the attention's code slower or faster where nothing else differs?

    XLA_PYTHON_CLIENT_PREALLOCATE=false python -m experiments.bench.attention_compare \
        [--seq-len 32768 --docs 8] [--against fe02211 | --module PATH]

attention_bench's "packed" way (one row of `docs` Dirichlet documents, Llama-3.2-3B's heads, the
batch's own documents bound), timed with its measure(): today's module, the other, today's again
(the two of today's show the run's own spread). The other module is `git show COMMIT:...`
(a self-contained attention.py, as at fe02211, before the kept backward of f866861), or --module
where the machine has no git history. One JSON line per timing on stdout and in --results.
"""
import argparse
import importlib.util
import subprocess
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from experiments.bench import attention_bench, e2e_bench
from experiments.bench.synthetic_rows import packed_segments
from kdjax.models import documents

PATH = "kdjax/models/attention.py"


def load_module(path: str):
  spec = importlib.util.spec_from_file_location("attention_other", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def other_module(args):
  if args.module:
    return load_module(args.module), args.module
  text = subprocess.run(["git", "show", f"{args.against}:{PATH}"], capture_output=True, text=True,
                        check=True).stdout
  with tempfile.NamedTemporaryFile("w", suffix=".py") as f:
    f.write(text)
    f.flush()
    return load_module(f.name), args.against


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--seq-len", type=int, default=32768)
  p.add_argument("--docs", type=int, default=8)
  p.add_argument("--against", default="fe02211", help="the commit whose attention.py to time")
  p.add_argument("--module", default="", help="that attention.py as a file (no git needed)")
  p.add_argument("--results", default="")
  args = p.parse_args()
  other, label = other_module(args)
  seg, _ = packed_segments(np.random.default_rng(0), 1, args.seq_len, args.docs)
  bound = documents.documents_bound(seg)
  s = jnp.asarray(seg)
  n = attention_bench.pairs(seg)
  for name, module in (("packed_head", attention_bench.attn), (f"packed_{label}", other),
                       ("packed_head2", attention_bench.attn)):
    f = lambda q, k, v, module=module: module.attention_cudnn(q, k, v, s, bound)
    row = attention_bench.measure(name, f, (1, args.seq_len), n, 0)
    row.update(docs=args.docs, bound=bound, mean_context=n / args.seq_len,
               heads=[attention_bench.H, attention_bench.G, attention_bench.E],
               commit=e2e_bench.commit(), device=str(jax.devices()[0].device_kind),
               date=e2e_bench.today())
    e2e_bench.record(row, args.results)


if __name__ == "__main__":
  main()
