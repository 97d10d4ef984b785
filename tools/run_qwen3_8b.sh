#!/usr/bin/env bash
# Qwen3-8B-Base, the paper's main setting (configs/qwen3_8b_base.yaml), on 4 nodes x 8 GPUs through Ray.
#
#   MODEL=/models/Qwen3-8B-Base DATA=data/dapo-math-17k.parquet EVAL=data/aime24.parquet \
#     tools/run_qwen3_8b.sh [--disaggregated] [--plan] [--out DIR] [KEY=VALUE ...]
#
# Start the cluster first (tools/ray_cluster.sh head on one node, worker on the three others); run this on the
# head. Colocated (default): 16 servers x TP 2 and 32 trainer ranks (tp 2 x dp 16) take turns on all 32 GPUs.
# --disaggregated: the trainer (tp 2 x dp 8) on nodes 0-1, 8 servers x TP 2 on nodes 2-3. Extra KEY=VALUE
# arguments go last and win. --plan: print the placement and memory (`rollverify plan`) and stop; needs no
# GPU, model or data. NOTHING OF THIS HAS RUN ON A GPU (docs/cluster.md says what has).
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=run_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/run_common.sh"

MODEL="${MODEL:-/models/Qwen3-8B-Base}"
DATA="${DATA:-data/dapo-math-17k.parquet}"
EVAL="${EVAL:-data/aime24.parquet}"
OUT="runs/qwen3-8b-$(date +%Y%m%d-%H%M%S)"
parse_paper_args "$@"
need_paper_inputs

paper_args
# 0.82: room for the parameters when a restarted server gets the policy while the others generate
ROLLOUT_ARGS+=(servers.engine_args.tp_size=2 servers.engine_args.max_running_requests=24 servers.engine_args.mem_fraction_static=0.82)
TRAINER_ARGS+=(trainer.tp=2 trainer.recompute=full)
if [[ "$PLACEMENT" == colocated ]]; then
  ROLLOUT_ARGS+=(servers.count=16 rollout.max_live=384)
  TRAINER_ARGS+=(trainer.dp=16)
else
  ROLLOUT_ARGS+=(servers.count=8 rollout.max_live=192)
  TRAINER_ARGS+=(trainer.dp=8)
fi

show_and_run qwen3_8b_base "$OUT" "${PAPER_ARRAYS[@]}"
