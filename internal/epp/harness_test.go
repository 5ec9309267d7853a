package epp

import (
	"context"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/kvgate/kvgate/internal/epp/standin"
	"github.com/kvgate/kvgate/internal/gateway"
	"github.com/kvgate/kvgate/internal/sim"
	"github.com/kvgate/kvgate/internal/testutil"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// rig is kvgate's endpoint picker in front of simulated replicas, driven
// by an Envoy stand-in: sims, a gateway with its control plane running,
// the ext_proc server on a loopback port, and the stand-in's HTTP front.
type rig struct {
	fl    *sim.Fleet
	g     *gateway.Gateway
	reg   *prometheus.Registry
	proxy *standin.Proxy
	front *httptest.Server
}

// startSims starts n simulated replicas, fast.
func startSims(t *testing.T, n int) *sim.Fleet {
	t.Helper()
	fl, err := sim.Start(context.Background(), sim.Config{Replicas: n, TimeScale: 50, Seed: 1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = fl.Close() })
	return fl
}

// gatewayConfig is a gateway on the fleet's replicas.
func gatewayConfig(fl *sim.Fleet, policy string) gateway.Config {
	cfg := gateway.Defaults()
	cfg.Policy = policy
	cfg.ScrapeInterval = gateway.Duration(20 * time.Millisecond)
	cfg.HealthInterval = gateway.Duration(50 * time.Millisecond)
	for _, u := range fl.URLs() {
		cfg.Replicas = append(cfg.Replicas, gateway.ReplicaConfig{URL: u})
	}
	return cfg
}

// startGateway starts g's control plane, and waits until it is ready.
func startGateway(t *testing.T, cfg gateway.Config) (*gateway.Gateway, *prometheus.Registry) {
	t.Helper()
	reg := prometheus.NewRegistry()
	g, err := gateway.New(cfg, gateway.Options{Registry: reg})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); g.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	testutil.Eventually(t, 10*time.Second, "the gateway ready", func() bool {
		if g.Ready() != nil {
			return false
		}
		for i := range g.Router().Replicas() {
			// Listed too: an unlisted replica is no candidate while another is.
			if _, _, ok := g.Router().ReplicaMetrics(i); !ok || !g.Router().Healthy(i) || g.Router().Replica(i).Served() == nil {
				return false
			}
		}
		return true
	})
	return g, reg
}

// servePicker serves srv on a loopback port until the test ends, with
// opts; it returns a client connection to it.
func servePicker(t *testing.T, register func(*grpc.Server), opts ...grpc.ServerOption) *grpc.ClientConn {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	gs := grpc.NewServer(opts...)
	register(gs)
	var wg sync.WaitGroup
	wg.Go(func() { _ = gs.Serve(ln) })
	conn, err := grpc.NewClient(ln.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close(); gs.Stop(); wg.Wait() })
	return conn
}

// startRig starts the whole chain with the stand-in configured by sc
// (its Conn set here), the picker's gRPC server with opts.
func startRig(t *testing.T, cfg gateway.Config, fl *sim.Fleet, sc standin.Config, opts ...grpc.ServerOption) *rig {
	t.Helper()
	g, reg := startGateway(t, cfg)
	srv, err := New(g, cfg.EPP, cfg.MaxBodyBytes, nil)
	if err != nil {
		t.Fatal(err)
	}
	sc.Conn = servePicker(t, func(gs *grpc.Server) { srv.Register(gs) }, opts...)
	p := standin.New(sc)
	front := httptest.NewServer(p)
	t.Cleanup(front.Close)
	return &rig{fl: fl, g: g, reg: reg, proxy: p, front: front}
}

// counter is the sum of a counter's series whose labels include want.
func counter(t *testing.T, reg *prometheus.Registry, name string, want map[string]string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	sum := 0.0
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			if labelsMatch(m, want) {
				sum += m.GetCounter().GetValue() + float64(m.GetHistogram().GetSampleCount())
			}
		}
	}
	return sum
}

func labelsMatch(m *dto.Metric, want map[string]string) bool {
	n := 0
	for _, l := range m.GetLabel() {
		if v, ok := want[l.GetName()]; ok && v == l.GetValue() {
			n++
		}
	}
	return n == len(want)
}

// chat is a chat request's body.
func chat(system, user string, stream bool, maxTokens int) string {
	s := `{"model":"` + sim.DefaultModel + `","messages":[{"role":"system","content":` + strconv.Quote(system) + `},` +
		`{"role":"user","content":` + strconv.Quote(user) + `}],"max_tokens":` + strconv.Itoa(maxTokens) + `,"ignore_eos":true`
	if stream {
		s += `,"stream":true,"stream_options":{"include_usage":true}`
	}
	return s + "}"
}

// post sends a chat to url (the stand-in's front, or a gateway's).
func post(t *testing.T, url, body string) testutil.Response {
	t.Helper()
	return testutil.Post(t, http.DefaultClient, url+"/v1/chat/completions", body)
}

// httpServer serves h on a loopback port until the test ends.
func httpServer(t *testing.T, h http.Handler) string {
	t.Helper()
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return srv.URL
}
