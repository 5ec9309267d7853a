package engine

import (
	"slices"

	"github.com/kvgate/kvgate/internal/hashtab"
)

// The host (CPU) tier, as vLLM's OffloadingConnector keeps it with its
// default LRUOffloadingManager (vllm/v1/kv_offload/lru_manager.py and the
// connector's scheduler side, kv_connector/v1/offloading/scheduler.py):
//
//   - write-through: every full prompt block a request has on the GPU,
//     computed or hit, is offered to the host tier once it is scheduled
//     (_get_reqs_to_store offers the request's blocks from its first on);
//     a block already there is only touched, a new one is stored at the
//     most recent end, evicting the least recent blocks when the tier is
//     full (prepare_store);
//   - the request's blocks are touched last to first whenever it is
//     looked up or stored (touch: reversed, so its head is the most
//     recent), which keeps a prompt's head longer than its tail;
//   - a request's hit continues into the host tier where its GPU hit
//     stops (get_num_new_matched_tokens after the GPU's computed tokens):
//     those blocks are loaded into GPU blocks before the request computes
//     (transfer.go), and then are cached on the GPU like computed ones;
//   - its events (take_events) are BlockStored and BlockRemoved with
//     medium "CPU", in vLLM's default, legacy payload: the hashes only, no
//     parent, no token ids (a consumer resolves them by the hashes its GPU
//     events taught it).
//
// Write-through means the tier holds copies of what the GPU holds too: a
// block evicted from the GPU is found in the host tier if it was among the
// tier's most recent blocks, so a tier of 4× the GPU's blocks holds about
// 4× its distinct prefixes. The hashes are the GPU's (offloaded block size
// = the GPU's block size here). Loads that are under way do not pin their
// source blocks (vLLM's ref_cnt): a load reads its blocks when admitted.
type hostTier struct {
	n     int
	hash  []uint64
	prev  []int32  // LRU list over slots, index n is the sentinel:
	next  []int32  // next[n] is the least recent, prev[n] the most recent
	used  int32    // slots ever taken
	freed []int32  // slots given back by evictions
	fresh []uint64 // scratch of store
	index *hashtab.Table[int32]

	events  bool
	stored  []uint64 // the current run of stores, not yet an event
	removed []uint64 // the current run of evictions, not yet an event
	out     []KVEvent

	storedN, evicted int64 // cumulative
}

func newHostTier(n int, events bool) *hostTier {
	t := &hostTier{
		n:      n,
		hash:   make([]uint64, n),
		prev:   make([]int32, n+1),
		next:   make([]int32, n+1),
		index:  hashtab.New[int32](),
		events: events,
	}
	t.prev[n], t.next[n] = int32(n), int32(n)
	return t
}

// len is the number of blocks the tier holds.
func (t *hostTier) len() int { return t.index.Len() }

// has reports whether the tier holds block h.
func (t *hostTier) has(h uint64) bool { return t.index.Get(h) != nil }

// run is the number of blocks of hashes[from:limit] the tier holds, from
// the first on without a gap.
func (t *hostTier) run(hashes []uint64, from, limit int) int {
	limit = min(limit, len(hashes))
	for i := from; i < limit; i++ {
		if !t.has(hashes[i]) {
			return i - from
		}
	}
	return max(limit-from, 0)
}

func (t *hostTier) unlink(i int32) {
	p, x := t.prev[i], t.next[i]
	t.next[p], t.prev[x] = x, p
}

// pushRecent makes slot i the most recent.
func (t *hostTier) pushRecent(i int32) {
	s := int32(t.n)
	last := t.prev[s]
	t.prev[i], t.next[i] = last, s
	t.next[last], t.prev[s] = i, i
}

// touch makes the held blocks of hashes the most recent, the first of them
// most recent of all (vLLM's touch walks them reversed).
func (t *hostTier) touch(hashes []uint64) {
	for i := len(hashes) - 1; i >= 0; i-- {
		if p := t.index.Get(hashes[i]); p != nil {
			t.unlink(*p)
			t.pushRecent(*p)
		}
	}
}

// store offers hashes to the tier as prepare_store does: the ones it lacks
// are stored as the most recent, after evicting as many of the least recent
// blocks as they need room (the caller then touches the request's blocks).
// More new blocks than the tier holds are not stored at all ("cannot
// store").
func (t *hostTier) store(hashes []uint64) {
	fresh := t.fresh[:0]
	for _, h := range hashes {
		if !t.has(h) {
			fresh = append(fresh, h)
		}
	}
	t.fresh = fresh
	if len(fresh) == 0 || len(fresh) > t.n {
		return
	}
	// The victims may be blocks of hashes themselves (vLLM evicts by
	// recency alone): they are gone, not stored again.
	for range len(fresh) - (t.n - t.len()) {
		slot := t.next[t.n] // the least recent
		t.unlink(slot)
		t.index.Del(t.hash[slot])
		t.freed = append(t.freed, slot)
		t.evicted++
		t.note(&t.removed, &t.stored, Stored, t.hash[slot])
	}
	for _, h := range fresh {
		var slot int32
		if n := len(t.freed); n > 0 {
			slot, t.freed = t.freed[n-1], t.freed[:n-1]
		} else {
			slot = t.used
			t.used++
		}
		t.hash[slot] = h
		v, _ := t.index.Upsert(h)
		*v = slot
		t.pushRecent(slot)
		t.storedN++
		t.note(&t.stored, &t.removed, Removed, h)
	}
}

// note adds h to the run of events it belongs to, after flushing the run
// of the other kind (otherKind): a consumer replaying the events in order
// into a set must see a block stored and evicted in one step in that order.
func (t *hostTier) note(run, other *[]uint64, otherKind KVKind, h uint64) {
	if !t.events {
		return
	}
	if len(*other) > 0 {
		t.flushKind(otherKind)
	}
	*run = append(*run, h)
}

// flushKind turns the pending run of kind into an event.
func (t *hostTier) flushKind(kind KVKind) {
	run := &t.stored
	if kind == Removed {
		run = &t.removed
	}
	if len(*run) == 0 {
		return
	}
	t.out = append(t.out, KVEvent{Kind: kind, Medium: MediumCPU, BlockHashes: slices.Clone(*run)})
	*run = (*run)[:0]
}

// flush moves the tier's events of a step to evs.
func (t *hostTier) flush(evs []KVEvent, bs int) []KVEvent {
	t.flushKind(Removed)
	t.flushKind(Stored)
	for i := range t.out {
		t.out[i].BlockSize = bs
	}
	evs = append(evs, t.out...)
	t.out = t.out[:0]
	return evs
}

// clear drops every block (vLLM's reset_prefix_cache resets the
// connector's manager too); no event: the Cleared event says it.
func (t *hostTier) clear() {
	t.index = hashtab.New[int32]()
	t.prev[t.n], t.next[t.n] = int32(t.n), int32(t.n)
	t.used, t.freed = 0, t.freed[:0]
	t.stored, t.removed, t.out = t.stored[:0], t.removed[:0], t.out[:0]
}

// Servable is how many leading blocks of hashes the engine holds in its
// GPU cache or its host tier: what a peer pulling them from it can read
// (the driver's answer to a remote_kv_source). No side effects.
func (e *Engine) Servable(hashes []uint64) int {
	for i, h := range hashes {
		if e.pool.cache.Get(h) == nil && (e.host == nil || !e.host.has(h)) {
			return i
		}
	}
	return len(hashes)
}

// offload offers s's blocks below hi to the host tier (write-through) and
// touches them, its head the most recent.
func (e *Engine) offload(s *seq, hi int) {
	if e.host == nil || hi <= s.nOffered {
		return
	}
	e.host.store(s.hashes[s.nOffered:hi])
	s.nOffered = hi
	e.host.touch(s.hashes[:hi])
}

// lookedUp is the host tier's lookup of s as it is admitted to compute
// (the connector touches a request's blocks at every lookup); a peer pull
// that found nothing beyond s's own hit is dropped.
func (e *Engine) lookedUp(s *seq, limit int) {
	if e.host != nil {
		e.host.touch(s.hashes[:limit])
	}
	if s.pullBlocks > 0 {
		s.pullBlocks = 0
		e.st.PeerPullMisses++
	}
}

// loadable is how many blocks after s's GPU hit (hit blocks) continue in
// the host tier, and how many after those the peer named by its pull holds
// (below limit, and short of the prompt's last token: a loaded request
// always has room in its own blocks to compute, see admitPulled).
func (e *Engine) loadable(s *seq, hit, limit int) (host, pull int) {
	limit = min(limit, (s.prompt-1)/e.bs)
	if e.host != nil {
		host = e.host.run(s.hashes, hit, limit)
	}
	if s.pullBlocks > 0 {
		pull = max(min(s.pullBlocks, limit)-hit-host, 0)
	}
	return host, pull
}

// admitLoad admits the waiting head s, whose hit continues past its hit
// GPU blocks (evictable of them in the free queue; in s.blocks) into host
// blocks of its host tier and pull blocks of a peer: it allocates the GPU
// blocks of its whole prompt, as a remote prefill does (a request holding
// its loaded blocks can always compute the rest: loads cannot take every
// block and leave nothing to compute with), and posts the loads, each on its own link, first come first
// served (the host tier's PCIe link; the KV link P/D pulls use, for the
// peer's blocks); the request waits, taking no budget and no running slot,
// until both are done, then computes the rest of its prompt (pulled,
// admitPulled). It reports false, leaving s waiting, when the blocks are
// not free.
func (e *Engine) admitLoad(s *seq, hit, host, pull, evictable int) bool {
	if !e.claim(s, hit, evictable) {
		return false
	}
	if e.host != nil {
		e.host.touch(s.hashes[:hit+host])
	}
	s.nHashed, s.computed = hit, hit*e.bs
	s.loadTo, s.tierLoad, s.pullBlocks = (hit+host+pull)*e.bs, true, 0
	if s.cached < 0 {
		s.hostTokens, s.pullTokens = host*e.bs, pull*e.bs
		s.external = s.hostTokens + s.pullTokens
		e.st.PrefixQueries += int64(s.prompt)
		e.st.PrefixHits += int64(hit * e.bs)
		e.st.ExternalQueries += int64(s.prompt - hit*e.bs)
		e.st.ExternalHits += int64(s.external)
	}
	prof, done := e.cfg.Profile, e.now
	if host > 0 {
		e.hostFree = max(e.now, e.hostFree) + prof.HostWireTime(host*e.bs)
		done = max(done, e.hostFree+prof.HostLatency())
		e.st.HostLoads++
		e.st.HostLoadTokens += int64(host * e.bs)
	}
	if pull > 0 {
		e.linkFree = max(e.now, e.linkFree) + prof.TransferWireTime(pull*e.bs)
		done = max(done, e.linkFree+prof.TransferLatency())
		e.st.PeerPulls++
		e.st.PeerPullTokens += int64(pull * e.bs)
	}
	s.pullStart, s.pullDone = e.now, done
	s.state = stPulling
	e.insertPulling(s)
	return true
}

// insertPulling adds s to the transfers under way, kept in order of their
// end (after those ending at the same time): loads and pulls use two links,
// so a later one may end first.
func (e *Engine) insertPulling(s *seq) {
	i := len(e.pulling)
	for i > 0 && e.pulling[i-1].pullDone > s.pullDone {
		i--
	}
	e.pulling = slices.Insert(e.pulling, i, s)
}
