package gateway

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvgate/kvgate/internal/clock"
	"github.com/kvgate/kvgate/internal/discovery"
	"github.com/kvgate/kvgate/internal/testutil"
)

// heldReplica is a replica whose streams send one event and then wait
// until the test releases them; non-streamed answers come at once.
type heldReplica struct {
	*stub
	release chan struct{}
	once    sync.Once
}

func newHeldReplica(t *testing.T) *heldReplica {
	h := &heldReplica{release: make(chan struct{})}
	h.stub = newStub(t, "", func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		if !strings.Contains(string(body), `"stream":true`) {
			w.Header().Set("Content-Type", "application/json")
			_, _ = io.WriteString(w, `{"choices":[{"index":0,"text":"ok"}],"usage":{"prompt_tokens":4,"completion_tokens":1}}`)
			return
		}
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, "data: {\"choices\":[{\"index\":0,\"text\":\"first\"}]}\n\n")
		w.(http.Flusher).Flush()
		select {
		case <-h.release:
		case <-r.Context().Done():
			return
		}
		_, _ = io.WriteString(w, "data: {\"choices\":[{\"index\":0,\"text\":\"last\"}]}\n\ndata: [DONE]\n\n")
	})
	t.Cleanup(h.free) // before the server closes (cleanups run last first)
	return h
}

func (h *heldReplica) free() { h.once.Do(func() { close(h.release) }) }

func (h *heldReplica) hostPort() string { return strings.TrimPrefix(h.srv.URL, "http://") }

// routable reports whether the gateway routes to url now: listed in the
// fleet, not removed, and its models known.
func routable(tg *testGW, url string) bool {
	i, ok := tg.g.rt.Lookup(url)
	return ok && !tg.g.rt.Replica(i).Removed() && tg.g.rt.Replica(i).Served() != nil
}

func replicaStateOf(tg *testGW, url string) string {
	i, ok := tg.g.rt.Lookup(url)
	if !ok {
		return "unknown"
	}
	return replicaState(tg.g.rt.Replica(i))
}

// servedBy sends n non-streamed requests and returns the replicas that answered.
func servedBy(t *testing.T, tg *testGW, n int) map[string]int {
	t.Helper()
	out := map[string]int{}
	for i := range n {
		resp, body := post(t, tg.srv.URL+"/v1/completions", fmt.Sprintf(`{"model":"m","prompt":"request %d","max_tokens":1}`, i))
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("status %d: %s", resp.StatusCode, body)
		}
		out[resp.Header.Get("X-Kvgate-Replica")]++
	}
	return out
}

// openStream starts a held stream and returns the replica it went to and
// a reader of the rest.
func openStream(t *testing.T, tg *testGW) (string, *http.Response, *bufio.Reader) {
	t.Helper()
	resp, br := startStream(t, tg.srv.URL, `{"model":"m","prompt":"a long story","max_tokens":8,"stream":true}`)
	return resp.Header.Get("X-Kvgate-Replica"), resp, br
}

// finishStream releases a held stream and checks it ends whole.
func finishStream(t *testing.T, h *heldReplica, resp *http.Response, br *bufio.Reader) {
	t.Helper()
	h.free()
	rest, err := io.ReadAll(br)
	resp.Body.Close()
	if err != nil || !strings.Contains(string(rest), "last") || !strings.Contains(string(rest), "[DONE]") {
		t.Fatalf("the stream on the removed replica did not finish: %q, %v", rest, err)
	}
}

// drainScenario: with replicas a and b in the fleet, a stream held on one
// of them; that one is removed (by remove, which names the survivor); new
// requests all go to the survivor, the held stream finishes whole, and
// the removed replica ends drained.
func drainScenario(t *testing.T, tg *testGW, reps map[string]*heldReplica, remove func(survivor string), settle func()) {
	t.Helper()
	on, resp, br := openStream(t, tg)
	held, ok := reps[on]
	if !ok {
		t.Fatalf("stream went to %q", on)
	}
	var survivor string
	for u := range reps {
		if u != on {
			survivor = u
		}
	}
	remove(survivor)
	eventually(t, "the replica removed", func() bool { return replicaStateOf(tg, on) == "draining" })
	if settle != nil {
		settle()
	}
	if got := servedBy(t, tg, 6); got[survivor] != 6 {
		t.Fatalf("served by %v after %s was removed", got, on)
	}
	finishStream(t, held, resp, br)
	eventually(t, "the replica drained", func() bool { return replicaStateOf(tg, on) == "removed" })
}

func writeAtomically(t *testing.T, path, content string) {
	t.Helper()
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

func TestReplicasFileAddRemoveDrainAndBadFile(t *testing.T) {
	a, b := newHeldReplica(t), newHeldReplica(t)
	reps := map[string]*heldReplica{a.srv.URL: a, b.srv.URL: b}
	path := filepath.Join(t.TempDir(), "replicas.yaml")
	writeAtomically(t, path, "- url: "+a.srv.URL+"\n")
	cfg := baseConfig()
	cfg.ReplicasFile = path
	cfg.Policy = "least_load"
	tg := startGatewayWith(t, cfg, Options{})
	eventually(t, "a routable", func() bool { return routable(tg, a.srv.URL) })
	writeAtomically(t, path, "- url: "+a.srv.URL+"\n- url: "+b.srv.URL+"\n  role: both\n")
	tg.g.Reload() // SIGHUP: at once
	eventually(t, "b added", func() bool { return routable(tg, b.srv.URL) })
	if i, _ := tg.g.rt.Lookup(b.srv.URL); tg.g.rt.Index().ReplicaLen(i) != 0 {
		t.Fatal("the added replica's index is not empty")
	}
	drainScenario(t, tg, reps, func(survivor string) {
		writeAtomically(t, path, "- url: "+survivor+"\n")
		tg.g.Reload()
	}, nil)
	// The per-replica gauges follow: the drained replica has none left.
	if got := gaugeSeries(t, tg.g.reg, "kvgate_replica_in_flight"); len(got) != 1 {
		t.Fatalf("in-flight gauges %v, want the remaining replica's only", got)
	}
	if got := gaugeSeries(t, tg.g.reg, "kvgate_replicas"); got["active"] != 1 || got["removed"] != 1 || got["draining"] != 0 {
		t.Fatalf("kvgate_replicas %v", got)
	}
	// A bad file keeps the previous list.
	before := tg.g.rt.Active()
	for _, bad := range []string{"- url: ftp://x\n", "not: [yaml\n", "", "- url: http://x:1\n  kv_events: tcp://x:2\n"} {
		writeAtomically(t, path, bad)
		tg.g.Reload()
	}
	writeAtomically(t, path, "- url: "+a.srv.URL+"\n- url: "+b.srv.URL+"\n- url: ftp://bad\n")
	tg.g.Reload()
	// The reloads are processed in order; a good one after them shows
	// that none of the bad ones changed the list.
	good := "- url: " + a.srv.URL + "\n- url: " + b.srv.URL + "\n"
	writeAtomically(t, path, good)
	tg.g.Reload()
	eventually(t, "both back", func() bool { return routable(tg, a.srv.URL) && routable(tg, b.srv.URL) })
	if before != 1 {
		t.Fatalf("%d active before the bad files, want 1", before)
	}
}

func TestReplicasFileBadFileKeepsTheList(t *testing.T) {
	a := newHeldReplica(t)
	path := filepath.Join(t.TempDir(), "replicas.yaml")
	writeAtomically(t, path, "- url: "+a.srv.URL+"\n")
	cfg := baseConfig()
	cfg.ReplicasFile = path
	clk := clock.NewFake(time.Unix(0, 0))
	tg := startGatewayWith(t, cfg, Options{Clock: clk})
	eventually(t, "a routable", func() bool { return routable(tg, a.srv.URL) })
	writeAtomically(t, path, "- url: [broken\n")
	clk.Advance(5 * time.Second) // the file's interval passes: it is read and refused
	writeAtomically(t, path, "")
	tg.g.Reload()
	if got := servedBy(t, tg, 3); got[a.srv.URL] != 3 || tg.g.rt.Active() != 1 {
		t.Fatalf("served by %v with %d active after bad files", got, tg.g.rt.Active())
	}
	if _, err := New(cfg, Options{}); err == nil {
		t.Fatal("a gateway started on an empty replicas file")
	}
}

// srvResolver answers SRV lookups from a script, reporting each lookup.
type srvResolver struct {
	mu      sync.Mutex
	answers [][]string // host:port; nil: a failed lookup
	asked   chan struct{}
}

func (r *srvResolver) set(answers ...[]string) {
	r.mu.Lock()
	r.answers = answers
	r.mu.Unlock()
}

func (r *srvResolver) LookupIPAddr(context.Context, string) ([]net.IPAddr, error) {
	return nil, errors.New("not used")
}

func (r *srvResolver) LookupSRV(_ context.Context, _, _, name string) (string, []*net.SRV, error) {
	r.mu.Lock()
	defer func() { r.mu.Unlock(); r.asked <- struct{}{} }()
	a := r.answers[0]
	if len(r.answers) > 1 {
		r.answers = r.answers[1:]
	}
	if a == nil {
		return "", nil, &net.DNSError{Err: "timeout", Name: name, IsTimeout: true}
	}
	var out []*net.SRV
	for _, hp := range a {
		h, p, _ := net.SplitHostPort(hp)
		var port int
		fmt.Sscan(p, &port)
		out = append(out, &net.SRV{Target: h + ".", Port: uint16(port)})
	}
	return name, out, nil
}

func TestDNSDiscoveryAddFlapRemove(t *testing.T) {
	a, b := newHeldReplica(t), newHeldReplica(t)
	reps := map[string]*heldReplica{a.srv.URL: a, b.srv.URL: b}
	res := &srvResolver{asked: make(chan struct{}, 64), answers: [][]string{{a.hostPort()}}}
	cfg := baseConfig()
	cfg.Policy = "least_load"
	cfg.Discovery = &DiscoveryConfig{DNS: "_http._tcp.vllm.test", Interval: Duration(5 * time.Second)}
	clk := clock.NewFake(time.Unix(0, 0))
	tg := startGatewayWith(t, cfg, Options{Clock: clk, Resolver: res})
	lookup := func() {
		t.Helper()
		select {
		case <-res.asked:
		case <-time.After(testutil.Bound(10 * time.Second)): // a deadline for a broken test
			t.Fatal("no DNS lookup")
		}
	}
	interval := func() { clk.Advance(5 * time.Second); lookup() }
	lookup()
	eventually(t, "a routable", func() bool { return routable(tg, a.srv.URL) })
	res.set([]string{a.hostPort(), b.hostPort()})
	interval() // one interval: b is in
	eventually(t, "b added", func() bool { return routable(tg, b.srv.URL) })

	// A flapping answer: the replica holding a stream is missing from one
	// answer, and a lookup fails; it stays, and its stream goes on.
	on, resp, br := openStream(t, tg)
	other := a.hostPort()
	if on == a.srv.URL {
		other = b.hostPort()
	}
	res.set([]string{other}, nil, []string{a.hostPort(), b.hostPort()})
	for range 3 {
		interval()
	}
	if st := replicaStateOf(tg, on); st != "active" {
		t.Fatalf("after a flap the replica holding a stream is %s", st)
	}
	finishStream(t, reps[on], resp, br)
	reps[on] = newHeldReplicaLike(t, reps[on]) // its stream is spent: hold the next one again

	// Gone for two answers: removed, its stream drains.
	drainScenario(t, tg, reps, func(survivor string) {
		res.set([]string{strings.TrimPrefix(survivor, "http://")})
		interval()
		interval()
	}, nil)
}

// newHeldReplicaLike re-arms h's hold for another stream.
func newHeldReplicaLike(t *testing.T, h *heldReplica) *heldReplica {
	h.release = make(chan struct{})
	h.once = sync.Once{}
	t.Cleanup(h.free)
	return h
}

// fakeKube stands in for the Kubernetes plugin (internal/discovery/kubernetes,
// which the gateway's tests do not link: its own tests cover EndpointSlices
// and the list-watch): it records the configuration the gateway asked the
// registry for, and its source gives the lists the test sends.
var fakeKube = struct {
	sync.Mutex
	asked map[string]discovery.KubernetesConfig // by namespace
	lists map[string]chan []ReplicaConfig
}{asked: map[string]discovery.KubernetesConfig{}, lists: map[string]chan []ReplicaConfig{}}

func init() {
	discovery.Register(discovery.Kubernetes, discovery.Plugin[discovery.KubernetesConfig]{
		Validate: func(discovery.KubernetesConfig) []error { return nil },
		New: func(c discovery.KubernetesConfig) (discovery.Source, error) {
			fakeKube.Lock()
			defer fakeKube.Unlock()
			fakeKube.asked[c.Namespace] = c
			if fakeKube.lists[c.Namespace] == nil {
				fakeKube.lists[c.Namespace] = make(chan []ReplicaConfig)
			}
			return fakeKubeSource(fakeKube.lists[c.Namespace]), nil
		}})
}

type fakeKubeSource chan []ReplicaConfig

func (fakeKubeSource) Name() string { return "kubernetes (fake)" }

func (f fakeKubeSource) Run(ctx context.Context, update func([]ReplicaConfig)) {
	for {
		select {
		case <-ctx.Done():
			return
		case l := <-f:
			update(l)
		}
	}
}

// kubeLists is the channel feeding the fake Kubernetes source of namespace.
func kubeLists(t *testing.T, namespace string) (chan<- []ReplicaConfig, discovery.KubernetesConfig) {
	t.Helper()
	fakeKube.Lock()
	defer fakeKube.Unlock()
	if fakeKube.lists[namespace] == nil {
		t.Fatalf("no Kubernetes source was built for namespace %s", namespace)
	}
	return fakeKube.lists[namespace], fakeKube.asked[namespace]
}

// Kubernetes discovery as the gateway sees it: built through the registry
// from discovery.kubernetes (the role label defaulted, the scheme and the
// gateway's clock passed on), a replica added is routable, one gone from
// the list (not ready) drains its stream, an empty list leaves none.
func TestKubernetesDiscoveryAddNotReadyRemove(t *testing.T) {
	a, b := newHeldReplica(t), newHeldReplica(t)
	cfg := baseConfig()
	cfg.Policy = "least_load"
	cfg.Discovery = &DiscoveryConfig{Scheme: "http", APIKey: "k",
		Kubernetes: &KubernetesConfig{Namespace: "llm", Selector: "kubernetes.io/service-name=vllm", Port: "http"}}
	clk := clock.NewFake(time.Unix(0, 0))
	tg := startGatewayWith(t, cfg, Options{Clock: clk})
	lists, asked := kubeLists(t, "llm")
	if asked.Selector != "kubernetes.io/service-name=vllm" || asked.Port != "http" || asked.RoleLabel != DefaultRoleLabel ||
		asked.Scheme != "http" || asked.Template.APIKey != "k" || asked.Clock != clk || asked.Log == nil {
		t.Fatalf("the plugin was asked for %+v", asked)
	}
	lists <- []ReplicaConfig{{URL: a.srv.URL}}
	eventually(t, "a routable", func() bool { return routable(tg, a.srv.URL) })
	lists <- []ReplicaConfig{{URL: a.srv.URL}, {URL: b.srv.URL, Role: "both"}}
	eventually(t, "b added", func() bool { return routable(tg, b.srv.URL) })
	reps := map[string]*heldReplica{a.srv.URL: a, b.srv.URL: b}
	// The replica holding a stream turns not ready: removed, it drains.
	drainScenario(t, tg, reps, func(survivor string) { lists <- []ReplicaConfig{{URL: survivor}} }, nil)
	// The last slice deleted: the other one leaves too.
	var left string
	for u := range reps {
		if replicaStateOf(tg, u) == "active" {
			left = u
		}
	}
	lists <- []ReplicaConfig{}
	eventually(t, "the deleted slice's replica removed", func() bool { return replicaStateOf(tg, left) == "removed" })
	resp, _ := post(t, tg.srv.URL+"/v1/completions", `{"model":"m","prompt":"x","max_tokens":1}`)
	if resp.StatusCode != http.StatusServiceUnavailable {
		t.Fatalf("with no replica left: status %d, want 503", resp.StatusCode)
	}
}

// gaugeSeries is a gauge's values by its one label's value.
func gaugeSeries(t *testing.T, reg *prometheus.Registry, name string) map[string]float64 {
	t.Helper()
	fams, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]float64{}
	for _, f := range fams {
		if f.GetName() != name {
			continue
		}
		for _, m := range f.GetMetric() {
			out[m.GetLabel()[0].GetValue()] = m.GetGauge().GetValue()
		}
	}
	return out
}

// TestReplicasFileRoles: roles come with the file's entries; a list that
// makes the fleet prefill/decode turns the two-step routing on, and a
// role changed on a listed replica is taken (its state kept).
func TestReplicasFileRoles(t *testing.T) {
	a, b := newHeldReplica(t), newHeldReplica(t)
	path := filepath.Join(t.TempDir(), "replicas.yaml")
	writeAtomically(t, path, "- url: "+a.srv.URL+"\n")
	cfg := baseConfig()
	cfg.ReplicasFile = path
	tg := startGatewayWith(t, cfg, Options{})
	eventually(t, "a routable", func() bool { return routable(tg, a.srv.URL) })
	if tg.g.ctl.Disaggregated() {
		t.Fatal("an aggregated fleet routed in two steps")
	}
	writeAtomically(t, path, "- url: "+a.srv.URL+"\n  role: decode\n- url: "+b.srv.URL+"\n  role: prefill\n")
	tg.g.Reload()
	eventually(t, "b added", func() bool { return routable(tg, b.srv.URL) })
	ia, _ := tg.g.rt.Lookup(a.srv.URL)
	ib, _ := tg.g.rt.Lookup(b.srv.URL)
	if !tg.g.ctl.Disaggregated() || tg.g.rt.Replica(ia).Role().String() != "decode" || tg.g.rt.Replica(ib).Role().String() != "prefill" || ia != 0 {
		t.Fatalf("pd %v, roles %s %s, a's slot %d", tg.g.ctl.Disaggregated(), tg.g.rt.Replica(ia).Role(), tg.g.rt.Replica(ib).Role(), ia)
	}
	// Prefill replicas only: refused, the P/D list kept.
	writeAtomically(t, path, "- url: "+b.srv.URL+"\n  role: prefill\n")
	tg.g.Reload()
	writeAtomically(t, path, "- url: "+a.srv.URL+"\n  role: decode\n- url: "+b.srv.URL+"\n  role: prefill\n- url: http://127.0.0.1:1\n  role: decode\n")
	tg.g.Reload()
	eventually(t, "the third listed", func() bool { _, ok := tg.g.rt.Lookup("http://127.0.0.1:1"); return ok })
	if tg.g.rt.Replica(ia).Removed() {
		t.Fatal("a list without a decode replica was applied")
	}
}
