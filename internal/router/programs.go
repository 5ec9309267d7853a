package router

import (
	"strconv"
	"sync"
	"time"

	"github.com/kvgate/kvgate/internal/policy"
	"github.com/kvgate/kvgate/internal/prompt"
)

// Programs. An agent's session, a conversation or a rollout is a program:
// requests that follow one another over one growing context, separated by
// the client's pauses (tool calls). Its cost is the whole program's time,
// and its context is worth keeping on its replica across the pauses. The
// router keeps, per program it has seen, where its context lives (its home)
// and how large it is (its footprint), and per replica the contexts of the
// live programs homed there: those with a turn in flight, or idle less than
// ProgramConfig.IdleTTL.
//
// Policies read it (policy.Program on the request, Programs and
// ProgramTokens on each view): kvgate's ttft prices moving a program off its
// home (policy/ttft_programs.go). For a policy that places programs
// (policy.PlacesPrograms) the router also applies KV admission: a new
// program goes only where the live programs' contexts leave room for it,
// and waits (ProgramConfig.AdmissionWait at most) rather than evict the
// contexts of paused programs, which would then prefill again tens of
// thousands of tokens; and burst co-location (bursts.go).
//
// Memory: a program costs about 150 bytes (its entry, 88 bytes, and its map
// slot), so the default cap of 65,536 programs is about 10 MB. Only a 64-bit
// hash of the client's id is kept.

// ProgramConfig configures the program table; the zero value is the
// defaults.
type ProgramConfig struct {
	// IdleTTL: a program with nothing in flight for this long releases
	// its reservation on its replica (its home is still remembered for
	// affinity until the cap forgets it). Default 10 s: vllm-router #285
	// measured 95 % of an agent's next calls within 10 s of the answer; a
	// longer pause frees the room for new programs (agents replay with
	// admission: program makespan p90 at 1× 192.8 s with 10 s, 196.0 s with
	// 30 s, preble's 193.7 s; capacity 2.08× and 2.07×).
	IdleTTL time.Duration
	// MaxPrograms caps the programs tracked (default 65,536); past it the
	// longest idle one is forgotten.
	MaxPrograms int
	// KVAdmission turns on KV admission by program (programs_admit.go):
	// a new program goes only where the live programs' contexts leave it
	// room. It is program-level concurrency control: on the agents replay
	// (8 replicas, ttft) past 1.9× speed-up the live programs' contexts
	// outgrow the fleet's KV, paused contexts are evicted before their next
	// turns (hit rate 88 % → 17 % at the peak) and each re-prefill evicts
	// the next; holding new programs keeps the live ones within the KV
	// (p90 TTFT ≤ 2 s up to 1.9× off, up to 2.05× on; capacity search
	// 1.92× off, 2.07× on; at 2.0× program makespan p50/p90 146/259 s
	// against 222/374 s off and preble's 170/313 s), at the price of the
	// held programs' first turns (p99 TTFT 10 s). The
	// zero value is off; the gateway and replay turn it on by default
	// (gateway.DefaultPrograms), gated: where programs are short and many (multiturn chats on 4
	// replicas of 1,000–2,000 blocks) the live contexts never fit, the
	// holds gain nothing and the first turns, a fifth of the requests,
	// wait (p90 TTFT up to 10 s against 70 ms off: the pressure sweep's
	// points above 1.05× of the best peer 44 of 112 against 30): hence
	// AdmissionMinContext.
	KVAdmission bool
	// AdmissionMinContext: admission holds new programs only once the
	// programs that went idle (past IdleTTL) had contexts of at least this
	// many tokens (an EWMA over them, weight 0.1). A hold pays where a
	// paused program's context is long to prefill again (agents: tens of
	// thousands of tokens), not for short chats, whose first turns it would
	// only delay; a new program's own first turn does not tell (an agent's
	// adds a few hundred tokens to a shared system prompt: gating on it
	// took the agents capacity with admission from 2.08× to 1.93×). With
	// 8,192: agents replay 2.07× (2.08× with IdleTTL 10 s and KVShare 1)
	// and the pressure sweep's short chats untouched (25 of 112 points
	// above 1.05× with admission and without). 0: the default; negative:
	// hold whatever the contexts.
	AdmissionMinContext int
	// KVShare is the share of a replica's KV cache the live programs homed
	// there may reserve before a new program is placed elsewhere (default
	// 1: the contexts reserved are the programs' own, beyond a shared
	// prefix, which requests without a program share as well; 0.9 held
	// agents back for room that went unused, as IdleTTL 30 s did).
	KVShare float64
	// AdmissionWait is how long a new program waits in the router for
	// room, in all, before it is placed anyway (default 10 s, short beside
	// an agent's minutes; a turn through the pool's queue is not counted,
	// nor starts it over: parked.add). The hold works less by finding room (at 2.0×
	// most held programs are placed at the end of their wait) than by
	// keeping the live programs fewer while it lasts, so it must outlast
	// the peak's re-prefills: agents replay capacity with admission at
	// 100 ms 1.91× (below admission off), 5 s 1.96×, 10 s 2.07×. A longer
	// hold raises the capacity measured by p90 TTFT past the oracle bound
	// (30 s: 2.62× against 2.21×) only because the held first turns are
	// under a tenth of the requests: not a gain.
	AdmissionWait time.Duration
	// BurstWindow: requests with an identical prompt arriving within this
	// long of the first go to its replica (default 100 ms, llm-d's
	// burst-prefix-cache-producer's windowDurationMs). Negative: off.
	BurstWindow time.Duration
	// BurstCap is how many requests of one burst a replica takes before
	// the next one is placed afresh (default 64; llm-d's maxPerReplica,
	// unlimited by default there). Negative: no cap.
	BurstCap int
}

// Defaults of ProgramConfig, and the bound on a program id's length.
const (
	DefaultProgramIdleTTL       = 10 * time.Second
	DefaultMaxPrograms          = 1 << 16
	DefaultProgramKVShare       = 1
	DefaultProgramAdmissionWait = 10 * time.Second
	DefaultAdmissionMinContext  = 8192
	DefaultBurstWindow          = 100 * time.Millisecond
	DefaultBurstCap             = 64
	// MaxProgramID bounds the program id a request carries in
	// policy.Request.Session: a longer one (a client's, from a header or
	// the body) is cut there and suffixed with its hash.
	MaxProgramID = 256
)

func (c ProgramConfig) withDefaults() ProgramConfig {
	if c.IdleTTL <= 0 {
		c.IdleTTL = DefaultProgramIdleTTL
	}
	if c.MaxPrograms <= 0 {
		c.MaxPrograms = DefaultMaxPrograms
	}
	if !(c.KVShare > 0 && c.KVShare <= 1) {
		c.KVShare = DefaultProgramKVShare
	}
	if c.AdmissionWait <= 0 {
		c.AdmissionWait = DefaultProgramAdmissionWait
	}
	if c.AdmissionMinContext == 0 {
		c.AdmissionMinContext = DefaultAdmissionMinContext
	}
	if c.BurstWindow == 0 {
		c.BurstWindow = DefaultBurstWindow
	}
	if c.BurstCap == 0 {
		c.BurstCap = DefaultBurstCap
	}
	return c
}

// ProgramName is a client's program id as a request carries it: at most
// MaxProgramID bytes (a longer id keeps its head and gains its hash, so
// that two long ids stay apart).
func ProgramName(id string) string {
	if len(id) <= MaxProgramID {
		return id
	}
	const hexLen = 16
	h := prompt.Chain(0, []byte(id))
	buf := make([]byte, 0, MaxProgramID)
	buf = append(buf, id[:MaxProgramID-hexLen-1]...)
	buf = append(buf, '#')
	for i := hexLen - 1; i >= 0; i-- {
		buf = append(buf, "0123456789abcdef"[h>>(4*uint(i))&0xf])
	}
	return string(buf)
}

// SetProgram makes id (at most MaxProgramID bytes: ProgramName) req's
// program: its Session, and its Program.ID, the id hashed under the
// request's partition (model as the client named it, adapter, cache_salt),
// so that two partitions' programs of one name never meet; never 0, the
// request's "no program".
func SetProgram(req *policy.Request, id string) {
	id = ProgramName(id)
	h := prompt.Chain(prompt.RootOf("program", prompt.Key{Model: req.Model, Adapter: req.Adapter, Salt: req.Salt}), []byte(id))
	if h == 0 {
		h = 1
	}
	req.Session, req.Program = id, policy.Program{ID: h, Home: -1}
}

// program is one tracked program.
type program struct {
	id     uint64
	home   int    // the replica slot of its last turn
	serial uint64 // that replica's serial (a slot reused is not its home)
	tokens int    // its context at its last turn: prompt + output
	// shared is the part of its context its home already held when it
	// came there (a system prompt other programs share): the home holds
	// those blocks once for all of them, so they are not its own.
	shared   int
	turns    int
	inFlight int
	last     time.Time // its last turn's routing or end
	// live: it reserves tokens on home (in programs.active), else it is
	// in programs.idle (listed: in one of the two).
	live, listed bool
	prev, next   *program
}

// progList is an intrusive doubly linked list of programs, oldest first.
type progList struct {
	head, tail *program
	n          int
}

func (l *progList) pushBack(p *program) {
	p.prev, p.next = l.tail, nil
	if l.tail != nil {
		l.tail.next = p
	} else {
		l.head = p
	}
	l.tail = p
	l.n++
}

func (l *progList) remove(p *program) {
	if p.prev != nil {
		p.prev.next = p.next
	} else {
		l.head = p.next
	}
	if p.next != nil {
		p.next.prev = p.prev
	} else {
		l.tail = p.prev
	}
	p.prev, p.next = nil, nil
	l.n--
}

// programs is the router's program table.
type programs struct {
	cfg ProgramConfig

	mu     sync.Mutex
	byID   map[uint64]*program
	active progList // live programs, by last activity
	idle   progList // the others, by when they went idle
	// Per slot: the tokens and count of live programs homed there, for the
	// replica of serial gen[slot] (a slot's next replica starts at 0).
	reserved []int64
	count    []int
	gen      []uint64
	moves    uint64 // turns routed off their program's home

	park parked // new programs waiting for room (admission)

	// onIdle, when set, hears the context of each program gone idle past
	// IdleTTL, by its home slot: its pool keeps their EWMA, admission's
	// gate (AdmissionMinContext; pool.noteIdle).
	onIdle func(slot, tokens int)
}

func newPrograms(cfg ProgramConfig) *programs {
	return &programs{cfg: cfg.withDefaults(), byID: map[uint64]*program{}}
}

// grow makes the per-slot tables hold slot. ps.mu held.
func (ps *programs) grow(slot int) {
	for len(ps.reserved) <= slot {
		ps.reserved = append(ps.reserved, 0)
		ps.count = append(ps.count, 0)
		ps.gen = append(ps.gen, 0)
	}
}

// reserve counts p's context on its home. ps.mu held.
func (ps *programs) reserve(p *program) {
	ps.grow(p.home)
	if ps.gen[p.home] != p.serial {
		ps.reserved[p.home], ps.count[p.home], ps.gen[p.home] = 0, 0, p.serial
	}
	ps.reserved[p.home] += int64(p.own())
	ps.count[p.home]++
}

// unreserve takes p's context off its home's count. ps.mu held.
func (ps *programs) unreserve(p *program) {
	if p.home < len(ps.gen) && ps.gen[p.home] == p.serial {
		ps.reserved[p.home] = max(ps.reserved[p.home]-int64(p.own()), 0)
		ps.count[p.home] = max(ps.count[p.home]-1, 0)
	}
}

// own is the KV p reserves on its home: its context beyond what the home
// held when p came (counted once there, for every program sharing it),
// as ReplicaView.InFlightKV counts requests in flight. Summing whole
// contexts counted a shared system prompt once per program and made every
// holder of a popular one look full (multiturn on 4 replicas of 1,500
// blocks: p90 TTFT 78.5 ms against 35.8 ms without KV admission).
func (p *program) own() int { return max(p.tokens-p.shared, 0) }

// detach takes p out of its list (and its reservation). ps.mu held.
func (ps *programs) detach(p *program) {
	if !p.listed {
		return
	}
	if p.live {
		ps.active.remove(p)
		ps.unreserve(p)
	} else {
		ps.idle.remove(p)
	}
	p.listed = false
}

// attach puts p at the back of the active list, reserving its context on
// its home (live), or of the idle list. ps.mu held; p detached.
func (ps *programs) attach(p *program, live bool) {
	p.live, p.listed = live, true
	if live {
		ps.reserve(p)
		ps.active.pushBack(p)
	} else {
		ps.idle.pushBack(p)
	}
}

// expire releases the reservations of programs idle for IdleTTL at now. A
// program with a turn in flight met at the front goes to the back (it is
// live however old its last turn), so each call costs the programs it
// expires and those it passes over. ps.mu held.
func (ps *programs) expire(now time.Time) {
	for n := ps.active.n; n > 0 && ps.active.head != nil; n-- {
		p := ps.active.head
		if p.inFlight > 0 {
			ps.active.remove(p)
			ps.active.pushBack(p)
			continue
		}
		if now.Sub(p.last) < ps.cfg.IdleTTL {
			return
		}
		if ps.onIdle != nil {
			ps.onIdle(p.home, p.tokens)
		}
		ps.detach(p)
		ps.attach(p, false)
	}
}

// evict makes room for one more program under MaxPrograms: the longest idle
// one is forgotten, else the least recently active. ps.mu held.
func (ps *programs) evict() {
	for len(ps.byID) >= ps.cfg.MaxPrograms {
		p := ps.idle.head
		if p == nil {
			p = ps.active.head
		}
		if p == nil {
			return
		}
		ps.detach(p)
		delete(ps.byID, p.id)
	}
}

// lookup is what the table knows of program id at now: its home (while
// that slot still holds the replica of serial serialOf(home)), context and
// turns.
func (ps *programs) lookup(id uint64, now time.Time, serialOf func(int) uint64) policy.Program {
	out := policy.Program{ID: id, Home: -1}
	ps.mu.Lock()
	defer ps.mu.Unlock()
	ps.expire(now)
	p, ok := ps.byID[id]
	if !ok {
		return out
	}
	out.Turns, out.Tokens = p.turns, p.tokens
	if serialOf(p.home) == p.serial {
		out.Continues, out.Home = true, p.home
	}
	return out
}

// routed records a turn of program id sent to slot (serial) at now with a
// context of tokens (prompt and output), of which the replica held shared
// before the turn.
func (ps *programs) routed(id uint64, slot int, serial uint64, tokens, shared int, now time.Time) {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	p, ok := ps.byID[id]
	if !ok {
		ps.evict()
		p = &program{id: id, home: slot, serial: serial}
		ps.byID[id] = p
	} else if p.home != slot || p.serial != serial {
		ps.moves++
	}
	ps.detach(p)
	if p.turns == 0 || p.home != slot || p.serial != serial {
		p.shared = max(shared, 0) // what its new home held of it on arrival
	}
	p.home, p.serial, p.tokens = slot, serial, max(tokens, 0)
	p.turns++
	p.inFlight++
	p.last = now
	ps.attach(p, true)
}

// remote records a turn of program id another gateway sent to slot
// (serial) at `at` with a context of tokens: as routed, with nothing in
// flight here. A new program is refused (false) when the table is full and
// none of its programs is idle: a peer's record never evicts a live one.
func (ps *programs) remote(id uint64, slot int, serial uint64, tokens int, at time.Time) bool {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	ps.expire(at)
	p, ok := ps.byID[id]
	if !ok {
		if len(ps.byID) >= ps.cfg.MaxPrograms && ps.idle.head == nil {
			return false
		}
		ps.evict()
		p = &program{id: id}
		ps.byID[id] = p
	}
	ps.detach(p)
	p.home, p.serial, p.tokens = slot, serial, tokens
	p.turns++
	if at.After(p.last) {
		p.last = at
	}
	ps.attach(p, true)
	return true
}

// ended records the end of one of program id's turns at now.
func (ps *programs) ended(id uint64, now time.Time) {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	p, ok := ps.byID[id]
	if !ok {
		return
	}
	p.inFlight = max(p.inFlight-1, 0)
	if now.After(p.last) {
		p.last = now
	}
	if p.live {
		ps.active.remove(p)
		ps.active.pushBack(p)
	}
}

// fill sets each view's live programs and their reserved contexts (the
// views' Index is their slot; serialOf tells the slot's replica now).
func (ps *programs) fill(views []policy.ReplicaView, now time.Time, serialOf func(int) uint64) {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	ps.expire(now)
	for i := range views {
		s := views[i].Index
		if s < len(ps.gen) && ps.gen[s] == serialOf(s) {
			views[i].Programs, views[i].ProgramTokens = ps.count[s], int(ps.reserved[s])
		}
	}
}

// ProgramStats is the program table's state, for /debug and metrics.
type ProgramStats struct {
	Tracked int    `json:"tracked"` // programs remembered
	Live    int    `json:"live"`    // of which reserving their context
	Moves   uint64 `json:"moves"`   // turns routed off their program's home so far
	Waiting int    `json:"waiting"` // new programs waiting for room
}

// ProgramStats is the program table's state now.
func (rt *Router) ProgramStats() ProgramStats {
	ps := rt.progs
	ps.mu.Lock()
	ps.expire(rt.cfg.Now())
	st := ProgramStats{Tracked: len(ps.byID), Live: ps.active.n, Moves: ps.moves}
	ps.mu.Unlock()
	st.Waiting = ps.park.len()
	return st
}

// serialOf is slot's replica's serial now (0: no such slot).
func (rt *Router) serialOf(slot int) uint64 {
	reps := rt.reps()
	if slot < 0 || slot >= len(reps) || reps[slot].removed.Load() {
		return 0
	}
	return reps[slot].serial
}

// lookupProgram fills req.Program from the table (no program: untouched).
func (rt *Router) lookupProgram(req *policy.Request) {
	if req.Program.ID == 0 {
		return
	}
	req.Program = rt.progs.lookup(req.Program.ID, req.Now, rt.serialOf)
}

// programRouted records t's turn of its program (a prefill step is not a
// turn: its decode step is).
func (rt *Router) programRouted(t *Ticket) {
	req := t.req
	if req.Program.ID == 0 || t.phase == policy.PhasePrefill {
		return
	}
	shared := min(t.Held*rt.cfg.BlockSize, req.Tokens)
	rt.progs.routed(req.Program.ID, t.Replica, t.r.serial, req.Tokens+max(req.MaxTokens, 0), shared, req.Now)
}

// programEnded records the end of t's turn.
func (rt *Router) programEnded(t *Ticket, at time.Time) {
	if t.req.Program.ID == 0 || t.phase == policy.PhasePrefill {
		return
	}
	rt.progs.ended(t.req.Program.ID, at)
}

// ProgramOf is a request's program id, from the first source that names
// one: the body's prompt_cache_key (OpenAI's client-side cache key), then
// session, what the transport found (a session header, the program of a
// Responses call's previous_response_id); "" for none. A session the
// client's subagents share (p.SessionShared: Claude Code's) is scoped by
// the conversation's start, its leading system prompt and first user
// message: a subagent has a system prompt and a task of its own, while a
// session's turns re-send both unchanged (until a compaction rewrites the
// conversation, which starts a program as it starts a context). Before,
// a session's subagents and side calls were turns of its main program,
// their contexts taken for its. At most MaxProgramID bytes (ProgramName).
func ProgramOf(p *prompt.Parsed, session string) string {
	id := p.PromptCacheKey
	if id == "" {
		id = session
	}
	if id != "" && p.SessionShared {
		start := prompt.Chain(prompt.Chain(0, []byte(p.System)), []byte(p.KeyText))
		id += "/" + strconv.FormatUint(start, 16)
	}
	return ProgramName(id)
}

// programIdled adds the context of a program gone idle on slot to the
// EWMA of its pool (one pool's long contexts gate no other pool's new
// programs). The program table's mutex is held.
func (rt *Router) programIdled(slot, tokens int) {
	if reps := rt.reps(); slot >= 0 && slot < len(reps) {
		if pl := rt.poolOf(reps[slot]); pl != nil {
			pl.noteIdle(tokens)
		}
	}
}
