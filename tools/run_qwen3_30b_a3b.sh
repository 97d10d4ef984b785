#!/usr/bin/env bash
# Qwen3-30B-A3B-Base (configs/qwen3_30b_a3b_base.yaml), on 4 nodes x 8 GPUs through Ray.
#
#   MODEL=/models/Qwen3-30B-A3B-Base DATA=data/dapo-math-17k.parquet EVAL=data/aime24.parquet \
#     tools/run_qwen3_30b_a3b.sh [--disaggregated] [--plan] [--out DIR] [KEY=VALUE ...]
#
# Start the cluster first (tools/ray_cluster.sh head on one node, worker on the three others); run this on the
# head. Colocated (default): 8 servers x TP 4 (EP 4) and 32 trainer ranks (tp 4 x dp 8, ep 16, sequence
# parallel, routing replay) take turns on all 32 GPUs. --disaggregated: the trainer (tp 4 x dp 4, ep 16) on
# nodes 0-1, 4 servers x TP 4 on nodes 2-3. Extra KEY=VALUE
# arguments go last and win. --plan: print the placement and memory (`rollverify plan`) and stop; needs no
# GPU, model or data. NOTHING OF THIS HAS RUN ON A GPU (docs/cluster.md says what has).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/run_common.sh"

MODEL="${MODEL:-/models/Qwen3-30B-A3B-Base}"
DATA="${DATA:-data/dapo-math-17k.parquet}"
EVAL="${EVAL:-data/aime24.parquet}"
OUT="runs/qwen3-30b-a3b-$(date +%Y%m%d-%H%M%S)"
PLACEMENT=colocated
EXTRA_ARGS=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --disaggregated) PLACEMENT=disaggregated; shift ;;
    --plan) PLAN_ONLY=1; shift ;;
    --out) OUT="$2"; shift 2 ;;
    *=*) EXTRA_ARGS+=("$1"); shift ;;
    *) die "unknown argument $1 (see the header of $0)" ;;
  esac
done

if [[ -z "${PLAN_ONLY:-}" ]]; then
  need_model "$MODEL"
  need_file "$DATA" DATA
  need_file "$EVAL" EVAL
fi

MODEL_ARGS=(model.path="$MODEL" model.dtype=bfloat16)
DATA_ARGS=(task.name=math task.options.train_path="$DATA" task.options.eval_path="$EVAL")
CLUSTER_ARGS=(cluster.launcher=ray cluster.address="${RAY_ADDRESS:-auto}" cluster.nodes=4 cluster.gpus_per_node=8
              cluster.placement="$PLACEMENT")
# paper, Sec. 5.1: 128 prompts x 8 responses, 32K context (2K prompt + 30K response)
ROLLOUT_ARGS=(rollout.batch_groups=128 rollout.n=8 rollout.max_new_tokens=30720 rollout.temperature=1.0
              rollout.engine_args.tp_size=4 rollout.engine_args.ep_size=4 rollout.engine_args.context_length=32768
              rollout.engine_args.max_running_requests=64)
ALGO_ARGS=(algo.mode=rollverify algo.d_s=0.01 algo.d_t=2.0 algo.conditional_switch=true algo.switch_window=8
           algo.switch_tau=0.5)
TRAINER_ARGS=(trainer.steps=500 trainer.lr=1e-6 trainer.eps_low=0.2 trainer.eps_high=0.3 trainer.use_tis=true
              trainer.tis_cap=2.0 trainer.tp=4 trainer.ep=16 trainer.sequence_parallel=true trainer.recompute=none
              trainer.replay_train=true trainer.replay_verify=false)
if [[ "$PLACEMENT" == colocated ]]; then
  CLUSTER_ARGS+=(cluster.rollout_gpus=0)
  ROLLOUT_ARGS+=(rollout.n_servers=8 rollout.max_live=512 rollout.engine_args.mem_fraction_static=0.85)
  TRAINER_ARGS+=(trainer.dp=8)
else
  CLUSTER_ARGS+=(cluster.rollout_gpus=16)
  ROLLOUT_ARGS+=(rollout.n_servers=4 rollout.max_live=256 rollout.engine_args.mem_fraction_static=0.85)
  TRAINER_ARGS+=(trainer.dp=4)
fi
LOG_ARGS=(eval.every=10 log.checkpoint_every=20)

show MODEL_ARGS "${MODEL_ARGS[@]}"
show DATA_ARGS "${DATA_ARGS[@]}"
show CLUSTER_ARGS "${CLUSTER_ARGS[@]}"
show ROLLOUT_ARGS "${ROLLOUT_ARGS[@]}"
show ALGO_ARGS "${ALGO_ARGS[@]}"
show TRAINER_ARGS "${TRAINER_ARGS[@]}"
show LOG_ARGS "${LOG_ARGS[@]}"
show EXTRA_ARGS "${EXTRA_ARGS[@]}"
run_job qwen3_30b_a3b_base "$OUT" "${MODEL_ARGS[@]}" "${DATA_ARGS[@]}" "${CLUSTER_ARGS[@]}" "${ROLLOUT_ARGS[@]}" \
  "${ALGO_ARGS[@]}" "${TRAINER_ARGS[@]}" "${LOG_ARGS[@]}" "${EXTRA_ARGS[@]}"
