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
