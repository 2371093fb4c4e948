"""The choice lists of config values, in a module that imports nothing.

Reading a config (kdjax.config) needs the choices but none of the code that implements them, so
they live here, and each implementing module takes its list from here: a config cannot offer a
choice the code lacks, and `import kdjax.config` loads no JAX, flax, optax or TensorStore.
"""

DTYPES = ("float32", "bfloat16")  # models/llama.DTYPES: activations, parameters, optimizer state
LAYOUTS = ("float32", "compact", "packed", "dictionary")  # cache/layout.py: top-k encodings
LOSS_MASKS = ("all", "assistant")  # data/sources.py: which tokens are targets
# loss/topk_kl.py: "reference" is dense, the others its CHUNKED table's; "auto" is "pallas" on a
# GPU, else "xla".
LOSS_IMPLS = ("auto", "reference", "xla", "pallas", "pallas_exact", "paper")
OBJECTIVES = ("sparse", "tail", "renorm")  # loss/objectives.py: the cached objectives
# loss/full_kl.py: what objective "online" minimises between the teacher p and the student q.
DIVERGENCES = ("forward", "reverse", "skew_forward", "skew_reverse")
TEACHER_DEVICES = ("process", "all")  # parallel.py: the cache stage's teacher, per process or one
ATTENTION_IMPLS = ("auto", "einsum", "cudnn")  # models/attention.py
MLP_IMPLS = ("auto", "xla", "pallas")  # models/llama.py (kernels/swiglu.py)
EXPERT_WEIGHTS = ("float", "mxfp4")  # models/moe.py
# models/remat.py: what a block keeps for its backward pass; "auto": remat_auto.py chooses.
REMAT_POLICIES = ("none", "names", "dots", "dots_attention", "attention", "offload", "full")
REMAT_CHOICES = REMAT_POLICIES + ("auto",)
