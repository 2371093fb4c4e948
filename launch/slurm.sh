#!/usr/bin/env bash
# A SLURM job of several processes (one per GPU), jax.distributed reading SLURM's variables:
#
#   sbatch --nodes=2 --ntasks-per-node=8 --gpus-per-node=8 launch/slurm.sh \
#       --config=configs/32k.py --config.mesh.data=2 --config.mesh.fsdp=8 \
#       --config.stages="('cache', 'train')"
#
# The mesh's product (data x fsdp) must be the job's GPUs (nodes x tasks per node). Stages data,
# pretrain, cache, train and baseline run under it; eval and export afterwards in one process.
#SBATCH --job-name=kdjax
#SBATCH --output=kdjax-%j.out
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"
python=${PYTHON:-.venv/bin/python}
export XLA_PYTHON_CLIENT_PREALLOCATE=${XLA_PYTHON_CLIENT_PREALLOCATE:-false}
# One GPU per task: srun binds them; kdjax.main calls jax.distributed.initialize(), which reads
# the coordinator, process count and id from SLURM's environment.
exec srun --gpus-per-task=1 "$python" -m kdjax.main "$@"
