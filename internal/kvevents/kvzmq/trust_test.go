package kvzmq

import (
	"context"
	"errors"
	"net/netip"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/clock"
	"github.com/kvgate/kvgate/internal/testutil"
)

func TestParseTrust(t *testing.T) {
	a := netip.MustParseAddr
	tests := []struct {
		name    string
		entries []string
		err     bool
		replica bool
		forAll  []netip.Addr // trusted for every replica
		not     []netip.Addr // not trusted for every replica
	}{
		{"default", []string{"replica_address"}, false, true, nil, []netip.Addr{a("10.0.0.1"), a("127.0.0.1")}},
		{"any", []string{"any"}, false, false, []netip.Addr{a("10.0.0.1"), a("::1")}, nil},
		{"cidrs", []string{"10.0.0.0/8", " fd00::/8"}, false, false, []netip.Addr{a("10.255.0.1"), a("fd00::7")},
			[]netip.Addr{a("11.0.0.1"), a("fe80::1"), {}}},
		{"cidr unmasked", []string{"10.1.2.3/8"}, false, false, []netip.Addr{a("10.9.9.9")}, nil},
		{"union", []string{"replica_address", "192.168.0.0/16"}, false, true, []netip.Addr{a("192.168.1.1")}, []netip.Addr{a("10.0.0.1")}},
		{"empty", nil, true, false, nil, nil},
		{"bare address", []string{"10.0.0.1"}, true, false, nil, nil},
		{"unknown word", []string{"replicas"}, true, false, nil, nil},
		{"any with others", []string{"any", "10.0.0.0/8"}, true, false, nil, nil},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			tr, err := ParseTrust(tc.entries)
			if (err != nil) != tc.err || (err != nil && !errors.Is(err, ErrTrust)) {
				t.Fatalf("err %v, want error %v", err, tc.err)
			}
			if err != nil {
				return
			}
			if tr.ReplicaAddress() != tc.replica {
				t.Errorf("ReplicaAddress %v", tr.ReplicaAddress())
			}
			for _, x := range tc.forAll {
				if !tr.ForAll(x) {
					t.Errorf("%v not trusted for all (%s)", x, tr)
				}
			}
			for _, x := range tc.not {
				if tr.ForAll(x) {
					t.Errorf("%v trusted for all (%s)", x, tr)
				}
			}
		})
	}
}

// fakeLookup answers from a table it counts the questions of.
type fakeLookup struct {
	mu      sync.Mutex
	answers map[string][]netip.Addr
	calls   int
}

func (f *fakeLookup) lookup(_ context.Context, host string) ([]netip.Addr, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls++
	as, ok := f.answers[host]
	if !ok {
		return nil, errors.New("no such host")
	}
	return slices.Clone(as), nil
}

func (f *fakeLookup) set(host string, as ...netip.Addr) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if as == nil {
		delete(f.answers, host)
		return
	}
	f.answers[host] = as
}

func (f *fakeLookup) count() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.calls
}

// The address book knows literals at once and names once resolved; a
// name's new address is learnt on a Kick no sooner than MinRefresh after
// the last round, and a failed lookup keeps the old addresses.
func TestAddrBook(t *testing.T) {
	a := netip.MustParseAddr
	clk := clock.NewFake(time.Unix(1000, 0))
	f := &fakeLookup{answers: map[string][]netip.Addr{"vllm-0.vllm": {a("10.1.0.5")}}}
	b := NewAddrBook(f.lookup, clk, AddrBookOptions{Refresh: time.Minute, MinRefresh: 5 * time.Second})
	b.SetHosts([]string{"VLLM-0.vllm", "10.1.0.9", "[fd00::1]"})
	if !b.Has(a("10.1.0.9")) || !b.Has(a("fd00::1")) || b.Has(a("10.1.0.5")) {
		t.Fatal("literals known at once, names not before a round")
	}
	if got := b.Addrs("[fd00::1]"); len(got) != 1 || got[0] != a("fd00::1") {
		t.Fatalf("Addrs of a literal: %v", got)
	}
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan struct{})
	go func() { defer close(done); b.Run(ctx) }()
	defer func() { cancel(); <-done }()
	testutil.Eventually(t, 10*time.Second, "the first round", func() bool { return b.Has(a("10.1.0.5")) })
	if got := b.Addrs("vllm-0.vllm"); len(got) != 1 || got[0] != a("10.1.0.5") {
		t.Fatalf("Addrs %v", got)
	}

	// The pod restarts with a new address: kicks within MinRefresh make
	// one round, when MinRefresh has passed.
	f.set("vllm-0.vllm", a("10.1.0.6"))
	calls := f.count()
	b.Kick()
	if !clk.WaitTimers(2, 10*time.Second) { // the ticker and the kick's wait
		t.Fatal("the kick does not wait for MinRefresh")
	}
	for range 5 {
		b.Kick()
	}
	if f.count() != calls || b.Has(a("10.1.0.6")) {
		t.Fatal("a round before MinRefresh")
	}
	clk.Advance(5 * time.Second)
	testutil.Eventually(t, 10*time.Second, "the new address", func() bool { return b.Has(a("10.1.0.6")) && !b.Has(a("10.1.0.5")) })

	// DNS fails: the last addresses stay.
	f.set("vllm-0.vllm")
	clk.Advance(time.Minute)
	testutil.Eventually(t, 10*time.Second, "a failed round", func() bool { return f.count() >= calls+2 })
	if !b.Has(a("10.1.0.6")) {
		t.Fatal("a failed lookup forgot the address")
	}
	// A host no longer followed is forgotten.
	b.SetHosts([]string{"10.1.0.9"})
	if b.Has(a("10.1.0.6")) || b.Names() {
		t.Fatal("a removed name is still known")
	}
}
