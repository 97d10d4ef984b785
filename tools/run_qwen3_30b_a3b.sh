#!/usr/bin/env bash
# Qwen3-30B-A3B-Base (configs/qwen3_30b_a3b_base.yaml), on 4 nodes x 8 GPUs through Ray.
#
#   MODEL=/models/Qwen3-30B-A3B-Base DATA=data/dapo-math-17k.parquet EVAL=data/aime24.parquet \
#     tools/run_qwen3_30b_a3b.sh [--disaggregated] [--plan] [--out DIR] [KEY=VALUE ...]
#
# Start the cluster first (tools/ray_cluster.sh head on one node, worker on the three others); run this on the
# head. Colocated (default): 8 servers x TP 4 (EP 4) and 32 trainer ranks (tp 4 x dp 8, ep 16, sequence
# parallel, full recompute with routing replay) take turns on all 32 GPUs. --disaggregated: the trainer (tp 4 x dp 4, ep 16) on
# nodes 0-1, 4 servers x TP 4 on nodes 2-3. Extra KEY=VALUE
# arguments go last and win. --plan: print the placement and memory (`rollverify plan`) and stop; needs no
# GPU, model or data. NOTHING OF THIS HAS RUN ON A GPU (docs/cluster.md says what has).
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=run_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/run_common.sh"

MODEL="${MODEL:-/models/Qwen3-30B-A3B-Base}"
DATA="${DATA:-data/dapo-math-17k.parquet}"
EVAL="${EVAL:-data/aime24.parquet}"
OUT="runs/qwen3-30b-a3b-$(date +%Y%m%d-%H%M%S)"
parse_paper_args "$@"
need_paper_inputs

paper_args
ROLLOUT_ARGS+=(servers.engine_args.tp_size=4 servers.engine_args.ep_size=4 servers.engine_args.max_running_requests=64
              servers.engine_args.mem_fraction_static=0.85)
TRAINER_ARGS+=(trainer.tp=4 trainer.ep=16 trainer.recompute=full trainer.replay_train=true trainer.replay_verify=false)
if [[ "$PLACEMENT" == colocated ]]; then
  ROLLOUT_ARGS+=(servers.count=8 rollout.max_live=512)
  TRAINER_ARGS+=(trainer.dp=8)
else
  ROLLOUT_ARGS+=(servers.count=4 rollout.max_live=256)
  TRAINER_ARGS+=(trainer.dp=4)
fi

show_and_run qwen3_30b_a3b_base "$OUT" "${PAPER_ARRAYS[@]}"
