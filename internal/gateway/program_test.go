package gateway

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/router"
)

// A program is named by prompt_cache_key, else X-Session-Id, else
// X-Dynamo-Session-Id: under the session policy (consistent hashing of the
// program id) every turn of one program goes to one replica, whatever its
// prompt and whatever session header a turn also sends.
func TestProgramIdentityHonoured(t *testing.T) {
	reps := []*fakeReplica{newFakeReplica(t), newFakeReplica(t), newFakeReplica(t)}
	cfg := baseConfig(reps[0].srv.URL, reps[1].srv.URL, reps[2].srv.URL)
	cfg.Policy, cfg.AdminToken = "session", "s3cret"
	gw := startGateway(t, cfg)
	allListed(t, gw)
	cases := []struct {
		name   string
		body   func(i int) string
		header func(i int) []string
	}{
		{"prompt_cache_key, whatever X-Session-Id says",
			func(i int) string {
				return fmt.Sprintf(`{"model":"m","prompt":"turn %d of the task","prompt_cache_key":"agent-7"}`, i)
			},
			func(i int) []string { return []string{"X-Session-Id", fmt.Sprintf("other-%d", i)} }},
		{"X-Session-Id",
			func(i int) string { return fmt.Sprintf(`{"model":"m","prompt":"step %d"}`, i) },
			func(int) []string { return []string{"X-Session-Id", "conv-3"} }},
		{"X-Dynamo-Session-Id",
			func(i int) string { return fmt.Sprintf(`{"model":"m","prompt":"call %d"}`, i) },
			func(int) []string { return []string{"X-Dynamo-Session-Id", "run-42:researcher"} }},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			seen := map[string]int{}
			for i := range 12 {
				resp, body := post(t, gw.srv.URL+"/v1/completions", c.body(i), c.header(i)...)
				if resp.StatusCode != 200 {
					t.Fatalf("%d %s", resp.StatusCode, body)
				}
				seen[resp.Header.Get("X-Kvgate-Replica")]++
			}
			if len(seen) != 1 {
				t.Fatalf("one program spread over %d replicas: %v", len(seen), seen)
			}
			resp, body := post(t, gw.srv.URL+"/debug/route", c.body(99), append(c.header(99), "Authorization", "Bearer s3cret")...)
			var out struct {
				Program *struct {
					ID        string `json:"id"`
					Continues bool   `json:"continues"`
					Home      string `json:"home"`
					Turns     int    `json:"turns"`
				} `json:"program"`
			}
			if resp.StatusCode != 200 || json.Unmarshal([]byte(body), &out) != nil || out.Program == nil {
				t.Fatalf("/debug/route names no program: %d %s", resp.StatusCode, body)
			}
			if p := out.Program; !p.Continues || p.Turns != 12 || seen[p.Home] != 12 {
				t.Fatalf("/debug/route: %+v, want the home of 12 turns", *p)
			}
		})
	}
}

// A Responses chain without a program id of its own is one program, named
// after its first response: each call's previous_response_id leads back
// to it. So too under Claude Code's session header, which its subagents
// share: a call continuing a chain re-sends only its new input, not the
// conversation's start the header is scoped by (router.ProgramOf), so the
// chain names its program. Before, each such call, its input its own, was
// a program of its own.
func TestProgramOfAResponsesChain(t *testing.T) {
	for _, c := range []struct {
		name string
		hdr  []string
		want int // programs: the chain's, and the first call's own
	}{
		{"no program id", nil, 1},
		{"X-Claude-Code-Session-Id", []string{"X-Claude-Code-Session-Id", "cc-1"}, 2},
	} {
		t.Run(c.name, func(t *testing.T) {
			a, b := newAPIReplica(t, "a", "m", ""), newAPIReplica(t, "b", "m", "")
			gw := apiGateway(t, a, b)
			prev := ""
			for k := range 4 {
				body := fmt.Sprintf(`{"model":"m","input":"turn %d"}`, k)
				if prev != "" {
					body = fmt.Sprintf(`{"model":"m","input":"turn %d","previous_response_id":%q}`, k, prev)
				}
				resp, out := post(t, gw.srv.URL+"/v1/responses", body, c.hdr...)
				var r struct {
					ID string `json:"id"`
				}
				if resp.StatusCode != 200 || json.Unmarshal([]byte(out), &r) != nil || r.ID == "" {
					t.Fatalf("turn %d: %d %s", k, resp.StatusCode, out)
				}
				prev = r.ID
			}
			// The three calls after the first are one program.
			if st := gw.g.rt.ProgramStats(); st.Tracked != c.want {
				t.Fatalf("a chain of 4 calls made %d programs, want %d", st.Tracked, c.want)
			}
			waitIdle(t, gw)
		})
	}
}

// A program stays on its home until the home is saturated (its engine
// reports a queue of thousands): then its next turn moves, /debug/route
// says why (the estimates at the home and where it goes, the move priced
// in), and the router counts the move.
func TestSaturatedProgramMoves(t *testing.T) {
	reps := []*fakeReplica{newFakeReplica(t), newFakeReplica(t), newFakeReplica(t)}
	cfg := baseConfig(reps[0].srv.URL, reps[1].srv.URL, reps[2].srv.URL)
	cfg.Policy, cfg.AdminToken = "ttft", "s3cret"
	gw := startGateway(t, cfg)
	allListed(t, gw)
	task := strings.Repeat("read the file, run the tests, fix the bug; ", 200) // about 2,000 tokens
	turn := func(i int) string {
		return fmt.Sprintf(`{"model":"m","prompt":%q,"max_tokens":16,"prompt_cache_key":"agent-9"}`, task+strings.Repeat("tool result. ", 20*i))
	}
	home := ""
	for i := range 3 {
		resp, body := post(t, gw.srv.URL+"/v1/completions", turn(i))
		if resp.StatusCode != 200 {
			t.Fatalf("%d %s", resp.StatusCode, body)
		}
		if got := resp.Header.Get("X-Kvgate-Replica"); home == "" {
			home = got
		} else if got != home {
			t.Fatalf("turn %d went to %s, its home is %s", i, got, home)
		}
	}
	for _, r := range reps {
		if r.srv.URL == home {
			r.waiting.Store(5000)
		}
	}
	type route struct {
		Decision struct {
			Reason string `json:"reason"`
		} `json:"decision"`
		ReplicaURL string `json:"replica_url"`
		Program    struct {
			Home string `json:"home"`
		} `json:"program"`
		Replicas []struct {
			URL     string `json:"url"`
			Waiting *int   `json:"waiting"`
			Unseen  *int   `json:"waiting_unseen"`
		} `json:"replicas"`
	}
	var out route
	eventually(t, "the home's queue scraped", func() bool {
		out = route{}
		resp, body := post(t, gw.srv.URL+"/debug/route", turn(3), "Authorization", "Bearer s3cret")
		if resp.StatusCode != 200 || json.Unmarshal([]byte(body), &out) != nil {
			t.Fatalf("/debug/route: %d %s", resp.StatusCode, body)
		}
		for _, r := range out.Replicas {
			if r.URL == home {
				// Another client's queue: none of it this gateway's.
				return r.Waiting != nil && *r.Waiting == 5000 && r.Unseen != nil && *r.Unseen == 5000
			}
		}
		return false
	})
	if out.Program.Home != home || out.ReplicaURL == home || !strings.Contains(out.Decision.Reason, "program moved off its home "+home) {
		t.Fatalf("/debug/route for a saturated home %s: to %s, program home %s, reason %q", home, out.ReplicaURL, out.Program.Home, out.Decision.Reason)
	}
	t.Logf("reason: %s", out.Decision.Reason)
	resp, body := post(t, gw.srv.URL+"/v1/completions", turn(3))
	if resp.StatusCode != 200 || resp.Header.Get("X-Kvgate-Replica") == home {
		t.Fatalf("the turn stayed on its saturated home: %d %s %s", resp.StatusCode, resp.Header.Get("X-Kvgate-Replica"), body)
	}
	if st := gw.g.rt.ProgramStats(); st.Moves != 1 {
		t.Fatalf("program stats %+v, want 1 move", st)
	}
}

// programs: is read from the file over the router's defaults, each value
// bounded at validation with its key, and reaches the router.
func TestProgramsConfig(t *testing.T) {
	cfg, err := ParseConfig([]byte("replicas: [{url: 'http://127.0.0.1:1'}]\nprograms: {idle_ttl: 5s, max_programs: 3, burst_window: 0s}\n"))
	if err != nil {
		t.Fatal(err)
	}
	got := cfg.Programs.RouterConfig()
	if got.IdleTTL != 5*time.Second || got.MaxPrograms != 3 || got.BurstWindow >= 0 || got.BurstCap != router.DefaultBurstCap ||
		got.KVShare != router.DefaultProgramKVShare || got.AdmissionWait != router.DefaultProgramAdmissionWait {
		t.Fatalf("programs %+v", got)
	}
	for _, c := range []struct {
		key string
		set func(*ProgramsConfig)
	}{
		{"programs.idle_ttl", func(p *ProgramsConfig) { p.IdleTTL = 0 }},
		{"programs.idle_ttl", func(p *ProgramsConfig) { p.IdleTTL = Duration(2 * time.Hour) }},
		{"programs.max_programs", func(p *ProgramsConfig) { p.MaxPrograms = 0 }},
		{"programs.max_programs", func(p *ProgramsConfig) { p.MaxPrograms = maxProgramsCap + 1 }},
		{"programs.kv_share", func(p *ProgramsConfig) { p.KVShare = 0 }},
		{"programs.kv_share", func(p *ProgramsConfig) { p.KVShare = 1.5 }},
		{"programs.admission_wait", func(p *ProgramsConfig) { p.AdmissionWait = -1 }},
		{"programs.burst_window", func(p *ProgramsConfig) { p.BurstWindow = -1 }},
		{"programs.burst_cap", func(p *ProgramsConfig) { p.BurstCap = -1 }},
	} {
		t.Run(c.key, func(t *testing.T) {
			cfg := baseConfig("http://127.0.0.1:1")
			c.set(&cfg.Programs)
			if err := cfg.Validate(); err == nil || !strings.Contains(err.Error(), c.key) {
				t.Fatalf("err %v, want %s", err, c.key)
			}
		})
	}
	run := baseConfig(newFakeReplica(t).srv.URL)
	run.Programs = cfg.Programs
	g := startGateway(t, run)
	for i := range 5 {
		resp, body := post(t, g.srv.URL+"/v1/completions", fmt.Sprintf(`{"model":"m","prompt":"x","prompt_cache_key":"p%d"}`, i))
		if resp.StatusCode != 200 {
			t.Fatalf("%d %s", resp.StatusCode, body)
		}
	}
	if st := g.g.rt.ProgramStats(); st.Tracked != 3 {
		t.Fatalf("max_programs 3: %+v", st)
	}
}
