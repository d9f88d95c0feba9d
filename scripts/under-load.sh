#!/usr/bin/env bash
# Run a command while N processes burn a CPU core each (a busy CI machine), and record how it went.
#   scripts/under-load.sh [--burners N] [--record FILE] -- COMMAND...
# e.g. scripts/under-load.sh --burners 2 --record benchmarks/results/suite_under_load.json -- bash .ci/run
# FILE (JSON) gets one entry appended per run: commit, start, wall seconds, exit code, pytest's
# summary line and the 1-minute load average sampled every 10 s (min/mean/max).
set -euo pipefail
burners=2 record=""
while [ $# -gt 0 ]; do
  case "$1" in
    --burners) burners=$2; shift 2 ;;
    --record) record=$(realpath -m "$2"); shift 2 ;;
    --) shift; break ;;
    *) echo "usage: scripts/under-load.sh [--burners N] [--record FILE] -- COMMAND..." >&2; exit 2 ;;
  esac
done
[ $# -gt 0 ] || { echo "under-load.sh: no command given" >&2; exit 2; }

pids=()
cleanup() { [ ${#pids[@]} -eq 0 ] || kill "${pids[@]}" 2>/dev/null || true; }
trap cleanup EXIT
for _ in $(seq "$burners"); do python3 -c 'while True: pass' & pids+=($!); done
samples=$(mktemp) out=$(mktemp)
( while true; do cut -d' ' -f1 /proc/loadavg >> "$samples"; sleep 10; done ) & pids+=($!)

start=$(date -u +%Y-%m-%dT%H:%M:%SZ) t0=$SECONDS
set +e
"$@" 2>&1 | tee "$out"
rc=${PIPESTATUS[0]}
set -e
wall=$(( SECONDS - t0 ))
cleanup; pids=()

if [ -n "$record" ]; then
  python3 - "$record" "$start" "$wall" "$rc" "$burners" "$samples" "$out" "$*" <<'EOF'
import json, os, re, subprocess, sys
record, start, wall, rc, burners, samples, out, command = sys.argv[1:]
loads = [float(x) for x in open(samples).read().split()]
summary = [l.strip("= \n") for l in open(out, errors="replace")
           if re.search(r"\d+ (passed|failed)", l) and " in " in l]
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                        text=True).stdout.strip()
runs = json.load(open(record))["runs"] if os.path.exists(record) else []
runs.append({"commit": commit, "start": start, "wall_s": int(wall), "rc": int(rc),
             "burners": int(burners), "command": command,
             "pytest": summary[-1] if summary else None,
             "load1": {"min": min(loads), "mean": round(sum(loads) / len(loads), 2),
                       "max": max(loads)} if loads else None})
json.dump({"what": "the whole test suite run by scripts/under-load.sh: N processes each burn "
                   "a CPU core while the command runs", "runs": runs},
          open(record, "w"), indent=1)
print(f"recorded in {record}")
EOF
fi
rm -f "$samples" "$out"
exit "$rc"
