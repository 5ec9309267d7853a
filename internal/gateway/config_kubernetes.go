package gateway

import (
	"bytes"
	"encoding/json"
	"errors"
	"strconv"

	"github.com/kvgate/kvgate/internal/discovery"
)

// DefaultRoleLabel is the label (on the Service, copied by Kubernetes onto
// its EndpointSlices) that gives discovered replicas their
// prefill/decode role.
const DefaultRoleLabel = "kvgate.io/role"

// KubernetesConfig is discovery.kubernetes: the EndpointSlices of a
// namespace that a label selector matches (a Service's:
// kubernetes.io/service-name=NAME, or the Service's own labels), their
// ready endpoints each a replica on port.
type KubernetesConfig struct {
	Namespace string `json:"namespace"`
	Selector  string `json:"selector"`
	// Port is a number or the EndpointSlice port's name (the Service
	// port's name).
	Port PortRef `json:"port"`
	// Kubeconfig is a kubeconfig file (default $KUBECONFIG; in a pod, none:
	// the service account's in-cluster configuration).
	Kubeconfig string `json:"kubeconfig,omitempty"`
	// RoleLabel gives each slice's (or pod's) replicas their role (default kvgate.io/role).
	RoleLabel string `json:"role_label,omitempty"`
	// InferencePool, instead of selector and port, names the Gateway API
	// Inference Extension's pool in namespace: its selector picks the
	// pods, each Ready pod a replica on each of its target ports.
	InferencePool string `json:"inference_pool,omitempty"`
	// InferencePoolGroup is the pool's API group (default
	// inference.networking.k8s.io, v1; or inference.networking.x-k8s.io,
	// v1alpha2).
	InferencePoolGroup string `json:"inference_pool_group,omitempty"`
}

// PortRef is a port number or name: `port: 8000` or `port: http`.
type PortRef string

func (p *PortRef) UnmarshalJSON(b []byte) error {
	b = bytes.TrimSpace(b)
	var n int
	if err := json.Unmarshal(b, &n); err == nil {
		*p = PortRef(strconv.Itoa(n))
		return nil
	}
	var s string
	if err := json.Unmarshal(b, &s); err != nil {
		return errors.New("a port is a number or a port name")
	}
	*p = PortRef(s)
	return nil
}

// validate checks a kubernetes: entry written at key.
func (k *KubernetesConfig) validate(key string) []error {
	var errs []error
	if k.Namespace == "" {
		errs = append(errs, keyErr(key+".namespace", "give the replicas' namespace"))
	}
	switch {
	case k.InferencePool != "":
		for _, f := range []struct{ key, v string }{{"selector", k.Selector}, {"port", string(k.Port)}} {
			if f.v != "" {
				errs = append(errs, keyErr(key+"."+f.key, "with inference_pool the pool's selector and target ports "+
					"find the pods: give no %s", f.key))
			}
		}
	case k.InferencePoolGroup != "":
		errs = append(errs, keyErr(key+".inference_pool_group", "give inference_pool too"))
	default:
		if k.Selector == "" {
			errs = append(errs, keyErr(key+".selector", "give a label selector of the EndpointSlices "+
				"(e.g. kubernetes.io/service-name=vllm), or inference_pool: NAME"))
		}
		if n, err := strconv.Atoi(string(k.Port)); k.Port == "" || (err == nil && (n <= 0 || n > 65535)) {
			errs = append(errs, keyErr(key+".port", "%q: a port number (1-65535) or an EndpointSlice port name", k.Port))
		}
	}
	// The rest (the selector's syntax, names the API server would refuse)
	// is the plugin's to check; a kvgate built without it says so here.
	for _, err := range discovery.Kubernetes.Validate(k.spec(nil)) {
		errs = append(errs, keyErr(key, "%v", err))
	}
	return errs
}

// spec is the plugin's configuration of discovery entry d (nil: for
// validation only).
func (k *KubernetesConfig) spec(d *DiscoveryConfig) discovery.KubernetesConfig {
	role := k.RoleLabel
	if role == "" {
		role = DefaultRoleLabel
	}
	out := discovery.KubernetesConfig{Namespace: k.Namespace, Selector: k.Selector, Port: string(k.Port),
		Kubeconfig: k.Kubeconfig, RoleLabel: role, InferencePool: k.InferencePool, PoolGroup: k.InferencePoolGroup}
	if d != nil {
		out.Scheme, out.Template = d.Scheme, d.template()
	}
	return out
}
