#!/usr/bin/env bash
# Several processes of one run (jax.distributed), each seeing its own devices: the mesh
# (--config.mesh.data / fsdp, their product the devices of all processes) spans them all.
#
#   On one host, N processes (e.g. one per GPU; on CPU, for trying it out):
#     KDJAX_PROCESSES=2 bash launch/multiprocess.sh --config=configs/8k.py --config.mesh.data=2
#   On several hosts, this process only (run it on each host with its own id):
#     KDJAX_COORDINATOR=host0:12355 KDJAX_NUM_PROCESSES=4 KDJAX_PROCESS_ID=$i \
#         bash launch/multiprocess.sh --config=...
#
# Stages data, pretrain, cache (each process writes its own regions; with
# --config.cache.teacher_devices=all one teacher over all processes, process 0 writing), train
# and baseline run under it on all processes; eval and export too (each process measures its own
# copy, process 0 writes). On SLURM use launch/slurm.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
export XLA_PYTHON_CLIENT_PREALLOCATE=${XLA_PYTHON_CLIENT_PREALLOCATE:-false}

if [[ -n "${KDJAX_COORDINATOR:-}" ]]; then  # one process of a run launched elsewhere
  exec "$python" -m kdjax.main "$@"
fi

n=${KDJAX_PROCESSES:-2}
export KDJAX_COORDINATOR="localhost:${KDJAX_PORT:-12355}" KDJAX_NUM_PROCESSES=$n
gpus=$("$python" -c 'import jax; print(jax.local_device_count() if jax.default_backend() == "gpu" else 0)')
pids=()
for ((i = 0; i < n; i++)); do
  if ((gpus >= n)); then  # one process per GPU
    CUDA_VISIBLE_DEVICES=$i KDJAX_PROCESS_ID=$i "$python" -m kdjax.main "$@" &
  else
    KDJAX_PROCESS_ID=$i "$python" -m kdjax.main "$@" &
  fi
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
