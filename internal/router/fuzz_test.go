package router

import (
	"math"
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/policy"
	"github.com/kvgate/kvgate/internal/prompt"
)

// FuzzBodyToDecision drives any request body a client can send through the
// whole path to a decision — parse, routing key, every policy's Pick with
// other requests in flight, the ticket's accounting — and checks that
// nothing panics, every score is a number, and the counters return to zero.
// (The overflow of max_tokens 2^63−1 in the token accounting was found here.)
func FuzzBodyToDecision(f *testing.F) {
	f.Add(`{"model":"m","prompt":"hello","max_tokens":16}`, uint8(0))
	f.Add(`{"model":"m","prompt":"x","max_tokens":9223372036854775807}`, uint8(1))
	f.Add(`{"model":"m","prompt":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17],"max_completion_tokens":16777216}`, uint8(2))
	f.Add(`{"model":"m","messages":[{"role":"system","content":"s"},{"role":"user","content":"u"}],"max_tokens":0}`, uint8(3))
	names := policy.Names()
	f.Fuzz(func(t *testing.T, body string, pick uint8) {
		kind := prompt.Completion
		if pick&1 == 1 {
			kind = prompt.Chat
		}
		p, err := prompt.Parse(kind, []byte(body))
		if err != nil {
			return // a clear 400: nothing reaches the router
		}
		pol, err := policy.New(names[int(pick)%len(names)], policy.Options{Seed: 1})
		if err != nil {
			t.Fatal(err)
		}
		now := time.Unix(1000, 0)
		rt, err := New(Config{Replicas: []string{"a", "b", "c"}, Policy: pol, Now: func() time.Time { return now },
			BlocksPerReplica: 1 << 12, MaxEntries: 1 << 16, LearnOnAccept: true})
		if err != nil {
			t.Fatal(err)
		}
		rt.SetMetrics(1, Metrics{Waiting: 1 << 30, Running: 1 << 30, KVUsage: 1, NumBlocks: 1 << 30, BlockSize: 1 << 15}, now)
		var tickets []*Ticket
		for range 3 { // the same request three times: the later ones see the first in flight
			tk, err := rt.Route(rt.Prepare(p, "s", ""))
			if err != nil {
				t.Fatalf("route: %v", err)
			}
			for _, s := range tk.Decision.Scores {
				if math.IsNaN(s) {
					t.Fatalf("%s: NaN score", pol.Name())
				}
			}
			if tk.Decision.EstTTFT < 0 {
				t.Fatalf("%s: negative estimate %v", pol.Name(), tk.Decision.EstTTFT)
			}
			tk.Accept()
			tickets = append(tickets, tk)
		}
		for _, tk := range tickets {
			tk.FirstToken(now.Add(time.Millisecond))
			tk.Done(now.Add(time.Second), Outcome{CachedTokens: p.MaxTokens, OutputTokens: p.MaxTokens})
		}
		for i := range rt.Replicas() {
			r := rt.Replica(i)
			if r.inFlight.Load() != 0 || r.inFlightTokens.Load() != 0 || r.pendingPrefill.Load() != 0 || r.pendingCount.Load() != 0 {
				t.Fatalf("replica %d counters not back to zero", i)
			}
		}
	})
}
