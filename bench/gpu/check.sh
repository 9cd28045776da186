#!/usr/bin/env bash
# The GPU figures of issues #19 and #25 in one prepared run, for a lent GPU machine
# (Python 3.12 with CUDA torch, no network, 16 cores; a session gets 15 minutes of it).
# Run from the repository root THERE, after `bash bench/gpu/fetch-wheels.sh` HERE, with
# `.whl` carried:
#
#   bash bench/gpu/check.sh dpsgd          # bench dpsgd: MLP, ResNet-18-GN 32/64 px,
#                                          # DenseNet-121-GN; record and patient level
#   bash bench/gpu/check.sh demo round     # imaging demo --device cuda; bench round n=5,10,20
#
# Each part is one `run` call of at most 10 minutes (dpsgd ~5-8, demo + round ~6-9 on an
# H100/H200, estimated: never run yet). Every command has its own timeout, so one that
# hangs costs its slot, not the call. What comes back under $OUT: check.log (everything
# printed), results.jsonl (one JSON object per measurement, labelled, with the card),
# demo-report.json. docs/benchmarks.md says where each figure goes.
#
# Settings (environment): MEDFED_GPU_CHECK_DEVICE (default cuda; cpu for a dry run),
# MEDFED_GPU_CHECK_PYTHON (default python3), MEDFED_GPU_CHECK_QUICK=1 (tiny sizes: a dry
# run of the script itself), MEDFED_GPU_CHECK_SITE (where the wheels and the project are
# installed; default /tmp/medfed-gpu-site).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/medfed-gpu-out}
mkdir -p "$OUT"
device=${MEDFED_GPU_CHECK_DEVICE:-cuda}
python=${MEDFED_GPU_CHECK_PYTHON:-python3}
quick=${MEDFED_GPU_CHECK_QUICK:-0}
site=${MEDFED_GPU_CHECK_SITE:-/tmp/medfed-gpu-site}
log="$OUT/check.log"
results="$OUT/results.jsonl"
export PYTHONUNBUFFERED=1

say() { echo "[gpu-check $(date -u +%H:%M:%S)] $*" | tee -a "$log"; }

install() {
  if [ -f "$site/.medfed-installed" ]; then
    say "installed already in $site"
  else
    if ! ls .whl/*.whl > /dev/null 2>&1; then
      say "no wheels in .whl/: run bash bench/gpu/fetch-wheels.sh here and carry .whl"
      exit 2
    fi
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --upgrade --target "$site" .whl/*.whl 2>&1 | tee -a "$log" || exit 2
    # The project itself: its entry points register the `medfed` subcommands. Built
    # from a copy of its packages, so no build/ or egg-info is left in the checkout.
    local source
    source=$(mktemp -d)
    cp -r pyproject.toml common coordinator site_agent demo bench "$source"/
    "$python" -m pip install -q --no-index --no-deps --no-build-isolation \
      --ignore-requires-python --no-compile --target "$site" "$source" 2>&1 \
      | tee -a "$log" || exit 2
    rm -rf "$source"
    touch "$site/.medfed-installed"
  fi
  export PYTHONPATH="$site"
  "$python" - <<'PY' 2>&1 | tee -a "$log"
import platform, torch
card = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
print(f"python {platform.python_version()}, torch {torch.__version__}, device: {card}")
PY
}

card() {
  "$python" -c 'import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu")'
}

# measure LABEL TIMEOUT ARGS...: runs `medfed ARGS --json`, keeps its last line (a JSON
# object) in results.jsonl with the label, the card and the command; a failure or a
# timeout is recorded as such, never as a figure.
measure() {
  local label=$1 limit=$2
  shift 2
  say "$label: medfed $*"
  local tmp
  tmp=$(mktemp)
  timeout --signal=TERM --kill-after=15 "$limit" "$python" -m common.commands.cli "$@" --json \
    2>&1 | tee -a "$log" > "$tmp"
  local rc=${PIPESTATUS[0]}
  LABEL=$label RC=$rc CARD=$(card) COMMAND="medfed $*" "$python" - "$tmp" >> "$results" <<'PY'
import json, os, sys
lines = [l for l in open(sys.argv[1]).read().splitlines() if l.strip()]
record = {"label": os.environ["LABEL"], "card": os.environ["CARD"],
          "command": os.environ["COMMAND"], "exit_status": int(os.environ["RC"])}
try:
    record["result"] = json.loads(lines[-1]) if record["exit_status"] == 0 else None
except (IndexError, json.JSONDecodeError):
    record["result"] = None
if record["result"] is None:
    record["error"] = ("timed out" if record["exit_status"] in (124, 137)
                       else "\n".join(lines[-5:]))
print(json.dumps(record))
PY
  rm -f "$tmp"
  say "$label: exit status $rc"
}

part_dpsgd() {
  local e1=15 e2=25 ei=3 b=8 bd=4
  if [ "$quick" = 1 ]; then e1=1 e2=1 ei=1 b=4 bd=4; fi
  measure mlp-record 120 bench dpsgd --device "$device" --privacy-unit record --epochs $e1
  measure mlp-patient 120 bench dpsgd --device "$device" --privacy-unit patient --epochs $e2
  for size in 32 64; do
    for unit in record patient; do
      measure "resnet18-gn-$size-$unit" 150 bench dpsgd --device "$device" \
        --model resnet18-gn --image-size $size --batch-size 32 --batches $b --epochs $ei \
        --privacy-unit $unit
    done
  done
  for unit in record patient; do
    measure "densenet121-gn-64-$unit" 180 bench dpsgd --device "$device" \
      --model densenet121-gn --image-size 64 --batch-size 32 --batches $bd --epochs 2 \
      --privacy-unit $unit
  done
}

part_demo() {
  local out=/tmp/medfed-gpu-demo
  rm -rf "$out"
  say "imaging demo: medfed demo --task imaging --device $device --out $out"
  timeout --signal=TERM --kill-after=15 300 "$python" -m common.commands.cli demo --task imaging \
    --device "$device" --out "$out" 2>&1 | tee -a "$log"
  say "imaging demo: exit status ${PIPESTATUS[0]}"
  [ -f "$out/report.json" ] && cp "$out/report.json" "$OUT/demo-report.json"
}

part_round() {
  local rounds=3 phase=6 sizes="5 10 20" dim=1000000 dropouts=2
  if [ "$quick" = 1 ]; then rounds=1 sizes=3 dim=100000 dropouts=0; fi
  for n in $sizes; do
    measure "round-$n" 200 bench round --sites $n --dim $dim --dropouts $dropouts \
      --rounds $rounds --phase-seconds $phase
  done
}

if [ $# -eq 0 ]; then
  set -- dpsgd
fi
say "parts: $*; device $device; out $OUT"
install
for part in "$@"; do
  case $part in
    dpsgd) part_dpsgd ;;
    demo) part_demo ;;
    round) part_round ;;
    *) say "unknown part $part (dpsgd, demo, round)"; exit 2 ;;
  esac
done
say "done: $(wc -l < "$results" 2>/dev/null || echo 0) measurements in $results"
