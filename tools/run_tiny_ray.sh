#!/usr/bin/env bash
# The tiny CPU model through the very same Ray path as the GPU jobs, on this one machine: trainer ranks and
# SGLang servers as actors of one placement group, CURVE on the servers' control endpoints (they bind to this
# machine's address, not loopback). With cluster.address unset (and no RAY_ADDRESS) `rollverify train` starts a
# one-node Ray of its own and stops it at the end; cluster.address=HOST:PORT joins one started with
# tools/ray_cluster.sh head instead.
#
#   tools/run_tiny_ray.sh [--out DIR] [--local] [KEY=VALUE ...]
#
# Default: 3 steps of rollverify with 2 trainer ranks (gloo) and 2 servers. --local runs the same job with the
# local launcher instead (no Ray), to compare wall times. Extra KEY=VALUE arguments go last and win.
# shellcheck disable=SC2034  # the argument arrays go to show_and_run by name
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=run_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/run_common.sh"

OUT="runs/tiny-ray-$(date +%Y%m%d-%H%M%S)"
LAUNCHER=ray
EXTRA_ARGS=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --out) OUT="$2"; shift 2 ;;
    --local) LAUNCHER=local; shift ;;
    *=*) EXTRA_ARGS+=("$1"); shift ;;
    *) die "unknown argument $1 (see the header of $0)" ;;
  esac
done
# Ray's memory monitor kills actors once the machine is 95 % full, which a small shared machine reaches without
# this run being at fault; the run's own Ray starts without it (set the variable to re-enable it)
export RAY_memory_monitor_refresh_ms="${RAY_memory_monitor_refresh_ms:-0}"
[[ ! -e "$OUT" ]] || die "$OUT exists; give another --out (a run folder is never overwritten here)"

MODEL_ARGS=(model.path=null)  # the tiny model, made offline and cached (rollverify make-tiny-model)
CLUSTER_ARGS=(cluster.launcher="$LAUNCHER" cluster.nodes=1 cluster.gpus_per_node=0)
# two servers starting at once on a busy 2-core machine take minutes: a start limit (and answer limit) of 900 s
ROLLOUT_ARGS=(servers.count=2 rollout.batch_groups=4 rollout.n=4 rollout.max_live=24 servers.timeout_s=900 servers.startup_s=900)
ALGO_ARGS=(algo.mode=rollverify)
TRAINER_ARGS=(trainer.steps=3 trainer.dp=2)
LOG_ARGS=(eval.every=0 log.plots=false log.tensorboard=false log.checkpoint_every=0 log.export_final=false)
show_and_run tiny_cpu "$OUT" MODEL_ARGS CLUSTER_ARGS ROLLOUT_ARGS ALGO_ARGS TRAINER_ARGS LOG_ARGS EXTRA_ARGS
