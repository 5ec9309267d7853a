package discovery

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"slices"
	"strconv"
	"time"

	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/clientcmd"
)

// KubernetesConfig configures a Kubernetes source.
type KubernetesConfig struct {
	Namespace string
	// Selector is a label selector on EndpointSlices. A Service's labels
	// are copied onto its EndpointSlices, and every slice carries
	// kubernetes.io/service-name=NAME.
	Selector string
	// Port is the replicas' port: a number, or the name of an
	// EndpointSlice port (the Service port's name).
	Port string
	// RoleLabel is the EndpointSlice label (copied from the Service) that
	// gives its replicas' role; a replica without it is of role both.
	RoleLabel string
	Scheme    string  // default http
	Template  Replica // every replica's settings but its URL and role
	Log       *slog.Logger
}

// Kubernetes watches EndpointSlices (discovery.k8s.io/v1) through an
// informer: its replicas are the ready endpoints (conditions.ready true or
// unset, not terminating) of the slices the selector matches.
type Kubernetes struct {
	cfg    KubernetesConfig
	client kubernetes.Interface
	sel    labels.Selector
}

// RestConfig is the API server's configuration: from kubeconfig (a path;
// "" tries $KUBECONFIG), else in-cluster (the pod's service account).
func RestConfig(kubeconfig string) (*rest.Config, error) {
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

// NewKubernetes makes a Kubernetes source on client.
func NewKubernetes(client kubernetes.Interface, cfg KubernetesConfig) (*Kubernetes, error) {
	sel, err := labels.Parse(cfg.Selector)
	if err != nil {
		return nil, fmt.Errorf("kubernetes.selector %q: %w", cfg.Selector, err)
	}
	if cfg.Port == "" {
		return nil, fmt.Errorf("kubernetes.port: give the replicas' port number or its EndpointSlice port name")
	}
	if cfg.Scheme == "" {
		cfg.Scheme = "http"
	}
	cfg.Log = logger(cfg.Log)
	return &Kubernetes{cfg: cfg, client: client, sel: sel}, nil
}

// Name is "kubernetes NAMESPACE/SELECTOR".
func (k *Kubernetes) Name() string { return "kubernetes " + k.cfg.Namespace + "/" + k.cfg.Selector }

// Run watches until ctx ends; the first list comes once the informer's
// cache has synced (a list of the slices), then one after each change.
func (k *Kubernetes) Run(ctx context.Context, update func([]Replica)) {
	f := informers.NewSharedInformerFactoryWithOptions(k.client, 10*time.Minute, informers.WithNamespace(k.cfg.Namespace),
		informers.WithTweakListOptions(func(o *metav1.ListOptions) { o.LabelSelector = k.sel.String() }))
	inf := f.Discovery().V1().EndpointSlices()
	changed := make(chan struct{}, 1)
	poke := func(any) {
		select {
		case changed <- struct{}{}:
		default:
		}
	}
	_, _ = inf.Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{AddFunc: poke,
		UpdateFunc: func(_, n any) { poke(n) }, DeleteFunc: poke})
	f.Start(ctx.Done())
	defer f.Shutdown()
	if !cache.WaitForCacheSync(ctx.Done(), inf.Informer().HasSynced) {
		return
	}
	var last []Replica
	for {
		slices, err := inf.Lister().EndpointSlices(k.cfg.Namespace).List(k.sel)
		if err != nil {
			k.cfg.Log.Warn("kubernetes discovery: cannot list EndpointSlices; keeping the previous replica list", "err", err)
		} else if list := k.Replicas(slices); last == nil || !slicesEqual(list, last) {
			last = list
			update(list)
		}
		select {
		case <-ctx.Done():
			return
		case <-changed:
		}
	}
}

func slicesEqual(a, b []Replica) bool { return slices.Equal(a, b) }

// Replicas are the ready endpoints of eps, one replica per endpoint (its
// first address: the others are the same pod's), sorted by URL; an
// endpoint in several slices counts once.
func (k *Kubernetes) Replicas(eps []*discoveryv1.EndpointSlice) []Replica {
	seen := map[string]bool{}
	out := []Replica{}
	for _, s := range eps {
		port, ok := k.port(s)
		if !ok {
			continue
		}
		for _, e := range s.Endpoints {
			if !ready(e) || len(e.Addresses) == 0 {
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
	return Sorted(out)
}

// port is the replicas' port in slice s: the number given, or the port
// named so (ok false: the slice has no such port).
func (k *Kubernetes) port(s *discoveryv1.EndpointSlice) (int, bool) {
	if n, err := strconv.Atoi(k.cfg.Port); err == nil {
		return n, true
	}
	for _, p := range s.Ports {
		if p.Name != nil && *p.Name == k.cfg.Port && p.Port != nil {
			return int(*p.Port), true
		}
	}
	return 0, false
}

// ready: conditions.ready true or unset (unknown counts as ready, as the
// API documents), and not terminating.
func ready(e discoveryv1.Endpoint) bool {
	c := e.Conditions
	return (c.Ready == nil || *c.Ready) && (c.Terminating == nil || !*c.Terminating)
}
