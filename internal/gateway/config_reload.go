package gateway

import (
	"reflect"
	"slices"
	"strings"
	"sync"
	"time"
)

// What a configuration reload (SIGHUP) may change is a type: Reloadable.
// Config embeds it, so its keys are top-level keys of the file like any
// other; the gateway holds the values of the moment behind one atomic
// pointer, which the request path reads through one accessor
// (Gateway.conf); the list of reloadable keys is derived from the type
// (reloadableKeys), so a field added to Reloadable is reloadable, and one
// added to Config is fixed and logged as ignored until a restart. A pool's
// entry is reloadable in the keys it shares with Reloadable (its
// policy_params, when nothing else of pools: changed). The gateway keeps
// the configuration given at start as a startConfig, whose reloadable
// settings the compiler refuses to read.

// Reloadable are the settings a reload changes at once: what the request
// path reads per request (timeouts, retries, the concurrency limit), the
// breaker's thresholds and the policy's parameters.
type Reloadable struct {
	// PolicyParams are the policy's parameters; a change rebuilds the
	// policy (its learnt state starts over; the index is kept).
	PolicyParams map[string]any `json:"policy_params,omitempty"`
	// EjectAfter consecutive failures take a replica out for EjectCooldown.
	EjectAfter    int      `json:"eject_after"`
	EjectCooldown Duration `json:"eject_cooldown"`
	// Retries is how many other replicas a request may try when one refused
	// it before any work (connection refused, 503, 429).
	Retries         int      `json:"retries"`
	RetryBackoff    Duration `json:"retry_backoff"`
	RetryBackoffMax Duration `json:"retry_backoff_max"`
	// FirstByteTimeout bounds the wait for a streamed answer's header (vLLM
	// sends it on admission), and a prefill step's whole answer on a
	// prefill/decode fleet; non-streamed answers are never cut by it.
	FirstByteTimeout Duration `json:"first_byte_timeout"`
	// StreamIdleTimeout bounds the silence between two events of a stream
	// (and between the header and the first event).
	StreamIdleTimeout Duration `json:"stream_idle_timeout"`
	// WriteTimeout bounds each write to a client: one that stops reading
	// loses its request, and its slot is freed.
	WriteTimeout   Duration `json:"write_timeout"`
	RequestTimeout Duration `json:"request_timeout"`
	// TokenizeTimeout bounds a remote /tokenize call; past it the
	// approximate tokenizer routes the request.
	TokenizeTimeout Duration `json:"tokenize_timeout"`
	// MaxConcurrency bounds the requests proxied at once (0: no bound);
	// MaxQueue more may wait up to QueueTimeout (full queue: 429; timeout: 503).
	MaxConcurrency int      `json:"max_concurrency"`
	MaxQueue       int      `json:"max_queue"`
	QueueTimeout   Duration `json:"queue_timeout"`
}

// DefaultReloadable returns the reloadable settings' defaults.
func DefaultReloadable() Reloadable {
	return Reloadable{
		EjectAfter:        3,
		EjectCooldown:     Duration(10 * time.Second),
		Retries:           2,
		RetryBackoff:      Duration(25 * time.Millisecond),
		RetryBackoffMax:   Duration(time.Second),
		FirstByteTimeout:  Duration(30 * time.Second),
		StreamIdleTimeout: Duration(2 * time.Minute),
		WriteTimeout:      Duration(30 * time.Second),
		RequestTimeout:    Duration(10 * time.Minute),
		TokenizeTimeout:   Duration(500 * time.Millisecond),
		MaxQueue:          1024,
		QueueTimeout:      Duration(30 * time.Second),
	}
}

// startConfig is the configuration given at start, as the gateway keeps
// it: its reloadable settings are out of reach, since both Config and
// hidden promote Reloadable's fields at the same depth, which makes a
// selector such as cfg.Retries ambiguous, a compile error. They are read
// through Gateway.conf (the values of the moment); the rest of Config, as
// given, through the embedded Config.
type startConfig struct {
	Config
	hidden `json:"-"` // never encoded: only Config is
}

// hidden shadows Config's Reloadable in startConfig.
type hidden struct{ Reloadable }

// ReloadableKeys are the top-level configuration keys a reload applies at
// once, sorted: Reloadable's fields' JSON names, and pools (its entries'
// reloadable keys).
func ReloadableKeys() []string {
	return slices.Sorted(slices.Values(append(reloadableKeys(), "pools")))
}

// reloadableKeys are Reloadable's fields' JSON names, derived once.
var reloadableKeys = sync.OnceValue(func() []string { return jsonKeys(reflect.TypeFor[Reloadable]()) })

// jsonKeys are the JSON names of a struct type's fields, as encoding/json
// writes them (jsonFields).
func jsonKeys(t reflect.Type) []string {
	var out []string
	for _, f := range jsonFields(t) {
		out = append(out, f.name)
	}
	return out
}

// poolReloadable are the indexes of PoolConfig's fields whose JSON names
// are reloadable keys (its policy_params), derived once.
var poolReloadable = sync.OnceValue(func() []int {
	var out []int
	for f := range reflect.TypeFor[PoolConfig]().Fields() {
		name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
		if slices.Contains(reloadableKeys(), name) {
			out = append(out, f.Index[0])
		}
	}
	return out
})

// withReloadable is cur with next's reloadable settings, and with next's
// pools' reloadable keys when the pools are otherwise the same (names,
// models, policies, replicas, in order): any other change of pools: waits
// for a restart.
func withReloadable(cur, next Config) Config {
	out := cur
	out.Reloadable = next.Reloadable
	out.Pools = withPoolReloadable(cur.Pools, next.Pools)
	return out
}

// withPoolReloadable is cur with next's reloadable keys, when the pools
// differ in nothing else.
func withPoolReloadable(cur, next []PoolConfig) []PoolConfig {
	if len(cur) != len(next) {
		return cur
	}
	out := slices.Clone(cur)
	for i := range out {
		a, b := cur[i], next[i]
		va, vb := reflect.ValueOf(&a).Elem(), reflect.ValueOf(&b).Elem()
		for _, k := range poolReloadable() {
			va.Field(k).SetZero()
			vb.Field(k).SetZero()
		}
		if !reflect.DeepEqual(a, b) {
			return cur
		}
		vo, vn := reflect.ValueOf(&out[i]).Elem(), reflect.ValueOf(&next[i]).Elem()
		for _, k := range poolReloadable() {
			vo.Field(k).Set(vn.Field(k))
		}
	}
	return out
}
