"""A torchx component:  torchx run -s local_cwd launch/torchx_component.py:tdmesh_job --script train.py -j 1x2

Builds the same command as launch/multinode.sh (torchrun, c10d rendezvous, -m tdmesh.worker)
for any torchx scheduler (local, Slurm, Kubernetes).  torchx itself is optional: install it
with ``pip install torchx`` to use this file; tdmesh does not depend on it.
"""


def tdmesh_job(*script_args: str, script: str, j: str = "1x2", image: str = "tdmesh:latest",
               gpus_per_node: int = 0, max_restarts: int = 0):
    """``j`` is NNODESxNPROC_PER_NODE; ``script`` runs on rank 0 as ``__main__``."""
    from torchx import specs

    nnodes, nproc = (int(x) for x in j.split("x"))
    rdzv = "$${app_id}-0.$${app_id}:29500" if nnodes > 1 else "localhost:0"
    args = ["-m", "torch.distributed.run", "--nnodes", str(nnodes), "--nproc_per_node", str(nproc),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv, "--max-restarts", str(max_restarts),
            "-m", "tdmesh.worker", script, *script_args]
    env = {"NCCL_NVLS_ENABLE": "0", "OMP_NUM_THREADS": "1"}
    if gpus_per_node == 0:
        env["TDMESH_DEVICE"] = "cpu"
    return specs.AppDef(name="tdmesh", roles=[specs.Role(
        name="worker", image=image, entrypoint="python", args=args, env=env, num_replicas=nnodes,
        resource=specs.Resource(cpu=max(1, nproc), gpu=gpus_per_node, memMB=16384),
        port_map={"c10d": 29500})])
