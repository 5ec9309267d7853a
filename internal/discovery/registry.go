package discovery

import (
	"fmt"
	"log/slog"

	"github.com/kvgate/kvgate/internal/clock"
)

// Sources whose code is large live in their own packages and register
// themselves here, as policies register by name (internal/policy): the
// gateway asks for a Kind and never imports the package, which
// cmd/kvgate links with a blank import behind a build tag that is on by
// default (as Prometheus links each service-discovery plugin). A binary
// built without it refuses the kind's configuration with NotLinkedError.

// Kind names a kind of source that registers itself; C is its
// configuration, in plain types (the gateway maps its YAML onto it).
type Kind[C any] struct {
	name  string // the key under discovery: in the configuration
	title string // for people: "Kubernetes"
	tag   string // the build tag that leaves it out
}

// Plugin is what a kind's package registers.
type Plugin[C any] struct {
	// Validate checks a configuration without contacting anything (for
	// --check-config too). Each error begins with the key it is about,
	// relative to the kind's section ("selector ..."): Kind.Validate puts
	// discovery.KIND. in front.
	Validate func(C) []error
	// New builds the source. It may read local files (a kubeconfig) but
	// contacts nothing until the source runs.
	New func(C) (Source, error)
}

// plugins maps a kind's name to its Plugin[C]; written only by Register
// from package init functions, before main runs.
var plugins = map[string]any{}

// Register links a kind's implementation (from its package's init).
func Register[C any](k Kind[C], p Plugin[C]) {
	if p.Validate == nil || p.New == nil {
		panic("discovery: " + k.name + " registered without Validate or New")
	}
	plugins[k.name] = p
}

// NotLinkedError is the configuration error of a kind the binary was built
// without.
type NotLinkedError struct{ Title, Tag string }

func (e *NotLinkedError) Error() string {
	return fmt.Sprintf("this kvgate was built without %s discovery (build tag %s); build it without -tags %s, "+
		"or find the replicas by dns: or replicas_file:", e.Title, e.Tag, e.Tag)
}

// plugin is the kind's registered implementation, or the error that it is
// not linked.
func (k Kind[C]) plugin() (Plugin[C], error) {
	p, ok := plugins[k.name].(Plugin[C])
	if !ok {
		return Plugin[C]{}, fmt.Errorf("discovery.%s: %w", k.name, &NotLinkedError{Title: k.title, Tag: k.tag})
	}
	return p, nil
}

// Linked reports whether the kind's package is in this binary.
func (k Kind[C]) Linked() bool {
	_, err := k.plugin()
	return err == nil
}

// Validate checks cfg with the kind's own rules (one NotLinkedError when
// the kind is not linked); errors name discovery.KIND.KEY.
func (k Kind[C]) Validate(cfg C) []error {
	p, err := k.plugin()
	if err != nil {
		return []error{err}
	}
	var errs []error
	for _, e := range p.Validate(cfg) {
		errs = append(errs, fmt.Errorf("discovery.%s.%w", k.name, e))
	}
	return errs
}

// New builds a source of the kind.
func (k Kind[C]) New(cfg C) (Source, error) {
	p, err := k.plugin()
	if err != nil {
		return nil, err
	}
	src, err := p.New(cfg)
	if err != nil {
		return nil, fmt.Errorf("discovery.%s: %w", k.name, err)
	}
	return src, nil
}

// Kubernetes is the EndpointSlices of a Kubernetes namespace, implemented
// in internal/discovery/kubernetes (left out by the build tag nokubernetes).
var Kubernetes = Kind[KubernetesConfig]{name: "kubernetes", title: "Kubernetes", tag: "nokubernetes"}

// KubernetesConfig configures a Kubernetes source: the ready endpoints of
// the EndpointSlices a label selector matches in a namespace, each a
// replica on port.
type KubernetesConfig struct {
	Namespace string
	// Selector is a label selector on EndpointSlices. A Service's labels
	// are copied onto its EndpointSlices, and every slice carries
	// kubernetes.io/service-name=NAME.
	Selector string
	// Port is the replicas' port: a number, or the name of an
	// EndpointSlice port (the Service port's name).
	Port string
	// Kubeconfig is a kubeconfig file ("": $KUBECONFIG, else the pod's
	// service account, else the default loading rules).
	Kubeconfig string
	// InferencePool names the Gateway API Inference Extension's pool (in
	// Namespace) whose selector and target ports give the replicas: its
	// Ready pods (Selector and Port are then unused).
	InferencePool string
	// PoolGroup is the pool's API group: inference.networking.k8s.io
	// (v1, the default) or inference.networking.x-k8s.io (v1alpha2).
	PoolGroup string
	// RoleLabel is the EndpointSlice label (copied from the Service), or
	// with InferencePool the pod label, that gives its replicas' role; a
	// replica without it is of role both.
	RoleLabel string
	Scheme    string  // default http
	Template  Replica // every replica's settings but its URL and role
	// Clock times the retries after a failed list or watch.
	Clock clock.Clock
	Log   *slog.Logger
}
