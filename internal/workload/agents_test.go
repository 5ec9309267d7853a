package workload

import (
	"strings"
	"testing"
	"time"
)

// An agent program: its turns extend one another (but across a
// compaction), wait for the turn before (or its subagent), pause as tool
// calls do; its subagent is a program of its own session, and the parent's
// next turn waits for the subagent's last.
func TestAgentsPrograms(t *testing.T) {
	reqs, err := Generate(Spec{Name: "agents", Seed: 5, Params: map[string]float64{"programs": 40, "compact_at": 20000, "system_prompt_len": 1000}})
	if err != nil {
		t.Fatal(err)
	}
	lastRoot, roots, subs, compactions := time.Duration(-1), 0, map[int]bool{}, 0
	var pauses []time.Duration
	for i := range reqs {
		r := &reqs[i]
		if !r.Timed || !r.Chat || r.Program < 1 || r.Session == "" {
			t.Fatalf("request %d: %+v", i, r)
		}
		if r.Prev < 0 {
			roots++
			if r.At < lastRoot || strings.HasSuffix(r.Session, ".sub") {
				t.Fatalf("request %d: a program's start at %v after %v (%s)", i, r.At, lastRoot, r.Session)
			}
			lastRoot = r.At
			continue
		}
		if r.At != 0 {
			t.Fatalf("request %d waits for %d yet has an arrival %v", i, r.Prev, r.At)
		}
		p := &reqs[r.Prev]
		switch {
		case p.Session == r.Session && strings.HasPrefix(r.Text(), p.Text()):
			pauses = append(pauses, r.Think)
		case p.Session == r.Session:
			compactions++ // started over from the system prompt and the task
			if r.Messages[0] != p.Messages[0] || r.Messages[1] != p.Messages[1] || r.InputTokens > p.InputTokens {
				t.Fatalf("request %d: neither the next turn nor a compaction of %d", i, r.Prev)
			}
		case strings.HasSuffix(r.Session, ".sub"):
			if r.Session != p.Session+".sub" || r.Program != p.Program || r.Think != 0 {
				t.Fatalf("request %d: a subagent's start %q after %q", i, r.Session, p.Session)
			}
			subs[r.Program] = true
		default: // the parent's turn after its subagent's last
			if p.Session != r.Session+".sub" || !subs[r.Program] {
				t.Fatalf("request %d (%s) waits for %d (%s)", i, r.Session, r.Prev, p.Session)
			}
		}
	}
	if roots != 40 || len(subs) < 10 || len(subs) > 30 || compactions == 0 {
		t.Fatalf("%d programs, %d with a subagent, %d compactions", roots, len(subs), compactions)
	}
	within := func(d time.Duration) float64 {
		n := 0
		for _, p := range pauses {
			if p <= d {
				n++
			}
		}
		return float64(n) / float64(len(pauses))
	}
	if s1, s10 := within(time.Second), within(10*time.Second); s1 < 0.82 || s1 > 0.9 || s10 < 0.93 || s10 > 0.97 {
		t.Fatalf("pauses within 1 s: %.3f, 10 s: %.3f (vllm-router #285: 0.86, 0.95)", s1, s10)
	}
	cut, err := Generate(Spec{Name: "agents", Seed: 5, Requests: 123})
	if err != nil || len(cut) != 123 {
		t.Fatalf("requests=123: %d %v", len(cut), err)
	}
}

// RL batches: each prompt's samples are identical and adjacent; batches
// are numbered; every request is released with its batch.
func TestRLBatches(t *testing.T) {
	reqs, err := Generate(Spec{Name: "rl", Seed: 2, Params: map[string]float64{"batches": 3, "prompts": 5, "samples": 4}})
	if err != nil || len(reqs) != 60 {
		t.Fatalf("%d requests, %v", len(reqs), err)
	}
	for i := range reqs {
		r := &reqs[i]
		if r.Batch != i/20+1 || r.Prev != -1 || !r.Timed || r.At != 0 || r.Program != 0 {
			t.Fatalf("request %d: %+v", i, r)
		}
		same := reqs[i-i%4].Text() == r.Text()
		if !same || i%4 == 0 && i > 0 && reqs[i-1].Text() == r.Text() {
			t.Fatalf("request %d: samples of one prompt are identical and adjacent", i)
		}
	}
}
