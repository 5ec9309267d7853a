package gateway

import (
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/clock"
	"github.com/kvgate/kvgate/internal/gateway/ui"
	"github.com/kvgate/kvgate/internal/prompt"
	"github.com/kvgate/kvgate/internal/router"
)

// replicaLabels is the distinct values of the replica label over every
// series of reg.
func replicaLabels(t *testing.T, tg *Gateway) map[string]bool {
	t.Helper()
	fams, err := tg.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]bool{}
	for _, f := range fams {
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "replica" {
					out[l.GetValue()] = true
				}
			}
		}
	}
	return out
}

// 5,000 replicas added and removed one by one, the clock moving two
// minutes each time (finding 11: 5,001 slots and every replica's series
// and tallies kept for good): each removed replica is forgotten once past
// forget_after (default 5 min), its slot reused and the gateway's state of
// it freed, so that slots, index entries, metric series, the live view's
// tallies and the logged-once causes stay bounded by the replicas known
// at once. A replica listed again within forget_after keeps its slot and
// its series.
func TestChurnForgetsRemovedReplicas(t *testing.T) {
	path := filepath.Join(t.TempDir(), "replicas.yaml")
	if err := os.WriteFile(path, []byte("- url: http://127.0.0.1:1\n  data_parallel_size: 1\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg := baseConfig()
	cfg.ReplicasFile, cfg.Policy = path, "least_load"
	clk := clock.NewFake(time.Unix(0, 0))
	g, err := New(cfg, Options{Clock: clk}) // not run: the replicas are never probed
	if err != nil {
		t.Fatal(err)
	}
	base := ReplicaConfig{URL: "http://127.0.0.1:1", DataParallelSize: 1}
	churn := func(k int) ReplicaConfig {
		return ReplicaConfig{URL: fmt.Sprintf("http://10.%d.%d.1:8000", k/250, k%250), DataParallelSize: 1}
	}
	maxSlots, maxEntries := 0, 0
	for k := range 5000 {
		r := churn(k)
		if err := ctlOf(g).Apply("", []ReplicaConfig{base, r}, "test"); err != nil {
			t.Fatal(err)
		}
		slot, ok := g.rt.Lookup(r.URL)
		if !ok {
			t.Fatalf("replica %d not added", k)
		}
		// What serving it leaves: index rows, series, a tally, a logged cause.
		req := g.rt.Prepare(&prompt.Parsed{Kind: prompt.Completion, Model: "m", Text: fmt.Sprintf("request %0200d", k), MaxTokens: 4}, "", "")
		tk, err := g.rt.Route(req, 0)
		if err != nil || tk.Replica != slot {
			t.Fatalf("routed to %v, %v; want slot %d", tk, err, slot)
		}
		tk.Accept()
		tk.Done(clk.Now(), router.Outcome{CachedTokens: -1})
		g.met.attempts.WithLabelValues(r.URL, "served").Inc()
		g.met.ttft.WithLabelValues(cfg.Policy, r.URL).Observe(0.1)
		g.ui.Note(ui.Attempt{At: clk.Now(), Replica: r.URL, TTFT: -1, Cached: -1})
		ctlOf(g).LogOnce(slot, "test_cause", slog.LevelDebug, "once")
		ctlOf(g).kv.models.Store(slot, "m")
		if err := ctlOf(g).Apply("", []ReplicaConfig{base}, "test"); err != nil {
			t.Fatal(err)
		}
		clk.Advance(2 * time.Minute)
		maxSlots, maxEntries = max(maxSlots, g.rt.Replicas()), max(maxEntries, g.rt.Index().Len())
		if maxSlots > 5 {
			t.Fatalf("%d slots after %d replicas added and removed: removed replicas are never forgotten", maxSlots, k+1)
		}
	}
	// The base replica, and those removed within the last 5 minutes.
	if n := len(replicaLabels(t, g)); n > 4 {
		t.Fatalf("series of %d replicas after 5,000 came and went", n)
	}
	logged, models := 0, 0
	ctlOf(g).kv.logged.Range(func(any, any) bool { logged++; return true })
	ctlOf(g).kv.models.Range(func(any, any) bool { models++; return true })
	if g.ui.Replicas() > 4 || logged > 4 || models > 4 || maxEntries > 5*len(g.rt.Prepare(&prompt.Parsed{
		Kind: prompt.Completion, Model: "m", Text: fmt.Sprintf("request %0200d", 0)}, "", "").Blocks) {
		t.Fatalf("kept: %d tallies, %d logged causes, %d topic models, up to %d index entries",
			g.ui.Replicas(), logged, models, maxEntries)
	}
	// Listed again within forget_after: the same slot, its series kept.
	last := churn(4999)
	if err := ctlOf(g).Apply("", []ReplicaConfig{base, last}, "test"); err != nil {
		t.Fatal(err)
	}
	if i, ok := g.rt.Lookup(last.URL); !ok || g.rt.Replica(i).Removed() || !replicaLabels(t, g)[last.URL] {
		t.Fatalf("the replica listed again within forget_after: slot %d %v, series %v", i, ok, replicaLabels(t, g)[last.URL])
	}
}

// While no source changes the fleet, the gateway still forgets a replica
// removed longer than forget_after ago: its slot is free (kvgate_replicas
// state free), its series gone; listed again, it takes the free slot, cold.
func TestForgetLoopFreesAReplicaRemovedLongAgo(t *testing.T) {
	a, b := newHeldReplica(t), newHeldReplica(t)
	path := filepath.Join(t.TempDir(), "replicas.yaml")
	both := "- url: " + a.srv.URL + "\n- url: " + b.srv.URL + "\n"
	writeAtomically(t, path, both)
	cfg := baseConfig()
	cfg.ReplicasFile, cfg.Policy, cfg.ForgetAfter = path, "round_robin", Duration(2*time.Minute)
	clk := clock.NewFake(time.Unix(0, 0))
	tg := startGatewayWith(t, cfg, Options{Clock: clk})
	eventually(t, "both routable", func() bool { return routable(tg, a.srv.URL) && routable(tg, b.srv.URL) })
	if got := servedBy(t, tg, 4); got[b.srv.URL] == 0 {
		t.Fatalf("served by %v: b never chosen", got)
	}
	slot, _ := tg.g.rt.Lookup(b.srv.URL)
	writeAtomically(t, path, "- url: "+a.srv.URL+"\n")
	tg.g.Reload()
	eventually(t, "b removed", func() bool { return replicaStateOf(tg, b.srv.URL) == "removed" })
	if !replicaLabels(t, tg.g)[b.srv.URL] {
		t.Fatal("b's series are gone before forget_after")
	}
	eventually(t, "b forgotten", func() bool {
		clk.Advance(30 * time.Second) // the sweep's ticker: every 30 s (forget_after / 4)
		return gaugeSeries(t, tg.g.reg, "kvgate_replicas")["free"] == 1
	})
	if _, ok := tg.g.rt.Lookup(b.srv.URL); ok || replicaLabels(t, tg.g)[b.srv.URL] || tg.g.rt.Index().ReplicaLen(slot) != 0 {
		t.Fatalf("b forgotten, yet still named, with series or index rows")
	}
	writeAtomically(t, path, both)
	tg.g.Reload()
	eventually(t, "b back", func() bool { return routable(tg, b.srv.URL) })
	if i, _ := tg.g.rt.Lookup(b.srv.URL); i != slot || tg.g.rt.Replicas() != 2 {
		t.Fatalf("b back in slot %d of %d, want its free slot %d of 2", i, tg.g.rt.Replicas(), slot)
	}
}
