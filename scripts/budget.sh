#!/usr/bin/env bash
# The time budgets as a newcomer meets them: a fresh clone of this checkout's HEAD and a fresh venv, then the
# README's two commands (read from the README, not copied here), timed, with the targets beside each figure.
#
#   scripts/budget.sh [--no-tests] [--no-full-tests] [--keep]
#
#   --no-tests        skip both test measurements (the test command and `pytest -m "not slow"`)
#   --no-full-tests   skip the test command only (ruff + the whole of tests/), keep `not slow`
#   --keep            keep the clone, its venv and the logs (printed at the end) instead of deleting them
#
# The targets are those of a quiet 2-core machine; on a busy one, wall times grow and CPU seconds much less, so
# the load average is printed before and after. Nothing but pip's index is reached over the network.
set -euo pipefail

full_tests=1 not_slow=1 keep=0
for arg in "$@"; do
    case "$arg" in
        --no-tests) full_tests=0 not_slow=0 ;;
        --no-full-tests) full_tests=0 ;;
        --keep) keep=1 ;;
        *) echo "usage: $0 [--no-tests] [--no-full-tests] [--keep]" >&2; exit 2 ;;
    esac
done

checkout=$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel)
head=$(git -C "$checkout" rev-parse HEAD)
scratch=$(mktemp -d)
if ((keep)); then trap 'echo "kept: $scratch"' EXIT; else trap 'rm -rf "$scratch"' EXIT; fi
# python3 FILE COMMAND...: runs COMMAND, writes its wall seconds and the CPU seconds (user + system) of it and every
# process it waited for (a pool's workers too) to FILE, exits with its status
RUSAGE='
import resource, subprocess, sys, time
start = time.perf_counter()
status = subprocess.call(sys.argv[2:])
children = resource.getrusage(resource.RUSAGE_CHILDREN)
with open(sys.argv[1], "w") as file:
    print(f"{time.perf_counter() - start:.1f} {children.ru_utime + children.ru_stime:.1f}", file=file)
sys.exit(status)'
rows=()                # the table: "what|measured|target"
failed=0

# The n-th ```bash block of the README (0: the main job, 1: the tests), on one line.
readme_command() {
    awk -v n="$1" '/^```bash$/ {block++; inside = 1; next} /^```$/ {inside = 0} inside && block == n + 1' \
        "$checkout/README.md"
}

# A README command split at its ` && `: the steps that set up (a venv, pip install) and those that run.
setup_steps() { readme_command "$1" | sed 's/ && /\n/g' | grep -E -- '-m venv|pip install' | paste -sd'&' | sed 's/&/ \&\& /g'; }
run_steps() { readme_command "$1" | sed 's/ && /\n/g' | grep -v -E -- '-m venv|pip install' | paste -sd'&' | sed 's/&/ \&\& /g'; }

# timed NAME COMMAND: runs COMMAND in the clone, its output in NAME.log; sets wall, cpu; counts a failure.
timed() {
    local name=$1 command=$2 status=0
    echo "== $name: $command" >&2
    (cd "$scratch/clone" && python3 -c "$RUSAGE" "$scratch/$name.time" bash -c "$command") > "$scratch/$name.log" 2>&1 ||
        status=$?
    if ((status)); then
        echo "   FAILED (exit $status); the end of its output:" >&2; tail -n 20 "$scratch/$name.log" >&2; failed=1
    fi
    read -r wall cpu < "$scratch/$name.time"
    echo "   wall $wall s, CPU $cpu s" >&2
}

echo "budget of $head, $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)" >&2
git clone --quiet --no-checkout "$checkout" "$scratch/clone"
git -C "$scratch/clone" checkout --quiet --detach "$head"

# 1) the main job's set-up, then the main job; each backend's CPU as the job reports it (its worker processes'
# seconds in that backend's checks; the rest of the total is the processes' start-up and the parent)
timed install "$(setup_steps 0)"
rows+=("install (the main job's command)|$wall s|")
timed main_job "$(run_steps 0)"
rows+=("main job, wall|$wall s|<= 60 s" "main job, CPU of all its processes|$cpu s|<= 100 s")
while read -r name _ backend_cpu; do
    rows+=("  $name, CPU in its checks|$backend_cpu s|")
done < <(sed -n -E 's/^(attention_[a-z]+): ([0-9.]+) s, CPU ([0-9.]+) s.*/\1 \2 \3/p' "$scratch/main_job.log")

# 2) the tests: the test command's extra set-up, then its run (ruff, then pytest), and the everyday loop
if ((full_tests || not_slow)); then
    timed test_install "$(setup_steps 1)"
    rows+=("install of the test extras|$wall s|")
fi
if ((full_tests)); then
    timed tests "$(run_steps 1)"
    rows+=("test command (ruff + pytest), wall|$wall s|<= 300 s")
fi
if ((not_slow)); then
    timed not_slow '.venv/bin/python -m pytest -m "not slow"'
    rows+=("pytest -m \"not slow\", wall|$wall s|<= 60 s")
fi

echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)" >&2
printf '\n%-45s %12s  %s\n' "measure" "measured" "target"
for row in "${rows[@]}"; do
    IFS='|' read -r what measured target <<< "$row"
    printf '%-45s %12s  %s\n' "$what" "$measured" "$target"
done
if ((keep)); then echo "logs: $scratch/*.log"; fi
exit "$failed"
