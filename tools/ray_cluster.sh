#!/usr/bin/env bash
# Start or stop the Ray cluster that `cluster.launcher: ray` runs on (one head, one worker per other node).
#
#   tools/ray_cluster.sh head   [--num-gpus N] [--num-cpus N] [--port 6379]   # on the first node
#   tools/ray_cluster.sh worker HEAD_IP:6379 [--num-gpus N] [--num-cpus N]    # on every other node
#   tools/ray_cluster.sh status                                               # nodes and resources
#   tools/ray_cluster.sh stop                                                 # on every node
#
# Every node needs this checkout's venv, the model and the data at the same paths (rollverify train checks it on
# every node before it starts anything). A run then joins with cluster.address=auto (on the head) or
# cluster.address=HEAD_IP:6379. The command is printed before it runs.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RAY="${RAY:-$ROOT/.venv/bin/ray}"
[[ -x "$RAY" ]] || { echo "error: $RAY not found: run 'make setup' (ray is pinned in requirements/*.txt)" >&2; exit 2; }

cmd="${1:-}"; shift || true
COMMON_ARGS=(
  --disable-usage-stats
  --include-dashboard=false
)
case "$cmd" in
  head)
    PORT=6379; RESOURCE_ARGS=()
    while [[ $# -gt 0 ]]; do
      case "$1" in
        --port) PORT="$2"; shift 2 ;;
        --num-gpus|--num-cpus) RESOURCE_ARGS+=("$1" "$2"); shift 2 ;;
        *) echo "error: unknown option $1" >&2; exit 2 ;;
      esac
    done
    ARGS=(start --head --port "$PORT" "${COMMON_ARGS[@]}" "${RESOURCE_ARGS[@]}")
    ;;
  worker)
    HEAD="${1:-}"; shift || true
    [[ -n "$HEAD" ]] || { echo "error: worker needs the head's address, e.g. tools/ray_cluster.sh worker 10.0.0.1:6379" >&2; exit 2; }
    RESOURCE_ARGS=()
    while [[ $# -gt 0 ]]; do
      case "$1" in
        --num-gpus|--num-cpus) RESOURCE_ARGS+=("$1" "$2"); shift 2 ;;
        *) echo "error: unknown option $1" >&2; exit 2 ;;
      esac
    done
    ARGS=(start --address "$HEAD" --disable-usage-stats "${RESOURCE_ARGS[@]}")
    ;;
  status) ARGS=(status) ;;
  stop) ARGS=(stop) ;;
  *) sed -n '2,12p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac

echo "+ $RAY ${ARGS[*]}"
t0=$(date +%s%N)
"$RAY" "${ARGS[@]}"
echo "[ray_cluster] $cmd took $(( ($(date +%s%N) - t0) / 1000000 )) ms"
