package gateway

import (
	"bytes"
	"encoding/json"
	"errors"
	"reflect"
	"strings"

	"sigs.k8s.io/yaml"

	"github.com/kvgate/kvgate/internal/discovery"
	"github.com/kvgate/kvgate/internal/policy"
)

// Where the replicas come from, as the configuration says it: replicas:
// (static), replicas_file: (a YAML list, watched) or discovery: (DNS or
// Kubernetes), at the top level or in a pool (config_pools.go). What the
// gateway does with them while it runs is the control plane's
// (control_sources.go, control_members.go).

// DiscoveryConfig is the config's discovery: exactly one of DNS and
// Kubernetes.
type DiscoveryConfig struct {
	// DNS is NAME:PORT (A/AAAA records, each address a replica) or a SRV
	// name _SERVICE._PROTO.DOMAIN (each target HOST:PORT a replica).
	DNS string `json:"dns,omitempty"`
	// Scheme of the discovered replicas' URLs: http (default) or https.
	Scheme string `json:"scheme,omitempty"`
	// Interval between DNS lookups (default 5s).
	Interval Duration `json:"interval,omitempty"`
	// RemoveAfter: DNS answers in a row without a replica before it is
	// removed (default 2: one answer missing it is a flap).
	RemoveAfter int `json:"remove_after,omitempty"`
	// Role of every replica DNS finds (one role per discovery entry);
	// Kubernetes reads each pod's role label instead.
	Role string `json:"role,omitempty"`
	// APIKey and DataParallelSize apply to every replica found.
	APIKey           string `json:"api_key,omitempty"`
	DataParallelSize int    `json:"data_parallel_size,omitempty"`

	Kubernetes *KubernetesConfig `json:"kubernetes,omitempty"`
}

// dynamic reports whether the replicas come from a source that changes
// while the gateway runs.
func (c *Config) dynamic() bool { return c.ReplicasFile != "" || c.Discovery != nil || c.poolSourced() }

// validateSources checks that the replicas come from exactly one source.
func (c *Config) validateSources() []error {
	n := 0
	for _, set := range []bool{len(c.Replicas) > 0, c.ReplicasFile != "", c.Discovery != nil} {
		if set {
			n++
		}
	}
	switch {
	case n == 0:
		return []error{keyErr("replicas", "no replicas: give --replicas URL,URL,... or --replicas-file FILE, or replicas:, "+
			"replicas_file: or discovery: in the config file")}
	case n > 1:
		key := "discovery"
		if c.ReplicasFile != "" {
			key = "replicas_file"
		}
		return []error{keyErr(key, "replicas come from one source: give only one of replicas: (--replicas), "+
			"replicas_file: (--replicas-file) and discovery:")}
	case c.Discovery != nil:
		return c.Discovery.validate("discovery")
	}
	return nil
}

// validate checks a discovery: entry written at key (discovery, or a
// pool's).
func (d *DiscoveryConfig) validate(key string) []error {
	var errs []error
	switch {
	case d.DNS == "" && d.Kubernetes == nil:
		return []error{keyErr(key, "give dns: NAME:PORT or kubernetes: {namespace, selector, port}")}
	case d.DNS != "" && d.Kubernetes != nil:
		return []error{keyErr(key, "give one of dns: and kubernetes:, not both")}
	case d.DNS != "":
		if _, _, _, err := discovery.ParseDNSName(d.DNS); err != nil {
			errs = append(errs, keyErr(key+".dns", "%v", err))
		}
	default:
		errs = append(errs, d.Kubernetes.validate(key+".kubernetes")...)
		if d.Role != "" {
			errs = append(errs, keyErr(key+".role", "with kubernetes each pod's role comes from its "+
				"role label (kubernetes.role_label, default "+DefaultRoleLabel+")"))
		}
	}
	if d.Scheme != "" && d.Scheme != "http" && d.Scheme != "https" {
		errs = append(errs, keyErr(key+".scheme", "%q: want http or https", d.Scheme))
	}
	if _, err := policy.ParseRole(d.Role); err != nil {
		errs = append(errs, keyErr(key+".role", "%s", strings.TrimPrefix(err.Error(), "role ")))
	}
	if d.RemoveAfter < 0 {
		errs = append(errs, keyErr(key+".remove_after", "must be ≥ 0"))
	}
	if d.DataParallelSize < 0 || d.DataParallelSize > maxDataParallel {
		errs = append(errs, keyErr(key+".data_parallel_size", "%d: want 0 to %d", d.DataParallelSize, maxDataParallel))
	}
	return errs
}

// template is every discovered replica's settings but its URL.
func (d *DiscoveryConfig) template() ReplicaConfig {
	return ReplicaConfig{Role: d.Role, APIKey: d.APIKey, DataParallelSize: d.DataParallelSize}
}

// ParseReplicasFile parses a replicas file: the YAML list of the config's
// replicas: (a bare list, or a map with replicas:), checked as the config
// checks it. kv_events endpoints are refused (static configuration only;
// use kv_events_listen), and so is an empty list: a file caught half
// written would otherwise remove every replica.
func ParseReplicasFile(data []byte) ([]ReplicaConfig, error) {
	js, err := yaml.YAMLToJSON(data)
	if err != nil {
		return nil, yamlError(err)
	}
	var tree any
	dec := json.NewDecoder(bytes.NewReader(js))
	dec.UseNumber()
	_ = dec.Decode(&tree) // YAMLToJSON wrote JSON
	root := ""
	if tree == nil {
		tree = []any{} // an empty file: an empty list
	}
	if list, ok := tree.([]any); ok {
		tree, root = map[string]any{"replicas": list}, "replicas" // a bare list: its items are replicas[i]
	}
	lines, probs := keyLines(data, root)
	src := &ConfigSource{lines: lines}
	var wrap struct {
		Replicas []ReplicaConfig `json:"replicas"`
	}
	if _, ok := tree.(map[string]any); !ok {
		return nil, src.Locate(&ConfigError{Msg: "want a list of replicas ({url: ..., role: ...}), or replicas: with one", read: true})
	}
	checkValue(tree, reflect.TypeOf(wrap), "", &probs)
	if err := decodeStrict(tree, &wrap); err != nil {
		probs = append(probs, &ConfigError{Msg: plainJSON(err), read: true})
	}
	if len(probs) > 0 {
		return nil, src.Locate(errors.Join(probs...))
	}
	list := wrap.Replicas
	if len(list) == 0 {
		return nil, errors.New("no replicas listed (an empty file is refused: the previous list is kept)")
	}
	errs := validateReplicas("replicas", list)
	for i, r := range list {
		if r.KVEvents != "" || r.KVEventsReplay != "" {
			errs = append(errs, keyErr(indexKey("replicas", i), "kv_events and kv_events_replay come from the config file only; "+
				"replicas from a replicas file reach precise mode through kv_events_listen"))
		}
	}
	return list, src.Locate(errors.Join(errs...))
}
