package gateway

import (
	"net/http"
	"net/netip"
	"testing"
	"time"

	"pgregory.net/rapid"
)

// The body-memory budget, over any sequence of reads taken, bodies given
// back and waits abandoned: the bytes held never pass the budget nor a
// client's share, they are the sum of what the holders hold (the gauge
// tells the truth), and no read waits while its bytes would fit (no lost
// wake-up: give grants every waiter that fits).
func TestBodyBudgetProperties(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		total := rapid.Int64Range(1, 400).Draw(t, "total")
		per := rapid.Int64Range(1, total).Draw(t, "per")
		b := &bodyBudget{total: total, perClient: per, clients: map[netip.Addr]int64{}}
		clients := []netip.Addr{netip.MustParseAddr("10.0.0.1"), netip.MustParseAddr("10.0.0.2"), netip.MustParseAddr("2001:db8::")}
		type hold struct {
			c netip.Addr
			n int64
		}
		var holds []hold
		var waiting []*bodyWaiter
		granted := func() { // waiters whose bytes were charged become holds
			left := waiting[:0]
			for _, w := range waiting {
				select {
				case <-w.ready:
					holds = append(holds, hold{w.client, w.n})
				default:
					left = append(left, w)
				}
			}
			waiting = left
		}
		t.Repeat(map[string]func(*rapid.T){
			"take": func(t *rapid.T) {
				c := rapid.SampledFrom(clients).Draw(t, "client")
				n := rapid.Int64Range(1, per).Draw(t, "n")
				if w := b.take(c, n); w == nil {
					holds = append(holds, hold{c, n})
				} else {
					waiting = append(waiting, w)
				}
			},
			"give": func(t *rapid.T) {
				if len(holds) == 0 {
					t.Skip("nothing held")
				}
				i := rapid.IntRange(0, len(holds)-1).Draw(t, "i")
				b.give(holds[i].c, holds[i].n)
				holds = append(holds[:i], holds[i+1:]...)
				granted()
			},
			"cancel": func(t *rapid.T) {
				if len(waiting) == 0 {
					t.Skip("nobody waits")
				}
				i := rapid.IntRange(0, len(waiting)-1).Draw(t, "i")
				w := waiting[i]
				waiting = append(waiting[:i], waiting[i+1:]...)
				if b.cancel(w) == nil {
					holds = append(holds, hold{w.client, w.n})
				}
			},
			"": func(t *rapid.T) {
				sum, byClient := int64(0), map[netip.Addr]int64{}
				for _, h := range holds {
					sum += h.n
					byClient[h.c] += h.n
				}
				if got := b.held.Load(); got != sum || got > total {
					t.Fatalf("held %d, holders hold %d, budget %d", got, sum, total)
				}
				for c, n := range byClient {
					if n > per || b.clients[c] != n {
						t.Fatalf("client %v holds %d (budget says %d), share %d", c, n, b.clients[c], per)
					}
				}
				if len(b.clients) != len(byClient) {
					t.Fatalf("clients %v, holders %v", b.clients, byClient)
				}
				for _, w := range waiting {
					if b.fits(w.client, w.n) == nil {
						t.Fatalf("a read of %d bytes from %v waits though it fits", w.n, w.client)
					}
				}
			},
		})
	})
}

// A body is charged to its peer's IPv4 address, or its IPv6 /64 (one
// host's usual allocation: the addresses of one /64 are one client).
func TestClientKey(t *testing.T) {
	for _, tc := range []struct{ remote, want string }{
		{"127.0.0.2:4242", "127.0.0.2"},
		{"[::ffff:10.1.2.3]:80", "10.1.2.3"},
		{"[2001:db8:1:2:aaaa:bbbb:cccc:dddd]:443", "2001:db8:1:2::"},
		{"[2001:db8:1:2::1]:443", "2001:db8:1:2::"},
		{"@", "invalid IP"},
	} {
		r := &http.Request{RemoteAddr: tc.remote}
		if got := clientKey(r).String(); got != tc.want {
			t.Errorf("%s: %s, want %s", tc.remote, got, tc.want)
		}
	}
}

// A body's deadline grows by a second per min_body_rate bytes after the
// grace, and never passes body_read_timeout (nor overflows).
func TestBodyDeadlineAllowed(t *testing.T) {
	for _, tc := range []struct {
		rate, got    int64
		grace, limit time.Duration
		want         time.Duration
		byRate       bool
	}{
		{1000, 0, 5 * time.Second, 30 * time.Second, 5 * time.Second, true},
		{1000, 1500, 5 * time.Second, 30 * time.Second, 6500 * time.Millisecond, true},
		{1000, 25000, 5 * time.Second, 30 * time.Second, 30 * time.Second, false},
		{1, 1 << 62, time.Second, time.Minute, time.Minute, false},
		{0, 10, 5 * time.Second, 30 * time.Second, 30 * time.Second, false},
	} {
		d := &bodyDeadline{rate: tc.rate, got: tc.got, grace: tc.grace, limit: tc.limit}
		if got, byRate := d.allowed(); got != tc.want || byRate != tc.byRate {
			t.Errorf("%+v: %v %v, want %v %v", tc, got, byRate, tc.want, tc.byRate)
		}
	}
}
