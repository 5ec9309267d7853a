// Package kubernetes is kvgate's Kubernetes discovery: the ready
// endpoints of the EndpointSlices (discovery.k8s.io/v1) a label selector
// matches in a namespace, followed by a list-then-watch. It registers
// itself as discovery.Kubernetes; cmd/kvgate links it unless built with
// the tag nokubernetes. It uses only client-go's discovery/v1 typed
// client: no clientset of every API group, no informer factory.
package kubernetes

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"os"
	"slices"
	"strconv"
	"strings"

	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/selection"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/apimachinery/pkg/watch"
	discoveryclient "k8s.io/client-go/kubernetes/typed/discovery/v1"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/kvgate/kvgate/internal/clock"
	"github.com/kvgate/kvgate/internal/discovery"
)

func init() {
	discovery.Register(discovery.Kubernetes, discovery.Plugin[discovery.KubernetesConfig]{Validate: Validate, New: build})
}

// Client is the part of the discovery/v1 EndpointSlices client (of one
// namespace) the source uses.
type Client interface {
	List(ctx context.Context, opts metav1.ListOptions) (*discoveryv1.EndpointSliceList, error)
	Watch(ctx context.Context, opts metav1.ListOptions) (watch.Interface, error)
}

var _ Client = discoveryclient.EndpointSliceInterface(nil)

// Validate checks what the API server would refuse, without asking it:
// the selector's syntax, the namespace and a port name (DNS-1123 labels),
// the InferencePool's name (a DNS-1123 subdomain) and group, the role
// label's key.
func Validate(cfg discovery.KubernetesConfig) []error {
	var errs []error
	if _, err := labels.Parse(cfg.Selector); err != nil {
		errs = append(errs, fmt.Errorf("selector %q: %w", cfg.Selector, err))
	}
	if cfg.Namespace != "" {
		if msgs := validation.IsDNS1123Label(cfg.Namespace); len(msgs) > 0 {
			errs = append(errs, fmt.Errorf("namespace %q: %s", cfg.Namespace, strings.Join(msgs, "; ")))
		}
	}
	if _, err := strconv.Atoi(cfg.Port); err != nil && cfg.Port != "" {
		if msgs := validation.IsDNS1123Label(cfg.Port); len(msgs) > 0 {
			errs = append(errs, fmt.Errorf("port %q: a port name is a DNS-1123 label: %s", cfg.Port, strings.Join(msgs, "; ")))
		}
	}
	if cfg.InferencePool != "" {
		if msgs := validation.IsDNS1123Subdomain(cfg.InferencePool); len(msgs) > 0 {
			errs = append(errs, fmt.Errorf("inference_pool %q: %s", cfg.InferencePool, strings.Join(msgs, "; ")))
		}
	}
	if g := cfg.PoolGroup; g != "" && g != PoolGroup && g != PoolGroupV1Alpha2 {
		errs = append(errs, fmt.Errorf("inference_pool_group %q: want %s (v1) or %s (v1alpha2)", g, PoolGroup, PoolGroupV1Alpha2))
	}
	if cfg.RoleLabel != "" {
		if _, err := labels.NewRequirement(cfg.RoleLabel, selection.Exists, nil); err != nil {
			errs = append(errs, fmt.Errorf("role_label %q: %w", cfg.RoleLabel, err))
		}
	}
	return errs
}

// build is the registered constructor: the API clients from the
// kubeconfig (or in-cluster), then the source: an InferencePool's
// (pool.go) when one is named, else the EndpointSlices'.
func build(cfg discovery.KubernetesConfig) (discovery.Source, error) {
	if errs := Validate(cfg); len(errs) > 0 {
		return nil, errors.Join(errs...)
	}
	path := cfg.Kubeconfig
	if path == "" {
		path = os.Getenv("KUBECONFIG")
	}
	if cfg.InferencePool != "" {
		pools, pods, err := newPoolClients(path, cfg.Namespace, cmp.Or(cfg.PoolGroup, PoolGroup))
		if err != nil {
			return nil, err
		}
		return NewPool(pools, pods, cfg)
	}
	client, err := newClient(path, cfg.Namespace)
	if err != nil {
		return nil, err
	}
	return New(client, cfg)
}

// newClient is the EndpointSlices client of namespace (a test replaces it
// with a fake).
var newClient = func(kubeconfig, namespace string) (Client, error) {
	rc, err := restConfig(kubeconfig)
	if err != nil {
		return nil, err
	}
	c, err := discoveryclient.NewForConfig(rc)
	if err != nil {
		return nil, err
	}
	return c.EndpointSlices(namespace), nil
}

// restConfig is the API server's configuration: from kubeconfig (a path;
// "" tries in-cluster first), else the default loading rules.
func restConfig(kubeconfig string) (*rest.Config, error) {
	if kubeconfig == "" {
		if c, err := rest.InClusterConfig(); err == nil {
			return c, nil
		}
	}
	rules := clientcmd.NewDefaultClientConfigLoadingRules()
	if kubeconfig != "" {
		rules.ExplicitPath = kubeconfig
	}
	c, err := clientcmd.NewNonInteractiveDeferredLoadingClientConfig(rules, &clientcmd.ConfigOverrides{}).ClientConfig()
	if err != nil {
		return nil, fmt.Errorf("kubernetes: neither in a cluster nor a usable kubeconfig ($KUBECONFIG or kubeconfig:): %w", err)
	}
	return c, nil
}

// Source follows the EndpointSlices the selector matches: its replicas
// are their ready endpoints (conditions.ready true or unset, not
// terminating).
type Source struct {
	cfg    discovery.KubernetesConfig
	client Client
	sel    labels.Selector
}

// New makes a source on client (the EndpointSlices of cfg.Namespace).
func New(client Client, cfg discovery.KubernetesConfig) (*Source, error) {
	sel, err := labels.Parse(cfg.Selector)
	if err != nil {
		return nil, fmt.Errorf("selector %q: %w", cfg.Selector, err)
	}
	if cfg.Port == "" {
		return nil, errors.New("port: give the replicas' port number or its EndpointSlice port name")
	}
	return &Source{cfg: withDefaults(cfg), client: client, sel: sel}, nil
}

// withDefaults is cfg with its optional fields filled: scheme http, the
// real clock, a log that discards.
func withDefaults(cfg discovery.KubernetesConfig) discovery.KubernetesConfig {
	cfg.Scheme = cmp.Or(cfg.Scheme, "http")
	cfg.Clock, cfg.Log = clock.OrReal(cfg.Clock), logOr(cfg.Log)
	return cfg
}

func logOr(l *slog.Logger) *slog.Logger {
	if l == nil {
		return slog.New(slog.DiscardHandler)
	}
	return l
}

// Name is "kubernetes NAMESPACE/SELECTOR".
func (k *Source) Name() string { return "kubernetes " + k.cfg.Namespace + "/" + k.cfg.Selector }

// Replicas are the ready endpoints of eps, one replica per endpoint (its
// first address: the others are the same pod's), sorted by URL; an
// endpoint in several slices counts once.
func (k *Source) Replicas(eps []*discoveryv1.EndpointSlice) []discovery.Replica {
	seen := map[string]bool{}
	out := []discovery.Replica{}
	for _, s := range eps {
		port, ok := k.port(s)
		if !ok {
			continue
		}
		for _, e := range s.Endpoints {
			if !ready(e) || len(e.Addresses) == 0 || !address(e.Addresses[0]) {
				continue
			}
			u := k.cfg.Scheme + "://" + net.JoinHostPort(e.Addresses[0], strconv.Itoa(port))
			if seen[u] {
				continue
			}
			seen[u] = true
			r := k.cfg.Template
			r.URL, r.Role = u, s.Labels[k.cfg.RoleLabel]
			out = append(out, r)
		}
	}
	return discovery.Sorted(out)
}

// port is the replicas' port in slice s: the number given, or the port
// named so (ok false: the slice has no such port, or not from 1 to 65535).
func (k *Source) port(s *discoveryv1.EndpointSlice) (int, bool) {
	if n, err := strconv.Atoi(k.cfg.Port); err == nil {
		return n, true
	}
	for _, p := range s.Ports {
		if p.Name != nil && *p.Name == k.cfg.Port && p.Port != nil {
			return int(*p.Port), *p.Port > 0 && *p.Port <= 65535
		}
	}
	return 0, false
}

// address reports whether an endpoint's address can be a replica's host:
// an IP, or a DNS name (addressType FQDN). The API server validates them;
// checked again where they enter, so that one odd endpoint is skipped
// instead of making the gateway refuse the whole list.
func address(a string) bool {
	return net.ParseIP(a) != nil || len(validation.IsDNS1123Subdomain(a)) == 0
}

// ready: conditions.ready true or unset (unknown counts as ready, as the
// API documents), and not terminating.
func ready(e discoveryv1.Endpoint) bool {
	c := e.Conditions
	return (c.Ready == nil || *c.Ready) && (c.Terminating == nil || !*c.Terminating)
}

// Run lists and watches the slices until ctx ends; the first list is
// given as soon as it is read, then one after each change.
func (k *Source) Run(ctx context.Context, update func([]discovery.Replica)) {
	r := &reflector[*discoveryv1.EndpointSlice]{kind: "EndpointSlices", source: k.Name(),
		list:  lister(k.client.List, func(l *discoveryv1.EndpointSliceList) []discoveryv1.EndpointSlice { return l.Items }),
		watch: k.client.Watch, opts: metav1.ListOptions{LabelSelector: k.sel.String()}, clock: k.cfg.Clock, log: k.cfg.Log}
	give := givenOnChange(update)
	r.run(ctx, &byName[*discoveryv1.EndpointSlice]{ // an endpoint in two slices takes the first's role
		keep: func(s *discoveryv1.EndpointSlice) bool { return k.sel.Matches(labels.Set(s.Labels)) },
		show: func(eps []*discoveryv1.EndpointSlice) { give(k.Replicas(eps)) }})
}

// lister is a client's List as a reflector's: the addresses of the
// list's items, and its resourceVersion.
func lister[L metav1.ListInterface, T any](list func(context.Context, metav1.ListOptions) (L, error),
	items func(L) []T) func(context.Context, metav1.ListOptions) ([]*T, string, error) {
	return func(ctx context.Context, opts metav1.ListOptions) ([]*T, string, error) {
		l, err := list(ctx, opts)
		if err != nil {
			return nil, "", err
		}
		its := items(l)
		out := make([]*T, len(its))
		for i := range its {
			out[i] = &its[i]
		}
		return out, l.GetResourceVersion(), nil
	}
}

// givenOnChange is update called the first time and then only with a
// list unlike the last.
func givenOnChange(update func([]discovery.Replica)) func([]discovery.Replica) {
	var last []discovery.Replica
	given := false
	return func(list []discovery.Replica) {
		if given && slices.Equal(list, last) {
			return
		}
		last, given = list, true
		update(list)
	}
}

// byName is a reflector's store: the objects it read, by name, that keep
// accepts (a watch brings objects relabelled out of the selector, and a
// fake's every object); after each change show has them sorted by name.
type byName[T object] struct {
	keep func(T) bool
	show func([]T)
	objs map[string]T
}

func (b *byName[T]) replace(items []T) {
	b.objs = make(map[string]T, len(items))
	for _, o := range items {
		if b.keep(o) {
			b.objs[o.GetName()] = o
		}
	}
	b.changed()
}

func (b *byName[T]) apply(t watch.EventType, o T) {
	if t == watch.Deleted || !b.keep(o) {
		delete(b.objs, o.GetName())
	} else {
		b.objs[o.GetName()] = o
	}
	b.changed()
}

func (b *byName[T]) changed() {
	names := slices.Sorted(maps.Keys(b.objs))
	list := make([]T, len(names))
	for i, n := range names {
		list[i] = b.objs[n]
	}
	b.show(list)
}
