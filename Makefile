# kvgate — build, test, benchmark.
SHELL := /bin/bash
export PATH := /usr/local/go/bin:$(HOME)/go/bin:$(PATH)
GO ?= go
BIN := bin/kvgate

.PHONY: all build test check vet vulncheck fmt-check bench bench-proxy bench-replay-scale demo fuzz chaos results size clean

all: build

# kvgate version prints it; the commit and its date come from the toolchain's VCS stamp.
VERSION ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)

build:
	$(GO) build -ldflags "-X main.version=$(VERSION)" -o $(BIN) ./cmd/kvgate

# The test command of the README and of CI: formatting, vet, every test with the race detector;
# then, without it, the packages whose large deterministic tests (whole replays, rendered reports:
# testutil.Deterministic) skip under -race, where the detector costs ~25x and finds nothing.
test: fmt-check vet
	$(GO) test -race -count=1 -timeout 20m ./...
	$(GO) test -count=1 -timeout 20m ./internal/replay ./internal/report

# The fast inner loop, for use between edits: formatting, vet, and every test in -short mode
# without the race detector (slow scenarios skip or shrink; results are cached per package).
# Not a substitute for make test, which CI runs.
check: fmt-check vet vulncheck
	$(GO) test -short ./...

# Known vulnerabilities reachable from the code (govulncheck, pinned in the script). Offline (no
# module proxy for the tool, or no vulnerability database at VULNDB) it prints SKIPPED and passes;
# VULNDB=file:///DIR points it at a local copy of the database.
vulncheck:
	GO=$(GO) scripts/vulncheck.sh

vet:
	$(GO) vet ./...

fmt-check:
	@out=$$(gofmt -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go')); \
	if [ -n "$$out" ]; then echo "gofmt would change:"; echo "$$out"; exit 1; fi

# Benchmarks quoted in the README (decision time, and at fleet scale beside the hash alone:
# BenchmarkDecisionScale's decision-x-hash at 256 replicas × 128k tokens; index memory, engine speed), and the wall-clock
# comparisons (figures reported, not asserted; make test asserts what no timing can change):
# cache-aware vs round_robin through the gateway, the replay's hit rates against a live fleet's,
# the sim's cold vs cached TTFT, and what sharing state between 4 gateways costs in Redis (a redis-server
# on loopback). One package at a time, so that they do not share the CPU.
bench:
	$(GO) test -run '^$$' -bench . -benchtime 2s ./internal/prompt ./internal/prefixindex ./internal/router
	KVGATE_BENCH=1 $(GO) test -run '^TestCacheAwareBeatsRoundRobinLive$$' -v -count=1 ./internal/bench
	KVGATE_BENCH=1 $(GO) test -run '^TestReplayAgreesWithLive$$' -v -count=1 ./internal/replay
	KVGATE_BENCH=1 $(GO) test -run '^TestSimCachedTTFTLive$$' -v -count=1 ./cmd/kvgate
	KVGATE_BENCH=1 $(GO) test -run '^TestSharingCostLive$$' -v -count=1 ./internal/sharedstate

# kvgate serve's proxy throughput against nginx's in front of the same four static upstreams (wrk -c32,
# alternating rounds; Debian's nginx and wrk). KVGATE_BASELINES="path/to/old/kvgate ..." adds other builds
# to the same run; the ratio to nginx is printed.
bench-proxy: build
	scripts/bench-proxy.sh

# The replay at scale: a generated 1M-request multiturn trace (166,667 conversations of 6 turns) on 64
# replicas, one policy, its bounds beside it on the other core; wall time and peak RSS (the goal: 2
# minutes, 2 GiB). Minutes of CPU and gigabytes: never part of make test.
bench-replay-scale: build
	set -o pipefail; /usr/bin/time -v $(BIN) replay --workload multiturn --requests 1000000 --replicas 64 \
		--rate 160 --policies ttft --oracle=false 2>&1 | \
		grep -E '^replay:|Elapsed|Maximum resident|User time|System time'

demo: build
	$(BIN) demo

# Each fuzz target for FUZZTIME (default 60s; e.g. FUZZTIME=1000000x), one after another. Every
# func FuzzXxx of the module is listed here: cmd/kvgate's TestMakeFuzzRunsEveryFuzzTarget checks.
FUZZTIME ?= 60s
fuzz:
	$(GO) test -run '^$$' -fuzz '^FuzzParse$$' -fuzztime $(FUZZTIME) ./internal/prompt
	$(GO) test -run '^$$' -fuzz '^FuzzMembers$$' -fuzztime $(FUZZTIME) ./internal/prompt
	$(GO) test -run '^$$' -fuzz '^FuzzParseMessages$$' -fuzztime $(FUZZTIME) ./internal/prompt
	$(GO) test -run '^$$' -fuzz '^FuzzResponse$$' -fuzztime $(FUZZTIME) ./internal/h1
	$(GO) test -run '^$$' -fuzz '^FuzzFastResponse$$' -fuzztime $(FUZZTIME) ./internal/h1
	$(GO) test -run '^$$' -fuzz '^FuzzDecode$$' -fuzztime $(FUZZTIME) ./internal/kvevents
	$(GO) test -run '^$$' -fuzz '^FuzzParseMetrics$$' -fuzztime $(FUZZTIME) ./internal/fleet
	$(GO) test -run '^$$' -fuzz '^FuzzReadTrace$$' -fuzztime $(FUZZTIME) ./internal/workload
	$(GO) test -run '^$$' -fuzz '^FuzzParseConfig$$' -fuzztime $(FUZZTIME) ./internal/gateway
	$(GO) test -run '^$$' -fuzz '^FuzzEditObject$$' -fuzztime $(FUZZTIME) ./internal/gateway
	$(GO) test -run '^$$' -fuzz '^FuzzScanUsage$$' -fuzztime $(FUZZTIME) ./internal/gateway
	$(GO) test -run '^$$' -fuzz '^FuzzBodyToDecision$$' -fuzztime $(FUZZTIME) ./internal/router
	$(GO) test -run '^$$' -fuzz '^FuzzRoutePD$$' -fuzztime $(FUZZTIME) ./internal/router
	$(GO) test -run '^$$' -fuzz '^FuzzParseJob$$' -fuzztime $(FUZZTIME) ./internal/sim
	$(GO) test -run '^$$' -fuzz '^FuzzDecodeBatch$$' -fuzztime $(FUZZTIME) ./internal/sharedstate
	$(GO) test -run '^$$' -fuzz '^FuzzDecodeSnapshot$$' -fuzztime $(FUZZTIME) ./internal/sharedstate

# Fault injection report: per scenario (replica faults, client-side ones and hostile peers), requests sent,
# succeeded, retried, failed clearly, hung up, lost; asserts the invariants and that each fault was met (wall
# clock), and the breaker's cycle. make test runs a short version asserting only what no timing can excuse.
# CHAOS_KINDS: a comma-separated list of kinds or sets (all, replica, client, hostile), e.g. CHAOS_KINDS=hostile;
# CHAOS_HOSTILE_FOR: how long each hostile-peers attack lasts beside its ordinary load (forged loads need a
# redis-server on the PATH, else the scenario reports itself skipped).
CHAOS_REQUESTS ?= 1000
CHAOS_KINDS ?= all
CHAOS_HOSTILE_FOR ?= 30s
chaos:
	KVGATE_CHAOS=1 KVGATE_CHAOS_REQUESTS=$(CHAOS_REQUESTS) KVGATE_CHAOS_KINDS=$(CHAOS_KINDS) \
	KVGATE_CHAOS_HOSTILE_FOR=$(CHAOS_HOSTILE_FOR) $(GO) test -run '^(TestChaosReport|TestBreakerCycle)$$' -v -count=1 -timeout 30m ./internal/chaos

# The README's results: every policy on both Mooncake traces, 8 replicas, capacity at p90 TTFT ≤ 2 s.
TRACES ?= ../shared/traces
results: build
	mkdir -p results
	for t in conversation synthetic; do \
	  $(BIN) replay --trace $(TRACES)/mooncake_$${t}_trace.jsonl --replicas 8 --policies all \
	    --capacity --slo-ttft-p90 2s --json results/$$t.json --report results/$$t-report | tee results/$$t.txt || exit 1; \
	done

# Stripped binary sizes: the default build, and one without Kubernetes discovery (-tags nokubernetes:
# no client-go; discovery: {kubernetes: ...} is then refused, naming the tag).
size:
	@mkdir -p bin; for tags in "" nokubernetes; do \
	  $(GO) build -tags "$$tags" -ldflags '-s -w' -o bin/kvgate-size ./cmd/kvgate || exit 1; \
	  wc -c < bin/kvgate-size | awk -v b="$${tags:-default}" '{ printf "%-13s %11d bytes (%.1f MB)\n", b, $$1, $$1 / 1e6 }'; \
	done; rm -f bin/kvgate-size

clean:
	rm -rf bin
