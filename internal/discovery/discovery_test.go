package discovery

import (
	"context"
	"errors"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"
	"sigs.k8s.io/yaml"

	"github.com/kvgate/kvgate/internal/clock"
	"github.com/kvgate/kvgate/internal/testutil"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// parseList is a minimal parser for the tests (the gateway's checks more).
func parseList(data []byte) ([]Replica, error) {
	var out []Replica
	if err := yaml.UnmarshalStrict(data, &out); err != nil {
		return nil, err
	}
	if len(out) == 0 {
		return nil, errors.New("no replicas")
	}
	for _, r := range out {
		if !strings.HasPrefix(r.URL, "http") {
			return nil, errors.New("bad url " + r.URL)
		}
	}
	return out, nil
}

// run runs src until the test ends, handing each update to the returned
// channel.
func run(t *testing.T, src Source) <-chan []Replica {
	ch := make(chan []Replica, 16)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() { src.Run(ctx, func(l []Replica) { ch <- l }) })
	t.Cleanup(func() { cancel(); wg.Wait() })
	return ch
}

func next(t *testing.T, ch <-chan []Replica) []Replica {
	t.Helper()
	select {
	case l := <-ch:
		return l
	case <-time.After(testutil.Bound(10 * time.Second)): // a deadline for a broken test
		t.Fatal("no update")
		return nil
	}
}

func urls(l []Replica) []string {
	out := []string{}
	for _, r := range l {
		out = append(out, r.URL)
	}
	return out
}

func TestFileReloadsOnChangeAndKeepsTheListOnABadFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "replicas.yaml")
	write := func(s string) { // atomically, as an operator's tools (and ConfigMaps) do
		tmp := path + ".tmp"
		if err := os.WriteFile(tmp, []byte(s), 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(tmp, path); err != nil {
			t.Fatal(err)
		}
	}
	write("- url: http://a:8000\n- url: http://b:8000\n  role: decode\n")
	clk := clock.NewFake(time.Unix(0, 0))
	parsed := make(chan struct{}, 16)
	f := NewFile(path, time.Second, func(b []byte) ([]Replica, error) {
		defer func() { parsed <- struct{}{} }()
		return parseList(b)
	}, clk, nil)
	waitParsed := func() {
		t.Helper()
		select {
		case <-parsed:
		case <-time.After(testutil.Bound(10 * time.Second)):
			t.Fatal("the file was not read")
		}
	}
	ch := run(t, f)
	waitParsed()
	if got := next(t, ch); !slices.Equal(urls(got), []string{"http://a:8000", "http://b:8000"}) || got[1].Role != "decode" {
		t.Fatalf("first list %+v", got)
	}
	write("- url: http://a:8000\n- url: http://c:8000\n")
	clk.Advance(time.Second)
	waitParsed()
	if got := next(t, ch); !slices.Equal(urls(got), []string{"http://a:8000", "http://c:8000"}) {
		t.Fatalf("after the edit %+v", got)
	}
	for _, bad := range []string{"- url: ftp://nope\n", "- url: [not yaml\n", ""} {
		write(bad)
		clk.Advance(time.Second)
		waitParsed()
	}
	// A forced reload of the same good content proves the bad ones gave no update.
	write("- url: http://a:8000\n- url: http://c:8000\n")
	f.Reload()
	if got := next(t, ch); !slices.Equal(urls(got), []string{"http://a:8000", "http://c:8000"}) {
		t.Fatalf("after bad files and a reload %+v", got)
	}
	select {
	case l := <-ch:
		t.Fatalf("an extra update %+v", l)
	default:
	}
}

// fakeResolver answers from a script, one answer per lookup.
type fakeResolver struct {
	asked   chan struct{} // a lookup was answered
	mu      sync.Mutex
	answers [][]string // IPs, or host:port for SRV; nil: an error
}

func (r *fakeResolver) pop() ([]string, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.asked != nil {
		defer func() { r.asked <- struct{}{} }()
	}
	if len(r.answers) == 0 {
		return nil, errors.New("script ran out")
	}
	a := r.answers[0]
	if len(r.answers) > 1 {
		r.answers = r.answers[1:]
	}
	if a == nil {
		return nil, &net.DNSError{Err: "server misbehaving", Name: "x", IsTemporary: true}
	}
	return a, nil
}

func (r *fakeResolver) LookupIPAddr(ctx context.Context, host string) ([]net.IPAddr, error) {
	a, err := r.pop()
	var out []net.IPAddr
	for _, ip := range a {
		out = append(out, net.IPAddr{IP: net.ParseIP(ip)})
	}
	return out, err
}

func (r *fakeResolver) LookupSRV(ctx context.Context, service, proto, name string) (string, []*net.SRV, error) {
	a, err := r.pop()
	var out []*net.SRV
	for _, hp := range a {
		h, p, _ := net.SplitHostPort(hp)
		n, _ := net.LookupPort("tcp", p)
		out = append(out, &net.SRV{Target: h + ".", Port: uint16(n)})
	}
	return name, out, err
}

func TestDNSFlapNeedsTwoMissingAnswersAndErrorsKeepTheList(t *testing.T) {
	res := &fakeResolver{asked: make(chan struct{}, 16), answers: [][]string{
		{"10.0.0.1", "10.0.0.2"},
		{"10.0.0.1"},             // 2 missing once: kept
		{"10.0.0.1", "10.0.0.2"}, // back: no change
		nil,                      // lookup error: kept
		{"10.0.0.1", "fd00::3"},  // 2 missing once, 3 new
		{"10.0.0.1", "fd00::3"},  // 2 missing twice: removed
	}}
	clk := clock.NewFake(time.Unix(0, 0))
	d, err := NewDNS(DNSConfig{Name: "vllm.ns.svc:8000", Interval: 5 * time.Second, Resolver: res, Clock: clk,
		Template: Replica{Role: "decode"}})
	if err != nil {
		t.Fatal(err)
	}
	ch := run(t, d)
	if got := next(t, ch); !slices.Equal(urls(got), []string{"http://10.0.0.1:8000", "http://10.0.0.2:8000"}) || got[0].Role != "decode" {
		t.Fatalf("first answer %+v", got)
	}
	lookup := func() {
		t.Helper()
		select {
		case <-res.asked:
		case <-time.After(testutil.Bound(10 * time.Second)):
			t.Fatal("no lookup")
		}
	}
	lookup()
	for range 3 { // a missing answer, the return, an error: no update
		clk.Advance(5 * time.Second)
		lookup()
	}
	clk.Advance(5 * time.Second)
	if got := next(t, ch); !slices.Equal(urls(got), []string{"http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://[fd00::3]:8000"}) {
		t.Fatalf("with a new address %+v", got)
	}
	clk.Advance(5 * time.Second)
	if got := next(t, ch); !slices.Equal(urls(got), []string{"http://10.0.0.1:8000", "http://[fd00::3]:8000"}) {
		t.Fatalf("after two answers without 10.0.0.2 %+v", got)
	}
}

func TestDNSSRV(t *testing.T) {
	res := &fakeResolver{answers: [][]string{{"pod-a.vllm.ns.svc.cluster.local:8000", "pod-b.vllm.ns.svc.cluster.local:8001"}}}
	d, err := NewDNS(DNSConfig{Name: "_http._tcp.vllm.ns.svc.cluster.local", Scheme: "https", Resolver: res, RemoveAfter: 1})
	if err != nil {
		t.Fatal(err)
	}
	got, ok := d.Resolve(context.Background())
	if !ok || !slices.Equal(got, []string{"https://pod-a.vllm.ns.svc.cluster.local:8000", "https://pod-b.vllm.ns.svc.cluster.local:8001"}) {
		t.Fatalf("SRV answer %v %v", got, ok)
	}
}

func TestParseDNSName(t *testing.T) {
	for _, bad := range []string{"vllm", "vllm:", "vllm:http", ":8000", "vllm:70000", "_http.vllm", "_http._tcp.", "_http._tcp.x:80"} {
		if _, _, _, err := ParseDNSName(bad); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
	for _, good := range []string{"vllm.ns.svc:8000", "[fd00::1]:80", "_http._tcp.vllm.ns.svc"} {
		if _, _, _, err := ParseDNSName(good); err != nil {
			t.Errorf("%q: %v", good, err)
		}
	}
}
