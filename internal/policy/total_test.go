package policy

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"slices"
	"testing"
	"time"

	"pgregory.net/rapid"
)

// totalVariants are the parameter sets TestEveryPolicyIsTotal builds each
// registered policy with: its defaults, and the options that take other
// arithmetic paths. A policy registered without an entry here fails the
// test, so that a new policy is covered from its first commit.
var totalVariants = map[string][]map[string]any{
	"round_robin":  {nil},
	"random":       {nil},
	"least_load":   {nil},
	"p2c":          {nil},
	"session":      {nil},
	"prefix_key":   {nil, {"key": "system", "prefix_chars": 1}},
	"lru_affinity": {nil, {"cache_capacity": 1, "prefix_tokens": 1}},
	"chwbl":        {nil, {"count_request": false}},
	"sglang":       {nil, {"defaults": "library", "random_ties": true, "max_tree_size": 8, "eviction_interval_secs": 0}},
	"dynamo": {nil, {"temperature": 0.7, "conditional_prefill": true}, {"router_queue_threshold": nil},
		{"overlap_score_weight": 0}},
	"llmd": {nil, {"index": "gie-1.5", "no_hit_lru_weight": 2}, {"auto_tune": false, "lru_capacity_per_server": 2,
		"non_cached_tokens": 0}},
	"preble": {nil, {"eviction_cost": false}, {"capacity_blocks": 4, "max_window_blocks": 16, "window_secs": 1,
		"max_tracked": 2}},
	"score":   {nil, {"cache_weight": 0, "load_weight": 0}},
	"precise": {nil, {"prefix_score": "min-max", "speculative_ttl_secs": 0.001}},
	"ttft": {nil, {"defer_ms": 0, "interference_weight": 1, "decode_weight": 0, "eviction_weight": 0},
		{"margin_rel": 0, "margin_ms": 0, "correction_alpha": 1, "replica_alpha": 1, "max_correction": 1e6},
		{"future_weight": 1e6, "wait_weight": 1e6, "prefix_life_s": 0.001, "window_s": 0.001},
		{"future_weight": 0, "wait_weight": 0, "prefix_life_s": 86400, "window_s": 86400}},
}

// TestEveryPolicyIsTotal: every registered policy's Pick, and PickPair for
// the pair pickers, answers any views and any request validly, before and
// after any events: no panic; ErrNoReplica only when no replica (side) is
// a candidate, ErrDefer only when the request allows it, else a decision
// naming a healthy replica's Index, with a non-negative estimate and
// numbers JSON can carry (no NaN, no infinity) in its scores and load.
// The views hold what a peer gateway, a replica's /metrics or a bug could
// put there: negative, huge and extreme counts, NaN and infinite KV
// usage, matches past the prompt; requests with no or huge prompts, huge
// or negative max_tokens; events for unknown replicas and requests, with
// huge or negative TTFTs and counts.
func TestEveryPolicyIsTotal(t *testing.T) {
	names := Names()
	for _, name := range names {
		if _, ok := totalVariants[name]; !ok {
			t.Errorf("policy %s is registered but has no totalVariants entry: add its defaults (and its other paths)", name)
		}
	}
	for name := range totalVariants {
		if !slices.Contains(names, name) {
			t.Errorf("totalVariants lists %s, which is not registered", name)
		}
	}
	for _, name := range names {
		for k, params := range totalVariants[name] {
			t.Run(fmt.Sprintf("%s/%d", name, k), func(t *testing.T) {
				rapid.Check(t, func(rt *rapid.T) { totalRun(rt, name, params) })
			})
		}
	}
}

// totalRun builds the policy and runs a random sequence of picks, pair
// picks and events on it, checking every answer.
func totalRun(t *rapid.T, name string, params map[string]any) {
	seed := rapid.Uint64().Draw(t, "seed")
	p, err := New(name, Options{Seed: seed, BlockSize: rapid.SampledFrom([]int{1, 16, 64}).Draw(t, "block_size"),
		Params: params})
	if err != nil {
		t.Fatalf("New(%s, %v): %v", name, params, err)
	}
	obs, _ := p.(Observer)
	pp, _ := p.(PairPicker)
	n := rapid.IntRange(0, 9).Draw(t, "replicas")
	steps := rapid.IntRange(1, 12).Draw(t, "steps")
	for step := range steps {
		label := fmt.Sprintf("step%d", step)
		switch kind := rapid.IntRange(0, 2).Draw(t, label+"/kind"); {
		case kind == 0 || (kind == 1 && pp == nil):
			req := drawRequest(t, label, n)
			rs := drawViews(t, label, n, len(req.Blocks))
			d, err := p.Pick(req, rs)
			checkPick(t, name, req, rs, d, err)
			if err == nil && obs != nil {
				obs.Observe(Event{Kind: Routed, At: req.Now, Req: req, Decision: d, Replica: d.Replica})
			}
		case kind == 1:
			req := drawRequest(t, label, n)
			req.NoDefer = true // as the router's RoutePD asks
			prefill, decode := drawSides(t, label, n, len(req.Blocks))
			pd, err := pp.PickPair(req, prefill, decode)
			checkPair(t, name, prefill, decode, pd, err)
		case obs != nil:
			obs.Observe(drawEvent(t, label, n))
		}
	}
}

// checkPick checks one Pick's answer.
func checkPick(t *rapid.T, name string, req *Request, rs []ReplicaView, d Decision, err error) {
	healthy := 0
	for i := range rs {
		if rs[i].Healthy {
			healthy++
		}
	}
	switch {
	case errors.Is(err, ErrNoReplica):
		if healthy > 0 {
			t.Fatalf("%s: ErrNoReplica with %d healthy replicas", name, healthy)
		}
	case errors.Is(err, ErrDefer):
		if req.NoDefer || healthy == 0 {
			t.Fatalf("%s: ErrDefer (NoDefer %v, %d healthy)", name, req.NoDefer, healthy)
		}
	case err != nil:
		t.Fatalf("%s: Pick: %v", name, err)
	default:
		checkDecision(t, name, "Pick", rs, d)
	}
}

// checkPair checks one PickPair's answer: the router asks only with a
// candidate on each side.
func checkPair(t *rapid.T, name string, prefill, decode []ReplicaView, pd PairDecision, err error) {
	nPre, nDec := 0, 0
	for i := range prefill {
		if prefill[i].Healthy {
			nPre++
		}
		if decode[i].Healthy {
			nDec++
		}
	}
	switch {
	case errors.Is(err, ErrNoReplica):
		if nPre > 0 && nDec > 0 {
			t.Fatalf("%s: PickPair: ErrNoReplica with %d prefill and %d decode candidates", name, nPre, nDec)
		}
		return
	case err != nil:
		t.Fatalf("%s: PickPair: %v", name, err)
	}
	checkDecision(t, name, "PickPair decode", decode, pd.Decode)
	if pd.SkipPrefill {
		if pd.Prefill.Replica != -1 {
			t.Fatalf("%s: PickPair skips the prefill step with prefill replica %d", name, pd.Prefill.Replica)
		}
	} else {
		checkDecision(t, name, "PickPair prefill", prefill, pd.Prefill)
	}
	if _, err := json.Marshal(pd); err != nil {
		t.Fatalf("%s: PickPair's decision %+v: %v", name, pd, err)
	}
}

// checkDecision checks that d names a candidate of rs and carries numbers.
func checkDecision(t *rapid.T, name, what string, rs []ReplicaView, d Decision) {
	if d.Replica < 0 || d.Replica >= len(rs) || rs[d.Replica].Index != d.Replica {
		t.Fatalf("%s: %s chose %d, no replica's Index (%d replicas)", name, what, d.Replica, len(rs))
	}
	if !rs[d.Replica].Healthy {
		t.Fatalf("%s: %s chose unhealthy replica %d", name, what, d.Replica)
	}
	if d.EstTTFT < 0 {
		t.Fatalf("%s: %s: negative estimate %v", name, what, d.EstTTFT)
	}
	if d.Scores != nil && len(d.Scores) != len(rs) {
		t.Fatalf("%s: %s: %d scores for %d replicas", name, what, len(d.Scores), len(rs))
	}
	for i, s := range d.Scores {
		if math.IsNaN(s) || math.IsInf(s, 0) {
			t.Fatalf("%s: %s: score %d is %v", name, what, i, s)
		}
	}
	if math.IsNaN(d.Load) || math.IsInf(d.Load, 0) {
		t.Fatalf("%s: %s: load %v", name, what, d.Load)
	}
	if d.Matched < 0 {
		t.Fatalf("%s: %s: %d blocks matched", name, what, d.Matched)
	}
}

// anyInt draws a count a view could carry: small, negative, or extreme.
func anyInt(t *rapid.T, label string) int {
	return rapid.OneOf(
		rapid.IntRange(0, 64),
		rapid.IntRange(-64, -1),
		rapid.SampledFrom([]int{math.MaxInt, math.MinInt, math.MaxInt / 2, math.MinInt / 2, -1_000_000,
			1 << 31, 1 << 40, 1<<53 + 1, -(1 << 53)}),
		rapid.Int(),
	).Draw(t, label)
}

// anyFloat draws a ratio a view could carry: in range, out of it, NaN or
// infinite.
func anyFloat(t *rapid.T, label string) float64 {
	return rapid.OneOf(
		rapid.Float64Range(0, 1),
		rapid.SampledFrom([]float64{math.NaN(), math.Inf(1), math.Inf(-1), -1, 1.5, 1e300, -1e300,
			math.MaxFloat64, math.SmallestNonzeroFloat64, math.Copysign(0, -1)}),
		rapid.Float64(),
	).Draw(t, label)
}

// anyDuration draws a duration: small, negative or extreme.
func anyDuration(t *rapid.T, label string) time.Duration {
	return time.Duration(rapid.OneOf(
		rapid.Int64Range(0, int64(10*time.Second)),
		rapid.Int64Range(-int64(time.Second), -1),
		rapid.SampledFrom([]int64{math.MaxInt64, math.MinInt64, 1}),
		rapid.Int64(),
	).Draw(t, label))
}

// drawViews draws n replicas' views as the router gives them (Index =
// position), for a prompt of blocks blocks.
func drawViews(t *rapid.T, label string, n, blocks int) []ReplicaView {
	rs := make([]ReplicaView, n)
	for i := range rs {
		l := fmt.Sprintf("%s/r%d/", label, i)
		rs[i] = ReplicaView{
			Index: i, URL: fmt.Sprintf("http://r%d", i),
			Healthy:         rapid.Bool().Draw(t, l+"healthy"),
			Role:            rapid.SampledFrom([]Role{RoleBoth, RolePrefill, RoleDecode}).Draw(t, l+"role"),
			InFlight:        anyInt(t, l+"in_flight"),
			InFlightTokens:  anyInt(t, l+"in_flight_tokens"),
			PendingPrefill:  anyInt(t, l+"pending_prefill"),
			PendingCount:    anyInt(t, l+"pending_count"),
			PendingTransfer: anyInt(t, l+"pending_transfer"),
			HaveMetrics:     rapid.Bool().Draw(t, l+"have_metrics"),
			MetricsAge:      anyDuration(t, l+"metrics_age"),
			Waiting:         anyInt(t, l+"waiting"),
			WaitingUnseen:   anyInt(t, l+"waiting_unseen"),
			Running:         anyInt(t, l+"running"),
			KVUsage:         anyFloat(t, l+"kv_usage"),
			NumBlocks:       anyInt(t, l+"num_blocks"),
			Match:           rapid.OneOf(rapid.IntRange(0, blocks+3), rapid.Custom(func(t *rapid.T) int { return anyInt(t, "any") })).Draw(t, l+"match"),
			Cached:          anyInt(t, l+"cached"),
			Programs:        anyInt(t, l+"programs"),
			ProgramTokens:   anyInt(t, l+"program_tokens"),
		}
	}
	return rs
}

// drawSides draws the views of a P/D decision as the router's side()
// makes them: every replica on both sides, a candidate on the sides its
// role takes part in.
func drawSides(t *rapid.T, label string, n, blocks int) (prefill, decode []ReplicaView) {
	rs := drawViews(t, label, n, blocks)
	prefill, decode = slices.Clone(rs), slices.Clone(rs)
	for i := range rs {
		prefill[i].Healthy = rs[i].Healthy && rs[i].Role.Prefills()
		decode[i].Healthy = rs[i].Healthy && rs[i].Role.Decodes()
	}
	return prefill, decode
}

var totalT0 = time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)

// drawTime draws an event's or a request's time: around totalT0, far
// from it, or the zero time.
func drawTime(t *rapid.T, label string) time.Time {
	return rapid.OneOf(
		rapid.Map(rapid.Int64Range(-3600, 3600), func(s int64) time.Time { return totalT0.Add(time.Duration(s) * time.Second) }),
		rapid.SampledFrom([]time.Time{{}, totalT0.Add(math.MaxInt64), totalT0.Add(math.MinInt64), time.Unix(1<<40, 0)}),
	).Draw(t, label)
}

// drawBlocks draws a prompt's block hashes: none, a few or thousands, a
// family's shared head then the request's own blocks (chained hashes name
// their prefix, so requests of one family share their head).
func drawBlocks(t *rapid.T, label string) []uint64 {
	n := rapid.OneOf(rapid.IntRange(0, 8), rapid.IntRange(0, 80), rapid.IntRange(1000, 5000)).Draw(t, label+"/blocks")
	family := rapid.Uint64Range(0, 3).Draw(t, label+"/family")
	own := rapid.Uint64().Draw(t, label+"/own")
	shared := rapid.IntRange(0, n).Draw(t, label+"/shared")
	out := make([]uint64, n)
	for k := range out {
		h := family
		if k >= shared {
			h = own | 1<<63
		}
		out[k] = mix64(h*0x9e3779b97f4a7c15 + uint64(k))
	}
	return out
}

// mix64 is splitmix64's finaliser.
func mix64(x uint64) uint64 {
	x = (x ^ x>>30) * 0xbf58476d1ce4e5b9
	x = (x ^ x>>27) * 0x94d049bb133111eb
	return x ^ x>>31
}

var totalTexts = []string{"", "hello", "system: be brief\nuser: hi", "\xff\xfe invalid utf-8 \xc3", "héllo wörld ✓"}

// drawText draws a routing text: a few fixed ones (shared heads,
// invalid UTF-8), any string, or a long one.
func drawText(t *rapid.T, label string) string {
	return rapid.OneOf(
		rapid.SampledFrom(totalTexts),
		rapid.String(),
		rapid.Map(rapid.IntRange(0, 20000), func(k int) string { return totalTexts[2] + string(make([]byte, k)) }),
	).Draw(t, label)
}

// drawRequest draws a request: prompts of no block or thousands, token
// counts of 0 or huge, max_tokens huge or negative; IDs from a small set,
// so that events name known and unknown requests.
func drawRequest(t *rapid.T, label string, n int) *Request {
	text := drawText(t, label+"/text")
	return &Request{
		ID:      rapid.Uint64Range(0, 16).Draw(t, label+"/id"),
		Now:     drawTime(t, label+"/now"),
		Model:   rapid.SampledFrom([]string{"m", "", "other"}).Draw(t, label+"/model"),
		Adapter: rapid.SampledFrom([]string{"", "lora"}).Draw(t, label+"/adapter"),
		Salt:    rapid.SampledFrom([]string{"", "salt"}).Draw(t, label+"/salt"),
		Text:    text, KeyText: text,
		System:  rapid.SampledFrom(totalTexts).Draw(t, label+"/system"),
		Session: rapid.SampledFrom([]string{"", "s1", "s2"}).Draw(t, label+"/session"),
		Blocks:  drawBlocks(t, label),
		Tokens: rapid.OneOf(rapid.Just(0), rapid.IntRange(1, 100000),
			rapid.SampledFrom([]int{math.MaxInt, 1 << 24, 1 << 40, -1, math.MinInt})).Draw(t, label+"/tokens"),
		MaxTokens: rapid.OneOf(rapid.Just(0), rapid.IntRange(1, 4096),
			rapid.SampledFrom([]int{math.MaxInt, 1 << 24, -1, math.MinInt})).Draw(t, label+"/max_tokens"),
		NoDefer:          rapid.Bool().Draw(t, label+"/no_defer"),
		SkipPrefillBelow: rapid.OneOf(rapid.IntRange(0, 1000), rapid.Custom(func(t *rapid.T) int { return anyInt(t, "any") })).Draw(t, label+"/skip_below"),
		Program: Program{ID: rapid.Uint64Range(0, 3).Draw(t, label+"/program"), Continues: rapid.Bool().Draw(t, label+"/continues"),
			Home: rapid.IntRange(-1, n).Draw(t, label+"/home"), Tokens: anyInt(t, label+"/program_tokens"), Turns: anyInt(t, label+"/turns")},
	}
}

// drawEvent draws an outcome event: any kind and phase, remote or not, for
// replicas known, unknown or negative, a request or none, with any TTFT
// and counts.
func drawEvent(t *rapid.T, label string, n int) Event {
	var req *Request
	if rapid.IntRange(0, 9).Draw(t, label+"/has_req") > 0 {
		req = drawRequest(t, label, n)
		req.BlockOffset = rapid.OneOf(rapid.Just(0), rapid.Custom(func(t *rapid.T) int { return anyInt(t, "any") })).Draw(t, label+"/offset")
	}
	var err error
	if rapid.Bool().Draw(t, label+"/err") {
		err = errors.New("failed")
	}
	replica := rapid.IntRange(-2, n+8).Draw(t, label+"/replica")
	return Event{
		Kind: rapid.SampledFrom([]EventKind{Routed, FirstToken, Done, EventKind(7)}).Draw(t, label+"/event"),
		At:   drawTime(t, label+"/at"),
		Req:  req,
		Decision: Decision{
			Replica: rapid.OneOf(rapid.Just(replica), rapid.IntRange(-2, n+8)).Draw(t, label+"/decision"),
			Matched: anyInt(t, label+"/matched"), EstTTFT: anyDuration(t, label+"/est"), Load: anyFloat(t, label+"/load"),
		},
		Replica:      replica,
		Phase:        rapid.SampledFrom([]Phase{PhaseNone, PhasePrefill, PhaseDecode}).Draw(t, label+"/phase"),
		Remote:       rapid.Bool().Draw(t, label+"/remote"),
		TTFT:         anyDuration(t, label+"/ttft"),
		CachedTokens: anyInt(t, label+"/cached_tokens"),
		OutputTokens: anyInt(t, label+"/output_tokens"),
		Err:          err,
	}
}
