package router

import (
	"errors"
	"fmt"
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
			BlocksPerReplica: 1 << 12, MaxEntries: 1 << 16, ConfirmOnAccept: true})
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

// FuzzRoutePD drives any request body through RoutePD on a random mix of
// roles (two bits a replica: both, prefill, decode, decode) with every
// policy, the same request three times (the later ones see the first in
// flight and its prompt learnt), and checks that nothing panics, every score
// is a number, each step lands on a replica of a fitting role, and the
// counters return to zero.
func FuzzRoutePD(f *testing.F) {
	f.Add(`{"model":"m","prompt":"hello","max_tokens":16}`, uint8(0), uint8(0b10100101))
	f.Add(`{"model":"m","prompt":"x","max_tokens":9223372036854775807}`, uint8(5), uint8(0b00011011))
	f.Add(`{"model":"m","messages":[{"role":"user","content":"u"}],"max_tokens":0}`, uint8(9), uint8(0))
	f.Add(`{"model":"m","prompt":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17]}`, uint8(14), uint8(0b01010101))
	names := policy.Names()
	f.Fuzz(func(t *testing.T, body string, pick, roles uint8) {
		kind := prompt.Completion
		if pick&1 == 1 {
			kind = prompt.Chat
		}
		p, err := prompt.Parse(kind, []byte(body))
		if err != nil {
			return
		}
		pol, err := policy.New(names[int(pick)%len(names)], policy.Options{Seed: 1})
		if err != nil {
			t.Fatal(err)
		}
		now := time.Unix(1000, 0)
		var specs []Spec
		decoders := 0
		for i := range 4 {
			role := []policy.Role{policy.RoleBoth, policy.RolePrefill, policy.RoleDecode, policy.RoleDecode}[roles>>(2*i)&3]
			specs = append(specs, Spec{URL: fmt.Sprintf("r%d", i), Role: role})
			if role.Decodes() {
				decoders++
			}
		}
		rt, err := New(Config{Specs: specs, Policy: pol, Now: func() time.Time { return now },
			BlocksPerReplica: 1 << 12, MaxEntries: 1 << 16, ConfirmOnAccept: pick&2 == 2})
		if err != nil {
			t.Fatal(err)
		}
		rt.SetMetrics(1, Metrics{Waiting: 1 << 30, Running: 1 << 30, KVUsage: 1, NumBlocks: 1 << 30, BlockSize: 1 << 15}, now)
		var pds []PD
		for range 3 {
			pd, err := rt.RoutePD(rt.Prepare(p, "s", ""))
			if decoders == 0 {
				if !errors.Is(err, policy.ErrNoReplica) {
					t.Fatalf("no decode replica: %v", err)
				}
				return
			}
			if err != nil {
				t.Fatalf("%s: RoutePD: %v", pol.Name(), err)
			}
			checkPD(t, rt, pol.Name(), pd)
			for _, tk := range []*Ticket{pd.Prefill, pd.Decode} {
				if tk != nil {
					tk.Accept()
				}
			}
			pds = append(pds, pd)
		}
		for _, pd := range pds {
			if pd.Prefill != nil {
				pd.Prefill.Done(now.Add(time.Millisecond), Outcome{CachedTokens: -1, OutputTokens: 1})
			}
			pd.Decode.FirstToken(now.Add(2 * time.Millisecond))
			pd.Decode.Done(now.Add(time.Second), Outcome{CachedTokens: p.MaxTokens, OutputTokens: p.MaxTokens})
		}
		for i := range rt.Replicas() {
			if l := rt.LocalLoad(i); l != (Load{}) || rt.Replica(i).pendingTransfer.Load() != 0 {
				t.Fatalf("replica %d counters not back to zero: %+v", i, l)
			}
		}
	})
}

// checkPD checks a routed pair's shape.
func checkPD(t *testing.T, rt *Router, name string, pd PD) {
	t.Helper()
	for _, d := range []policy.Decision{pd.Decision.Prefill, pd.Decision.Decode} {
		for _, s := range d.Scores {
			if math.IsNaN(s) {
				t.Fatalf("%s: NaN score", name)
			}
		}
		if d.EstTTFT < 0 {
			t.Fatalf("%s: negative estimate %v", name, d.EstTTFT)
		}
	}
	if !rt.Replica(pd.Decode.Replica).Role().Decodes() {
		t.Fatalf("%s: decode step on a %v replica", name, rt.Replica(pd.Decode.Replica).Role())
	}
	if (pd.Prefill == nil) != pd.Decision.SkipPrefill {
		t.Fatalf("%s: prefill ticket %v with skip %v", name, pd.Prefill, pd.Decision.SkipPrefill)
	}
	if pd.Prefill != nil && (!rt.Replica(pd.Prefill.Replica).Role().Prefills() || pd.Prefill.Replica == pd.Decode.Replica) {
		t.Fatalf("%s: prefill step on %d (%v), decode on %d", name, pd.Prefill.Replica,
			rt.Replica(pd.Prefill.Replica).Role(), pd.Decode.Replica)
	}
}
