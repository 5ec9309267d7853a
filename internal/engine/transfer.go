package engine

import (
	"fmt"
	"slices"
	"time"
)

// Prefill/decode disaggregation, as vLLM's NixlConnector does it:
//
//   - a prefill instance gets a request marked remote decode (vLLM's
//     kv_transfer_params.do_remote_decode), computes its prompt and samples
//     its token(s) as usual; when it finishes, its blocks are not freed but
//     held (request_finished → delay_free_blocks) for the decode instance to
//     read, until the decode side says it is done (NIXL's notification) or
//     VLLM_NIXL_ABORT_REQUEST_TIMEOUT passes. Held blocks stay in the prefix
//     cache: other requests can hit them.
//   - a decode instance gets the request marked remote prefill
//     (do_remote_prefill): when the scheduler first admits it, it takes the
//     blocks of its own cached prefix and allocates the rest of the prompt
//     (get_num_new_matched_tokens: all prompt tokens not computed locally),
//     and the request waits for the remote KV (WAITING_FOR_REMOTE_KVS)
//     while the others keep running. When the transfer is done the pulled
//     blocks are cached (_update_waiting_for_remote_kv: num_computed_tokens
//     = prompt − 1, the last token recomputed) and the request goes back to
//     the head of the waiting queue; its first step computes that one token
//     and samples its first output token.
//
// The transfer's time comes from the profile: the wire time of the pulled
// tokens' bytes at the link's bandwidth plus a fixed latency. Transfers
// share one link per engine, first come first served: a transfer's bytes go
// on the wire when the previous one's are through, and it is done one
// latency later. The engine does not model the prefill side's link.

// Role is an instance's part in prefill/decode disaggregation (vLLM's
// kv_role; NixlConnector instances are usually kv_both and the proxy decides).
type Role uint8

// Roles.
const (
	RoleBoth    Role = iota // serves both kinds of transfer, and plain requests
	RolePrefill             // serves remote decodes (it prefills) and plain requests
	RoleDecode              // serves remote prefills (it pulls and decodes) and plain requests
)

func (r Role) String() string {
	switch r {
	case RoleBoth:
		return "both"
	case RolePrefill:
		return "prefill"
	case RoleDecode:
		return "decode"
	}
	return fmt.Sprintf("Role(%d)", uint8(r))
}

// ParseRole reads "both", "prefill" or "decode".
func ParseRole(s string) (Role, error) {
	for _, r := range []Role{RoleBoth, RolePrefill, RoleDecode} {
		if s == r.String() {
			return r, nil
		}
	}
	return 0, fmt.Errorf("role %q: want both, prefill or decode", s)
}

// Pull is one completed transfer of a RemotePrefill request.
type Pull struct {
	ReqID  uint64
	Tokens int     // prompt tokens pulled (the request's ExternalTokens)
	Bytes  float64 // their KV bytes, from the profile
	// Start is when the request was admitted and its transfer posted; End
	// when its last byte arrived and its latency passed.
	Start, End time.Duration
}

// hold is one held request's deadline; the request may have been released
// since (then its state or deadline no longer match).
type hold struct {
	id    uint64
	until time.Duration
}

// checkTransfer validates a request's KV transfer against the role.
func (e *Engine) checkTransfer(r *Request) error {
	switch {
	case r.RemoteDecode && r.RemotePrefill:
		return fmt.Errorf("%w: id %d: both remote decode and remote prefill", ErrInvalidRequest, r.ID)
	case r.RemoteDecode && e.cfg.Role == RoleDecode:
		return fmt.Errorf("%w: id %d: remote decode on a decode instance", ErrWrongRole, r.ID)
	case r.RemotePrefill && e.cfg.Role == RolePrefill:
		return fmt.Errorf("%w: id %d: remote prefill on a prefill instance", ErrWrongRole, r.ID)
	}
	return nil
}

// Release ends the hold of a finished RemoteDecode request (the decode side
// has pulled its blocks): its blocks are freed and stay cached. False when
// id is not held (unknown, never a remote decode, released, or expired).
func (e *Engine) Release(id uint64) bool {
	s, ok := e.seqs[id]
	if !ok || s.state != stHeld {
		return false
	}
	e.endHold(s)
	e.st.HoldsReleased++
	return true
}

// NextEvent is the engine time of the next change that needs no call but
// Step: a transfer ending or a hold expiring. A driver with no work (HasWork
// false), or whose Step scheduled nothing, steps again then. ok is false
// when nothing is pending.
func (e *Engine) NextEvent() (at time.Duration, ok bool) {
	for len(e.holds) > 0 && !e.holding(e.holds[0]) {
		e.holds = e.holds[1:]
	}
	if len(e.holds) > 0 {
		at, ok = e.holds[0].until, true
	}
	if len(e.pulling) > 0 && (!ok || e.pulling[0].pullDone < at) {
		at, ok = e.pulling[0].pullDone, true
	}
	return at, ok
}

func (e *Engine) holding(h hold) bool {
	s := e.seqs[h.id]
	return s != nil && s.state == stHeld && s.holdUntil == h.until
}

// HeldBlocks is a copy of the block table of a held request (a finished
// RemoteDecode request not yet released or expired): its blocks in prompt
// order, the last one partial unless the prompt fills it, as vLLM's
// remote_block_ids. False when id is not held.
func (e *Engine) HeldBlocks(id uint64) ([]int32, bool) {
	s, ok := e.seqs[id]
	if !ok || s.state != stHeld {
		return nil, false
	}
	return slices.Clone(s.blocks), true
}

// hold keeps a finished RemoteDecode request's blocks for its remote
// decode, until released or KVHoldTimeout after the step that finished it.
func (e *Engine) hold(s *seq) {
	s.state = stHeld
	s.holdUntil = e.lastEnd + e.cfg.KVHoldTimeout
	e.holds = append(e.holds, hold{id: s.id, until: s.holdUntil})
	e.held++
}

func (e *Engine) endHold(s *seq) {
	e.pool.release(s.blocks)
	e.held--
	e.retire(s)
}

// advance applies what happened by now: holds expire (vLLM frees them in
// get_finished once past their deadline) and transfers end.
func (e *Engine) advance(now time.Duration) {
	for len(e.holds) > 0 && e.holds[0].until <= now {
		h := e.holds[0]
		e.holds = e.holds[1:]
		if e.holding(h) {
			e.endHold(e.seqs[h.id])
			e.st.HoldsExpired++
			e.expired = append(e.expired, h.id)
		}
	}
	n := 0
	for n < len(e.pulling) && e.pulling[n].pullDone <= now {
		e.pulled(e.pulling[n])
		n++
	}
	if n > 0 {
		e.pulling = slices.Delete(e.pulling, 0, n)
	}
}

// pulled finishes s's transfer: its pulled (or loaded) blocks are cached
// (Stored events), for a remote prefill up to prompt − 1 tokens, the last
// one left to compute, and it waits at the head of the queue behind
// earlier pulled requests.
func (e *Engine) pulled(s *seq) {
	s.computed = s.loadTo
	e.registerComputed(s)
	s.pulled, s.state = true, stWaiting
	if !s.tierLoad {
		e.st.Transfers++
		e.st.TransferTokens += int64(s.external)
		e.pulls = append(e.pulls, Pull{ReqID: s.id, Tokens: s.external,
			Bytes: e.cfg.Profile.TransferBytes(s.external), Start: s.pullStart, End: s.pullDone})
	}
	i := 0
	for i < e.waiting.len() && e.waiting.at(i).pulled {
		i++
	}
	e.waiting.insert(i, s)
}

// claim takes the waiting head s off the queue when the blocks its
// prompt needs beyond its hit ones (in s.blocks, evictable of them in the
// free queue) are free: it touches the hit blocks and allocates the rest.
// It reports false, leaving s waiting, when they are not.
func (e *Engine) claim(s *seq, hit, evictable int) bool {
	need := e.blocksFor(s.prompt) - hit
	if need > e.pool.free-evictable {
		s.blocks = s.blocks[:0]
		return false
	}
	e.waiting.popFront()
	for _, b := range s.blocks {
		e.pool.touch(b)
	}
	e.allocate(s, need)
	return true
}

// admitPull admits the waiting head s, a RemotePrefill request whose hit
// blocks (hit of them, evictable of those in the free queue) are in
// s.blocks: it allocates the rest of the prompt and posts the transfer. It
// reports false, leaving s waiting, when the blocks are not free. The
// request takes no budget and no running slot.
func (e *Engine) admitPull(s *seq, hit, evictable int) bool {
	if !e.claim(s, hit, evictable) {
		return false
	}
	local := hit * e.bs
	s.nHashed, s.computed = hit, local
	s.remotePrefill = false // one transfer per request, as vLLM
	s.external = s.prompt - local
	s.loadTo = s.prompt - 1
	e.st.PrefixQueries += int64(s.prompt)
	e.st.PrefixHits += int64(local)
	e.st.ExternalQueries += int64(s.external)
	e.st.ExternalHits += int64(s.external)

	prof := e.cfg.Profile
	begin := max(e.now, e.linkFree)
	e.linkFree = begin + prof.TransferWireTime(s.external)
	s.pullStart, s.pullDone = e.now, e.linkFree+prof.TransferLatency()
	s.state = stPulling
	e.insertPulling(s)
	return true
}

// admitPulled runs the waiting head s, whose transfer is done, with its
// blocks: it computes the rest of its prompt, chunked to the budget (a
// remote prefill: its last prompt token, which fits its last block). It
// reports false, leaving s waiting, when no block is free (or newBlocks is
// false) for a chunk past its blocks, which it then does not need: its
// transfer stopped short of its last prompt token.
func (e *Engine) admitPulled(s *seq, newBlocks bool) bool {
	// Its blocks cover its prompt, whose last token is never transferred;
	// a chunk past them (a preempted request's outputs) takes free blocks,
	// unless newBlocks is false.
	room := len(s.blocks) * e.bs
	if newBlocks {
		room += e.pool.free * e.bs
	}
	n := min(s.target()-s.computed, e.budget, room-s.computed)
	if n < 1 {
		return false
	}
	need := max(e.blocksFor(s.computed+n)-len(s.blocks), 0)
	e.waiting.popFront()
	s.pulled, s.tierLoad = false, false
	if s.cached < 0 {
		s.cached = s.computed // vLLM's num_cached_tokens: local, loaded and pulled
	}
	s.state, s.preempted = stRunning, false
	e.running = append(e.running, s)
	e.live++
	e.allocate(s, need)
	e.schedule(s, n)
	return true
}

// removePulling drops s from the transfers under way.
func (e *Engine) removePulling(s *seq) {
	i := slices.Index(e.pulling, s)
	e.pulling = slices.Delete(e.pulling, i, i+1)
}

// countSources adds s's prompt tokens to the by-source counters as vLLM's
// PromptTokenStats does (local hits clamped at 0, the fix of its negative
// counter in P/D).
func (e *Engine) countSources(s *seq) {
	recomputed := 0
	if s.cached+1 == s.prompt {
		recomputed = 1 // the last token of a fully cached prompt, recomputed
	}
	e.st.PromptComputed += int64(s.prompt - s.cached)
	e.st.PromptExternal += int64(s.external)
	e.st.PromptLocalHit += int64(max(s.cached+recomputed-s.external, 0))
}
