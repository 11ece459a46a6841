#!/bin/bash
# The test suite's wall time, before and now, interleaved (before, now, now, before), each in its own venv:
#   git archive df443db | tar -x -C /tmp/before
#   python3 -m venv /tmp/before/.venv && /tmp/before/.venv/bin/pip install -e "/tmp/before[test]"
#   bash benchmarks/suite_ab.sh [/tmp/before]
# Both run this README's test command (python -m pytest -q -n 2).
BEFORE=${1:-/tmp/before}
NOW=$(cd "$(dirname "$0")/.." && pwd)
for r in 1 2; do
  for v in $( [ $r = 1 ] && echo "before now" || echo "now before" ); do
    d=$([ $v = before ] && echo "$BEFORE" || echo "$NOW")
    cd "$d" && s=$(date +%s.%N); .venv/bin/python -m pytest -q -p no:cacheprovider -n 2 > /tmp/suite_$v$r.log 2>&1; rc=$?
    e=$(date +%s.%N); echo "round $r $v rc=$rc wall=$(python3 -c "print(round($e-$s,1))") $(tail -1 /tmp/suite_$v$r.log)"
  done
done
