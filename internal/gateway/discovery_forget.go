package gateway

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvgate/kvgate/internal/router"
)

// Forgetting removed replicas. The router forgets a replica a source
// removed once it has drained and forget_after has passed since its
// removal (router/membership.go): its slot goes to the next replica added
// and the router frees what it kept (index rows, policy state, counters,
// scrapes), the control plane what it kept (control.forgot: its KV-event
// series and logged causes, the fleet's probes), and forget here what the
// request path keeps of it: its metric series and the live view's tally
// (the stored responses homed on its slot are told from its next
// replica's by serial: passthrough_responses.go). Without it a fleet that
// churns (autoscaling, rolling restarts) grew by every replica it ever
// saw: 5,000 added and removed kept 5,001 slots and 155 MiB more.

// forget is the control plane's onForget: the request path's state of a
// forgotten replica freed.
func (g *Gateway) forget(f router.Forgotten) {
	g.met.forgetReplica(f.Name)
	g.ui.Forget(f.Name)
}

// replicaSeries are the metric vectors with a replica label.
func (m *metrics) replicaSeries() []*prometheus.MetricVec {
	return []*prometheus.MetricVec{m.requests.MetricVec, m.ttft.MetricVec, m.ejections.MetricVec, m.attempts.MetricVec,
		m.underpredicted.MetricVec, m.pdAttempts.MetricVec, m.decisions.MetricVec,
		m.ttftRatio.MetricVec, m.promptTokens.MetricVec, m.cachedTokens.MetricVec, m.genTokens.MetricVec,
		m.usageReported.MetricVec, m.routeChecks.MetricVec, m.wrongRoutes.MetricVec}
}

// forgetReplica deletes every series of the replica named name.
func (m *metrics) forgetReplica(name string) {
	for _, v := range m.replicaSeries() {
		v.DeletePartialMatch(prometheus.Labels{"replica": name})
	}
	m.series.forget(name)
}
