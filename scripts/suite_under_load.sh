#!/usr/bin/env bash
# The default test suite N times in a row (default 5) on a fresh clone of
# HEAD, with every core kept busy by another load (one busy loop per core at
# normal priority), as a newcomer's loaded machine would run it. Runs
# alternate torch's CPU kernels: the machine's best, then the portable ones
# (ATEN_CPU_CAPABILITY=default, no AVX2/AVX-512), so a result that depends on
# the kernels a CPU selects shows up here. Prints each run's result line and
# exits non-zero if any run failed.
#   bash scripts/suite_under_load.sh [N]
set -euo pipefail
runs=${1:-5}
repo=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'kill ${burners[@]} 2>/dev/null || true; rm -rf "$work"' EXIT
git clone --quiet "$repo" "$work/gradfabric"
cd "$work/gradfabric"
bash scripts/bootstrap.sh
burners=()
for _ in $(seq "$(nproc)"); do
  python3 -c 'while True: pass' &
  burners+=($!)
done
failed=0
caps=(best default)
for i in $(seq "$runs"); do
  start=$(date +%s)
  cap=${caps[$(( (i - 1) % 2 ))]}
  if [ "$cap" = best ]; then unset ATEN_CPU_CAPABILITY; else export ATEN_CPU_CAPABILITY=$cap; fi
  if .venv/bin/python -m pytest -q -p no:cacheprovider > "$work/run$i.log" 2>&1; then
    verdict=green
  else
    verdict=RED; failed=1
    cp "$work/run$i.log" "$repo/suite_under_load_run$i.log"
  fi
  echo "run $i/$runs ($cap CPU kernels): $verdict in $(( $(date +%s) - start )) s: $(tail -1 "$work/run$i.log")"
done
exit $failed
