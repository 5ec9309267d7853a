package gateway

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"iter"
	"net/url"
	"strings"
	"time"

	"github.com/kvgate/kvgate/internal/costmodel"
	"github.com/kvgate/kvgate/internal/discovery"
	"github.com/kvgate/kvgate/internal/kvevents/kvzmq"
	"github.com/kvgate/kvgate/internal/policy"
	"github.com/kvgate/kvgate/internal/router"
	"github.com/kvgate/kvgate/internal/sharedstate"
)

// Duration is a time.Duration written as "250ms", "10s" in configuration.
type Duration time.Duration

func (d Duration) MarshalJSON() ([]byte, error) { return json.Marshal(time.Duration(d).String()) }

// UnmarshalJSON reads "250ms", "10s", "2m" (time.ParseDuration); a bare
// number is refused, naming the units it could mean, but 0, which means
// the same in every unit; null leaves the value as it is (encoding/json's
// rule).
func (d *Duration) UnmarshalJSON(b []byte) error {
	b = bytes.TrimSpace(b)
	if string(b) == "null" {
		return nil
	}
	var s string
	if err := json.Unmarshal(b, &s); err != nil {
		var n json.Number
		switch {
		case json.Unmarshal(b, &n) != nil:
			return errors.New(`want a duration such as "250ms", "10s" or "2m"`)
		case n.String() == "0":
			*d = 0
			return nil
		}
		return fmt.Errorf("%s has no unit: write %sms or %ss", n, n, n)
	}
	v, err := time.ParseDuration(s)
	if err != nil {
		return fmt.Errorf("%q is not a duration: write it like 250ms, 10s or 2m", s)
	}
	if v < 0 {
		return fmt.Errorf("duration %q is negative", s)
	}
	*d = Duration(v)
	return nil
}

// D is the time.Duration.
func (d Duration) D() time.Duration { return time.Duration(d) }

// ReplicaConfig is one upstream replica (the config's replicas: entries,
// a replicas file's, and what discovery finds): one type with
// internal/discovery, whose sources produce it.
type ReplicaConfig = discovery.Replica

// Config is the gateway's configuration (YAML file and flags).
type Config struct {
	// Reloadable are the settings a reload (SIGHUP) changes while the
	// gateway runs (config_reload.go); their keys are top-level keys of
	// the file, as every other field's. The rest is fixed at start.
	Reloadable

	Listen   string          `json:"listen"`
	Replicas []ReplicaConfig `json:"replicas"`
	// ReplicasFile is a YAML file holding the replicas: list (the same
	// entries as replicas:), watched while the gateway runs (control_sources.go).
	ReplicasFile string `json:"replicas_file,omitempty"`
	// Discovery finds the replicas by DNS or from Kubernetes EndpointSlices.
	Discovery *DiscoveryConfig `json:"discovery,omitempty"`
	// ForgetAfter: a replica a source removed is forgotten this long after
	// its removal, once drained: its router slot goes to the next replica
	// added, and its state (prefix index rows, policy state, probes,
	// metric series) is freed. Listed again before, it comes back with its
	// state (discovery_forget.go).
	ForgetAfter Duration `json:"forget_after"`
	// Pools route each model to its own replicas with its own policy
	// (pools.go); then replicas: is empty and each pool lists its own.
	Pools  []PoolConfig `json:"pools,omitempty"`
	Policy string       `json:"policy"`
	Seed   uint64       `json:"seed"`
	// Tokenizer: "approx" (default) or "remote" (the replica's POST /tokenize).
	Tokenizer string `json:"tokenizer"`
	BlockSize int    `json:"block_size"`
	// KVEventsListen binds one SUB socket (tcp://HOST:PORT) that replicas
	// connect their KV-event publishers to (vLLM with a host in its
	// --kv-events-config endpoint, llm-d's topology); the topic
	// kv@HOST:PORT@MODEL names the replica. Precise mode.
	KVEventsListen string `json:"kv_events_listen,omitempty"`
	// The KV-event socket's trust and bounds (control_kvlisten.go).
	//
	// KVEventsTrust says who may publish on kv_events_listen:
	// replica_address (the default: a publisher speaks only for the
	// replicas whose host, an IP or a name resolved to it, is its source
	// address), CIDRs (publishers from those networks speak for any
	// replica, e.g. behind NAT), both, or any (no check).
	KVEventsTrust TrustList `json:"kv_events_trust"`
	// KVEventsMaxFrameBytes caps one frame of a KV-event batch, on every
	// socket (listening, subscribed, replay): a peer announcing a larger
	// one is disconnected before anything is allocated for it.
	KVEventsMaxFrameBytes int `json:"kv_events_max_frame_bytes"`
	// KVEventsMaxConnections and KVEventsMaxConnectionsPerAddress cap the
	// listening socket's connections, in all and per source address.
	KVEventsMaxConnections           int `json:"kv_events_max_connections"`
	KVEventsMaxConnectionsPerAddress int `json:"kv_events_max_connections_per_address"`
	// KVEventsIdleTimeout closes a listened connection silent this long
	// (vLLM sends no heartbeat; an idle engine reconnects at once);
	// KVEventsHandshakeTimeout bounds its ZMTP handshake.
	KVEventsIdleTimeout      Duration `json:"kv_events_idle_timeout"`
	KVEventsHandshakeTimeout Duration `json:"kv_events_handshake_timeout"`
	// NonCachedTokens (prefill/decode fleets): when the decode replica
	// chosen lacks fewer than this many tokens of the prompt, the prefill
	// step is skipped and the decode replica computes the rest itself
	// (llm-d's prefix-based-pd-decider threshold; default 16 as in llm-d's
	// P/D guide; 0 never skips: every request is disaggregated).
	NonCachedTokens int `json:"non_cached_tokens"`
	// PassKVTransferParams passes a client's own kv_transfer_params to the
	// replica on an aggregated fleet, for a trusted prefill/decode proxy in
	// front of kvgate that routes each of its steps through it. Off by
	// default: a client's could point a replica's KV connector at any host.
	// Never on a prefill/decode fleet or with a peer pull, where kvgate
	// writes them.
	PassKVTransferParams bool `json:"pass_kv_transfer_params"`
	// Profile is the replicas' latency profile, for the ttft estimate.
	Profile        string `json:"profile"`
	MaxBatchTokens int    `json:"max_batch_tokens"`

	ScrapeInterval Duration `json:"scrape_interval"`
	HealthInterval Duration `json:"health_interval"`

	// ScrapeStaleAfter: a replica's metrics older than this are not used
	// for routing (the gateway's own counts decide), and it is logged.
	ScrapeStaleAfter Duration `json:"scrape_stale_after"`

	ConnectTimeout Duration `json:"connect_timeout"`
	// DrainTimeout is how long in-flight requests may run after SIGTERM
	// before they are cut (with an SSE error event).
	DrainTimeout Duration `json:"drain_timeout"`
	MaxBodyBytes int64    `json:"max_body_bytes"`
	// MaxBodyMemory bounds the bytes of request bodies held at once.
	MaxBodyMemory int64 `json:"max_body_memory"`
	// MaxStreamLineBytes bounds one line of a replica's SSE stream.
	MaxStreamLineBytes int `json:"max_stream_line_bytes"`
	// GCHeapFloor is the heap, in bytes, below which the Go collector does
	// not run (gcfloor.go: GOGC's pacing with a floor; 0: GOGC alone).
	GCHeapFloor int64 `json:"gc_heap_floor"`
	// MaxConnections caps client connections (0: half the process's
	// file-descriptor limit, so upstream connections always have room).
	MaxConnections int `json:"max_connections"`
	// ReadHeaderTimeout and BodyReadTimeout cut slow clients (slowloris).
	ReadHeaderTimeout Duration `json:"read_header_timeout"`
	BodyReadTimeout   Duration `json:"body_read_timeout"`
	// A request body's read deadline grows with its bytes (bodyread.go):
	// BodyRateGrace, plus a second per MinBodyRate bytes received (0: off),
	// never past BodyReadTimeout; a body slower than that is cut (408).
	// MaxBodyMemoryShare is the fraction of max_body_memory one client
	// address may hold (at least one body of max_body_bytes).
	MinBodyRate        int64    `json:"min_body_rate"`
	BodyRateGrace      Duration `json:"body_rate_grace"`
	MaxBodyMemoryShare float64  `json:"max_body_memory_share"`

	// OffloadBlocks is each replica's host (CPU) KV tier in blocks (vLLM's
	// OffloadingConnector), the size of the approximate index of the host
	// tiers; 0: none assumed (precise mode learns the tiers from events of
	// medium CPU all the same).
	OffloadBlocks int `json:"offload_blocks"`
	// KVPulls lets a decision pull a prefix from a peer (kvpulls.go).
	KVPulls KVPullsConfig `json:"kv_pulls"`

	// IndexMaxEntries caps the prefix index ((block, replica) entries).
	IndexMaxEntries int `json:"index_max_entries"`
	// BlocksPerReplica is each replica's index capacity until its
	// cache_config_info is scraped.
	BlocksPerReplica int `json:"blocks_per_replica"`

	// Record writes a trace of the traffic served (kvgate serve --record):
	// block hashes and lengths, never text. See RecordConfig.
	Record RecordConfig `json:"record"`

	// Programs bounds and tunes the program table (agents' sessions,
	// conversations, rollouts: program.go), fixed at start.
	Programs ProgramsConfig `json:"programs"`

	// SharedState (redis://HOST:PORT/DB) shares this gateway's routing
	// decisions and loads with the other gateways in front of the same
	// replicas, through Redis (internal/sharedstate); never on a request's
	// path. SharedStateNamespace prefixes its keys (one per fleet).
	SharedState          string `json:"shared_state,omitempty"`
	SharedStateNamespace string `json:"shared_state_namespace,omitempty"`
	// StateFile: the approximate index is written there at shutdown and
	// read at start, a warm restart without Redis.
	StateFile string `json:"state_file,omitempty"`

	// AdminToken enables /debug/* and /admin/*, behind "Authorization: Bearer".
	AdminToken string `json:"admin_token,omitempty"`
	// APIKeys, when set, are the only bearer tokens clients may use
	// (with tenants: keys of no tenant; config_tenants.go).
	APIKeys []string `json:"api_keys,omitempty"`
	// Tenants and FlowControl: several tenants on one fleet (config_tenants.go).
	Tenants     []TenantConfig    `json:"tenants,omitempty"`
	FlowControl FlowControlConfig `json:"flow_control"`
	// Passthrough opts replica paths in beyond the default allow-list
	// (passthroughPaths: vLLM's inference and read-only endpoints): exact
	// paths such as /v1/load_lora_adapter, open to every client the
	// gateway admits, with the replica's api_key attached.
	Passthrough []string `json:"passthrough,omitempty"`
	// AccessLog logs one line per request at info (accesslog.go): never
	// the prompt, the answer or a key.
	AccessLog bool `json:"access_log,omitempty"`
	// Tracing turns OpenTelemetry tracing on (tracing.go; also
	// OTEL_TRACES_EXPORTER=otlp), exported as the OTEL_* variables say.
	Tracing bool `json:"tracing,omitempty"`
	// RouteReceipts adds the X-Kvgate-Route receipt to every answer
	// relayed (receipt.go); the access log and spans carry it always.
	RouteReceipts bool `json:"route_receipts,omitempty"`
	// TTFTObjective is the TTFT the pools' saturation gauge is measured
	// against, and SaturationWindow the time constant of the load it
	// weighs (config_epp.go).
	TTFTObjective    Duration `json:"ttft_objective"`
	SaturationWindow Duration `json:"saturation_window"`
	// EPP configures kvgate epp, the endpoint picker (config_epp.go).
	EPP EPPConfig `json:"epp"`
}

// Defaults returns the configuration with every default set.
func Defaults() Config {
	return Config{
		Reloadable: DefaultReloadable(),

		Listen:             "127.0.0.1:8080",
		Policy:             policy.Default,
		Seed:               1,
		Tokenizer:          "approx",
		BlockSize:          16,
		NonCachedTokens:    router.DefaultNonCachedTokens,
		Profile:            costmodel.Default,
		MaxBatchTokens:     8192,
		ScrapeInterval:     Duration(250 * time.Millisecond),
		HealthInterval:     Duration(time.Second),
		ScrapeStaleAfter:   Duration(2 * time.Second),
		ForgetAfter:        Duration(router.DefaultForgetAfter),
		ConnectTimeout:     Duration(5 * time.Second),
		DrainTimeout:       Duration(30 * time.Second),
		MaxBodyBytes:       8 << 20,
		MaxBodyMemory:      256 << 20,
		MaxStreamLineBytes: 1 << 20,
		GCHeapFloor:        64 << 20,
		ReadHeaderTimeout:  Duration(10 * time.Second),
		BodyReadTimeout:    Duration(30 * time.Second),
		MinBodyRate:        1024,
		BodyRateGrace:      Duration(5 * time.Second),
		MaxBodyMemoryShare: 0.25,
		IndexMaxEntries:    4 << 20,
		BlocksPerReplica:   30000,
		KVPulls:            KVPullsConfig{Param: DefaultKVPullParam},
		Record:             DefaultRecord(),
		FlowControl:        DefaultFlowControl(),
		Programs:           DefaultPrograms(),

		// The KV-event socket's trust and bounds.
		KVEventsTrust:                    TrustList{kvzmq.TrustReplicaAddress},
		KVEventsMaxFrameBytes:            kvzmq.DefaultMaxFrameBytes,
		KVEventsMaxConnections:           1024,
		KVEventsMaxConnectionsPerAddress: kvzmq.DefaultMaxConnectionsPerAddress,
		KVEventsIdleTimeout:              Duration(kvzmq.DefaultIdleTimeout),
		KVEventsHandshakeTimeout:         Duration(5 * time.Second),

		TTFTObjective:    Duration(2 * time.Second),
		SaturationWindow: Duration(5 * time.Second),
		EPP:              DefaultEPP(),
	}
}

// LoadConfig reads a YAML (or JSON) file over the defaults. Unknown keys
// are errors: every problem of the file is returned, each with its line
// (ReadConfig). The file is read as a replicas file is (a regular file,
// size capped, with a timeout): SIGHUP reads it again while the gateway
// runs.
func LoadConfig(path string) (Config, error) {
	cfg, src, err := ReadConfig(path)
	if err != nil {
		return Config{}, src.Locate(err)
	}
	return cfg, nil
}

// ParseConfig parses YAML over the defaults, strictly: every problem, each
// with its line.
func ParseConfig(data []byte) (Config, error) {
	cfg, lines, err := readConfig(data)
	if err != nil {
		return Config{}, (&ConfigSource{lines: lines}).Locate(err)
	}
	return cfg, nil
}

// ReplicaLists are the per-replica flags beside --replicas: comma lists
// in the replicas' order, and one data-parallel size for all.
type ReplicaLists struct {
	// Prefill are the prefill replicas' URLs (--prefill-replicas): given,
	// the replicas of --replicas are decode replicas, and these follow them
	// in the list (and in --kv-events and --kv-events-replay) with role
	// prefill.
	Prefill                  string
	KVEvents, KVEventsReplay string
	DataParallelSize         int
}

// ParseReplicaList builds the replica list of the flags.
func ParseReplicaList(urls string, l ReplicaLists) ([]ReplicaConfig, error) {
	out := splitURLs(urls, "", l.DataParallelSize)
	if strings.TrimSpace(l.Prefill) != "" {
		if len(out) == 0 {
			return nil, errors.New("--prefill-replicas needs --replicas: the decode replicas, which stream the answers")
		}
		for i := range out {
			out[i].Role = policy.RoleDecode.String()
		}
		out = append(out, splitURLs(l.Prefill, policy.RolePrefill.String(), l.DataParallelSize)...)
	}
	for _, list := range []struct {
		flag, eps string
		set       func(r *ReplicaConfig, ep string)
	}{
		{"--kv-events", l.KVEvents, func(r *ReplicaConfig, ep string) { r.KVEvents = ep }},
		{"--kv-events-replay", l.KVEventsReplay, func(r *ReplicaConfig, ep string) { r.KVEventsReplay = ep }},
	} {
		if list.eps == "" {
			continue
		}
		eps := strings.Split(list.eps, ",")
		if len(eps) != len(out) {
			return nil, fmt.Errorf("%s has %d endpoints for %d replicas: give one per replica, in order", list.flag, len(eps), len(out))
		}
		for i, e := range eps {
			list.set(&out[i], strings.TrimSpace(e))
		}
	}
	return out, nil
}

// splitURLs is a comma list of replica URLs, each of role.
func splitURLs(urls, role string, dp int) []ReplicaConfig {
	var out []ReplicaConfig
	for _, u := range strings.Split(urls, ",") {
		if u = strings.TrimSpace(u); u != "" {
			out = append(out, ReplicaConfig{URL: u, DataParallelSize: dp, Role: role})
		}
	}
	return out
}

// Validate checks the configuration and names every problem, each with
// the key it is about (ConfigError) where one key is.
func (c *Config) Validate() error {
	var errs []error
	if len(c.Pools) > 0 {
		errs = c.validatePools() // each pool's source, and the top-level one feeding a pool
	} else {
		errs = c.validateSources()
	}
	errs = append(errs, validateReplicas("replicas", c.Replicas)...)
	if c.KVEventsListen != "" && !strings.HasPrefix(c.KVEventsListen, "tcp://") {
		errs = append(errs, keyErr("kv_events_listen", "%q is not a tcp://HOST:PORT endpoint", c.KVEventsListen))
	}
	if c.Tokenizer != "approx" && c.Tokenizer != "remote" {
		errs = append(errs, keyErr("tokenizer", "%q: want approx or remote", c.Tokenizer))
	}
	if _, err := costmodel.Lookup(c.Profile); err != nil {
		errs = append(errs, keyErr("profile", "%s", strings.TrimPrefix(err.Error(), "costmodel: ")))
	}
	errs = append(errs, c.validateBounds()...)
	errs = append(append(errs, c.validatePrecise()...), c.validateLimits()...)
	errs = append(errs, c.validateKVEvents()...)
	errs = append(errs, c.validateBodies()...)
	errs = append(errs, c.Record.validate()...)
	errs = append(errs, c.Programs.validate()...)
	errs = append(errs, validatePassthrough(c.Passthrough)...)
	errs = append(errs, c.validateNoSelf()...)
	errs = append(errs, c.validateEPP()...)
	errs = append(errs, c.validateTenants()...)
	if c.SharedState != "" {
		if _, err := sharedstate.ParseURL(c.SharedState); err != nil {
			errs = append(errs, keyErr("shared_state", "%v", err))
		}
	}
	return errors.Join(errs...)
}

// validateBounds checks the numbers that must be positive (or ≥ 0), one
// key at a time.
func (c *Config) validateBounds() []error {
	var errs []error
	for _, b := range []struct {
		key  string
		bad  bool
		want string
	}{
		{"block_size", c.BlockSize <= 0, "must be positive"},
		{"max_batch_tokens", c.MaxBatchTokens <= 0, "must be positive"},
		{"eject_after", c.EjectAfter <= 0, "must be positive"},
		{"max_body_bytes", c.MaxBodyBytes <= 0, "must be positive"},
		{"retries", c.Retries < 0, "must be ≥ 0"},
		{"max_stream_line_bytes", c.MaxStreamLineBytes < 4096, "must be at least 4096"},
		{"gc_heap_floor", c.GCHeapFloor < 0 || c.GCHeapFloor > maxGCHeapFloor, "must be between 0 (off) and 1 TiB"},
		{"max_connections", c.MaxConnections < 0, "must be ≥ 0 (0: half the open-file limit)"},
		{"queue_timeout", c.QueueTimeout <= 0, "must be positive"},
		{"tokenize_timeout", c.TokenizeTimeout <= 0, "must be positive"},
		{"max_concurrency", c.MaxConcurrency < 0, "must be ≥ 0 (0: no bound)"},
		{"max_queue", c.MaxQueue < 0, "must be ≥ 0"},
		{"forget_after", c.ForgetAfter <= 0, "must be positive (a removed replica is forgotten that long after its removal)"},
		{"read_header_timeout", c.ReadHeaderTimeout <= 0, "must be positive"},
		{"body_read_timeout", c.BodyReadTimeout <= 0, "must be positive"},
		{"index_max_entries", c.IndexMaxEntries < 0, "must be ≥ 0"},
		{"blocks_per_replica", c.BlocksPerReplica < 0, "must be ≥ 0"},
		{"scrape_interval", c.ScrapeInterval <= 0, "must be positive"},
		{"health_interval", c.HealthInterval <= 0, "must be positive"},
	} {
		if b.bad {
			errs = append(errs, keyErr(b.key, "%s", b.want))
		}
	}
	if c.MaxBodyMemory < c.MaxBodyBytes {
		errs = append(errs, keyErr("max_body_memory", "%d must be at least max_body_bytes (%d)", c.MaxBodyMemory, c.MaxBodyBytes))
	}
	return errs
}

// validateReplicas checks a replica list (where names it in messages):
// http(s) URLs listed once, KV-event endpoints, data-parallel sizes and
// roles; a prefill/decode list needs a replica that can decode.
func validateReplicas(where string, list []ReplicaConfig) []error {
	var errs []error
	seen := map[string]bool{}
	for i, r := range list {
		at := indexKey(where, i)
		if err := checkReplicaURL(r.URL); err != "" {
			errs = append(errs, keyErr(at+".url", "%s", err))
		}
		if seen[r.URL] {
			errs = append(errs, keyErr(at+".url", "%q is listed twice", r.URL))
		}
		seen[r.URL] = true
		if r.KVEvents != "" && !strings.HasPrefix(r.KVEvents, "tcp://") && !strings.HasPrefix(r.KVEvents, "ipc://") {
			errs = append(errs, keyErr(at+".kv_events", "%q is not a tcp:// or ipc:// endpoint", r.KVEvents))
		}
		if r.KVEventsReplay != "" && !strings.HasPrefix(r.KVEventsReplay, "tcp://") && !strings.HasPrefix(r.KVEventsReplay, "ipc://") {
			errs = append(errs, keyErr(at+".kv_events_replay", "%q is not a tcp:// or ipc:// endpoint", r.KVEventsReplay))
		}
		if r.DataParallelSize < 0 || r.DataParallelSize > maxDataParallel {
			errs = append(errs, keyErr(at+".data_parallel_size", "%d: want 0 (count at start) to %d", r.DataParallelSize, maxDataParallel))
		}
	}
	return append(errs, validateRoles(where, list)...)
}

// checkReplicaURL is what is wrong with a replica's URL ("" when nothing).
//
// A URL ending in /v1 (an OpenAI client's base URL, the habit) is refused
// rather than rewritten: kvgate appends /v1/completions, /health and
// /metrics to the server's base URL, so that with /v1 every health check
// would fail and the replica sit out of rotation; and the URL as written is
// the replica's name everywhere (X-Kvgate-Replica, metric labels, logs,
// /debug/route, the peers' shared state), which a silent rewrite would make
// differ from the configuration.
func checkReplicaURL(s string) string {
	u, err := url.Parse(s)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return fmt.Sprintf("%q is not an http(s) URL", s)
	}
	if strings.HasSuffix(strings.TrimRight(u.Path, "/"), "/v1") {
		return fmt.Sprintf("%q ends with /v1: give the server's base URL without it (%s://%s%s): kvgate adds "+
			"/v1/completions, /health and /metrics itself", s, u.Scheme, u.Host, strings.TrimSuffix(strings.TrimRight(u.Path, "/"), "/v1"))
	}
	return ""
}

// validateRoles checks the replicas' roles: spelled right, and a
// prefill/decode fleet with a replica that can decode (stream answers).
func validateRoles(where string, list []ReplicaConfig) []error {
	var errs []error
	disagg, decodes := false, 0
	for i, r := range list {
		role, err := policy.ParseRole(r.Role)
		if err != nil {
			errs = append(errs, keyErr(indexKey(where, i)+".role", "%s", strings.TrimPrefix(err.Error(), "role ")))
			continue
		}
		disagg = disagg || role != policy.RoleBoth
		if role.Decodes() {
			decodes++
		}
	}
	if disagg && decodes == 0 && len(errs) == 0 {
		errs = append(errs, keyErr(where, "a prefill/decode fleet needs at least one replica of role decode or both "+
			"(--replicas with --prefill-replicas): prefill replicas only compute prompts, they never stream answers"))
	}
	return errs
}

// validateLimits checks the routing thresholds.
func (c *Config) validateLimits() []error {
	var errs []error
	if err := c.KVPulls.validate(); err != nil {
		errs = append(errs, err)
	}
	if c.OffloadBlocks < 0 || c.OffloadBlocks >= 1<<31-1 {
		errs = append(errs, fmt.Errorf("offload_blocks %d: want 0 (none) to %d", c.OffloadBlocks, 1<<31-2))
	}
	if c.NonCachedTokens < 0 {
		errs = append(errs, keyErr("non_cached_tokens", "%d: want ≥ 0 (0: never skip the prefill step)", c.NonCachedTokens))
	}
	return errs
}

// TrustList is kv_events_trust: a list, or one entry as a string
// ("any", "replica_address", "10.0.0.0/8").
type TrustList []string

func (t *TrustList) UnmarshalJSON(b []byte) error {
	var one string
	if json.Unmarshal(b, &one) == nil {
		*t = TrustList{one}
		return nil
	}
	var list []string
	if err := json.Unmarshal(b, &list); err != nil {
		return errors.New("kv_events_trust: want replica_address, any, a CIDR, or a list of them")
	}
	*t = list
	return nil
}

// Bounds of the KV-event socket's settings.
const (
	minKVFrameBytes = 64 << 10
	maxKVFrameBytes = 1 << 30
	maxKVConns      = 1 << 16
)

// validateKVEvents checks the KV-event socket's trust and bounds.
func (c *Config) validateKVEvents() []error {
	var errs []error
	if _, err := kvzmq.ParseTrust(c.KVEventsTrust); err != nil {
		errs = append(errs, keyErr("kv_events_trust", "%v", err))
	}
	if c.KVEventsMaxFrameBytes < minKVFrameBytes || c.KVEventsMaxFrameBytes > maxKVFrameBytes {
		errs = append(errs, keyErr("kv_events_max_frame_bytes", "%d: want %d (64 KiB) to %d (1 GiB); vLLM's batches are "+
			"under 100 KiB at its default max_num_batched_tokens", c.KVEventsMaxFrameBytes, minKVFrameBytes, maxKVFrameBytes))
	}
	if c.KVEventsMaxConnections < 1 || c.KVEventsMaxConnections > maxKVConns ||
		c.KVEventsMaxConnectionsPerAddress < 1 || c.KVEventsMaxConnectionsPerAddress > c.KVEventsMaxConnections {
		errs = append(errs, keyErr("kv_events_max_connections", "%d, and kv_events_max_connections_per_address %d: "+
			"want 1 ≤ per address ≤ in all ≤ %d", c.KVEventsMaxConnections, c.KVEventsMaxConnectionsPerAddress, maxKVConns))
	}
	if c.KVEventsIdleTimeout.D() < time.Second {
		errs = append(errs, keyErr("kv_events_idle_timeout", "must be at least 1s"))
	}
	if c.KVEventsHandshakeTimeout <= 0 || c.KVEventsHandshakeTimeout.D() > time.Minute {
		errs = append(errs, keyErr("kv_events_handshake_timeout", "want above 0 to 1m"))
	}
	return errs
}

// maxDataParallel bounds a server's data-parallel ranks (targets).
const maxDataParallel = 1024

func (c *Config) validatePrecise() []error {
	if !c.Precise() {
		return nil
	}
	var errs []error
	if c.Tokenizer == "approx" {
		errs = append(errs, keyErr("tokenizer", "precise mode (kv_events, kv_events_listen) matches the token ids the replicas' "+
			"KV events carry, which the approximate tokenizer never reproduces: set tokenizer: remote (--tokenizer remote, "+
			"the replicas' own /tokenize)"))
	}
	if c.KVEventsListen != "" {
		return errs
	}
	for key, r := range c.replicaKeys() {
		if r.KVEvents == "" {
			errs = append(errs, keyErr(key+".kv_events", "precise mode needs kv_events for every replica (or kv_events_listen)"))
		}
	}
	return errs
}

// replicaKeys is every replica the config lists (allReplicas) with its key
// path: replicas[i], pools[p].replicas[i].
func (c *Config) replicaKeys() iter.Seq2[string, ReplicaConfig] {
	return func(yield func(string, ReplicaConfig) bool) {
		for i, r := range c.Replicas {
			if !yield(indexKey("replicas", i), r) {
				return
			}
		}
		for p, pool := range c.Pools {
			for i, r := range pool.Replicas {
				if !yield(indexKey(indexKey("pools", p)+".replicas", i), r) {
					return
				}
			}
		}
	}
}

// Precise reports whether KV events feed the index.
func (c *Config) Precise() bool {
	if c.KVEventsListen != "" {
		return true
	}
	for _, r := range c.allReplicas() {
		if r.KVEvents != "" {
			return true
		}
	}
	return false
}
