package main

import (
	"cmp"
	"errors"
	"fmt"
	"io"
	"net"
	"slices"
	"sort"
	"strconv"
	"strings"

	"github.com/kvgate/kvgate/internal/costmodel"
	"github.com/kvgate/kvgate/internal/discovery"
	"github.com/kvgate/kvgate/internal/gateway"
	"github.com/kvgate/kvgate/internal/policy"
)

// errBadConfig marks a configuration `kvgate serve` (and --check-config)
// rejected: exit status 2, as a usage error, so that a deploy script can
// tell a bad file from a gateway that failed while running.
var errBadConfig = errors.New("invalid configuration")

// configProblems is a rejected configuration's problems, printed one a
// line (errBadConfig).
type configProblems []error

func (p configProblems) Error() string {
	if len(p) == 1 {
		return "invalid configuration: " + p[0].Error()
	}
	var b strings.Builder
	fmt.Fprintf(&b, "invalid configuration, %d problems:", len(p))
	for _, e := range p {
		b.WriteString("\n  " + strings.ReplaceAll(e.Error(), "\n", "\n    "))
	}
	return b.String()
}

func (p configProblems) Is(target error) bool { return target == errBadConfig }

// checkConfig is what `kvgate serve` would reject at start, found without
// starting anything: no socket bound, no replica, Redis or file touched.
// It is gateway.Config.Validate, plus what gateway.New checks beyond it
// (the policy and its parameters), plus the listen address net.Listen
// would refuse. The Kubernetes manifests' test calls it on their ConfigMap.
func checkConfig(cfg gateway.Config) error {
	errs := []error{cfg.Validate()}
	if prof, err := costmodel.Lookup(cfg.Profile); err == nil { // else Validate named it
		// The options gateway.New builds the policy with, so that a
		// parameter it would refuse is refused here.
		_, err := policy.New(cfg.Policy, policy.Options{Seed: cfg.Seed, BlockSize: cfg.BlockSize, Profile: prof,
			MaxBatchTokens: cfg.MaxBatchTokens, Params: cfg.PolicyParams})
		if err != nil {
			key := "policy_params"
			if !slices.Contains(policy.Names(), cfg.Policy) {
				key = "policy"
			}
			errs = append(errs, &gateway.ConfigError{Key: key, Msg: strings.TrimPrefix(err.Error(), "policy: ")})
		}
	}
	errs = append(errs, checkListen(cfg.Listen), checkPoolFiles(cfg))
	if cfg.ReplicasFile != "" {
		if _, err := replicasFileList(cfg.ReplicasFile); err != nil {
			errs = append(errs, &gateway.ConfigError{Key: "replicas_file", Msg: err.Error()})
		}
	}
	return errors.Join(errs...)
}

// replicasFileList is the replicas file's list, read and checked as the
// gateway reads it at start (it refuses to start on a bad one).
func replicasFileList(path string) ([]gateway.ReplicaConfig, error) {
	return discovery.NewFile(path, 0, gateway.ParseReplicasFile, nil, nil).Load()
}

// checkListen checks a listen address's form (HOST:PORT, HOST may be empty
// for every interface) without resolving the host.
func checkListen(addr string) error {
	_, port, err := net.SplitHostPort(addr)
	if err != nil {
		return &gateway.ConfigError{Key: "listen", Msg: fmt.Sprintf("%q: want HOST:PORT (e.g. 0.0.0.0:8080 or :8080): %v", addr, err)}
	}
	if n, err := strconv.Atoi(port); err != nil || n < 0 || n > 65535 {
		return &gateway.ConfigError{Key: "listen", Msg: fmt.Sprintf("%q: port %q is not a number from 0 to 65535", addr, port)}
	}
	return nil
}

// reportCheck ends `kvgate serve --check-config`: loadErr is the loading's
// and checking's (serveFlags.config: every problem of the file, the flags
// and checkConfig); without one, the configuration's summary.
func reportCheck(w io.Writer, source string, cfg gateway.Config, loadErr error) error {
	switch {
	case errors.Is(loadErr, errBadConfig):
		return loadErr
	case loadErr != nil:
		return configProblems{loadErr} // a flag's mistake
	}
	fmt.Fprintf(w, "configuration valid (%s)\n", source)
	writeSummary(w, cfg)
	return nil
}

// writeSummary describes what a configuration serves, never its secrets.
func writeSummary(w io.Writer, cfg gateway.Config) {
	fmt.Fprintf(w, "  listen:    %s\n", cfg.Listen)
	fmt.Fprintf(w, "  policy:    %s%s\n", cfg.Policy, paramsText(cfg.PolicyParams))
	fmt.Fprintf(w, "  tokenizer: %s, block size %d, profile %s\n", cfg.Tokenizer, cfg.BlockSize, cfg.Profile)
	if len(cfg.Pools) > 0 {
		writePools(w, cfg) // each pool lists its replicas
		fmt.Fprintf(w, "  enabled:   %s\n", enabledText(cfg))
		fmt.Fprintf(w, "  SIGHUP:    %s\n", reloadText())
		return
	}
	fmt.Fprintf(w, "  replicas:  %s\n", replicaSummary(cfg))
	list := cfg.Replicas
	switch {
	case cfg.ReplicasFile != "":
		list, _ = replicasFileList(cfg.ReplicasFile) // checked by checkConfig
		fmt.Fprintf(w, "    now %s\n", fleetSummary(gateway.Config{Replicas: list}))
	case cfg.Discovery != nil:
		fmt.Fprintf(w, "    found while serving (--check-config contacts neither DNS nor the Kubernetes API)\n")
	}
	for _, r := range list {
		fmt.Fprintf(w, "    %s%s\n", r.URL, replicaText(r))
	}
	fmt.Fprintf(w, "  enabled:   %s\n", enabledText(cfg))
	fmt.Fprintf(w, "  SIGHUP:    %s\n", reloadText())
}

// kubernetesSummary says where Kubernetes discovery finds the replicas.
func kubernetesSummary(k *gateway.KubernetesConfig) string {
	if k.InferencePool == "" {
		return fmt.Sprintf("replicas of the EndpointSlices %s in namespace %s", k.Selector, k.Namespace)
	}
	group := cmp.Or(k.InferencePoolGroup, "inference.networking.k8s.io")
	return fmt.Sprintf("replicas of the InferencePool %s in namespace %s (%s): its selector's Ready pods, one replica per target port",
		k.InferencePool, k.Namespace, group)
}

// reloadText says what SIGHUP changes while serving (the keys derived
// from gateway.Reloadable).
func reloadText() string {
	return "re-reads the replicas files; applies " + strings.Join(gateway.ReloadableKeys(), ", ") +
		" (pools: their policy_params); any other key at a restart"
}

// paramsText is " (a=1, b=x)", sorted, or "" without parameters.
func paramsText(p map[string]any) string {
	if len(p) == 0 {
		return ""
	}
	kv := make([]string, 0, len(p))
	for k, v := range p {
		kv = append(kv, fmt.Sprintf("%s=%v", k, v))
	}
	sort.Strings(kv)
	return " (" + strings.Join(kv, ", ") + ")"
}

// replicaText is what a replica's line adds to its URL: role, ranks,
// KV-event endpoints, whether it has an API key (never the key).
func replicaText(r gateway.ReplicaConfig) string {
	role := r.Role
	if role == "" {
		role = policy.RoleBoth.String()
	}
	s := "  role " + role
	if r.DataParallelSize > 0 {
		s += fmt.Sprintf(", %d data-parallel ranks", r.DataParallelSize)
	}
	if r.KVEvents != "" {
		s += ", kv events " + r.KVEvents
	}
	if r.KVEventsReplay != "" {
		s += ", replay " + r.KVEventsReplay
	}
	if r.APIKey != "" {
		s += ", api key set"
	}
	return s
}

// enabledText lists the optional features a configuration turns on.
func enabledText(cfg gateway.Config) string {
	var on []string
	if cfg.Precise() {
		p := "precise mode (KV events"
		if cfg.KVEventsListen != "" {
			p += " bound at " + cfg.KVEventsListen
		}
		on = append(on, p+")")
		if cfg.KVEventsListen != "" {
			on = append(on, "KV-event publishers trusted: "+strings.Join(cfg.KVEventsTrust, ","))
		}
	}
	for _, o := range []struct {
		cond bool
		text string
	}{
		{cfg.AdminToken != "", "admin endpoints (/debug, /admin: token set)"},
		{len(cfg.APIKeys) > 0, fmt.Sprintf("client API keys (%d)", len(cfg.APIKeys))},
		{len(cfg.Tenants) > 0, fmt.Sprintf("tenants (%d) with flow control", len(cfg.Tenants))},
		{len(cfg.Tenants) == 0 && cfg.FlowControl.Enabled, "flow control"},
		{cfg.SharedState != "", "shared state " + redactURL(cfg.SharedState)},
		{cfg.StateFile != "", "state file " + cfg.StateFile},
		{cfg.Record.Path != "", "recording to " + cfg.Record.Path},
		{cfg.MaxConcurrency > 0, fmt.Sprintf("max_concurrency %d (queue %d)", cfg.MaxConcurrency, cfg.MaxQueue)},
		{cfg.AccessLog, "access log"},
	} {
		if o.cond {
			on = append(on, o.text)
		}
	}
	if len(on) == 0 {
		return "nothing optional"
	}
	return strings.Join(on, "; ")
}
