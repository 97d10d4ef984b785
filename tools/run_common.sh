# shellcheck shell=bash disable=SC2034  # OUT and the argument arrays are the sourcing script's, passed to show_and_run by name
# Shared by tools/run_*.sh (sourced): path checks first, every argument array printed before anything starts,
# then `rollverify plan` (no GPU needed: it refuses a layout that does not fit) and `rollverify train`.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RV="${RV:-$ROOT/.venv/bin/rollverify}"

die() { echo "error: $*" >&2; exit 2; }

need_model() {  # a local Hugging Face folder: config.json and safetensors (nothing is downloaded)
  [[ -f "$1/config.json" ]] || die "model $1 has no config.json: set MODEL=/path/to/a/local/HF/folder"
  compgen -G "$1/*.safetensors" >/dev/null || die "model $1 has no *.safetensors"
}

need_file() { [[ -f "$1" ]] || die "data file $1 does not exist: set $2 (tools/prepare_data.py converts the published layouts)"; }

show() {  # show NAME ARRAY...: one line per argument, before anything starts
  local name="$1"; shift
  echo "$name:"
  for a in "$@"; do echo "    $a"; done
}

run_job() {  # run_job CONFIG OUT ARGS...: plan, then train with the same arguments
  local config="$1" out="$2"; shift 2
  [[ -x "$RV" ]] || die "$RV not found: run 'make setup'"
  echo "+ $RV plan --config $config ..."
  "$RV" plan --config "$config" "$@"
  [[ -z "${PLAN_ONLY:-}" ]] || return 0
  echo "+ $RV train --config $config --out $out ..."
  local t0; t0=$(date +%s%N)
  "$RV" train --config "$config" --out "$out" "$@"
  echo "[run] $config: $(( ($(date +%s%N) - t0) / 1000000 )) ms wall"
}

show_and_run() {  # show_and_run CONFIG OUT ARRAY_NAME...: print every named array, then run_job with all of them in order
  local config="$1" out="$2"; shift 2
  local name ref args=()
  for name in "$@"; do
    ref="${name}[@]"
    show "$name" "${!ref}"
    args+=("${!ref}")
  done
  run_job "$config" "$out" "${args[@]}"
}

# --- the paper's GPU jobs (tools/run_qwen3_*.sh): 4 nodes x 8 GPUs through Ray, colocated or disaggregated ---

parse_paper_args() {  # [--disaggregated] [--plan] [--out DIR] [KEY=VALUE ...]; sets PLACEMENT, PLAN_ONLY, OUT, EXTRA_ARGS
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
}

need_paper_inputs() {  # MODEL, DATA and EVAL exist before anything starts; --plan needs none of them
  [[ -z "${PLAN_ONLY:-}" ]] || return 0
  need_model "$MODEL"
  need_file "$DATA" DATA
  need_file "$EVAL" EVAL
}

paper_args() {  # the arrays both paper jobs share; the job script appends its model's parallelism and sizes
  MODEL_ARGS=(model.path="$MODEL" model.dtype=bfloat16)
  DATA_ARGS=(task.name=math task.options.train_path="$DATA" task.options.eval_path="$EVAL")
  CLUSTER_ARGS=(cluster.launcher=ray cluster.address="${RAY_ADDRESS:-auto}" cluster.nodes=4 cluster.gpus_per_node=8
                cluster.placement="$PLACEMENT")
  if [[ "$PLACEMENT" == colocated ]]; then
    CLUSTER_ARGS+=(cluster.rollout_gpus=0)
  else
    CLUSTER_ARGS+=(cluster.rollout_gpus=16)  # the servers on nodes 2-3, the trainer on nodes 0-1
  fi
  # paper, Sec. 5.1: 128 prompts x 8 responses, 32K context (2K prompt + 30K response)
  ROLLOUT_ARGS=(rollout.batch_groups=128 rollout.n=8 rollout.max_new_tokens=30720 rollout.temperature=1.0
                servers.engine_args.context_length=32768)
  ALGO_ARGS=(algo.mode=rollverify algo.d_s=0.01 algo.d_t=2.0 algo.conditional_switch=true algo.switch_window=8
             algo.switch_tau=0.5)
  TRAINER_ARGS=(trainer.steps=500 trainer.lr=1e-6 trainer.eps_low=0.2 trainer.eps_high=0.3 trainer.correction.method=tis
                trainer.correction.tis_cap=2.0 trainer.sequence_parallel=true)
  LOG_ARGS=(eval.every=10 log.checkpoint_every=20)
}

PAPER_ARRAYS=(MODEL_ARGS DATA_ARGS CLUSTER_ARGS ROLLOUT_ARGS ALGO_ARGS TRAINER_ARGS LOG_ARGS EXTRA_ARGS)
