package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"go.uber.org/goleak"

	"github.com/kvgate/kvgate/internal/engine"
	"github.com/kvgate/kvgate/internal/gateway"
	"github.com/kvgate/kvgate/internal/sim"
	"github.com/kvgate/kvgate/internal/testutil"
)

// grafanaPanel is the part of a dashboard panel the test reads.
type grafanaPanel struct {
	ID         int    `json:"id"`
	Type       string `json:"type"`
	Title      string `json:"title"`
	Datasource *struct {
		UID string `json:"uid"`
	} `json:"datasource"`
	GridPos struct{ H, W, X, Y int } `json:"gridPos"`
	Targets []struct {
		Expr  string `json:"expr"`
		RefID string `json:"refId"`
	} `json:"targets"`
	Panels []grafanaPanel `json:"panels"` // a collapsed row's
}

type grafanaDashboard struct {
	Title, UID string
	Panels     []grafanaPanel `json:"panels"`
	Templating struct {
		List []struct {
			Name, Type string
			Query      json.RawMessage `json:"query"`
		} `json:"list"`
	} `json:"templating"`
}

// readDashboard reads deploy/grafana/kvgate.json and returns it with its
// panels, rows' panels included, in order.
func readDashboard(t *testing.T) (grafanaDashboard, []grafanaPanel) {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(repoRoot(t), "deploy", "grafana", "kvgate.json"))
	if err != nil {
		t.Fatal(err)
	}
	var d grafanaDashboard
	if err := json.Unmarshal(data, &d); err != nil {
		t.Fatalf("kvgate.json: %v", err)
	}
	var all []grafanaPanel
	for _, p := range d.Panels {
		all = append(append(all, p), p.Panels...)
	}
	return d, all
}

// metricName finds the series names a PromQL expression queries: kvgate's
// and vLLM's (label names, functions and variables never look like them).
var metricName = regexp.MustCompile(`\b(kvgate_[a-z0-9_]+|vllm:[a-z0-9_:]+)`)

// The dashboard's shape: unique ids, every panel placed and on the
// datasource variable, every variable it uses defined, a replica variable.
func TestGrafanaDashboardShape(t *testing.T) {
	d, panels := readDashboard(t)
	vars := map[string]string{}
	for _, v := range d.Templating.List {
		vars[v.Name] = v.Type + " " + string(v.Query)
	}
	if !strings.HasPrefix(vars["datasource"], `datasource "prometheus"`) {
		t.Errorf("want a datasource variable over Prometheus, got %q", vars["datasource"])
	}
	if !strings.Contains(vars["replica"], "label_values(kvgate_replica_healthy, replica)") {
		t.Errorf("want a replica variable over the gateway's replica label, got %q", vars["replica"])
	}
	ids := map[int]bool{}
	queried := 0
	for _, p := range panels {
		if ids[p.ID] || p.ID == 0 {
			t.Errorf("panel %q: id %d missing or used twice", p.Title, p.ID)
		}
		ids[p.ID] = true
		if p.Type == "row" {
			continue
		}
		if p.GridPos.W <= 0 || p.GridPos.H <= 0 || p.GridPos.X+p.GridPos.W > 24 {
			t.Errorf("panel %q: gridPos %+v", p.Title, p.GridPos)
		}
		if p.Datasource == nil || p.Datasource.UID != "${datasource}" || len(p.Targets) == 0 {
			t.Errorf("panel %q: want targets on the ${datasource} variable", p.Title)
		}
		for _, tg := range p.Targets {
			queried++
			if len(metricName.FindAllString(tg.Expr, -1)) == 0 {
				t.Errorf("panel %q: %q queries no kvgate or vLLM series", p.Title, tg.Expr)
			}
			for _, m := range regexp.MustCompile(`\$(\w+)`).FindAllStringSubmatch(tg.Expr, -1) {
				if _, ok := vars[m[1]]; !ok && !strings.HasPrefix(m[1], "__") {
					t.Errorf("panel %q: variable $%s is not defined", p.Title, m[1])
				}
			}
		}
	}
	if queried < 20 {
		t.Fatalf("only %d queries found: is the dashboard read right?", queried)
	}
}

// Every series the dashboard queries is exposed: kvgate's by a gateway in
// precise mode, with shared state, in front of kvgate sim's prefill and
// decode replicas, read from its /metrics after requests; vLLM's by those
// replicas' /metrics (kvgate sim serves vLLM's names). A histogram is
// queried by its _bucket, _sum or _count series. A labelled counter that
// no event of this run touched (an ejection, a gap) has no series yet: it
// must then be registered in the gateway's registry under that name.
func TestGrafanaMetricsExposed(t *testing.T) {
	if testing.Short() {
		t.Skip("starts replicas and a gateway")
	}
	ignore := goleak.IgnoreCurrent()
	t.Cleanup(func() {
		// go-redis redials the closed shared-state address in the background
		// and sees its pool closed only after its next 1 s pause.
		_ = testutil.Poll(context.Background(), testutil.Bound(10*time.Second), func() bool { return goleak.Find(ignore) == nil })
		goleak.VerifyNone(t, ignore)
	})
	_, panels := readDashboard(t)
	names := map[string]bool{}
	for _, p := range panels {
		for _, tg := range p.Targets {
			for _, n := range metricName.FindAllString(tg.Expr, -1) {
				names[n] = true
			}
		}
	}
	gw, replicas, reg := exposeMetrics(t)
	var unseen []string
	for _, n := range slices.Sorted(maps.Keys(names)) {
		fams := gw
		if strings.HasPrefix(n, "vllm:") {
			fams = replicas
		}
		switch err := exposedAs(fams, n); {
		case err == nil:
		case fams[n] == nil && strings.HasPrefix(n, "kvgate_") && registered(reg, n):
			unseen = append(unseen, n)
		default:
			t.Errorf("the dashboard queries %s: %v", n, err)
		}
	}
	t.Logf("%d series names queried; registered without a series in this run: %v", len(names), unseen)
}

// exposedAs checks that a query of name finds series in fams.
func exposedAs(fams map[string]*dto.MetricFamily, name string) error {
	if f, ok := fams[name]; ok {
		if t := f.GetType(); t == dto.MetricType_HISTOGRAM || t == dto.MetricType_SUMMARY {
			return errors.New("a histogram: query its _bucket, _sum or _count")
		}
		return nil
	}
	for _, suffix := range []string{"_bucket", "_sum", "_count"} {
		if base, ok := strings.CutSuffix(name, suffix); ok {
			if f, ok := fams[base]; ok && f.GetType() == dto.MetricType_HISTOGRAM {
				return nil
			}
		}
	}
	return errors.New("not exposed")
}

// registered reports whether reg has a collector of that name (a histogram's
// base name for its series): registering another under the name conflicts.
func registered(reg *prometheus.Registry, name string) bool {
	for _, suffix := range []string{"_bucket", "_sum", "_count"} {
		name = strings.TrimSuffix(name, suffix)
	}
	probe := prometheus.NewGauge(prometheus.GaugeOpts{Name: name, Help: "a probe of the dashboard's test"})
	if err := reg.Register(probe); err != nil {
		return true
	}
	reg.Unregister(probe)
	return false
}

// exposeMetrics runs two kvgate sim replicas (prefill, decode) with KV
// events and a gateway over them in precise mode with shared state (at a
// closed port: kvgate_shared_state_up is 0), sends requests, and returns
// the gateway's and the replicas' metric families and the gateway's registry.
func exposeMetrics(t *testing.T) (gw, replicas map[string]*dto.MetricFamily, reg *prometheus.Registry) {
	t.Helper()
	fl, err := sim.Start(context.Background(), sim.Config{Replicas: 2, TimeScale: 50, KVEvents: true, KVEventsReplay: true,
		Roles: []engine.Role{engine.RolePrefill, engine.RoleDecode}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { fl.Close() })
	cfg := gateway.Defaults()
	for i, role := range []string{"prefill", "decode"} {
		cfg.Replicas = append(cfg.Replicas, gateway.ReplicaConfig{URL: fl.URLs()[i], Role: role, DataParallelSize: 1,
			KVEvents: fl.KVEndpoints()[i], KVEventsReplay: fl.KVReplayEndpoints()[i]})
	}
	cfg.Tokenizer, cfg.SharedState = "remote", "redis://"+closedAddr(t)+"/0"
	cfg.ScrapeInterval, cfg.HealthInterval = gateway.Duration(20*time.Millisecond), gateway.Duration(20*time.Millisecond)
	reg = prometheus.NewRegistry()
	g, err := gateway.New(cfg, gateway.Options{Registry: reg})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); g.Run(ctx) }()
	srv := httptest.NewServer(g.Handler())
	hc := &http.Client{}
	t.Cleanup(func() { hc.CloseIdleConnections(); srv.Close(); cancel(); <-done })
	body := `{"model":"` + sim.DefaultModel + `","max_tokens":4,"stream":true,"stream_options":{"include_usage":true},"prompt":"` +
		strings.Repeat("a prompt the dashboard's test sends twice. ", 12) + `"}`
	// Twice: the second finds the prompt cached (a decision held by the
	// prefix; on this fleet a skipped prefill step).
	for range 2 {
		testutil.Eventually(t, 10*time.Second, "a streamed answer through the gateway", func() bool {
			return testutil.Post(t, hc, srv.URL+"/v1/completions", body).Status == http.StatusOK
		})
	}
	testutil.Post(t, hc, srv.URL+"/v1/completions", `{"model": `) // a gateway error
	// A subscriber that joined after the replicas published their events
	// (ZMQ's slow joiner, on a busy machine) hears of them, and of the gap
	// that sends it to the replay, only with a later event: each poll
	// sends a new prompt, whose blocks are new events.
	fresh := 0
	testutil.Eventually(t, 10*time.Second, "the replicas' KV events at the gateway", func() bool {
		if simMetrics(t, hc, srv.URL)["kvgate_kv_events_batches_total"] != nil {
			return true
		}
		fresh++
		testutil.Post(t, hc, srv.URL+"/v1/completions", `{"model":"`+sim.DefaultModel+`","max_tokens":1,"prompt":"`+
			strings.Repeat(fmt.Sprintf("a new prompt %d for new KV events. ", fresh), 12)+`"}`)
		return false
	})
	replicas = map[string]*dto.MetricFamily{}
	for _, u := range fl.URLs() {
		maps.Copy(replicas, simMetrics(t, hc, u))
	}
	return simMetrics(t, hc, srv.URL), replicas, reg
}

// closedAddr is a loopback address nothing listens on.
func closedAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	return addr
}
