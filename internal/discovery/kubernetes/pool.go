package kubernetes

import (
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"strconv"
	"sync"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/dynamic"
	corev1client "k8s.io/client-go/kubernetes/typed/core/v1"

	"github.com/kvgate/kvgate/internal/discovery"
)

// The Gateway API Inference Extension's InferencePool as a source, read
// as its reference endpoint picker reads it (--pool-name,
// --pool-namespace, --pool-group): the pool's selector picks the pods of
// its namespace, each Ready pod (condition Ready true, not being deleted,
// with a pod IP) is a replica on each of the pool's target ports ("every
// port will be treated as a distinctive endpoint by EPP", up to 8), and
// a change of the pool's selector or ports re-targets. The pool is read
// as an unstructured object (its few fields by path, no module of the
// Inference Extension): inference.networking.k8s.io/v1
// (spec.selector.matchLabels, spec.targetPorts[].number) or the older
// inference.networking.x-k8s.io/v1alpha2 (spec.selector, a map, and
// spec.targetPortNumber).

// The InferencePool's API groups.
const (
	PoolGroup         = "inference.networking.k8s.io"   // version v1 (the default)
	PoolGroupV1Alpha2 = "inference.networking.x-k8s.io" // version v1alpha2
)

// Bounds of a pool's spec, the API's own (its CRD validation), checked
// again where the pool enters.
const (
	maxPoolPorts  = 8
	maxPoolLabels = 64
)

// poolResource is the InferencePools' resource in group.
func poolResource(group string) schema.GroupVersionResource {
	v := "v1"
	if group == PoolGroupV1Alpha2 {
		v = "v1alpha2"
	}
	return schema.GroupVersionResource{Group: group, Version: v, Resource: "inferencepools"}
}

// PoolClient is the part of the dynamic client of a namespace's
// InferencePools the source uses.
type PoolClient interface {
	List(ctx context.Context, opts metav1.ListOptions) (*unstructured.UnstructuredList, error)
	Watch(ctx context.Context, opts metav1.ListOptions) (watch.Interface, error)
}

// PodClient is the part of the core/v1 Pods client of a namespace the
// source uses.
type PodClient interface {
	List(ctx context.Context, opts metav1.ListOptions) (*corev1.PodList, error)
	Watch(ctx context.Context, opts metav1.ListOptions) (watch.Interface, error)
}

var (
	_ PoolClient = dynamic.ResourceInterface(nil)
	_ PodClient  = corev1client.PodInterface(nil)
)

// newPoolClients are the pools' and the pods' clients of namespace (a
// test replaces them with fakes).
var newPoolClients = func(kubeconfig, namespace, group string) (PoolClient, PodClient, error) {
	rc, err := restConfig(kubeconfig)
	if err != nil {
		return nil, nil, err
	}
	dc, err := dynamic.NewForConfig(rc)
	if err != nil {
		return nil, nil, err
	}
	cc, err := corev1client.NewForConfig(rc)
	if err != nil {
		return nil, nil, err
	}
	return dc.Resource(poolResource(group)).Namespace(namespace), cc.Pods(namespace), nil
}

// target is what a pool names: its pods' selector and their ports.
type target struct {
	sel   labels.Selector
	ports []int
}

func (t *target) equal(o *target) bool {
	if t == nil || o == nil {
		return t == o
	}
	return t.sel.String() == o.sel.String() && slices.Equal(t.ports, o.ports)
}

// parsePool reads and checks a pool's spec (by its apiVersion's group):
// a selector of 1 to 64 valid labels, 1 to 8 distinct ports from 1 to
// 65535, the HTTP/1.1 app protocol. A pool that selects nothing would select every pod. Each field
// is read by its path, so that a field of the wrong type is named.
func parsePool(u *unstructured.Unstructured) (*target, error) {
	if _, ok := u.Object["spec"].(map[string]any); !ok {
		return nil, errors.New("no spec")
	}
	if u.GroupVersionKind().Group == PoolGroupV1Alpha2 {
		set, _, err := unstructured.NestedStringMap(u.Object, "spec", "selector")
		if err != nil {
			return nil, err
		}
		port, found, err := unstructured.NestedInt64(u.Object, "spec", "targetPortNumber")
		if err != nil || !found {
			return nil, fmt.Errorf("spec.targetPortNumber: want a number (%v)", err)
		}
		return checkTarget(set, []int64{port})
	}
	// appProtocol (v1): http (HTTP/1.1, the default) or kubernetes.io/h2c,
	// which kvgate does not speak to replicas.
	if proto, _, err := unstructured.NestedString(u.Object, "spec", "appProtocol"); err != nil || (proto != "" && proto != "http") {
		return nil, fmt.Errorf("spec.appProtocol %q: kvgate speaks HTTP/1.1 (http) to the replicas (%v)", proto, err)
	}
	set, _, err := unstructured.NestedStringMap(u.Object, "spec", "selector", "matchLabels")
	if err != nil {
		return nil, err
	}
	list, _, err := unstructured.NestedSlice(u.Object, "spec", "targetPorts")
	if err != nil {
		return nil, err
	}
	ports := make([]int64, len(list))
	for i, item := range list {
		m, _ := item.(map[string]any)
		n, found, err := unstructured.NestedInt64(m, "number")
		if err != nil || !found {
			return nil, fmt.Errorf("spec.targetPorts[%d].number: want a number (%v)", i, err)
		}
		ports[i] = n
	}
	return checkTarget(set, ports)
}

// checkTarget is the target of a pool's selector labels and ports, or why
// they cannot be one.
func checkTarget(set map[string]string, ports []int64) (*target, error) {
	if len(set) == 0 || len(set) > maxPoolLabels {
		return nil, fmt.Errorf("the selector has %d labels: want 1 to %d (none would select every pod)", len(set), maxPoolLabels)
	}
	sel, err := labels.ValidatedSelectorFromSet(set)
	if err != nil {
		return nil, fmt.Errorf("selector: %w", err)
	}
	if len(ports) == 0 || len(ports) > maxPoolPorts {
		return nil, fmt.Errorf("%d target ports: want 1 to %d", len(ports), maxPoolPorts)
	}
	t := &target{sel: sel}
	for _, p := range ports {
		if p < 1 || p > 65535 || slices.Contains(t.ports, int(p)) {
			return nil, fmt.Errorf("target port %d: want distinct ports from 1 to 65535", p)
		}
		t.ports = append(t.ports, int(p))
	}
	return t, nil
}

// PoolSource follows an InferencePool and the Ready pods it selects.
type PoolSource struct {
	cfg   discovery.KubernetesConfig
	pools PoolClient
	pods  PodClient
}

// NewPool makes the source of pool cfg.InferencePool on the clients of
// cfg.Namespace.
func NewPool(pools PoolClient, pods PodClient, cfg discovery.KubernetesConfig) (*PoolSource, error) {
	if cfg.InferencePool == "" {
		return nil, errors.New("inference_pool: give the InferencePool's name")
	}
	return &PoolSource{cfg: withDefaults(cfg), pools: pools, pods: pods}, nil
}

// Name is "kubernetes InferencePool NAMESPACE/NAME".
func (p *PoolSource) Name() string {
	return "kubernetes InferencePool " + p.cfg.Namespace + "/" + p.cfg.InferencePool
}

// Run follows the pool and, through each of its targets in turn, its
// pods, until ctx ends. A pool absent or deleted gives an empty list (as
// the reference picker clears its pods); a pool refused keeps the last
// good target, whose pods are still followed.
func (p *PoolSource) Run(ctx context.Context, update func([]discovery.Replica)) {
	targets := make(chan *target, 1)
	var wg sync.WaitGroup
	wg.Go(func() { p.followPods(ctx, targets, givenOnChange(update)) })
	r := &reflector[*unstructured.Unstructured]{kind: "InferencePools", source: p.Name(),
		list:  lister(p.pools.List, func(l *unstructured.UnstructuredList) []unstructured.Unstructured { return l.Items }),
		watch: p.pools.Watch, opts: metav1.ListOptions{FieldSelector: "metadata.name=" + p.cfg.InferencePool},
		clock: p.cfg.Clock, log: p.cfg.Log}
	r.run(ctx, &poolView{p: p, out: targets})
	wg.Wait()
}

// followPods list-watches the pods of each target received (the last
// one; nil: no pool, no replica), one target at a time: update is called
// from one goroutine at a time.
func (p *PoolSource) followPods(ctx context.Context, targets <-chan *target, give func([]discovery.Replica)) {
	stop := func() {}
	defer func() { stop() }()
	for {
		select {
		case <-ctx.Done():
			return
		case t := <-targets:
			stop()
			stop = func() {}
			if t == nil {
				give([]discovery.Replica{})
			} else {
				stop = p.followTarget(ctx, t, give)
			}
		}
	}
}

// followTarget list-watches the pods t selects until stop is called.
func (p *PoolSource) followTarget(ctx context.Context, t *target, give func([]discovery.Replica)) (stop func()) {
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	r := &reflector[*corev1.Pod]{kind: "Pods", source: p.Name(),
		list:  lister(p.pods.List, func(l *corev1.PodList) []corev1.Pod { return l.Items }),
		watch: p.pods.Watch, opts: metav1.ListOptions{LabelSelector: t.sel.String()}, clock: p.cfg.Clock, log: p.cfg.Log}
	pods := &byName[*corev1.Pod]{keep: func(pod *corev1.Pod) bool { return t.sel.Matches(labels.Set(pod.Labels)) },
		show: func(pods []*corev1.Pod) { give(p.replicas(t, pods)) }}
	go func() { defer close(done); r.run(ctx, pods) }()
	return func() { cancel(); <-done }
}

// replicas are the replicas of pods (t's, sorted by name) on t's ports:
// each pod Ready, not being deleted and with an IP, on each port, sorted
// by URL; its role from its role label. An address twice counts once (the
// first pod's).
func (p *PoolSource) replicas(t *target, pods []*corev1.Pod) []discovery.Replica {
	seen := map[string]bool{}
	out := []discovery.Replica{}
	for _, pod := range pods {
		if !podReady(pod) {
			continue
		}
		for _, port := range t.ports {
			r := p.cfg.Template
			r.URL = p.cfg.Scheme + "://" + net.JoinHostPort(pod.Status.PodIP, strconv.Itoa(port))
			if seen[r.URL] { // pods on the host's network share its IP
				continue
			}
			seen[r.URL] = true
			r.Role = pod.Labels[p.cfg.RoleLabel]
			out = append(out, r)
		}
	}
	return discovery.Sorted(out)
}

// podReady is the reference picker's test (condition Ready true, no
// deletion timestamp) and a pod IP that parses.
func podReady(pod *corev1.Pod) bool {
	if pod.DeletionTimestamp != nil || net.ParseIP(pod.Status.PodIP) == nil {
		return false
	}
	for _, c := range pod.Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

// poolView is the store of the pool's reflector: it sends each new
// target (nil: no pool) to out, which keeps only the latest.
type poolView struct {
	p       *PoolSource
	out     chan *target
	cur     *target
	sent    bool
	refused string // the last refusal logged
}

func (v *poolView) replace(items []*unstructured.Unstructured) {
	var pool *unstructured.Unstructured
	for _, u := range items {
		if u.GetName() == v.p.cfg.InferencePool {
			pool = u
		}
	}
	v.set(pool)
}

func (v *poolView) apply(t watch.EventType, u *unstructured.Unstructured) {
	switch {
	case u.GetName() != v.p.cfg.InferencePool:
	case t == watch.Deleted:
		v.set(nil)
	default:
		v.set(u)
	}
}

// set takes the pool as it now is (nil: none): a pool refused is logged
// (once per reason) and changes nothing.
func (v *poolView) set(pool *unstructured.Unstructured) {
	var t *target
	if pool != nil {
		var err error
		if t, err = parsePool(pool); err != nil {
			if msg := err.Error(); msg != v.refused {
				v.refused = msg
				v.p.cfg.Log.Error("kubernetes discovery: InferencePool refused; keeping its last good selector and ports",
					"source", v.p.Name(), "err", msg)
			}
			return
		}
	} else if !v.sent || v.cur != nil {
		v.p.cfg.Log.Warn("kubernetes discovery: no such InferencePool: no replica until it exists", "source", v.p.Name())
	}
	if v.refused != "" {
		v.refused = ""
		v.p.cfg.Log.Info("kubernetes discovery: InferencePool accepted again", "source", v.p.Name())
	}
	if v.sent && t.equal(v.cur) {
		return
	}
	v.cur, v.sent = t, true
	select { // only the latest target counts
	case <-v.out:
	default:
	}
	v.out <- t
}
