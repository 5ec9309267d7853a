package gateway

import (
	"context"
	"fmt"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/kvgate/kvgate/internal/prompt"
	"github.com/kvgate/kvgate/internal/router"
	"github.com/kvgate/kvgate/internal/sharedstate"
	"github.com/kvgate/kvgate/internal/sim"
	"github.com/kvgate/kvgate/internal/testutil"
)

// stop ends a test gateway now (its Run returns: the state file is
// written); the test's cleanup does nothing more.
func (tg *testGW) stop() {
	tg.srv.Close()
	tg.cancel()
	<-tg.done
}

// conversationTurn is turn k of conversation c: each turn's prompt holds
// the previous one's whole, so its blocks are a prefix of the next.
func conversationTurn(c, k int) string {
	var b strings.Builder
	fmt.Fprintf(&b, "conversation %d: you are a careful assistant who answers in full sentences. ", c)
	for j := 0; j <= k; j++ {
		fmt.Fprintf(&b, "turn %d of conversation %d asks about topic %d and gives some context to think about. ", j, c, 7*c+j)
		b.WriteString(strings.Repeat("more words of context for this turn. ", 6))
	}
	return b.String()
}

// matchAnywhere is the largest match of text on any replica in gw's view.
func matchAnywhere(gw *testGW, text string) int {
	m := 0
	for i := range gw.g.Router().Replicas() {
		m = max(m, matchOn(gw, sim.DefaultModel, text, i))
	}
	return m
}

// fullMatch reports whether gw's index holds all of text's blocks on the
// replica at url.
func fullMatch(gw *testGW, text, url string) bool {
	rt := gw.g.Router()
	for i := range rt.Replicas() {
		if rt.Name(i) == url {
			req := rt.Prepare(&prompt.Parsed{Kind: prompt.Completion, Model: sim.DefaultModel, Text: text, KeyText: text, Prompts: 1}, "", "")
			return len(req.Blocks) > 0 && rt.Views(req)[i].Match == len(req.Blocks)
		}
	}
	return false
}

// Without Redis: the index is written at shutdown and read at start, so a
// restarted gateway sends a known prompt to its holder from the first
// request.
func TestStateFileWarmRestart(t *testing.T) {
	fl := startSim(t, sim.Config{Replicas: 3})
	cfg := simConfig("ttft", fl.URLs()...)
	cfg.StateFile = filepath.Join(t.TempDir(), "kvgate.state")
	a := startGateway(t, cfg)
	waitHealthy(t, a)
	text := conversationTurn(1, 0)
	holder := routedTo(t, a, sim.DefaultModel, text)
	a.stop()

	b := startGateway(t, cfg)
	if m := matchAnywhere(b, text); m == 0 {
		t.Fatal("the restarted gateway's index is empty")
	}
	waitHealthy(t, b)
	if got := routedTo(t, b, sim.DefaultModel, conversationTurn(1, 1)); got != holder {
		t.Fatalf("after the restart the conversation went to %s, its holder is %s", got, holder)
	}
}

// Two gateways, one Redis: a conversation whose turns alternate between
// the gateways stays on one replica, and the conversations spread over the
// replicas; a gateway killed and started again routes a known prefix to
// its holder from its first request; Redis stopped mid-run fails no
// request, and the gateways say so.
func TestSharedStateTwoGateways(t *testing.T) {
	rd := testutil.NewRedis(t)
	fl := startSim(t, sim.Config{Replicas: 3})
	cfg := simConfig("ttft", fl.URLs()...)
	cfg.SharedState = rd.URL()
	gws := []*testGW{startGateway(t, cfg), startGateway(t, cfg)}
	for _, gw := range gws {
		waitHealthy(t, gw)
	}
	const convs, turns = 12, 4
	holder, last := make([]string, convs), make([]string, convs)
	stayed, later := 0, 0
	used := map[string]bool{}
	for k := range turns {
		for c := range convs {
			gw := gws[(c+k)%2]
			text := conversationTurn(c, k)
			got := routedTo(t, gw, sim.DefaultModel, text)
			last[c] = got
			if k == 0 {
				holder[c] = got
				used[got] = true
			} else {
				later++
				if got == holder[c] {
					stayed++
				}
			}
			// A client thinks for seconds between turns; here: until the
			// other gateway has heard of this one.
			other := gws[(c+k+1)%2]
			eventually(t, "the decision shared", func() bool { return fullMatch(other, text, got) })
		}
	}
	if stayed*10 < later*9 {
		t.Errorf("%d of %d later turns stayed on their conversation's replica, want ≥ 90%%", stayed, later)
	}
	if len(used) < 2 {
		t.Errorf("the conversations all went to %v", used)
	}

	// Kill gateway 1 and start it again: warm from Redis before it is ready.
	gws[1].stop()
	gws[1] = startGateway(t, cfg)
	eventually(t, "the restarted gateway ready", func() bool {
		r, err := http.Get(gws[1].srv.URL + "/ready")
		if err != nil {
			return false
		}
		r.Body.Close()
		return r.StatusCode == 200
	})
	// Ready as soon as one replica is: its first requests wait until every
	// replica lists its models, or they could only go to those listed.
	waitHealthy(t, gws[1])
	for c := range 4 {
		if got := routedTo(t, gws[1], sim.DefaultModel, conversationTurn(c, turns)); got != last[c] {
			var ms []int
			for i := range gws[1].g.Router().Replicas() {
				ms = append(ms, matchOn(gws[1], sim.DefaultModel, conversationTurn(c, turns), i))
			}
			t.Errorf("restarted gateway: conversation %d went to %s, its last turn's replica is %s (matches now %v, replicas %v)", c, got, last[c], ms, fl.URLs())
		}
	}

	// Redis goes away: every request still succeeds (routedTo fails the
	// test on anything but 200), and both gateways report it.
	rd.Stop()
	for c := range 10 {
		routedTo(t, gws[c%2], sim.DefaultModel, conversationTurn(c, turns+1))
	}
	for i, gw := range gws {
		eventually(t, fmt.Sprintf("gateway %d reports Redis down", i), func() bool {
			return counterValue(t, gw.g.reg, "kvgate_shared_state_up", nil) == 0
		})
	}
	rd.Start()
	for i, gw := range gws {
		eventually(t, fmt.Sprintf("gateway %d reports Redis back", i), func() bool {
			return counterValue(t, gw.g.reg, "kvgate_shared_state_up", nil) == 1
		})
	}
}

// Finding 1 at the shared-state door: whoever can write to the Redis
// writes a peer's load of -1,000,000 in flight for one replica (the red
// team's forged entry, with the project's own encoder). The gateway drops
// it where it reads it: the router never sees it, every request succeeds,
// and the drop is counted.
func TestForgedPeerLoadIsDroppedAtTheDoor(t *testing.T) {
	rd := testutil.NewRedis(t)
	fl := startSim(t, sim.Config{Replicas: 3})
	cfg := simConfig("ttft", fl.URLs()...)
	cfg.SharedState = rd.URL()
	gw := startGateway(t, cfg)
	waitHealthy(t, gw)
	opt, err := sharedstate.ParseURL(rd.URL())
	if err != nil {
		t.Fatal(err)
	}
	rc := redis.NewClient(opt)
	defer rc.Close()
	forged := sharedstate.Batch{Gateway: "forger", Seq: 1, At: time.Now(),
		Loads: []sharedstate.ReplicaLoad{{Replica: fl.URLs()[1], Load: router.Load{InFlight: -1_000_000}}}}
	id, err := rc.XAdd(context.Background(), &redis.XAddArgs{Stream: sharedstate.DefaultNamespace + ":batches",
		Values: []any{"b", sharedstate.AppendBatch(nil, &forged)}}).Result()
	if err != nil {
		t.Fatal(err)
	}
	eventually(t, "the gateway reading the forged entry", func() bool { return !idBefore(ctlOf(gw.g).shared.Stats().LastID, id) })
	for i := range 20 {
		routedTo(t, gw, sim.DefaultModel, conversationTurn(i, 0))
	}
	for i := range gw.g.Router().Replicas() {
		if l := gw.g.Router().RemoteLoad(i); l != (router.Load{}) {
			t.Fatalf("the forged load reached the router on %s: %+v", gw.g.Router().Name(i), l)
		}
	}
	if n := counterValue(t, gw.g.reg, "kvgate_shared_state_dropped_total", map[string]string{"reason": "load"}); n != 1 {
		t.Fatalf("kvgate_shared_state_dropped_total{reason=load} = %v, want 1", n)
	}
}

// idBefore reports whether the stream ID a ("ms-seq") is before b.
func idBefore(a, b string) bool {
	var am, as, bm, bs uint64
	if _, err := fmt.Sscanf(a, "%d-%d", &am, &as); err != nil {
		return true
	}
	if _, err := fmt.Sscanf(b, "%d-%d", &bm, &bs); err != nil {
		return false
	}
	return am < bm || am == bm && as < bs
}
