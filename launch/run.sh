#!/usr/bin/env bash
# NGPU=8 LOG_RANK=0 ./launch/run.sh tutorials/05_train.py --steps 100 --size small
#
# One host, torchtitan style: NGPU workers (one per GPU; with no GPU, NGPU CPU workers over
# gloo, default 2), the script on rank 0.  LOG_RANK picks whose output reaches this terminal
# (comma-separated local ranks); every rank's output is teed (--tee 3) so torchrun's filter applies.
set -euo pipefail
if [ $# -lt 1 ]; then
  echo "usage: NGPU=N LOG_RANK=0 $0 script.py [args...]" >&2
  exit 2
fi
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  NGPU=${NGPU:-$(nvidia-smi -L | wc -l)}
else
  NGPU=${NGPU:-2}
  export TDMESH_DEVICE=cpu          # CPU/gloo mode
fi
LOG_RANK=${LOG_RANK:-0}
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec python -m torch.distributed.run --standalone --nproc_per_node "$NGPU" \
  --local-ranks-filter "$LOG_RANK" --role rank --tee 3 \
  -m tdmesh.worker "$@"
