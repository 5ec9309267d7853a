package kubernetes

import (
	"cmp"
	"context"
	"log/slog"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	dynamicfake "k8s.io/client-go/dynamic/fake"
	fakecorev1 "k8s.io/client-go/kubernetes/typed/core/v1/fake"

	"github.com/kvgate/kvgate/internal/discovery"
	"github.com/kvgate/kvgate/internal/testutil"
)

// pool is an InferencePool (v1) in namespace llm selecting labels on ports.
func pool(name string, labels map[string]any, ports ...any) *unstructured.Unstructured {
	tp := []any{}
	for _, p := range ports {
		tp = append(tp, map[string]any{"number": p})
	}
	return &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": PoolGroup + "/v1", "kind": "InferencePool",
		"metadata": map[string]any{"name": name, "namespace": "llm"},
		"spec": map[string]any{"selector": map[string]any{"matchLabels": labels}, "targetPorts": tp,
			"endpointPickerRef": map[string]any{"name": "kvgate-epp"}},
	}}
}

// pod is a pod of namespace llm labelled app=app at ip, ready as given.
func pod(name, app, ip string, ready bool) *corev1.Pod {
	status := corev1.ConditionFalse
	if ready {
		status = corev1.ConditionTrue
	}
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "llm", Labels: map[string]string{"app": app}},
		Status: corev1.PodStatus{PodIP: ip, Conditions: []corev1.PodCondition{
			{Type: corev1.PodScheduled, Status: corev1.ConditionTrue}, {Type: corev1.PodReady, Status: status}}},
	}
}

func vllm() map[string]any { return map[string]any{"app": "vllm"} }

// Each pool the API could hold, read and checked: v1 and v1alpha2, and
// every way a spec can be refused, each with its reason.
func TestParsePool(t *testing.T) {
	alpha := &unstructured.Unstructured{Object: map[string]any{"apiVersion": PoolGroupV1Alpha2 + "/v1alpha2", "kind": "InferencePool",
		"metadata": map[string]any{"name": "p"}, "spec": map[string]any{"selector": map[string]any{"app": "vllm"}, "targetPortNumber": int64(8000)}}}
	many := []any{}
	for i := range 9 {
		many = append(many, int64(8000+i))
	}
	noSpec := pool("p", vllm(), int64(8000))
	delete(noSpec.Object, "spec")
	h2c, http1 := pool("p", vllm(), int64(8000)), pool("p", vllm(), int64(8000))
	h2c.Object["spec"].(map[string]any)["appProtocol"] = "kubernetes.io/h2c"
	http1.Object["spec"].(map[string]any)["appProtocol"] = "http"
	for _, tc := range []struct {
		name  string
		pool  *unstructured.Unstructured
		sel   string
		ports []int
		err   string
	}{
		{"v1", pool("p", map[string]any{"app": "vllm", "tier": "gpu"}, int64(8000)), "app=vllm,tier=gpu", []int{8000}, ""},
		{"v1, one endpoint per port", pool("p", vllm(), int64(8000), int64(8001)), "app=vllm", []int{8000, 8001}, ""},
		{"v1alpha2", alpha, "app=vllm", []int{8000}, ""},
		{"v1, appProtocol http", http1, "app=vllm", []int{8000}, ""},
		{"appProtocol h2c", h2c, "", nil, "spec.appProtocol \"kubernetes.io/h2c\""},
		{"no spec", noSpec, "", nil, "no spec"},
		{"a port that is not a number", pool("p", vllm(), "http"), "", nil, "number"},
		{"port 0", pool("p", vllm(), int64(0)), "", nil, "target port 0"},
		{"port 70000", pool("p", vllm(), int64(70000)), "", nil, "target port 70000"},
		{"a port twice", pool("p", vllm(), int64(8000), int64(8000)), "", nil, "target port 8000"},
		{"no port", pool("p", vllm()), "", nil, "0 target ports"},
		{"9 ports", pool("p", vllm(), many...), "", nil, "9 target ports"},
		{"an empty selector", pool("p", map[string]any{}, int64(8000)), "", nil, "0 labels"},
		{"a bad label value", pool("p", map[string]any{"app": "vllm llama"}, int64(8000)), "", nil, "selector"},
		{"a selector that is not labels", pool("p", map[string]any{"app": []any{"x"}}, int64(8000)), "", nil, "matchLabels"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := parsePool(tc.pool)
			switch {
			case tc.err == "" && err != nil:
				t.Fatalf("refused: %v", err)
			case tc.err != "" && (err == nil || !strings.Contains(err.Error(), tc.err)):
				t.Fatalf("error %v, want one with %q", err, tc.err)
			case tc.err == "" && (got.sel.String() != tc.sel || !slices.Equal(got.ports, tc.ports)):
				t.Fatalf("target %s %v, want %s %v", got.sel, got.ports, tc.sel, tc.ports)
			}
		})
	}
}

// poolFakes are client-go's fakes of the pools (dynamic) and of the pods
// (core/v1) of namespace llm, each telling its channel when a watch is
// established (the fakes, unlike an API server, lose a change made
// between a list and its watch).
type poolFakes struct {
	pools       *dynamicfake.FakeDynamicClient
	pods        *fakecorev1.FakeCoreV1
	poolWatched chan struct{}
	podWatched  chan struct{}
}

func newPoolFakes(t *testing.T, pools []runtime.Object, pods ...runtime.Object) *poolFakes {
	f := &poolFakes{poolWatched: make(chan struct{}, 1), podWatched: make(chan struct{}, 1)}
	f.pools = dynamicfake.NewSimpleDynamicClientWithCustomListKinds(runtime.NewScheme(),
		map[schema.GroupVersionResource]string{poolResource(PoolGroup): "InferencePoolList"}, pools...)
	f.pools.PrependWatchReactor("*", signalWatch(f.pools.Tracker(), f.poolWatched))
	f.pods = &fakecorev1.FakeCoreV1{Fake: fakeTracker(t, corev1.AddToScheme, f.podWatched, pods...)}
	return f
}

// source is the pool source over the fakes, logging to log.
func (f *poolFakes) source(t *testing.T, log *slog.Logger) *PoolSource {
	cfg := config()
	cfg.Selector, cfg.Port, cfg.InferencePool, cfg.Log = "", "", "vllm-pool", log
	cfg.Template = discovery.Replica{APIKey: "k"}
	src, err := NewPool(f.pools.Resource(poolResource(PoolGroup)).Namespace("llm"), f.pods.Pods("llm"), cfg)
	if err != nil {
		t.Fatal(err)
	}
	return src
}

func waitFor(t *testing.T, ch <-chan struct{}, what string) {
	t.Helper()
	select {
	case <-ch:
	case <-time.After(testutil.Bound(10 * time.Second)): // a bound on a broken test, not a wait
		t.Fatalf("no %s", what)
	}
}

// errorLog is a logger sending each error's message and err to a channel.
type errorLog chan string

func (e errorLog) Enabled(context.Context, slog.Level) bool { return true }
func (e errorLog) WithAttrs([]slog.Attr) slog.Handler       { return e }
func (e errorLog) WithGroup(string) slog.Handler            { return e }
func (e errorLog) Handle(_ context.Context, r slog.Record) error {
	if r.Level >= slog.LevelError {
		msg := r.Message
		r.Attrs(func(a slog.Attr) bool {
			if a.Key == "err" {
				msg += ": " + a.Value.String()
			}
			return true
		})
		e <- msg
	}
	return nil
}

// Against client-go's fakes: the pool's Ready pods (not another pool's,
// not another app's, not unready, deleted or without an IP) on its port;
// a pod turning unready leaves, ready again comes back; the pool's ports
// changed re-target (one replica per port); a malformed pool is refused
// with its reason and its last good target kept (its pods still
// followed); a new selector re-targets; the pool deleted leaves none.
func TestPoolSourceFollowsThePoolAndItsPods(t *testing.T) {
	deleting := pod("d", "vllm", "10.0.0.4", true)
	deleting.DeletionTimestamp = &metav1.Time{Time: time.Unix(1, 0)}
	a := pod("a", "vllm", "10.0.0.1", true)
	a.Labels["kvgate.io/role"] = "decode"
	f := newPoolFakes(t, []runtime.Object{pool("vllm-pool", vllm(), int64(8000)), pool("other", map[string]any{"app": "sglang"}, int64(1))},
		a, pod("b", "vllm", "10.0.0.2", false), pod("c", "sglang", "10.0.0.3", true), deleting, pod("e", "vllm", "", true))
	errs := make(errorLog, 4)
	src := f.source(t, slog.New(errs))
	ch := run(t, src)
	first := nextList(t, ch)
	if !slices.Equal(urls(first), []string{"http://10.0.0.1:8000"}) || first[0].Role != "decode" || first[0].APIKey != "k" {
		t.Fatalf("first list %+v", first)
	}
	ctx := context.Background()
	pods := f.pods.Pods("llm")
	pools := f.pools.Resource(poolResource(PoolGroup)).Namespace("llm")
	setPod := func(p *corev1.Pod) error { _, err := pods.Update(ctx, p, metav1.UpdateOptions{}); return err }
	setPool := func(u *unstructured.Unstructured) error {
		_, err := pools.Update(ctx, u, metav1.UpdateOptions{})
		return err
	}
	waitFor(t, f.poolWatched, "watch of the pool")
	steps := []struct {
		name    string
		do      func() error
		retarge bool // the pods are listed and watched again
		want    []string
	}{
		{"b ready", func() error { return setPod(pod("b", "vllm", "10.0.0.2", true)) }, false,
			[]string{"http://10.0.0.1:8000", "http://10.0.0.2:8000"}},
		{"a unready", func() error { return setPod(pod("a", "vllm", "10.0.0.1", false)) }, false, []string{"http://10.0.0.2:8000"}},
		{"the pool's ports changed", func() error { return setPool(pool("vllm-pool", vllm(), int64(9000), int64(9001))) }, true,
			[]string{"http://10.0.0.2:9000", "http://10.0.0.2:9001"}},
		{"a ready again, after a malformed pool", func() error {
			if err := setPool(pool("vllm-pool", vllm(), int64(0))); err != nil {
				return err
			}
			if e := <-errs; !strings.Contains(e, "InferencePool refused") || !strings.Contains(e, "target port 0") {
				t.Fatalf("logged %q", e)
			}
			return setPod(pod("a", "vllm", "10.0.0.1", true))
		}, false, []string{"http://10.0.0.1:9000", "http://10.0.0.1:9001", "http://10.0.0.2:9000", "http://10.0.0.2:9001"}},
		{"the selector changed", func() error { return setPool(pool("vllm-pool", map[string]any{"app": "sglang"}, int64(9000))) }, true,
			[]string{"http://10.0.0.3:9000"}},
		{"the pool deleted", func() error { return pools.Delete(ctx, "vllm-pool", metav1.DeleteOptions{}) }, false, []string{}},
	}
	waitFor(t, f.podWatched, "watch of the pods")
	for _, st := range steps {
		if err := st.do(); err != nil {
			t.Fatalf("%s: %v", st.name, err)
		}
		if got := next(t, ch); !slices.Equal(got, st.want) {
			t.Fatalf("%s: %v, want %v", st.name, got, st.want)
		}
		if st.retarge {
			waitFor(t, f.podWatched, "watch of the pods after "+st.name)
		}
	}
	select {
	case l := <-ch:
		t.Fatalf("an extra list %v", urls(l))
	default:
	}
}

// Through the registry: a configuration naming a pool gets the pool's
// source, its clients made for the namespace and the group given.
func TestRegistryBuildsThePoolSource(t *testing.T) {
	saved := newPoolClients
	defer func() { newPoolClients = saved }()
	var asked [3]string
	newPoolClients = func(kubeconfig, namespace, group string) (PoolClient, PodClient, error) {
		asked = [3]string{kubeconfig, namespace, group}
		f := newPoolFakes(t, nil)
		return f.pools.Resource(poolResource(group)).Namespace(namespace), f.pods.Pods(namespace), nil
	}
	for _, group := range []string{"", PoolGroupV1Alpha2} {
		src, err := discovery.Kubernetes.New(discovery.KubernetesConfig{Namespace: "llm", InferencePool: "vllm-pool", PoolGroup: group,
			Kubeconfig: "/kc"})
		if err != nil {
			t.Fatal(err)
		}
		want := [3]string{"/kc", "llm", cmp.Or(group, PoolGroup)}
		if _, ok := src.(*PoolSource); !ok || asked != want || src.Name() != "kubernetes InferencePool llm/vllm-pool" {
			t.Fatalf("source %T %q, clients for %q: want a PoolSource, clients for %q", src, src.Name(), asked, want)
		}
	}
}

// Which pods are replicas, and at which address: Ready with an IP (v4 or
// v6), once per port, an address twice once (the first pod's role), the
// template's settings on each.
func TestPoolReplicas(t *testing.T) {
	src, err := NewPool(nil, nil, discovery.KubernetesConfig{Namespace: "llm", InferencePool: "p", RoleLabel: "kvgate.io/role",
		Template: discovery.Replica{APIKey: "k"}})
	if err != nil {
		t.Fatal(err)
	}
	host1, host2 := pod("h1", "vllm", "10.0.0.9", true), pod("h2", "vllm", "10.0.0.9", true) // hostNetwork: one IP
	host1.Labels["kvgate.io/role"] = "prefill"
	noCondition := pod("n", "vllm", "10.0.0.8", true)
	noCondition.Status.Conditions = nil
	pods := []*corev1.Pod{pod("a", "vllm", "10.0.0.1", true), pod("b", "vllm", "fd00::2", true), host1, host2, noCondition,
		pod("x", "vllm", "10.0.0.5/evil", true), pod("y", "vllm", "vllm-0.llm.svc", true), pod("z", "vllm", "10.0.0.6", false)}
	got := src.replicas(&target{ports: []int{8000, 8001}}, pods)
	want := []string{"http://10.0.0.1:8000", "http://10.0.0.1:8001", "http://10.0.0.9:8000", "http://10.0.0.9:8001",
		"http://[fd00::2]:8000", "http://[fd00::2]:8001"}
	if !slices.Equal(urls(got), want) {
		t.Fatalf("replicas %v, want %v", urls(got), want)
	}
	for _, r := range got {
		if r.APIKey != "k" || (strings.Contains(r.URL, "10.0.0.9") != (r.Role == "prefill")) {
			t.Errorf("replica %+v", r)
		}
	}
}
