#!/usr/bin/env bash
# A SLURM job of several processes (one per GPU), jax.distributed reading SLURM's variables:
#
#   sbatch --nodes=2 --ntasks-per-node=8 --gpus-per-node=8 launch/slurm.sh \
#       --config=configs/32k.py --config.mesh.data=2 --config.mesh.fsdp=8
#
# The mesh's product (data x fsdp x tensor) must be the job's GPUs (nodes x tasks per node).
# Every stage runs under it: the data stage on process 0, the cache stage's regions per process
# (or one teacher over all with --config.cache.teacher_devices=all), eval and export on every
# process with process 0 writing.
#SBATCH --job-name=kdjax
#SBATCH --output=kdjax-%j.out
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"
python=${PYTHON:-.venv/bin/python}
export XLA_PYTHON_CLIENT_PREALLOCATE=${XLA_PYTHON_CLIENT_PREALLOCATE:-false}
# One GPU per task: srun binds them; kdjax.main calls jax.distributed.initialize(), which reads
# the coordinator, process count and id from SLURM's environment.
exec srun --gpus-per-task=1 "$python" -m kdjax.main "$@"
