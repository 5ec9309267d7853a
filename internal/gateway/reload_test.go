package gateway

import (
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/prompt"
	"github.com/kvgate/kvgate/internal/router"
)

func TestReloadConfigAppliesLimitsAndParamsAndIgnoresTheRest(t *testing.T) {
	a := newFakeReplica(t)
	cfg := baseConfig(a.srv.URL)
	cfg.Policy = "sglang"
	cfg.MaxConcurrency = 4
	tg := startGateway(t, cfg)
	g := tg.g
	oldPolicy := g.rt.Policy()

	next := cfg
	next.Retries = 5
	next.FirstByteTimeout = Duration(3 * time.Second)
	next.PolicyParams = map[string]any{"cache_threshold": 0.3}
	next.EjectAfter = 1
	next.MaxConcurrency = 8
	next.Listen = "127.0.0.1:9999"
	next.Tokenizer = "remote"
	applied, ignored, err := g.ReloadConfig(next)
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"retries", "first_byte_timeout", "policy_params", "eject_after", "max_concurrency"} {
		if !slices.Contains(applied, k) {
			t.Errorf("%s not applied (applied %v)", k, applied)
		}
	}
	if !slices.Equal(ignored, []string{"listen", "tokenizer"}) {
		t.Errorf("ignored %v, want listen and tokenizer", ignored)
	}
	if c := g.conf(); c.Retries != 5 || c.FirstByteTimeout.D() != 3*time.Second || g.cfg.Listen != cfg.Listen || g.cfg.Tokenizer != "approx" {
		t.Fatalf("live settings %+v, listen %s, tokenizer %s", c, g.cfg.Listen, g.cfg.Tokenizer)
	}
	if g.rt.Policy() == oldPolicy || cap(g.live.lim.Load().slots) != 8 {
		t.Fatal("the policy or the limiter was not replaced")
	}
	// eject_after 1: one failure opens the breaker.
	tk, err := g.rt.Route(g.rt.Prepare(&prompt.Parsed{Kind: prompt.Completion, Model: "m", Text: "x", Prompts: 1}, "", ""))
	if err != nil || tk.Replica != 0 || !tk.Allow() {
		t.Fatalf("routed %v, %v: want replica 0, its breaker closed", tk, err)
	}
	tk.Done(g.clock.Now(), router.Outcome{CachedTokens: -1, Health: router.HealthFailed})
	if g.fleet.State(0) != "open" {
		t.Fatalf("breaker %s after one failure with eject_after 1", g.fleet.State(0))
	}

	// A bad parameter changes nothing.
	bad := next
	bad.Retries = 1
	bad.PolicyParams = map[string]any{"no_such_param": 1}
	if _, _, err := g.ReloadConfig(bad); err == nil {
		t.Fatal("an unknown policy parameter was taken")
	}
	invalid := next
	invalid.MaxQueue = -1
	if _, _, err := g.ReloadConfig(invalid); err == nil {
		t.Fatal("an invalid config was taken")
	}
	if g.conf().Retries != 5 {
		t.Fatalf("a refused reload changed retries to %d", g.conf().Retries)
	}
}

// Reloadability is a type: every field of Reloadable changes live on a
// reload (applied, and conf reads the new value at once), every other
// top-level key, changed, is reported ignored until a restart and changes
// nothing, and the two sets partition Config's keys. A key added to Config
// is classified by where it is declared; one whose kind the generic change
// below does not cover needs an entry in alt.
func TestReloadableKeysPartitionConfig(t *testing.T) {
	cfg := baseConfig("http://127.0.0.1:1")
	cfg.Replicas[0].DataParallelSize = 1 // nothing dialled
	cfg.Policy = "sglang"
	g, err := New(cfg, Options{})
	if err != nil {
		t.Fatal(err)
	}
	// Changes the generic rule (by kind) cannot make valid.
	alt := map[string]func(c *Config){
		"listen": func(c *Config) { c.Listen = "127.0.0.1:9999" },
		"replicas": func(c *Config) {
			c.Replicas = append(slices.Clone(c.Replicas), ReplicaConfig{URL: "http://127.0.0.1:2"})
		},
		"replicas_file": func(c *Config) { c.Replicas, c.ReplicasFile = nil, "replicas.yaml" },
		"discovery":     func(c *Config) { c.Replicas, c.Discovery = nil, &DiscoveryConfig{DNS: "replicas.test:8000"} },
		"pools": func(c *Config) {
			c.Pools, c.Replicas = []PoolConfig{{Name: "p", Models: []string{"*"}, Replicas: c.Replicas}}, nil
		},
		"policy":           func(c *Config) { c.Policy = "round_robin" },
		"policy_params":    func(c *Config) { c.PolicyParams = map[string]any{"cache_threshold": 0.3} },
		"tokenizer":        func(c *Config) { c.Tokenizer = "remote" },
		"kv_events_listen": func(c *Config) { c.Tokenizer, c.KVEventsListen = "remote", "tcp://127.0.0.1:5557" },
		"kv_events_trust":  func(c *Config) { c.KVEventsTrust = TrustList{"any"} },
		"profile":          func(c *Config) { c.Profile = "llama3-70b-h100-tp2" },
		"record":           func(c *Config) { c.Record.Path = "trace.jsonl" },
		"programs":         func(c *Config) { c.Programs.IdleTTL = Duration(time.Second) },
		"kv_pulls":         func(c *Config) { c.KVPulls.Enabled = true },
		"shared_state":     func(c *Config) { c.SharedState = "redis://127.0.0.1:6379/0" },
		"api_keys":         func(c *Config) { c.APIKeys = []string{"key"} },
		"passthrough":      func(c *Config) { c.Passthrough = []string{"/v1/load_lora_adapter"} },
		"epp":              func(c *Config) { c.EPP.Fallbacks = 2 },
		"flow_control":     func(c *Config) { c.FlowControl.QueueMs = 75 },
		"tenants":          func(c *Config) { c.Tenants = []TenantConfig{{Name: "t", APIKeys: []string{"k"}}} },
	}
	keys := jsonKeys(reflect.TypeFor[Config]())
	if len(keys) != len(slices.Compact(slices.Sorted(slices.Values(keys)))) {
		t.Fatalf("a key twice among Config's: %v", keys)
	}
	reloadable := reloadableKeys()
	for _, k := range reloadable {
		if !slices.Contains(keys, k) {
			t.Errorf("reloadable key %s is no key of Config", k)
		}
	}
	if want := slices.Sorted(slices.Values(append(slices.Clone(reloadable), "pools"))); !slices.Equal(ReloadableKeys(), want) {
		t.Errorf("ReloadableKeys() %v, want %v", ReloadableKeys(), want)
	}
	for _, key := range keys {
		t.Run(key, func(t *testing.T) {
			next := cfg
			if f, ok := alt[key]; ok {
				f(&next)
			} else if !changeByKind(configField(&next, key)) {
				t.Fatalf("key %s: give alt a valid change of it", key)
			}
			applied, ignored, err := g.ReloadConfig(next)
			if err != nil {
				t.Fatalf("key %s: %v (give alt a valid change of it)", key, err)
			}
			if !slices.Contains(reloadable, key) {
				if len(applied) != 0 || !slices.Contains(ignored, key) {
					t.Fatalf("fixed key %s: applied %v, ignored %v", key, applied, ignored)
				}
				return
			}
			live := reflect.ValueOf(g.conf()).Elem().FieldByName(configFieldName(key))
			if !slices.Equal(applied, []string{key}) || len(ignored) != 0 || !reflect.DeepEqual(live.Interface(), configField(&next, key).Interface()) {
				t.Fatalf("reloadable key %s: applied %v, ignored %v, live %v", key, applied, ignored, live)
			}
			if applied, _, err := g.ReloadConfig(cfg); err != nil || !slices.Equal(applied, []string{key}) {
				t.Fatalf("key %s set back: applied %v: %v", key, applied, err)
			}
		})
	}
}

// configFieldName is the name of the field of Config (or of its embedded
// Reloadable) whose JSON name is key.
func configFieldName(key string) string {
	for _, t := range []reflect.Type{reflect.TypeFor[Config](), reflect.TypeFor[Reloadable]()} {
		for f := range t.Fields() {
			if name, _, _ := strings.Cut(f.Tag.Get("json"), ","); name == key {
				return f.Name
			}
		}
	}
	return ""
}

// configField is c's field whose JSON name is key.
func configField(c *Config, key string) reflect.Value {
	return reflect.ValueOf(c).Elem().FieldByName(configFieldName(key))
}

// changeByKind changes a scalar setting to another valid value: booleans
// flipped, counts one more, durations a second longer, fractions halved.
func changeByKind(v reflect.Value) bool {
	switch v.Kind() {
	case reflect.Bool:
		v.SetBool(!v.Bool())
	case reflect.Int, reflect.Int64:
		if v.Type() == reflect.TypeFor[Duration]() {
			v.SetInt(v.Int() + int64(time.Second))
		} else {
			v.SetInt(v.Int() + 1)
		}
	case reflect.Uint64:
		v.SetUint(v.Uint() + 1)
	case reflect.Float64:
		v.SetFloat(v.Float() / 2)
	case reflect.String:
		v.SetString(v.String() + "x")
	default:
		return false
	}
	return true
}
