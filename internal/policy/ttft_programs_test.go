package policy

import (
	"strings"
	"testing"
)

// A continuing program of a 32,000-token context: its home (position 0)
// holds it all, the other replica its first 4,000 tokens (a shared system
// prompt). Re-prefilling the other 28,000 tokens there takes about 1.2 s.
func programCase(homeQueued, awayReserved int) (*Request, []ReplicaView) {
	req := peerReq(1, strings.Repeat("abcd", 32000), peerT0)
	rs := peerViews(2)
	req.Program = Program{ID: 9, Continues: true, Home: rs[0].Index, Tokens: 31000, Turns: 6}
	rs[0].Match, rs[1].Match = len(req.Blocks), 250
	rs[0].PendingPrefill, rs[0].PendingCount, rs[0].InFlight = homeQueued, 1, 1
	for i := range rs {
		rs[i].NumBlocks, rs[i].Cached = 30000, rs[i].Match // room in the cache: no eviction cost
	}
	rs[1].ProgramTokens = awayReserved
	return req, rs
}

func TestTTFTPricesMovingAProgram(t *testing.T) {
	base := map[string]any{"margin_rel": 0, "margin_ms": 0, "saturated_rel": 0, "decode_weight": 0, "program_weight": 1} // the mechanism, at full weight
	cases := []struct {
		name         string
		params       map[string]any
		homeQueued   int // tokens queued at the home (40,000: about 1.6 s)
		awayReserved int // the other replica's programs' contexts
		want         int
	}{
		{"unpriced, a busy home loses the program", map[string]any{"programs": false}, 40_000, 0, 1},
		{"priced, the re-prefill keeps it home", nil, 40_000, 0, 0},
		{"priced, a saturated home loses it", nil, 200_000, 0, 1},
		{"into a full replica, every future turn pays", nil, 100_000, 470_000, 0},
		{"into one with room, once", nil, 100_000, 0, 1},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			params := map[string]any{}
			for k, v := range base {
				params[k] = v
			}
			for k, v := range c.params {
				params[k] = v
			}
			p := peerNew(t, "ttft", params)
			req, rs := programCase(c.homeQueued, c.awayReserved)
			pos, d := peerPick(t, p, req, rs)
			if pos != c.want {
				t.Fatalf("chose %d, want %d (scores %v, %s)", pos, c.want, d.Scores, d.Reason)
			}
			if moved := strings.HasPrefix(d.Reason, "program moved off its home "+rs[0].URL); moved != (pos == 1 && c.params == nil) {
				t.Fatalf("reason %q", d.Reason)
			}
		})
	}
	if PlacesPrograms(peerNew(t, "ttft", map[string]any{"programs": false})) || !PlacesPrograms(peerNew(t, "ttft", nil)) ||
		PlacesPrograms(peerNew(t, "llmd", nil)) {
		t.Fatal("ttft places programs unless programs=false; the peers never")
	}
}

// A burst's followers (ReplicaView.BurstPending) are decodes to come: of
// two replicas with as much prefill queued and as many requests pending,
// the one whose pending requests follow a burst decodes more once its
// prefill is done, and a new request goes to the other. BurstPending is
// read within PendingCount: an impossible count adds nothing more.
func TestTTFTCountsBurstFollowersAsDecodes(t *testing.T) {
	p := peerNew(t, "ttft", map[string]any{"margin_rel": 0, "margin_ms": 0})
	for _, c := range []struct {
		name   string
		burst  [2]int
		want   int
		equals bool
	}{
		{"followers on 0", [2]int{7, 0}, 1, false},
		{"followers on 1", [2]int{0, 7}, 0, false},
		{"none: as many decodes", [2]int{0, 0}, -1, true},
		{"beyond the pending: capped", [2]int{7, 1 << 40}, 0, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			rs := peerViews(2)
			for i := range rs {
				rs[i].PendingPrefill, rs[i].PendingCount, rs[i].InFlight, rs[i].InFlightTokens = 3000, 8, 8, 8*2000
				rs[i].BurstPending = c.burst[i]
			}
			pos, d := peerPick(t, p, ttftReq(1), rs)
			if c.equals {
				if d.Scores[0] != d.Scores[1] {
					t.Fatalf("scores %v, want equal", d.Scores)
				}
				return
			}
			if pos != c.want || d.Scores[pos] >= d.Scores[1-pos] {
				t.Fatalf("chose %d, want %d (scores %v)", pos, c.want, d.Scores)
			}
		})
	}
}

// A chat's next turn (2,700 tokens, the first 1,536 a system prompt its
// home holds, its history evicted there) with 8,000 tokens queued at its
// home: where the fleet's KV has room it moves to the idle replica, as
// before; where the fleet's KV is claimed (every replica's in-flight KV at
// its capacity), a replica that holds none of it would keep a copy of the
// system prompt for each of the chat's turns to come (hold), and it stays
// home; a replica holding the system prompt still takes it.
func TestTTFTPricesTheOpeningAProgramCopies(t *testing.T) {
	params := map[string]any{"margin_rel": 0, "margin_ms": 0, "decode_weight": 0}
	cases := []struct {
		name       string
		inFlightKV int // every replica's, tokens (capacity 16,000)
		awayMatch  int // blocks the other replica holds
		want       int
	}{
		{"fleet KV with room: moves", 0, 0, 1},
		{"fleet KV claimed: stays home", 16_000, 0, 0},
		{"fleet KV claimed, the other holds the opening: moves", 16_000, 96, 1},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			req := peerReq(1, strings.Repeat("abcd", 2700), peerT0)
			rs := peerViews(2)
			req.Program = Program{ID: 9, Continues: true, Home: rs[0].Index, Tokens: 2500, Turns: 6}
			rs[0].Match, rs[1].Match = 96, c.awayMatch
			rs[0].PendingPrefill, rs[0].PendingCount, rs[0].InFlight = 8000, 1, 1
			for i := range rs {
				rs[i].NumBlocks, rs[i].Cached = 1000, rs[i].Match // room in the cache: no eviction cost
				rs[i].InFlightKV, rs[i].ProgramTokens = c.inFlightKV, 80_000
			}
			pos, d := peerPick(t, peerNew(t, "ttft", params), req, rs)
			if pos != c.want {
				t.Fatalf("chose %d, want %d (scores %v, %s)", pos, c.want, d.Scores, d.Reason)
			}
		})
	}
}
