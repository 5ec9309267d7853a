#!/usr/bin/env bash
# scripts/bench-epp.sh: kvgate as an endpoint picker against kvgate serve,
# live, on the same simulated replicas.
#
# For each POLICY (round_robin and ttft by default) and each FRONT, on a
# fresh `kvgate sim` fleet (cold caches, the same seed): FRONT is
#   serve: kvgate serve --policy POLICY, the HTTP gateway;
#   epp:   kvgate epp --policy POLICY --standin ADDR, the ext_proc picker
#          behind the in-process Envoy stand-in (STANDIN_MODE body mode),
#          which forwards each request to the endpoint kvgate names.
# `kvgate bench --target` drives it with WORKLOAD; printed: each run's
# summary line (hit rate from the replicas' own usage.cached_tokens), then
# a table of hit rates and the ttft − round_robin gain per front.
set -euo pipefail

KVGATE=${KVGATE:-bin/kvgate}
POLICIES=${POLICIES:-round_robin ttft}
FRONTS=${FRONTS:-serve epp}
REPLICAS=${REPLICAS:-4}
WORKLOAD=${WORKLOAD:-multiturn}
REQUESTS=${REQUESTS:-600}
CONCURRENCY=${CONCURRENCY:-16}
TIME_SCALE=${TIME_SCALE:-20}
STANDIN_MODE=${STANDIN_MODE:-full_duplex_streamed}
PORT0=${PORT0:-27300}

[ -x "$KVGATE" ] || { echo "bench-epp: $KVGATE not built (make build)" >&2; exit 1; }

dir=$(mktemp -d)
pids=()
stop_all() {
	for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
	for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
	pids=()
}
trap 'stop_all; rm -rf "$dir"' EXIT

# wait_ready URL: polls until it answers 200 (bounded: 20 s).
wait_ready() {
	for _ in $(seq 1 200); do
		if curl -sf -o /dev/null "$1"; then return 0; fi
		sleep 0.1
	done
	echo "bench-epp: $1 never ready" >&2
	return 1
}

sim_port=$((PORT0 + 10))
replicas=$(seq 0 $((REPLICAS - 1)) | awk -v p=$sim_port '{ printf "%shttp://127.0.0.1:%d", (NR > 1 ? "," : ""), p + $1 }')
front_port=$((PORT0 + 1))
ops_port=$((PORT0 + 2))
grpc_port=$((PORT0 + 3))

declare -A hit
for policy in $POLICIES; do
	for front in $FRONTS; do
		"$KVGATE" sim --replicas "$REPLICAS" --port "$sim_port" --time-scale "$TIME_SCALE" --seed 1 >"$dir/sim.log" 2>&1 &
		pids+=($!)
		for i in $(seq 0 $((REPLICAS - 1))); do wait_ready "http://127.0.0.1:$((sim_port + i))/health"; done
		case $front in
		serve)
			"$KVGATE" serve --policy "$policy" --replicas "$replicas" --listen "127.0.0.1:$front_port" >"$dir/front.log" 2>&1 &
			pids+=($!)
			wait_ready "http://127.0.0.1:$front_port/ready"
			;;
		epp)
			"$KVGATE" epp --policy "$policy" --replicas "$replicas" --listen "127.0.0.1:$ops_port" \
				--epp-listen "127.0.0.1:$grpc_port" --standin "127.0.0.1:$front_port" --standin-mode "$STANDIN_MODE" \
				>"$dir/front.log" 2>&1 &
			pids+=($!)
			wait_ready "http://127.0.0.1:$ops_port/ready"
			;;
		esac
		out=$("$KVGATE" bench --target "http://127.0.0.1:$front_port" --workload "$WORKLOAD" --requests "$REQUESTS" \
			--concurrency "$CONCURRENCY" 2>"$dir/bench.err") || { cat "$dir/bench.err" "$dir/front.log" >&2; exit 1; }
		echo "== $front $policy"
		echo "$out" | grep -v "requests$"
		# The row under the table's header: its ninth column is "hit %".
		hit[$front,$policy]=$(echo "$out" | awk '/^policy / { getline; print $9; exit }')
		stop_all
	done
done

echo
printf '%-8s' front
for policy in $POLICIES; do printf ' %12s' "$policy"; done
echo
for front in $FRONTS; do
	printf '%-8s' "$front"
	for policy in $POLICIES; do printf ' %12s' "${hit[$front,$policy]:-?}"; done
	echo
done
