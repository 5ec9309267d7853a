#!/usr/bin/env bash
# pressure-sweep.sh: ttft under KV-cache pressure (issue #25). Replays the cache-pressure
# question (kvgate replay --question cache-pressure: --kv-blocks 1000 to 8000, every
# cache-aware policy) on two generated workloads at four rising rates, on 4 and 8 replicas,
# and prints ttft's p90 TTFT over the best other policy's at every point.
#
# Usage:
#   scripts/pressure-sweep.sh OUTDIR
#
# OUTDIR receives, per workload, replica count and rate (e.g. mt-8-r032): NAME.json (the
# result), NAME/ (its HTML report: p90 TTFT, hit rate and ttft over the best other policy
# against the cache size), NAME.txt (the replay's table), summary.txt (the summary) and summary/
# (one chart per workload of every point: summary/sweep_mt.png, summary/sweep_sp.png).
#
# The workloads (the issue's, larger: 240-320 requests make p90 noisy):
#   mt  multiturn: CONVERSATIONS chats of 5 turns over 4 system prompts of 1,536 tokens,
#       128 output tokens, at 8, 16, 24, 32 requests/s per 4 replicas
#   sp  shared_prefix: 6 groups of PER_GROUP questions (128 tokens) on a 3,072-token system
#       prompt, 128 output tokens, at 12, 24, 36, 48 requests/s per 4 replicas
# Each replay takes a second or two; the whole sweep a few minutes on a busy machine.
#
# Environment:
#   KVGATE         the kvgate binary (default: built into OUTDIR/kvgate from this checkout)
#   CONVERSATIONS  multiturn chats (default 128)
#   PER_GROUP      shared_prefix questions per group (default 80)
#   SEED           workload and policy seed (default 1)
#   SEEDS          several seeds, e.g. "1 2 3 4 5 6 7 8 9 10": each seed's sweep in OUTDIR/seed-N/,
#                  and the summary on each policy's mean p90 over them (a single run's p90 of
#                  240-480 requests moves by a few percent from seed to seed; the mean tells which
#                  points are the policy's and which the seed's). Default: SEED alone, in OUTDIR.
#   TIMEOUT        seconds allowed per replay (default 600)
#   MAX            fail (exit 1) when a point's ratio is above it, e.g. 1.05 (default: report only)
#
# The summary is a Go test of internal/replay (TestPressureSweepSummary) reading OUTDIR:
# no python or jq needed, only the Go toolchain that builds kvgate. Beside ttft's ratios it
# counts, for every policy, the points where it is above 1.05x the best of the others: how
# often a single run misses the mark by chance.
set -euo pipefail

if [ $# -ne 1 ]; then
	echo "usage: $0 OUTDIR" >&2
	exit 2
fi
out=$1
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
out=$(cd "$out" && pwd)

conversations=${CONVERSATIONS:-128}
per_group=${PER_GROUP:-80}
seeds=${SEEDS:-${SEED:-1}}
timeout_s=${TIMEOUT:-600}

kvgate=${KVGATE:-}
if [ -z "$kvgate" ]; then
	kvgate=$out/kvgate
	(cd "$root" && go build -o "$kvgate" ./cmd/kvgate)
fi

mt=(--workload multiturn --workload-param "conversations=$conversations" --workload-param turns=5
	--workload-param system_prompts=4 --workload-param system_prompt_len=1536 --workload-param output_len=128)
sp=(--workload shared_prefix --workload-param groups=6 --workload-param "prompts_per_group=$per_group"
	--workload-param system_prompt_len=3072 --workload-param question_len=128 --workload-param output_len=128)

# replay DIR SEED NAME RATE REPLICAS WORKLOAD-FLAGS...: one cache-pressure sweep over --kv-blocks.
replay() {
	local dir=$1 seed=$2 name=$3 rate=$4 replicas=$5
	shift 5
	echo "$name: $replicas replicas, $rate requests/s, seed $seed" >&2
	timeout "$timeout_s" "$kvgate" replay "$@" --rate "$rate" --replicas "$replicas" --seed "$seed" \
		--question cache-pressure --json "$dir/$name.json" --report "$dir/$name" >"$dir/$name.txt" 2>&1 || {
		echo "FAIL: $name (see $dir/$name.txt)" >&2
		exit 1
	}
}

# sweep DIR SEED: every point of the sweep on one seed.
sweep() {
	local dir=$1 seed=$2 replicas step rate
	mkdir -p "$dir"
	for replicas in 4 8; do
		for step in 1 2 3 4; do
			rate=$((8 * step * replicas / 4))
			replay "$dir" "$seed" "$(printf 'mt-%d-r%03d' "$replicas" "$rate")" "$rate" "$replicas" "${mt[@]}"
			rate=$((12 * step * replicas / 4))
			replay "$dir" "$seed" "$(printf 'sp-%d-r%03d' "$replicas" "$rate")" "$rate" "$replicas" "${sp[@]}"
		done
	done
}

read -ra seed_list <<<"$seeds"
for s in "${seed_list[@]}"; do
	case $s in
	'' | *[!0-9]*)
		echo "$0: seed $s: want a whole number" >&2
		exit 2
		;;
	esac
done
if [ "${#seed_list[@]}" -eq 1 ]; then
	sweep "$out" "${seed_list[0]}"
else
	for s in "${seed_list[@]}"; do
		sweep "$out/seed-$s" "$s"
	done
fi

cd "$root"
status=0
KVGATE_PRESSURE_DIR=$out KVGATE_PRESSURE_MAX=${MAX:-} \
	go test ./internal/replay -run '^TestPressureSweepSummary$' -count=1 -v >"$out/summary.txt" 2>&1 || status=$?
grep -v -e '^=== RUN' -e '^--- ' -e '^PASS$' -e '^FAIL$' -e '^ok ' "$out/summary.txt" || true
exit "$status"
