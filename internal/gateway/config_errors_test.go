package gateway

import (
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"pgregory.net/rapid"
)

// readAndValidate is what kvgate serve does with a file: every problem of
// its reading and of Validate, located.
func readAndValidate(t *testing.T, yaml string) []string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "kvgate.yaml")
	if err := os.WriteFile(path, []byte(yaml), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg, src, err := ReadConfig(path)
	if src == nil {
		t.Fatal(err)
	}
	var out []string
	for _, p := range ConfigProblems(src.Locate(errors.Join(err, cfg.Validate()))) {
		out = append(out, strings.TrimSpace(strings.TrimPrefix(p.Error(), path+":")))
	}
	return out
}

// Every problem of a file at once, in the file's order, each with its
// line and key path; a near miss with the key it likely meant; a value
// of the wrong type left at its default, so that it costs one problem,
// not one more from Validate.
func TestConfigEveryProblemWithItsLine(t *testing.T) {
	for _, tc := range []struct {
		name, yaml string
		want       []string
	}{
		{"three mistakes", `listen: 127.0.0.1:8080
scrape_intervall: 250ms
health_interval: 250
replicas:
  - url: http://10.0.0.1:8000
  - url: htp://10.0.0.2:8000
`, []string{
			"2: scrape_intervall: unknown key (did you mean scrape_interval?)",
			"3: health_interval: 250 has no unit: write 250ms or 250s",
			`6: replicas[1].url: "htp://10.0.0.2:8000" is not an http(s) URL`,
		}},
		{"nested keys in pools", `pools:
  - name: llama
    models: [llama]
    replicas:
      - url: http://10.0.0.1:8000
        rol: decode
  - name: qwen
    models: ["Qwen/*"]
    replicas:
      - {url: "http://10.0.0.2:8000", data_parallel_size: two}
      - url: "10.0.0.3:8000"
`, []string{
			"6: pools[0].replicas[0].rol: unknown key (did you mean role?)",
			`10: pools[1].replicas[0].data_parallel_size: want a whole number, not the text "two"`,
			`11: pools[1].replicas[1].url: "10.0.0.3:8000" is not an http(s) URL`,
		}},
		{"types and flag spellings", `listen: 8080
retries: 1.5
first-byte-timeout: 2s
access_log: maybe
replicas: [{url: "http://10.0.0.1:8000"}]
`, []string{
			`1: listen: want text, not the number 8080: write it in quotes ("8080")`,
			"2: retries: want a whole number, not 1.5",
			"3: first-byte-timeout: unknown key (did you mean first_byte_timeout?)",
			`4: access_log: want true or false, not the text "maybe"`,
		}},
		{"a key written twice, a bad duration, a missing key under its parent", `retries: 1
eject_cooldown: soon
retries: 3
discovery:
  kubernetes: {selector: app=vllm, port: 8000}
`, []string{
			`2: eject_cooldown: "soon" is not a duration: write it like 250ms, 10s or 2m`,
			"3: retries: written twice (line 1 and here): the last one is used; keep one",
			"5: discovery.kubernetes.namespace: give the replicas' namespace",
		}},
		{"a list where a mapping is: one problem, not a second for no replicas", "replicas: http://10.0.0.1:8000\n", []string{
			`1: replicas: want a list ([a, b], or one "- item" a line), not the text "http://10.0.0.1:8000"`,
		}},
		{"not YAML: nothing else", "replicas: [\n  {url: x\n", []string{"2: not valid YAML: "}},
		{"not a mapping: nothing else", "- url: http://10.0.0.1:8000\n", []string{"want a mapping of keys (key: value, one a line), not a list"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := readAndValidate(t, tc.yaml)
			if len(got) != len(tc.want) {
				t.Fatalf("%d problems, want %d:\n%s", len(got), len(tc.want), strings.Join(got, "\n"))
			}
			for _, w := range tc.want {
				found := false
				for _, g := range got {
					found = found || strings.HasPrefix(g, w)
				}
				if !found {
					t.Errorf("no problem %q in:\n%s", w, strings.Join(got, "\n"))
				}
			}
		})
	}
}

// The replicas file's problems carry their lines too, all of them.
func TestReplicasFileEveryProblem(t *testing.T) {
	_, err := ParseReplicasFile([]byte("- url: http://10.0.0.1:8000\n  rol: decode\n- url: 8000\n- url: http://10.0.0.1:8000\n"))
	got := ConfigProblems(err)
	want := []string{"line 2: replicas[0].rol: unknown key (did you mean role?)",
		`line 3: replicas[1].url: want text, not the number 8000`}
	if len(got) != len(want) {
		t.Fatalf("%d problems, want %d: %v", len(got), len(want), err)
	}
	for i, w := range want {
		if !strings.HasPrefix(got[i].Error(), w) {
			t.Errorf("problem %d: %q, want %q", i, got[i], w)
		}
	}
}

// A one-edit typo of any known key (a letter changed, dropped, added, or
// two neighbours swapped) gets a suggestion: a known key one edit away.
func TestNearestKeyProperty(t *testing.T) {
	known := jsonKeys(reflect.TypeFor[Config]())
	rapid.Check(t, func(t *rapid.T) {
		key := rapid.SampledFrom(known).Draw(t, "key")
		i := rapid.IntRange(0, len(key)-1).Draw(t, "at")
		c := rapid.ByteRange('a', 'z').Draw(t, "letter")
		var typo string
		switch rapid.IntRange(0, 3).Draw(t, "edit") {
		case 0:
			typo = key[:i] + string(c) + key[i+1:]
		case 1:
			typo = key[:i] + key[i+1:]
		case 2:
			typo = key[:i] + string(c) + key[i:]
		default:
			if i == len(key)-1 {
				i--
			}
			typo = key[:i] + key[i+1:i+2] + key[i:i+1] + key[i+2:]
		}
		if typo == key {
			return
		}
		got := nearest(typo, known)
		if got == "" || editDistance(typo, got) > 1 {
			t.Fatalf("%q (a typo of %q): suggested %q", typo, key, got)
		}
	})
	if got := nearest("frobnicate", known); got != "" {
		t.Errorf("a key like none: suggested %q", got)
	}
}

// tenants: and flow_control: problems, each located at its key: a key
// of two tenants, a max_priority less urgent than the priority, a
// negative quota, a band twice (with a reserve, not sheddable), an unknown
// quota fallback, a negative count of gateways.
func TestTenantsConfigProblems(t *testing.T) {
	got := readAndValidate(t, `replicas: [{url: "http://10.0.0.1:8000"}]
api_keys: [k0]
tenants:
  - name: gold
    api_keys: [k1]
    priority: 1
    max_priority: 2
  - name: bulk
    api_keys: [k0]
    tokens_per_minute: -5
flow_control:
  bands:
    - {priority: 2, sheddable: true}
    - {priority: 2, reserve: 1}
  quota:
    fallback: open
    expected_gateways: -1
`)
	want := []string{
		"7: tenants[0].max_priority: 2 is less urgent than priority 1 (lower is more urgent): max_priority is the most urgent band its requests may ask for",
		"9: tenants[1].api_keys[0]: also a key of api_keys: a key names one tenant",
		"10: tenants[1].tokens_per_minute: -5: want 0 (none) to 1099511627776 per minute",
		"14: flow_control.bands[1].priority: priority 2 is configured twice",
		"14: flow_control.bands[1].reserve: 1: want 0 to 65536, on a sheddable band",
		`16: flow_control.quota.fallback: "open": want local_share, local_full or reject`,
		"17: flow_control.quota.expected_gateways: -1: want 0 to 1024",
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("problems:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}
