"""The device mesh of a run (config group `mesh`) and where arrays live on it.

    mesh = make_mesh(c.mesh)            # axes ("data", "fsdp", "tensor"), sizes from the config
    state = place_state(mesh, state)    # parameters and optimizer state over "tensor", "fsdp"
    batch = place_batch(mesh, batch)    # rows [A, B, ...] sharded over ("data", "fsdp")

Student training is data-parallel over data x fsdp devices, each holding B / (data * fsdp) rows
of a micro-batch, with fully sharded parameters, gradients and AdamW state (each array split
along its largest dimension that the fsdp size divides; XLA gathers parameters where it needs
them). With mesh.tensor > 1 the devices of a tensor group share the same rows and split the
vocabulary, heads and MLP width of every parameter that has them (named by its shape letters:
V, H, G, F; `spec_of`): the lm_head by vocabulary, the body Megatron-style. The model body is
partitioned by XLA from these placements; the fused loss, whose kernels XLA cannot partition,
runs per device under `shard_map` on its own rows and its own vocabulary columns
(`sharded_loss`; the kernels' statistics combined across the tensor axis per chunk,
kdjax.loss.projection.combine_shards): each device's masked mean is turned into the global one
with psums.

The teacher (cache stage) of a run whose mesh has several devices is sharded over each process's
own devices (`teacher_mesh`: its weights split over them as they load, a batch's rows too), so a
teacher larger than one GPU fits in one host's; with cache.teacher_devices = "all" over every
process's devices, so a teacher larger than one host fits in all of them.

Several processes (jax.distributed: launch/multiprocess.sh, launch/slurm.sh): the mesh spans
every process's devices and the training stages run on all of them, each process loading the
same rows and placing its own share; the cache stage writes disjoint regions per process (rank =
process, `cache_rank`); the data stage runs on process 0 while the others wait; eval and export
run on every process (each its own copy of the models), process 0 writing their outputs.

One device is the 1 x 1 x 1 mesh (the default): arrays on that device, the loss outside
shard_map.
"""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from kdjax import choices
from kdjax.errors import UserError

AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")


def make_mesh(g, devices=None) -> Mesh:
  """The mesh of config group g (data, fsdp, tensor) over the first data x fsdp x tensor of
  `devices` (default: all of this run's)."""
  devices = jax.devices() if devices is None else devices
  shape = (g.data, g.fsdp, g.tensor)
  size = int(np.prod(shape))
  if size > len(devices) or (jax.process_count() > 1 and size != len(devices)):
    most = "exactly" if jax.process_count() > 1 else "at most"
    raise UserError(f"mesh data x fsdp x tensor = {' x '.join(map(str, shape))} = {size} "
                    f"devices, but this run has {len(devices)} ({jax.process_count()} "
                    f"processes): set mesh.data, mesh.fsdp and mesh.tensor so their product "
                    f"is {most} {len(devices)}.")
  return Mesh(np.asarray(devices[:size]).reshape(shape), AXES)


def several(mesh: Mesh | None) -> bool:
  """Whether mesh spans several devices: arrays are placed on it and the loss runs under
  shard_map. None and a mesh of one device are one device: arrays stay where they are."""
  return mesh is not None and mesh.size > 1


def data_shards(mesh: Mesh) -> int:
  return mesh.shape["data"] * mesh.shape["fsdp"]


def in_flight(mesh: Mesh | None) -> int:
  """How many independent programs a loop may dispatch before reading the oldest's outputs.

  One on a mesh of several CPU devices: XLA's CPU client runs each device's share of a program
  on a pool of one thread per device, and a collective holds its thread until every device has
  arrived; with several independent programs in flight the pool's threads can all be held by
  devices of different programs while the last device of the oldest waits for a thread, and
  XLA aborts the run after 40 s ("Termination timeout ... only 7 of them arrived"). Two
  elsewhere: the next batch computes while the host reads the last, and no more of a region's
  outputs wait in device memory."""
  return 1 if several(mesh) and mesh.devices.flat[0].platform == "cpu" else 2


# Dimensions split over "tensor", by their letter in a parameter's name (wq_DxHxE, w_down_FxD,
# embed_VxD): the first of these the name has and the tensor size divides.
TENSOR_DIMS = ("V", "H", "G", "F")


def spec_of(shape: tuple, fsdp: int, tensor: int = 1, letters: tuple | None = None) -> P:
  """A parameter's placement: over "tensor" its first TENSOR_DIMS dimension (letters: one per
  dimension, from its name) that tensor divides; over "fsdp" the largest other dimension that
  fsdp divides (ties: the earliest). Dimensions neither divides stay whole."""
  axes = [None] * len(shape)
  if tensor > 1 and letters:
    for letter in TENSOR_DIMS:
      if letter in letters and shape[letters.index(letter)] % tensor == 0:
        axes[letters.index(letter)] = "tensor"
        break
  if fsdp > 1:
    for i in sorted(range(len(shape)), key=lambda i: -shape[i]):
      if axes[i] is None and shape[i] % fsdp == 0:
        axes[i] = "fsdp"
        break
  while axes and axes[-1] is None:
    axes.pop()
  return P(*axes)


def letters_of(path: tuple, ndim: int) -> tuple | None:
  """The shape letters of the parameter a path leads to (its last key named like `wq_DxHxE`
  with ndim letters; optimizer state mirrors the parameters' paths), or None. Keys: tree path
  entries or plain names."""
  for key in reversed(path):
    name = key if isinstance(key, str) else getattr(key, "key", getattr(key, "name", None))
    if isinstance(name, str) and "_" in name:
      letters = tuple(name.rsplit("_", 1)[1].split("x"))
      if len(letters) == ndim and all(letter[:1].isupper() for letter in letters):
        return letters
  return None


def _place(x, sharding):
  """x (the same on every process) as a global array: each process fills its own devices."""
  if isinstance(x, jax.Array) and (not x.is_fully_addressable or jax.process_count() == 1):
    return jax.device_put(x, sharding)
  x = np.asarray(jax.device_get(x)) if isinstance(x, jax.Array) else np.asarray(x)
  return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def sharding_of(mesh: Mesh, path: tuple, shape: tuple) -> NamedSharding:
  """Where a parameter (or its optimizer state) lives: spec_of for its name's letters; path
  names it (tree path entries or plain keys, its name last)."""
  return NamedSharding(mesh, spec_of(shape, mesh.shape["fsdp"], mesh.shape["tensor"],
                                     letters_of(path, len(shape))))


def shardings_of(mesh: Mesh, tree):
  """sharding_of for every array (or shape-dtype struct) of tree: e.g. jit's out_shardings to
  create a state already sharded."""
  return jax.tree_util.tree_map_with_path(
      lambda path, x: sharding_of(mesh, path, np.shape(x)), tree)


def place_param(mesh: Mesh, path: tuple, x):
  """One parameter (host or device array, the same on every process) where place_state puts
  it."""
  return _place(x, sharding_of(mesh, path, np.shape(x)))


def place_state(mesh: Mesh, tree):
  """Every array of tree on the mesh, sharded over "tensor" and "fsdp" as spec_of says for its
  name's letters, replicated elsewhere."""
  return jax.tree_util.tree_map_with_path(lambda path, x: place_param(mesh, path, x), tree)


def place_batch(mesh: Mesh, batch_AxB: dict) -> dict:
  """A step's rows [A, B, ...] with B split over the batch axes; B must be a multiple of them
  (config.validate's rule on opt.batch_size). Every process passes the same rows (its loader
  has the same seed and order)."""
  sharding = NamedSharding(mesh, P(None, BATCH_AXES))
  return {name: _place(x, sharding) for name, x in batch_AxB.items()}


def place_rows(mesh: Mesh, x_BxT):
  """One array of rows [B, ...] on the mesh: B split over the batch axes where they divide it,
  else whole on every device."""
  spec = P(BATCH_AXES) if x_BxT.shape[0] % data_shards(mesh) == 0 else P()
  return _place(x_BxT, NamedSharding(mesh, spec))


TEACHER_DEVICES = choices.TEACHER_DEVICES


def teacher_mesh(devices: str) -> Mesh:
  """The teacher's devices as one fsdp group (its weights sharded over them, each running its
  share of a batch's rows): "process", this process's own; "all", every process's (a teacher
  larger than one host: every process runs each batch, process 0 writes the cache)."""
  devices = jax.local_devices() if devices == "process" else jax.devices()
  return Mesh(np.asarray(devices).reshape(1, len(devices), 1), AXES)


def run_teacher_mesh(g, devices: str) -> Mesh | None:
  """A run's teacher mesh: with mesh config group g of several devices, teacher_mesh(devices);
  else None (the teacher on one device)."""
  return teacher_mesh(devices) if g.data * g.fsdp * g.tensor > 1 else None


def spans_processes(mesh: Mesh | None) -> bool:
  return mesh is not None and any(d.process_index != jax.process_index()
                                  for d in mesh.devices.flat)


def gather(tree):
  """A tree of (possibly sharded, multi-process) arrays as host numpy arrays, on every process;
  when some span several processes a collective, which every process must call."""
  if all(getattr(x, "is_fully_addressable", True) for x in jax.tree.leaves(tree)):
    return jax.device_get(tree)
  from jax.experimental import multihost_utils
  return multihost_utils.process_allgather(tree, tiled=True)


def per_process(x: float) -> list[float]:
  """x of every process, in process order; of several, a collective every process calls."""
  if jax.process_count() == 1:
    return [float(x)]
  from jax.experimental import multihost_utils
  return [float(v) for v in np.ravel(multihost_utils.process_allgather(np.float32(x)))]


def cache_rank(rank: int, world: int) -> tuple[int, int]:
  """The cache writer's (rank, world): the config's, split further over this run's processes."""
  return rank * jax.process_count() + jax.process_index(), world * jax.process_count()


def barrier(name: str) -> None:
  """Every process waits here for the others (nothing to do in a run of one)."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices(name)


# A run of several processes (launch/multiprocess.sh, launch/slurm.sh) names its coordinator and
# its process in these; SLURM's own variables are read by jax.distributed when they are unset.
ENV_COORDINATOR, ENV_PROCESSES, ENV_PROCESS_ID = (
    "KDJAX_COORDINATOR", "KDJAX_NUM_PROCESSES", "KDJAX_PROCESS_ID")


def claim_memory(fraction: float, allocator: str = "") -> None:
  """Lets JAX allocate `fraction` of each GPU (mesh.memory_fraction) with `allocator`
  (mesh.allocator; "" JAX's default) unless the environment already says
  (XLA_PYTHON_CLIENT_MEM_FRACTION, XLA_PYTHON_CLIENT_ALLOCATOR). Read when JAX first uses a GPU:
  call before."""
  os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", str(fraction))
  if allocator:
    os.environ.setdefault("XLA_PYTHON_CLIENT_ALLOCATOR", allocator)


def initialize_distributed(failure_timeout_s: float = 60) -> None:
  """Joins a multi-process run (jax.distributed) when the environment describes one: our
  variables above, or a SLURM job step of several tasks. Must run before any device is used.
  jax.distributed's own heartbeat outlasts failure_timeout_s (kdjax.peers notices a lost
  process first and says so in one line; jax's would abort with thread dumps)."""
  timeouts = dict(heartbeat_timeout_seconds=int(2 * failure_timeout_s + 30),
                  shutdown_timeout_seconds=int(failure_timeout_s + 30))
  if os.environ.get(ENV_COORDINATOR):
    processes = int(os.environ[ENV_PROCESSES])
    if processes > 1 and jax.config.jax_platforms == "cpu":
      jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(os.environ[ENV_COORDINATOR], processes,
                               int(os.environ[ENV_PROCESS_ID]), **timeouts)
  elif int(os.environ.get("SLURM_NTASKS", "1")) > 1:
    jax.distributed.initialize(**timeouts)


def sharded_loss(loss_fn, mesh: Mesh | None, hidden_BxTxD, lm_head_DxV, batch: dict):
  """loss_fn(hidden, lm_head, batch, vocab_axis) -> (masked mean, {name: masked mean}) over the
  whole batch: per device on its rows under shard_map when the mesh has several devices (lm_head
  gathered whole, or with mesh.tensor > 1 its vocabulary split over "tensor": loss_fn then gets
  vocab_axis="tensor", see kdjax.loss.topk_kl_loss), each mean weighted by its device's count of
  batch["loss_mask"]."""
  if not several(mesh):
    return loss_fn(hidden_BxTxD, lm_head_DxV, batch, vocab_axis=None)
  tensor = mesh.shape["tensor"]
  if lm_head_DxV.shape[1] % tensor:
    raise UserError(f"the student's vocabulary ({lm_head_DxV.shape[1]}) cannot be split over "
                    f"mesh.tensor = {tensor} devices: make mesh.tensor a divisor of it.")
  vocab_axis = "tensor" if tensor > 1 else None

  def local(hidden_BxTxD, lm_head_DxV, batch):
    value, metrics = loss_fn(hidden_BxTxD, lm_head_DxV, batch, vocab_axis=vocab_axis)
    count = jnp.sum(batch["loss_mask"].astype(jnp.float32))
    total = jnp.maximum(jax.lax.psum(count, BATCH_AXES), 1.0)
    mean = lambda x: jax.lax.psum(x * count, BATCH_AXES) / total
    return mean(value), {k: mean(v) for k, v in metrics.items()}

  rows = P(BATCH_AXES)
  return jax.shard_map(local, mesh=mesh,
                       in_specs=(rows, P(None, "tensor"), {k: rows for k in batch}),
                       out_specs=(P(), P()), check_vma=False)(hidden_BxTxD, lm_head_DxV, batch)
