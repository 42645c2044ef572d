#!/usr/bin/env bash
# Ray inside a SLURM allocation, then one pita run on it (docs/operations.md, "On a Ray cluster").
#   sbatch --nodes=2 --gpus-per-node=4 scripts/ray_on_slurm.sh experiment=goal_walk hydra.run.dir=/shared/runs/gw
# The head starts on the allocation's first node, a worker on each of the others (srun), the
# run uses every GPU of the allocation (executor=ray), and the cluster stops when the run ends.
# The run folder must be on storage every node mounts (pita checks it before the first task).
#   RAY_PORT     the head's GCS port (default 6379)
#   PITA_PYTHON  the interpreter with pita and ray installed (default .venv/bin/python)
#SBATCH --job-name=pita-ray
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"
PY=${PITA_PYTHON:-.venv/bin/python}
RAY="$(dirname "$PY")/ray"
PORT=${RAY_PORT:-6379}
if [ -z "${SLURM_JOB_NODELIST:-}" ]; then
  echo "error: scripts/ray_on_slurm.sh runs inside a SLURM allocation (sbatch or salloc)" >&2
  exit 2
fi
mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
HEAD=${NODES[0]}
HEAD_IP=$(srun --nodes=1 --ntasks=1 -w "$HEAD" hostname --ip-address | awk '{print $1}')
ADDRESS="$HEAD_IP:$PORT"
GPUS=${SLURM_GPUS_ON_NODE:-0}
CPUS=${SLURM_CPUS_ON_NODE:-$(nproc)}

stop_cluster() {  # every node's Ray, started below, goes with the job step
  kill "${STEPS[@]}" 2>/dev/null || true
  wait 2>/dev/null || true
}
STEPS=()
trap stop_cluster EXIT

echo "Ray head on $HEAD ($ADDRESS), workers on ${NODES[*]:1}"
srun --nodes=1 --ntasks=1 -w "$HEAD" "$RAY" start --head --block --node-ip-address="$HEAD_IP" \
  --port="$PORT" --num-gpus="$GPUS" --num-cpus="$CPUS" --include-dashboard=false &
STEPS+=($!)
sleep 10
for node in "${NODES[@]:1}"; do
  srun --nodes=1 --ntasks=1 -w "$node" "$RAY" start --block --address="$ADDRESS" \
    --num-gpus="$GPUS" --num-cpus="$CPUS" &
  STEPS+=($!)
done
# wait until every node has joined (at most 5 minutes)
for _ in $(seq 60); do
  joined=$("$PY" -c "import ray; ray.init(address='$ADDRESS', logging_level='ERROR'); print(sum(n['Alive'] for n in ray.nodes()))" 2>/dev/null || echo 0)
  [ "$joined" -ge "${#NODES[@]}" ] && break
  sleep 5
done
echo "$joined of ${#NODES[@]} nodes joined"
"$PY" run_parallel.py executor=ray executor.ray_address="$ADDRESS" "$@"
