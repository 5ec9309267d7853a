#!/usr/bin/env bash
# make bench-proxy: kvgate serve's proxy throughput against nginx's, in one run.
#
# Four static upstreams (nginx answering a canned completion, /v1/models,
# /health and /metrics on loopback ports) stand in for replicas, so that the
# figure is the proxy's own cost. In front of them, one after another and
# alternating for ROUNDS rounds: nginx round-robin, kvgate serve
# --policy round_robin, and each kvgate binary named in KVGATE_BASELINES (e.g.
# an older build, to compare). wrk drives each with -c32 for DURATION.
# Printed: each front's requests/s per round, the medians, and kvgate's
# median as a ratio of nginx's; for each kvgate build also its CPU time per
# request (user + system, from /proc), which a machine busy with other work
# moves far less than the rate.
#
# Needs nginx and wrk (Debian's packages: apt-get install nginx wrk).
set -euo pipefail

KVGATE=${KVGATE:-bin/kvgate}
BASELINES=${KVGATE_BASELINES:-}
ROUNDS=${ROUNDS:-3}
DURATION=${DURATION:-10s}
CONNS=${CONNS:-32}
PORT0=${PORT0:-19400}

for cmd in nginx wrk; do
	command -v "$cmd" >/dev/null || { echo "bench-proxy: $cmd not found (apt-get install nginx wrk)" >&2; exit 1; }
done
[ -x "$KVGATE" ] || { echo "bench-proxy: $KVGATE not built (make build)" >&2; exit 1; }

dir=$(mktemp -d)
pids=()
cleanup() {
	for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
	[ -f "$dir/nginx.pid" ] && kill "$(cat "$dir/nginx.pid")" 2>/dev/null || true
	wait 2>/dev/null || true
	rm -rf "$dir"
}
trap cleanup EXIT

up_ports=()
for i in 0 1 2 3; do up_ports+=($((PORT0 + 1 + i))); done
front_nginx=$((PORT0 + 10))
front_kvgate=$((PORT0 + 20))

completion='{"id":"cmpl-1","object":"text_completion","created":1,"model":"static","choices":[{"index":0,"text":" hello","finish_reason":"length"}],"usage":{"prompt_tokens":5,"completion_tokens":1,"total_tokens":6,"prompt_tokens_details":{"cached_tokens":0}}}'
models='{"object":"list","data":[{"id":"static","object":"model","owned_by":"bench","max_model_len":4096}]}'

{
	echo "worker_processes 2; pid $dir/nginx.pid; error_log $dir/error.log;"
	echo "events { worker_connections 4096; }"
	echo "http { access_log off; keepalive_requests 1000000;"
	echo "  upstream replicas { keepalive 256;"
	for p in "${up_ports[@]}"; do echo "    server 127.0.0.1:$p;"; done
	echo "  }"
	for p in "${up_ports[@]}"; do
		echo "  server { listen 127.0.0.1:$p;"
		echo "    location = /v1/models { default_type application/json; return 200 '$models'; }"
		echo "    location = /health { return 200 'ok'; }"
		echo "    location = /metrics { default_type text/plain; return 200 ''; }"
		echo "    location / { default_type application/json; return 200 '$completion'; } }"
	done
	echo "  server { listen 127.0.0.1:$front_nginx;"
	echo "    location / { proxy_pass http://replicas; proxy_http_version 1.1; proxy_set_header Connection \"\"; } }"
	echo "}"
} >"$dir/nginx.conf"
nginx -c "$dir/nginx.conf" -p "$dir"

replicas=$(printf 'http://127.0.0.1:%s,' "${up_ports[@]}")
replicas=${replicas%,}
body='{"model":"static","prompt":"Hello there, how are you?","max_tokens":1}'
cat >"$dir/post.lua" <<EOF
wrk.method = "POST"
wrk.body = '$body'
wrk.headers["Content-Type"] = "application/json"
EOF

# wait_ready URL: polls until it answers 200 (bounded).
wait_ready() {
	for _ in $(seq 1 200); do
		if curl -sf -o /dev/null "$1"; then return 0; fi
		sleep 0.05
	done
	echo "bench-proxy: $1 never became ready" >&2
	return 1
}

# rps NAME URL: wrk's requests/s against URL, and the requests it made.
rps() {
	wrk -t2 -c"$CONNS" -d"$DURATION" -s "$dir/post.lua" "$2/v1/completions" |
		awk '/requests in/ {n=$1} /^Requests\/sec/ {r=$2} END {print r, n}'
}

# cpu PID: the process's user + system CPU time so far, in clock ticks.
cpu() { awk '{print $14 + $15}' "/proc/$1/stat"; }

# kvgate_rps BIN: starts BIN serve in front of the upstreams, measures its
# requests/s and its CPU time per request (µs: steadier than the rate on a
# machine busy with other work), stops it.
kvgate_rps() {
	"$1" serve --listen "127.0.0.1:$front_kvgate" --replicas "$replicas" --policy round_robin >"$dir/kvgate.log" 2>&1 &
	local pid=$!
	pids+=("$pid")
	wait_ready "http://127.0.0.1:$front_kvgate/ready"
	local t0 t1 out
	t0=$(cpu "$pid")
	out=$(rps kvgate "http://127.0.0.1:$front_kvgate")
	t1=$(cpu "$pid")
	kill "$pid"
	wait "$pid" 2>/dev/null || true
	awk -v o="$out" -v a="$t0" -v b="$t1" -v hz="$(getconf CLK_TCK)" \
		'BEGIN {split(o, f, " "); printf "%s %.1f\n", f[1], (b - a) / hz * 1e6 / f[2]}'
}

wait_ready "http://127.0.0.1:$front_nginx/health"
names=(nginx kvgate)
for b in $BASELINES; do names+=("$b"); done
declare -A results cpus
for r in $(seq 1 "$ROUNDS"); do
	line="round $r:"
	read -r v _ < <(rps nginx "http://127.0.0.1:$front_nginx"); results[nginx]+="$v "; line+=" nginx $v"
	for b in "$KVGATE" $BASELINES; do
		name=$b
		[ "$b" = "$KVGATE" ] && name=kvgate
		read -r v c < <(kvgate_rps "$b")
		results[$name]+="$v "; cpus[$name]+="$c "; line+=" $name $v ($c µs CPU/req)"
	done
	echo "$line"
done

median() { tr ' ' '\n' | grep -v '^$' | sort -g | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }
n=$(echo "${results[nginx]}" | median)
echo "median requests/s (wrk -c$CONNS, $DURATION x $ROUNDS rounds):"
for name in "${names[@]}"; do
	m=$(echo "${results[$name]}" | median)
	extra=""
	[ -n "${cpus[$name]:-}" ] && extra=$(printf ', %.1f µs CPU per request' "$(echo "${cpus[$name]}" | median)")
	printf '  %-40s %10.0f  (%.2fx nginx%s)\n' "$name" "$m" "$(awk -v a="$m" -v b="$n" 'BEGIN {print a/b}')" "$extra"
done
