package kubernetes

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	"k8s.io/apimachinery/pkg/watch"
	fakediscovery "k8s.io/client-go/kubernetes/typed/discovery/v1/fake"
	k8stesting "k8s.io/client-go/testing"

	"github.com/kvgate/kvgate/internal/clock"
	"github.com/kvgate/kvgate/internal/discovery"
	"github.com/kvgate/kvgate/internal/testutil"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// slice is an EndpointSlice of Service vllm in namespace llm with port
// "http" = port and one endpoint per address, each ready as given.
func slice(name string, port int32, ready bool, addrs ...string) *discoveryv1.EndpointSlice {
	pname := "http"
	s := &discoveryv1.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Name: name, Namespace: "llm", Labels: map[string]string{"kubernetes.io/service-name": "vllm"}},
		AddressType: discoveryv1.AddressTypeIPv4,
		Ports:       []discoveryv1.EndpointPort{{Name: &pname, Port: &port}},
	}
	for _, a := range addrs {
		s.Endpoints = append(s.Endpoints, discoveryv1.Endpoint{Addresses: []string{a}, Conditions: discoveryv1.EndpointConditions{Ready: &ready}})
	}
	return s
}

func config() discovery.KubernetesConfig {
	return discovery.KubernetesConfig{Namespace: "llm", Selector: "kubernetes.io/service-name=vllm", Port: "http",
		RoleLabel: "kvgate.io/role"}
}

func urls(l []discovery.Replica) []string {
	out := []string{}
	for _, r := range l {
		out = append(out, r.URL)
	}
	return out
}

func TestReplicasOfSlices(t *testing.T) {
	yes, no := true, false
	terminating := slice("t", 8000, true, "10.0.0.9")
	terminating.Endpoints[0].Conditions.Terminating = &yes
	unknown := slice("u", 8000, true, "10.0.0.8")
	unknown.Endpoints[0].Conditions.Ready = nil
	decode := slice("d", 8000, true, "10.0.0.7", "10.0.0.1") // 10.0.0.1 also in slice a
	decode.Labels["kvgate.io/role"] = "decode"
	other := slice("o", 9000, true, "10.0.0.6")
	other.Ports[0].Name = nil // no port named http: skipped by name, taken by number
	odd := slice("x", 8000, true, "10.0.0.5/evil", "vllm-0.vllm.llm.svc", "10.0.0.4:1", "")
	zero := slice("z", 0, true, "10.0.0.3")
	for _, tc := range []struct {
		name   string
		mutate func(*discovery.KubernetesConfig)
		eps    []*discoveryv1.EndpointSlice
		want   []string
		roles  []string
	}{
		{"ready, unknown, not ready, terminating", nil,
			[]*discoveryv1.EndpointSlice{slice("a", 8000, true, "10.0.0.2"), slice("b", 8000, false, "10.0.0.3"), terminating, unknown},
			[]string{"http://10.0.0.2:8000", "http://10.0.0.8:8000"}, []string{"", ""}},
		{"an endpoint in two slices counts once, the first slice's role", nil,
			[]*discoveryv1.EndpointSlice{slice("a", 8000, true, "10.0.0.1"), decode},
			[]string{"http://10.0.0.1:8000", "http://10.0.0.7:8000"}, []string{"", "decode"}},
		{"port by name skips a slice without it", nil, []*discoveryv1.EndpointSlice{other, slice("a", 8000, true, "10.0.0.2")},
			[]string{"http://10.0.0.2:8000"}, []string{""}},
		{"port by number, https", func(c *discovery.KubernetesConfig) { c.Port, c.Scheme = "7000", "https" },
			[]*discoveryv1.EndpointSlice{other, slice("v6", 8000, true, "fd00::1")},
			[]string{"http" + "s://10.0.0.6:7000", "https://[fd00::1]:7000"}, []string{"", ""}},
		{"odd addresses and a port out of range skipped", nil, []*discoveryv1.EndpointSlice{odd, zero},
			[]string{"http://vllm-0.vllm.llm.svc:8000"}, []string{""}},
		{"not ready only", nil, []*discoveryv1.EndpointSlice{slice("b", 8000, no, "10.0.0.3")}, []string{}, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := config()
			cfg.Template = discovery.Replica{APIKey: "k", DataParallelSize: 2}
			if tc.mutate != nil {
				tc.mutate(&cfg)
			}
			src, err := New(nil, cfg)
			if err != nil {
				t.Fatal(err)
			}
			got := src.Replicas(tc.eps)
			if !slices.Equal(urls(got), tc.want) {
				t.Fatalf("replicas %v, want %v", urls(got), tc.want)
			}
			for i, r := range got {
				if r.Role != tc.roles[i] || r.APIKey != "k" || r.DataParallelSize != 2 {
					t.Fatalf("replica %d: %+v", i, r)
				}
			}
		})
	}
}

// Validate refuses what the API server would, each error naming its key;
// through the registry the keys are discovery.kubernetes.KEY.
func TestValidate(t *testing.T) {
	for _, tc := range []struct {
		name   string
		mutate func(*discovery.KubernetesConfig)
		want   string // "": valid
	}{
		{"valid", nil, ""},
		{"port number", func(c *discovery.KubernetesConfig) { c.Port = "8000" }, ""},
		{"set selector", func(c *discovery.KubernetesConfig) { c.Selector = "app in (vllm, sglang),tier!=x" }, ""},
		{"bad selector", func(c *discovery.KubernetesConfig) { c.Selector = "a=(" }, "discovery.kubernetes.selector"},
		{"bad namespace", func(c *discovery.KubernetesConfig) { c.Namespace = "LLM_1" }, "discovery.kubernetes.namespace"},
		{"bad port name", func(c *discovery.KubernetesConfig) { c.Port = "Http_1" }, "discovery.kubernetes.port"},
		{"bad role label", func(c *discovery.KubernetesConfig) { c.RoleLabel = "a b" }, "discovery.kubernetes.role_label"},
		{"inference pool", func(c *discovery.KubernetesConfig) {
			c.InferencePool, c.PoolGroup, c.Selector, c.Port = "vllm-pool", PoolGroupV1Alpha2, "", ""
		}, ""},
		{"bad inference pool", func(c *discovery.KubernetesConfig) { c.InferencePool = "Vllm_Pool" }, "discovery.kubernetes.inference_pool"},
		{"bad pool group", func(c *discovery.KubernetesConfig) { c.InferencePool, c.PoolGroup = "p", "x.io" },
			"discovery.kubernetes.inference_pool_group"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := config()
			if tc.mutate != nil {
				tc.mutate(&cfg)
			}
			errs := discovery.Kubernetes.Validate(cfg)
			switch {
			case tc.want == "" && len(errs) > 0:
				t.Fatalf("refused: %v", errs)
			case tc.want != "" && (len(errs) != 1 || !strings.HasPrefix(errs[0].Error(), tc.want)):
				t.Fatalf("errors %v, want one beginning %q", errs, tc.want)
			}
		})
	}
}

// typedFake is client-go's fake discovery/v1 client over an object
// tracker that knows only EndpointSlices: its List filters by label, its
// Watch does not (the source filters again).
func typedFake(t *testing.T, objs ...runtime.Object) Client {
	t.Helper()
	return typedFakeWatched(t, nil, objs...)
}

// typedFakeWatched is typedFake telling watching (when not nil) each time
// a watch is established. The fake's tracker, unlike an API server, does
// not replay events since the watch's resourceVersion: a change made
// between a list and its watch is lost, so a test that changes the slices
// after a list waits for the watch first.
func typedFakeWatched(t *testing.T, watching chan<- struct{}, objs ...runtime.Object) Client {
	t.Helper()
	return (&fakediscovery.FakeDiscoveryV1{Fake: fakeTracker(t, discoveryv1.AddToScheme, watching, objs...)}).EndpointSlices("llm")
}

// fakeTracker is client-go's fake over an object tracker that knows the
// types addToScheme adds, telling watching (when not nil) each time a
// watch is established.
func fakeTracker(t *testing.T, addToScheme func(*runtime.Scheme) error, watching chan<- struct{}, objs ...runtime.Object) *k8stesting.Fake {
	t.Helper()
	scheme := runtime.NewScheme()
	if err := addToScheme(scheme); err != nil {
		t.Fatal(err)
	}
	tracker := k8stesting.NewObjectTracker(scheme, serializer.NewCodecFactory(scheme).UniversalDecoder())
	for _, o := range objs {
		if err := tracker.Add(o); err != nil {
			t.Fatal(err)
		}
	}
	f := &k8stesting.Fake{}
	f.AddReactor("*", "*", k8stesting.ObjectReaction(tracker))
	f.AddWatchReactor("*", signalWatch(tracker, watching))
	return f
}

// signalWatch is a watch reactor on tracker telling watching (when not
// nil) each time a watch is established.
func signalWatch(tracker k8stesting.ObjectTracker, watching chan<- struct{}) k8stesting.WatchReactionFunc {
	return func(a k8stesting.Action) (bool, watch.Interface, error) {
		w, err := tracker.Watch(a.GetResource(), a.GetNamespace(), a.(k8stesting.WatchActionImpl).ListOptions)
		if err == nil && watching != nil {
			select {
			case watching <- struct{}{}:
			default:
			}
		}
		return err == nil, w, err
	}
}

// run runs src until the test ends, handing each list to the channel.
func run(t *testing.T, src discovery.Source) <-chan []discovery.Replica {
	ch := make(chan []discovery.Replica, 16)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() { src.Run(ctx, func(l []discovery.Replica) { ch <- l }) })
	t.Cleanup(func() { cancel(); wg.Wait() })
	return ch
}

func next(t *testing.T, ch <-chan []discovery.Replica) []string {
	t.Helper()
	return urls(nextList(t, ch))
}

func nextList(t *testing.T, ch <-chan []discovery.Replica) []discovery.Replica {
	t.Helper()
	select {
	case l := <-ch:
		return l
	case <-time.After(testutil.Bound(10 * time.Second)): // a bound on a broken test, not a wait
		t.Fatal("no list")
		return nil
	}
}

// Against client-go's fake: the first list at once; a slice created, an
// endpoint turning not ready, a slice of another Service (no list), a
// slice relabelled out of the selector and one deleted, each a new list.
func TestFollowsEndpointSlices(t *testing.T) {
	client := typedFake(t, slice("vllm-a", 8000, true, "10.0.0.1"))
	src, err := New(client, config())
	if err != nil {
		t.Fatal(err)
	}
	ch := run(t, src)
	if got := next(t, ch); !slices.Equal(got, []string{"http://10.0.0.1:8000"}) {
		t.Fatalf("first list %v", got)
	}
	ctx := context.Background()
	fake := client.(interface {
		Create(context.Context, *discoveryv1.EndpointSlice, metav1.CreateOptions) (*discoveryv1.EndpointSlice, error)
		Update(context.Context, *discoveryv1.EndpointSlice, metav1.UpdateOptions) (*discoveryv1.EndpointSlice, error)
		Delete(context.Context, string, metav1.DeleteOptions) error
	})
	steps := []struct {
		name string
		do   func() error
		want []string
	}{
		{"b created", func() error {
			_, err := fake.Create(ctx, slice("vllm-b", 8000, true, "10.0.0.2", "10.0.0.3"), metav1.CreateOptions{})
			return err
		}, []string{"http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000"}},
		{"a not ready, after another Service's slice", func() error {
			other := slice("sglang-a", 8000, true, "10.0.0.9")
			other.Labels["kubernetes.io/service-name"] = "sglang"
			if _, err := fake.Create(ctx, other, metav1.CreateOptions{}); err != nil {
				return err
			}
			_, err := fake.Update(ctx, slice("vllm-a", 8000, false, "10.0.0.1"), metav1.UpdateOptions{})
			return err
		}, []string{"http://10.0.0.2:8000", "http://10.0.0.3:8000"}},
		{"a ready again", func() error {
			_, err := fake.Update(ctx, slice("vllm-a", 8000, true, "10.0.0.1"), metav1.UpdateOptions{})
			return err
		}, []string{"http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000"}},
		{"b relabelled out", func() error {
			b := slice("vllm-b", 8000, true, "10.0.0.2", "10.0.0.3")
			b.Labels["kubernetes.io/service-name"] = "old"
			_, err := fake.Update(ctx, b, metav1.UpdateOptions{})
			return err
		}, []string{"http://10.0.0.1:8000"}},
		{"a deleted", func() error { return fake.Delete(ctx, "vllm-a", metav1.DeleteOptions{}) }, []string{}},
	}
	for _, st := range steps {
		if err := st.do(); err != nil {
			t.Fatalf("%s: %v", st.name, err)
		}
		if got := next(t, ch); !slices.Equal(got, st.want) {
			t.Fatalf("%s: %v, want %v", st.name, got, st.want)
		}
	}
	select {
	case l := <-ch:
		t.Fatalf("an extra list %v", urls(l))
	default:
	}
}

// scripted is a Client whose calls the test answers one at a time.
type scripted struct {
	calls   chan call
	lists   chan listAnswer
	watches chan watchAnswer
}

type call struct {
	verb string // list or watch
	opts metav1.ListOptions
}

type listAnswer struct {
	rv  string
	eps []*discoveryv1.EndpointSlice
	err error
}

type watchAnswer struct {
	w   watch.Interface
	err error
}

func newScripted() *scripted {
	return &scripted{calls: make(chan call), lists: make(chan listAnswer), watches: make(chan watchAnswer)}
}

func (s *scripted) List(ctx context.Context, opts metav1.ListOptions) (*discoveryv1.EndpointSliceList, error) {
	select {
	case s.calls <- call{"list", opts}:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	select {
	case a := <-s.lists:
		if a.err != nil {
			return nil, a.err
		}
		l := &discoveryv1.EndpointSliceList{ListMeta: metav1.ListMeta{ResourceVersion: a.rv}}
		for _, e := range a.eps {
			l.Items = append(l.Items, *e)
		}
		return l, nil
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

func (s *scripted) Watch(ctx context.Context, opts metav1.ListOptions) (watch.Interface, error) {
	select {
	case s.calls <- call{"watch", opts}:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	select {
	case a := <-s.watches:
		return a.w, a.err
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// expect takes the source's next call: verb, from resourceVersion rv.
func (s *scripted) expect(t *testing.T, verb, rv string) call {
	t.Helper()
	select {
	case c := <-s.calls:
		if c.verb != verb || c.opts.ResourceVersion != rv || c.opts.LabelSelector != "kubernetes.io/service-name=vllm" {
			t.Fatalf("call %s %+v, want %s from resourceVersion %q", c.verb, c.opts, verb, rv)
		}
		return c
	case <-time.After(testutil.Bound(10 * time.Second)): // a bound on a broken test
		t.Fatalf("no %s", verb)
		return call{}
	}
}

func withRV(s *discoveryv1.EndpointSlice, rv string) *discoveryv1.EndpointSlice {
	s.ResourceVersion = rv
	return s
}

func expired() *metav1.Status {
	return &metav1.Status{Status: metav1.StatusFailure, Code: 410, Reason: metav1.StatusReasonExpired,
		Message: "too old resource version: 12 (40)"}
}

// The list-then-watch: the watch starts from the list's resourceVersion
// and asks for bookmarks; a watch the server closes resumes from the last
// resourceVersion seen (a bookmark's too) without listing; 410 Gone lists
// again, and the fresh list replaces the slices seen. Both at once: the
// watch had delivered events.
func TestListThenWatchResumesAndRelistsOnGone(t *testing.T) {
	cl := newScripted()
	cfg := config()
	cfg.Clock = clock.NewFake(time.Unix(0, 0))
	src, err := New(cl, cfg)
	if err != nil {
		t.Fatal(err)
	}
	ch := run(t, src)
	cl.expect(t, "list", "")
	cl.lists <- listAnswer{rv: "10", eps: []*discoveryv1.EndpointSlice{slice("a", 8000, true, "10.0.0.1")}}
	if got := next(t, ch); !slices.Equal(got, []string{"http://10.0.0.1:8000"}) {
		t.Fatalf("first list %v", got)
	}
	c := cl.expect(t, "watch", "10")
	if !c.opts.AllowWatchBookmarks || c.opts.TimeoutSeconds == nil || *c.opts.TimeoutSeconds <= 0 {
		t.Fatalf("watch options %+v", c.opts)
	}
	w := watch.NewFake()
	cl.watches <- watchAnswer{w: w}
	w.Add(withRV(slice("b", 8000, true, "10.0.0.2"), "11"))
	if got := next(t, ch); !slices.Equal(got, []string{"http://10.0.0.1:8000", "http://10.0.0.2:8000"}) {
		t.Fatalf("after b %v", got)
	}
	w.Action(watch.Bookmark, withRV(&discoveryv1.EndpointSlice{}, "12"))
	w.Stop() // the server's timeout
	w = watch.NewFake()
	cl.expect(t, "watch", "12")
	cl.watches <- watchAnswer{w: w}
	w.Modify(withRV(slice("a", 8000, false, "10.0.0.1"), "13"))
	if got := next(t, ch); !slices.Equal(got, []string{"http://10.0.0.2:8000"}) {
		t.Fatalf("after a turned not ready %v", got)
	}
	w.Error(expired())
	cl.expect(t, "list", "") // at once (no timer armed): the watch had done its work
	cl.lists <- listAnswer{rv: "40", eps: []*discoveryv1.EndpointSlice{slice("c", 8000, true, "10.0.0.3")}}
	if got := next(t, ch); !slices.Equal(got, []string{"http://10.0.0.3:8000"}) {
		t.Fatalf("after the fresh list %v (b deleted, c created while the watch was gone)", got)
	}
	cl.expect(t, "watch", "40")
	cl.watches <- watchAnswer{w: watch.NewFake()}
}

// Failures keep the list and back off on the injected clock: a failed
// watch, then failed lists, are retried after 0, 1 s, 2 s, 4 s …
// (capped at 30 s), warned once; the first watch event starts the backoff
// over. Nothing is given until a list succeeds and changes something.
func TestFailuresBackOffAndKeepTheList(t *testing.T) {
	cl := newScripted()
	clk := clock.NewFake(time.Unix(0, 0))
	cfg := config()
	cfg.Clock = clk
	src, err := New(cl, cfg)
	if err != nil {
		t.Fatal(err)
	}
	ch := run(t, src)
	a := []*discoveryv1.EndpointSlice{slice("a", 8000, true, "10.0.0.1")}
	cl.expect(t, "list", "")
	cl.lists <- listAnswer{rv: "5", eps: a}
	next(t, ch)
	cl.expect(t, "watch", "5")
	cl.watches <- watchAnswer{err: fmt.Errorf("connection refused")}
	// A failed watch: listed again at once (the backoff starts at 0), then
	// each failure waits twice as long.
	cl.expect(t, "list", "")
	wait := func(d time.Duration) {
		t.Helper()
		if !clk.WaitTimers(1, 10*time.Second) || clk.Pending()[0] != d {
			t.Fatalf("pending %v, want a wait of %v", clk.Pending(), d)
		}
		clk.Advance(d)
	}
	for _, d := range []time.Duration{time.Second, 2 * time.Second, 4 * time.Second, 8 * time.Second, 16 * time.Second, 30 * time.Second, 30 * time.Second} {
		cl.lists <- listAnswer{err: fmt.Errorf("apiserver down")}
		wait(d)
		cl.expect(t, "list", "")
	}
	cl.lists <- listAnswer{rv: "9", eps: a} // the same slices: no new list
	w := watch.NewFake()
	cl.expect(t, "watch", "9")
	cl.watches <- watchAnswer{w: w}
	w.Modify(withRV(slice("a", 8000, true, "10.0.0.1", "10.0.0.2"), "10"))
	if got := next(t, ch); !slices.Equal(got, []string{"http://10.0.0.1:8000", "http://10.0.0.2:8000"}) {
		t.Fatalf("after recovery %v", got)
	}
	w.Error(&metav1.Status{Status: metav1.StatusFailure, Code: 500, Message: "etcd"})
	cl.expect(t, "list", "") // the watch made progress: the backoff started over
	cl.lists <- listAnswer{err: fmt.Errorf("apiserver down")}
	wait(time.Second)
	cl.expect(t, "list", "")
	select {
	case l := <-ch:
		t.Fatalf("a list given on a failure: %v", urls(l))
	default:
	}
}
