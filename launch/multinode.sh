#!/usr/bin/env bash
# On every node:  NNODES=2 NODE_RANK=<0|1> RDZV_ENDPOINT=head-node:29500 NGPU=8 ./launch/multinode.sh train.py
#
# Several hosts through torchrun's own c10d rendezvous (no home-made launcher): the mesh is
# ("host", "gpu") = (NNODES, NGPU); the script runs on global rank 0 only.  Tested in CI with
# two invocations on one machine (RDZV_ENDPOINT=127.0.0.1:PORT, NGPU=2, CPU workers).
set -euo pipefail
: "${NNODES:?set NNODES}" "${NODE_RANK:?set NODE_RANK}" "${RDZV_ENDPOINT:?set RDZV_ENDPOINT (host:port of node 0)}"
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  NGPU=${NGPU:-$(nvidia-smi -L | wc -l)}
else
  NGPU=${NGPU:-2}
  export TDMESH_DEVICE=cpu
fi
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
# Several hosts: share a secret (chmod 600; the same file on every node) so that the job token
# is derived, never written into the c10d store; on a shared network add TDMESH_TLS_CERT,
# TDMESH_TLS_KEY and TDMESH_TLS_CA (docs/SECURITY.md).  Without a secret rank 0 warns.
if [ -n "${TDMESH_SECRET_FILE:-}" ]; then export TDMESH_SECRET_FILE; fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec python -m torch.distributed.run --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc_per_node "$NGPU" \
  --rdzv-backend c10d --rdzv-endpoint "$RDZV_ENDPOINT" --rdzv-id "${RDZV_ID:-tdmesh}" \
  --max-restarts "${MAX_RESTARTS:-0}" -m tdmesh.worker "$@"
