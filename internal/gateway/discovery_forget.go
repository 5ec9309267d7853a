package gateway

import (
	"context"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvgate/kvgate/internal/router"
)

// Forgetting removed replicas. The router forgets a replica a source
// removed once it has drained and forget_after has passed since its
// removal (router/membership.go): its slot goes to the next replica added
// and the router frees what it kept (index rows, policy state, counters,
// scrapes). forgot frees what the gateway keeps of it: its metric series,
// the live view's tally, its logged-once causes, the model its KV-event
// topic named, the fleet's probe bookkeeping, and the stored responses
// homed on its slot. Without it a fleet that churns (autoscaling, rolling
// restarts) grew by every replica it ever saw: 5,000 added and removed
// kept 5,001 slots and 155 MiB more.

// forgetLoop forgets the replicas due while no source changes the fleet
// (SetReplicas forgets at each change too), until ctx ends.
func (g *Gateway) forgetLoop(ctx context.Context) {
	tick := g.clock.NewTicker(forgetSweep(g.cfg.ForgetAfter.D()))
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C():
		}
		g.memMu.Lock()
		g.forgot(g.rt.Forget())
		g.memMu.Unlock()
	}
}

// forgetSweep is how often forgetLoop looks: a quarter of forget_after,
// between a second and a minute (a replica is forgotten at most that late).
func forgetSweep(after time.Duration) time.Duration {
	return min(max(after/4, time.Second), time.Minute)
}

// forgot frees the gateway's state of the replicas the router forgot
// (memMu held: before their slots are given again).
func (g *Gateway) forgot(list []router.Forgotten) {
	for _, f := range list {
		g.met.forgetReplica(f.Name)
		g.ui.forget(f.Name)
		g.kvLogged.Range(func(k, _ any) bool {
			if strings.HasPrefix(k.(string), f.Name+"\x00") {
				g.kvLogged.Delete(k)
			}
			return true
		})
		g.kvModels.Delete(f.Slot)
		g.fleet.Forget(f.Slot, f.URL)
		if g.homes != nil {
			g.homes.forgetSlot(f.Slot)
		}
		g.log.Info("replica forgotten: drained and removed for forget_after; its slot is free and its state freed",
			"replica", f.Name, "slot", f.Slot)
	}
}

// replicaSeries are the metric vectors with a replica label.
func (m *metrics) replicaSeries() []*prometheus.MetricVec {
	return []*prometheus.MetricVec{m.requests.MetricVec, m.ttft.MetricVec, m.ejections.MetricVec, m.attempts.MetricVec,
		m.kvBatches.MetricVec, m.kvDropped.MetricVec, m.kvGaps.MetricVec, m.kvReplayed.MetricVec,
		m.kvBlockSizeMismatch.MetricVec, m.underpredicted.MetricVec, m.pdAttempts.MetricVec, m.decisions.MetricVec,
		m.ttftRatio.MetricVec, m.promptTokens.MetricVec, m.cachedTokens.MetricVec, m.genTokens.MetricVec,
		m.usageReported.MetricVec}
}

// forgetReplica deletes every series of the replica named name.
func (m *metrics) forgetReplica(name string) {
	for _, v := range m.replicaSeries() {
		v.DeletePartialMatch(prometheus.Labels{"replica": name})
	}
}

// forget drops the replica's tally.
func (s *uiStats) forget(name string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.replicas, name)
}

// forgetSlot drops the responses homed on slot: its replica is forgotten
// and the slot may name another (a lookup asks the replicas again).
func (h *responseHomes) forgetSlot(slot int) {
	for _, id := range h.c.Keys() {
		if s, ok := h.c.Peek(id); ok && s == slot {
			h.c.Remove(id)
		}
	}
}
