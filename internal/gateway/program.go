package gateway

import (
	"fmt"
	"net/http"
	"strconv"
	"time"

	"github.com/kvgate/kvgate/internal/policy"
	"github.com/kvgate/kvgate/internal/prompt"
	"github.com/kvgate/kvgate/internal/router"
)

// Program identity (router.ProgramOf): a request's program is named, in
// order, by its body's prompt_cache_key (OpenAI's client-side cache key;
// a Messages call's metadata.user_id session, prompt/messages.go), by a
// session header, or by its Responses chain (the first response of
// the chain its previous_response_id continues; passthrough_responses.go).
//
// The session headers, in order:
//   - X-Session-Id: kvgate's own since the session policy (and OpenCode's,
//     which Dynamo maps to its session id);
//   - X-Dynamo-Session-Id: NVIDIA Dynamo's canonical agent session header
//     (Dynamo 1.5+, docs "Session IDs": one id per reasoning/tool chain; its
//     X-Dynamo-Parent-Session-Id names a subagent's parent, which kvgate
//     does not need: a subagent is a program of its own);
//   - X-Claude-Code-Session-Id: Claude Code's, on every request it sends
//     (the session its metadata.user_id names too; its subagents' requests
//     carry their parent's, so that the router scopes it by each
//     conversation's start: router.ProgramOf, prompt.Parsed.SessionShared).
//
// llm-d's session affinity is not a program id: its x-session-token header
// (inference scheduler ≤ v0.2) and its llm-d-session cookie (later) carry
// the base64 name of the pod the previous request went to, the same for
// every session on that pod; kvgate does not read them.
var programHeaders = [...]string{"X-Session-Id", "X-Dynamo-Session-Id", claudeCodeSession}

const claudeCodeSession = "X-Claude-Code-Session-Id"

// programSession is the program id a request's headers name ("" for
// none). Claude Code's is a session its subagents share: p.SessionShared
// (router.ProgramOf scopes it), unless the body named the program. A
// Responses call continuing a chain re-sends only its new input, not the
// conversation's start the scope needs: its chain names its program
// (passthrough.choose), as it does without a header.
func programSession(h http.Header, p *prompt.Parsed) string {
	for _, name := range programHeaders {
		v := h.Get(name)
		if v == "" {
			continue
		}
		if name == claudeCodeSession && p.PromptCacheKey == "" {
			if p.PreviousResponseID != "" {
				return "" // its chain names it
			}
			p.SessionShared = true
		}
		return v
	}
	return ""
}

// tenantProgram scopes req's program id (and its session, the body's user
// without a program) to tenant t: tenants that do not isolate their
// caches share a partition, where the router's program ids (hashed with
// model, adapter and cache_salt) would meet, so that one tenant's session
// header or prompt_cache_key could continue another's program (its home,
// context, KV reservation and turn priority) and a recording would merge
// their sessions. The tenant's name goes in front, its length first, so
// that no name and id can spell another's. Nothing without a tenant.
func tenantProgram(req *policy.Request, t *tenant) {
	name := t.label()
	if name == "" || req.Session == "" {
		return
	}
	scoped := strconv.Itoa(len(name)) + ":" + name + ":" + req.Session
	if req.Program.ID == 0 {
		req.Session = scoped
		return
	}
	router.SetProgram(req, scoped)
}

// programDebug is req's program as /debug/route shows it: its hash (not
// the client's id), and, once the router knows it, its home and context.
func (g *Gateway) programDebug(req *policy.Request) map[string]any {
	p := req.Program
	out := map[string]any{"id": strconv.FormatUint(p.ID, 16), "continues": p.Continues, "turns": p.Turns}
	if p.Continues {
		out["home"], out["context_tokens"] = g.rt.URL(p.Home), p.Tokens
	}
	return out
}

// ProgramsConfig is the program table's configuration (the programs: key;
// router.ProgramConfig, whose defaults it takes). Fixed at start.
//
// Memory: a program costs about 150 bytes whatever its context (its 64-bit
// id's hash, home, context size, turns, last activity, list links, map
// slot), so max_programs bounds the table: 65,536 programs, about 10 MB.
type ProgramsConfig struct {
	// IdleTTL: a program with nothing in flight for this long releases
	// its KV reservation on its replica (its home is remembered for
	// affinity until the cap forgets it).
	IdleTTL Duration `json:"idle_ttl"`
	// MaxPrograms caps the programs remembered; past it the longest idle
	// one is forgotten (another gateway's never evicts a live one).
	MaxPrograms int `json:"max_programs"`
	// KVAdmission: a new program goes only where the live programs leave
	// it room (router.ProgramConfig.KVAdmission; on by default), once
	// programs are long: AdmissionMinContext, the tokens the contexts of
	// programs gone idle average (0: hold whatever the contexts).
	KVAdmission         bool `json:"kv_admission"`
	AdmissionMinContext int  `json:"admission_min_context"`
	// KVShare: the share of a replica's KV cache the live programs homed
	// there may reserve before a new program is placed elsewhere.
	KVShare float64 `json:"kv_share"`
	// AdmissionWait: how long a new program waits for KV room before it
	// is placed anyway.
	AdmissionWait Duration `json:"admission_wait"`
	// BurstWindow: requests with an identical prompt within this long of
	// the first go to its replica (0: off); BurstCap: how many of one
	// burst a replica takes (0: no cap).
	BurstWindow Duration `json:"burst_window"`
	BurstCap    int      `json:"burst_cap"`
}

// The bounds of programs:'s values.
const (
	maxProgramsCap        = 1 << 22 // 4M programs, about 600 MB
	maxProgramIdleTTL     = time.Hour
	maxAdmissionWait      = time.Minute
	maxBurstWindow        = 10 * time.Second
	maxBurstCapPerReplica = 1 << 20
	maxAdmissionContext   = 1 << 24 // tokens, as a program record's context
)

// DefaultPrograms is the router's defaults.
func DefaultPrograms() ProgramsConfig {
	return ProgramsConfig{IdleTTL: Duration(router.DefaultProgramIdleTTL), MaxPrograms: router.DefaultMaxPrograms,
		KVAdmission: true, AdmissionMinContext: router.DefaultAdmissionMinContext, KVShare: router.DefaultProgramKVShare, AdmissionWait: Duration(router.DefaultProgramAdmissionWait),
		BurstWindow: Duration(router.DefaultBurstWindow), BurstCap: router.DefaultBurstCap}
}

func (c *ProgramsConfig) validate() []error {
	var errs []error
	for _, b := range []struct {
		key  string
		bad  bool
		want string
	}{
		{"programs.idle_ttl", c.IdleTTL <= 0 || c.IdleTTL.D() > maxProgramIdleTTL, fmt.Sprintf("want > 0 and ≤ %v", maxProgramIdleTTL)},
		{"programs.max_programs", c.MaxPrograms < 1 || c.MaxPrograms > maxProgramsCap, fmt.Sprintf("want 1 to %d", maxProgramsCap)},
		{"programs.kv_share", !(c.KVShare > 0 && c.KVShare <= 1), "want a share in (0, 1]"},
		{"programs.admission_wait", c.AdmissionWait <= 0 || c.AdmissionWait.D() > maxAdmissionWait, fmt.Sprintf("want > 0 and ≤ %v", maxAdmissionWait)},
		{"programs.burst_window", c.BurstWindow < 0 || c.BurstWindow.D() > maxBurstWindow, fmt.Sprintf("want 0 (off) to %v", maxBurstWindow)},
		{"programs.admission_min_context", c.AdmissionMinContext < 0 || c.AdmissionMinContext > maxAdmissionContext, fmt.Sprintf("want 0 (hold whatever the contexts) to %d tokens", maxAdmissionContext)},
		{"programs.burst_cap", c.BurstCap < 0 || c.BurstCap > maxBurstCapPerReplica, fmt.Sprintf("want 0 (no cap) to %d", maxBurstCapPerReplica)},
	} {
		if b.bad {
			errs = append(errs, keyErr(b.key, "%s", b.want))
		}
	}
	return errs
}

// RouterConfig is the router's ProgramConfig (its "off" values negative).
func (c *ProgramsConfig) RouterConfig() router.ProgramConfig {
	pc := router.ProgramConfig{IdleTTL: c.IdleTTL.D(), MaxPrograms: c.MaxPrograms, KVAdmission: c.KVAdmission, KVShare: c.KVShare,
		AdmissionWait: c.AdmissionWait.D(), BurstWindow: c.BurstWindow.D(), BurstCap: c.BurstCap}
	pc.AdmissionMinContext = c.AdmissionMinContext
	if pc.AdmissionMinContext == 0 {
		pc.AdmissionMinContext = -1
	}
	if pc.BurstWindow == 0 {
		pc.BurstWindow = -1
	}
	if pc.BurstCap == 0 {
		pc.BurstCap = -1
	}
	return pc
}
