package sim

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/kvgate/kvgate/internal/engine"
)

// Prefill/decode disaggregation on vLLM's wire (its NixlConnector, as its
// disaggregated proxy examples drive it):
//
//  1. the proxy sends a request with kv_transfer_params {"do_remote_decode":
//     true, ...} (stream false, max_tokens 1) to a prefill replica, which
//     computes the prompt, samples its token, holds the request's blocks
//     (engine.Request.RemoteDecode) and answers, non-streamed, with a
//     top-level kv_transfer_params naming them: {"do_remote_prefill": true,
//     "do_remote_decode": false, "remote_block_ids", "remote_engine_id",
//     "remote_request_id", "remote_host", "remote_port", "tp_size"};
//  2. the proxy sends the original request with those parameters to a
//     decode replica, which pulls what its own cache lacks
//     (engine.Request.RemotePrefill), then decodes, streamed or not.
//
// NIXL's side channel (a ZMQ handshake, one-sided RDMA reads, then a
// notification that frees the prefill side's blocks) is the prefill
// replica's own HTTP server here: remote_host and remote_port are its
// address. Before it submits the request, the decode replica asks it
// (POST /kvgate/sim/kv_read) whether it still holds the blocks; when the
// engine's transfer ends it tells it (POST /kvgate/sim/kv_release), and
// also when the request is aborted first, as vLLM's decode side notifies
// the prefill side of an aborted request. A prefill side that does not
// answer, or no longer holds the blocks (released, or expired after
// Config.KVHoldTimeout), makes the decode replica compute the prompt
// itself, as vLLM recomputes the blocks of a failed transfer (its default
// kv_load_failure_policy); vLLM itself does not notice an expired hold and
// reads whatever the blocks then hold.

// HeaderKVPull is the sim's aid on the answer to a remote-prefill request
// (vLLM sends no such header): "pulled" when the prompt's KV is pulled
// from the prefill replica, "recomputed: REASON" when the prefill side
// could not be read and the decode replica computes the prompt itself.
// Named X-Sim-*, as HeaderHold: X-Kvgate-* is the gateway's, which drops a
// replica's X-Kvgate-* answer headers.
const HeaderKVPull = "X-Sim-KV-Pull"

// Paths of the side channel a prefill replica serves.
const (
	PathKVRead    = "/kvgate/sim/kv_read"
	PathKVRelease = "/kvgate/sim/kv_release"
)

// sideChannelTimeout bounds one call to a prefill replica's side channel,
// as NIXL's handshake waits 5 s for the remote's metadata.
const sideChannelTimeout = 5 * time.Second

// kvRequestPrefix prefixes the remote_request_id of a held request: the
// engine request id follows.
const kvRequestPrefix = "kvsim-"

// kvParams are a request's kv_transfer_params.
type kvParams struct {
	set           bool // the request carried them: its non-streamed answer carries the field
	remoteDecode  bool
	remotePrefill bool
	engineID      string
	requestID     string
	host          string
	port          int
	blockIDs      []int64
	// prefillMs and prefillWallMs are the prefill step's engine time and
	// span (PrefillKey, PrefillWallKey), which the decode side counts in
	// its Timing.
	prefillMs, prefillWallMs float64
	// source is a peer to pull the cached prefix from (remote_kv_source,
	// tiers.go), nil when none.
	source *kvSource
}

// kvBad is a 400 naming a field of kv_transfer_params.
func kvBad(field, format string, args ...any) *APIError {
	return badRequest("kv_transfer_params."+field, format, args...)
}

// readKVParams reads kv_transfer_params, each field by its exact key and
// type (the sim is stricter than vLLM, which takes any dict and ignores
// what its connector cannot use): an object, booleans, strings, a port,
// block ids that are non-negative integers; unknown keys are ignored.
func readKVParams(b body) (kvParams, error) {
	raw := b.get("kv_transfer_params")
	if raw == nil {
		return kvParams{}, nil
	}
	var o body
	if raw[0] != '{' || json.Unmarshal(raw, &o) != nil {
		return kvParams{}, badRequest("kv_transfer_params", "kv_transfer_params must be an object.")
	}
	p := kvParams{set: true}
	var err error
	for _, f := range []struct {
		key string
		dst *bool
	}{{"do_remote_decode", &p.remoteDecode}, {"do_remote_prefill", &p.remotePrefill}} {
		if *f.dst, err = o.flag(f.key); err != nil {
			return p, kvBad(f.key, "%s must be a boolean.", f.key)
		}
	}
	for _, f := range []struct {
		key string
		dst *string
	}{{"remote_engine_id", &p.engineID}, {"remote_request_id", &p.requestID}, {"remote_host", &p.host}} {
		if v := o.get(f.key); v != nil && json.Unmarshal(v, f.dst) != nil {
			return p, kvBad(f.key, "%s must be a string.", f.key)
		}
	}
	if err := p.readNumbers(o); err != nil {
		return p, err
	}
	if p.source, err = readKVSource(o); err != nil {
		return p, err
	}
	return p, p.check()
}

// readNumbers reads remote_port, remote_block_ids and tp_size.
func (p *kvParams) readNumbers(o body) error {
	port, err := o.integer("remote_port")
	if err != nil || (port.set && (port.v < 1 || port.v > 65535)) {
		return kvBad("remote_port", "remote_port must be an integer in [1, 65535].")
	}
	p.port = int(port.v)
	if v := o.get("remote_block_ids"); v != nil {
		if json.Unmarshal(v, &p.blockIDs) != nil || slices.ContainsFunc(p.blockIDs, func(id int64) bool { return id < 0 }) {
			return kvBad("remote_block_ids", "remote_block_ids must be a list of non-negative integers.")
		}
	}
	if tp, err := o.integer("tp_size"); err != nil || (tp.set && tp.v < 1) {
		return kvBad("tp_size", "tp_size must be a positive integer.")
	}
	for _, f := range []struct {
		key string
		dst *float64
	}{{PrefillKey, &p.prefillMs}, {PrefillWallKey, &p.prefillWallMs}} {
		// A number: json.Unmarshal refuses NaN and infinities.
		if v := o.get(f.key); v != nil && (json.Unmarshal(v, f.dst) != nil || !(*f.dst >= 0 && *f.dst <= MaxTimingMs)) {
			return kvBad(f.key, "%s must be a number in [0, %d].", f.key, MaxTimingMs)
		}
	}
	return nil
}

// check refuses contradictory or incomplete parameters.
func (p *kvParams) check() error {
	switch {
	case p.remoteDecode && p.remotePrefill:
		return badRequest("kv_transfer_params", "do_remote_decode and do_remote_prefill cannot both be true.")
	case p.remotePrefill && p.source != nil:
		return kvBad(remoteKVSource, "a remote prefill pulls its whole prompt: remote_kv_source goes with do_remote_decode or alone.")
	case !p.remotePrefill:
		return nil
	case p.engineID == "":
		return kvBad("remote_engine_id", "do_remote_prefill needs remote_engine_id.")
	case p.requestID == "":
		return kvBad("remote_request_id", "do_remote_prefill needs remote_request_id.")
	case p.host == "":
		return kvBad("remote_host", "do_remote_prefill needs remote_host.")
	case p.port == 0:
		return kvBad("remote_port", "do_remote_prefill needs remote_port.")
	case len(p.blockIDs) == 0:
		return kvBad("remote_block_ids", "do_remote_prefill needs remote_block_ids.")
	}
	return nil
}

// checkKVJob checks a job's transfer against the replica's role and the
// request's shape: one prompt, one choice, and a remote decode answered
// non-streamed (its parameters are in the response body).
func (r *Replica) checkKVJob(j *job) error {
	kv := j.kv
	if !kv.remoteDecode && !kv.remotePrefill && kv.source == nil {
		return nil
	}
	role := r.cfg.Role
	switch {
	case kv.remoteDecode && role == engine.RoleDecode:
		return badRequest("kv_transfer_params", "do_remote_decode sent to a decode replica (role %s).", role)
	case kv.remotePrefill && role == engine.RolePrefill:
		return badRequest("kv_transfer_params", "do_remote_prefill sent to a prefill replica (role %s).", role)
	case len(j.prompts) != 1 || j.n != 1:
		return badRequest("kv_transfer_params", "a KV transfer needs one prompt and n = 1.")
	case kv.remoteDecode && j.stream:
		return badRequest("stream", "do_remote_decode needs stream false: the transfer parameters are in the response body.")
	}
	return nil
}

// kvTransferOut is the kv_transfer_params of a prefill replica's answer,
// the fields in the order vLLM's NixlConnector.request_finished sets them.
type kvTransferOut struct {
	DoRemotePrefill bool    `json:"do_remote_prefill"`
	DoRemoteDecode  bool    `json:"do_remote_decode"`
	RemoteBlockIDs  []int32 `json:"remote_block_ids"`
	RemoteEngineID  string  `json:"remote_engine_id"`
	RemoteRequestID string  `json:"remote_request_id"`
	RemoteHost      string  `json:"remote_host"`
	RemotePort      int     `json:"remote_port"`
	TPSize          int     `json:"tp_size"`
	// PrefillMs and PrefillWallMs are the sim's own: this step's engine
	// time and span (see Timing).
	PrefillMs     float64 `json:"kvgate_sim_prefill_ms"`
	PrefillWallMs float64 `json:"kvgate_sim_prefill_wall_ms"`
}

// kvTransferParams is the kv_transfer_params field of a finished call's
// non-streamed answer: none when the request had none, the hold of a
// prefilled request, else null (vLLM's None: a decode, or a prefill that
// stopped before max_tokens and holds nothing).
func (r *Replica) kvTransferParams(j *job, cl *call) json.RawMessage {
	if !j.kv.set {
		return nil
	}
	c := cl.choices[0]
	if !j.kv.remoteDecode || c.held == nil {
		return jsonNull
	}
	host, port, _ := net.SplitHostPort(r.addr)
	p, _ := strconv.Atoi(port)
	out := kvTransferOut{
		DoRemotePrefill: true, RemoteBlockIDs: c.held, RemoteEngineID: cl.core.engineID,
		RemoteRequestID: kvRequestPrefix + strconv.FormatUint(c.id, 10),
		RemoteHost:      host, RemotePort: p, TPSize: 1,
	}
	if t := r.timing(j, cl); t != nil {
		out.PrefillMs, out.PrefillWallMs = t.E2Ems, t.WallE2Ems
	}
	data, _ := json.Marshal(out)
	return data
}

// engineIDOf is the engine id of core rank of the replica at addr: one id
// per data-parallel rank, as vLLM suffixes its engine id with _dp<rank>.
func engineIDOf(addr string, rank, ranks int) string {
	id := "kvgate-sim@" + addr
	if ranks > 1 {
		id += "_dp" + strconv.Itoa(rank)
	}
	return id
}

// kvReadRequest asks a prefill replica for a held request's blocks.
type kvReadRequest struct {
	EngineID  string  `json:"engine_id"`
	RequestID string  `json:"request_id"`
	BlockIDs  []int64 `json:"block_ids,omitempty"`
}

// kvReadAnswer describes the blocks held.
type kvReadAnswer struct {
	NumBlocks int `json:"num_blocks"`
	BlockSize int `json:"block_size"`
}

func kvNotHeld(format string, args ...any) *APIError {
	return &APIError{Status: http.StatusNotFound, Type: "not_found_error", Message: fmt.Sprintf(format, args...)}
}

// heldRequest finds the core and the engine request a side-channel call
// names. The caller holds r.mu.
func (r *Replica) heldRequest(q kvReadRequest) (*core, uint64, error) {
	i := slices.IndexFunc(r.cores, func(c *core) bool { return c.engineID == q.EngineID })
	if i < 0 {
		return nil, 0, kvNotHeld("unknown engine %q.", q.EngineID)
	}
	id, err := strconv.ParseUint(strings.TrimPrefix(q.RequestID, kvRequestPrefix), 10, 64)
	if err != nil || !strings.HasPrefix(q.RequestID, kvRequestPrefix) {
		return nil, 0, kvNotHeld("unknown request %q.", q.RequestID)
	}
	return r.cores[i], id, nil
}

func decodeSideChannel(w http.ResponseWriter, req *http.Request) (kvReadRequest, bool) {
	var q kvReadRequest
	if err := json.NewDecoder(http.MaxBytesReader(w, req.Body, maxBody)).Decode(&q); err != nil {
		writeError(w, badRequest("", "side channel request: %v", err))
		return q, false
	}
	return q, true
}

// kvRead is the side channel's read: the blocks a request holds, if they
// are the ones named. NIXL's decode side learns as much from the
// handshake and the remote block ids.
func (r *Replica) kvRead(w http.ResponseWriter, req *http.Request) {
	q, ok := decodeSideChannel(w, req)
	if !ok {
		return
	}
	r.mu.Lock()
	c, id, err := r.heldRequest(q)
	var blocks []int32
	if err == nil {
		if blocks, ok = c.eng.HeldBlocks(id); !ok {
			err = kvNotHeld("request %q holds no blocks (unknown, released, or expired).", q.RequestID)
		}
	}
	r.mu.Unlock()
	if err == nil && !slices.Equal(q.BlockIDs, widen(blocks)) {
		err = &APIError{Status: http.StatusConflict, Type: "invalid_request_error",
			Message: fmt.Sprintf("request %q holds %d other blocks.", q.RequestID, len(blocks))}
	}
	if err != nil {
		writeError(w, err)
		return
	}
	writeJSON(w, kvReadAnswer{NumBlocks: len(blocks), BlockSize: r.cfg.BlockSize})
}

func widen(ids []int32) []int64 {
	out := make([]int64, len(ids))
	for i, b := range ids {
		out[i] = int64(b)
	}
	return out
}

// kvReleaseSide is the side channel's notification: the decode side has
// pulled the blocks (or gave up); the hold ends.
func (r *Replica) kvReleaseSide(w http.ResponseWriter, req *http.Request) {
	q, ok := decodeSideChannel(w, req)
	if !ok {
		return
	}
	r.mu.Lock()
	c, id, err := r.heldRequest(q)
	if err == nil && !c.eng.Release(id) {
		err = kvNotHeld("request %q holds no blocks (unknown, released, or expired).", q.RequestID)
	}
	if err == nil {
		c.wakeLocked(c.presentLocked())
	}
	r.mu.Unlock()
	if err != nil {
		writeError(w, err)
		return
	}
	c.poke() // the freed blocks may let a waiting request in
	writeJSON(w, map[string]bool{"released": true})
}

// kvRemote is the prefill side of a pull, to read and release.
type kvRemote struct {
	url       string // base URL of the prefill replica's side channel
	engineID  string
	requestID string
}

func remoteOf(p kvParams) *kvRemote {
	return &kvRemote{url: "http://" + net.JoinHostPort(p.host, strconv.Itoa(p.port)),
		engineID: p.engineID, requestID: p.requestID}
}

// sideCall posts q to the remote's side channel path and decodes a 200
// answer into out.
func (r *Replica) sideCall(ctx context.Context, url string, q, out any) error {
	ctx, cancel := context.WithTimeout(ctx, sideChannelTimeout)
	defer cancel()
	body, _ := json.Marshal(q)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(body))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := r.side.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	data, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%s: %d %s", url, resp.StatusCode, bytes.TrimSpace(data))
	}
	return json.Unmarshal(data, out)
}

// openPull asks the prefill side whether it holds the blocks of j's
// prompt; an error says why the decode replica must compute it instead.
func (r *Replica) openPull(ctx context.Context, j *job) error {
	kv := j.kv
	var a kvReadAnswer
	q := kvReadRequest{EngineID: kv.engineID, RequestID: kv.requestID, BlockIDs: kv.blockIDs}
	if err := r.sideCall(ctx, remoteOf(kv).url+PathKVRead, q, &a); err != nil {
		return err
	}
	bs := r.cfg.BlockSize
	// The prompt's blocks lead the ones held (more when the prefill
	// generated more than one token).
	if want := (j.prompts[0].tokens + bs - 1) / bs; a.BlockSize != bs || a.NumBlocks < want {
		return fmt.Errorf("the prefill side holds %d blocks of %d tokens, this prompt needs %d of %d",
			a.NumBlocks, a.BlockSize, want, bs)
	}
	return nil
}

// notePull reports a remote-prefill call's pull: the sim's header and, when
// the prefill side could not be read, vLLM's failed-transfer counter and a
// warning.
func (r *Replica) notePull(w http.ResponseWriter, cl *call, pullErr error) {
	if pullErr == nil {
		w.Header().Set(HeaderKVPull, "pulled")
		return
	}
	w.Header().Set(HeaderKVPull, "recomputed: "+strings.ReplaceAll(pullErr.Error(), "\n", " "))
	cl.core.metrics.failedTransfers.Inc()
	r.log.Warn("sim: KV pull failed, computing the prompt locally", "replica", r.url, "error", pullErr)
}

// releaser sends the decode side's notifications to prefill replicas from
// one goroutine, so that the engine's driver never waits on the network.
type releaser struct {
	queue chan releaseJob
}

type releaseJob struct {
	remote *kvRemote
	core   *core // the decode core, whose counter a failure bumps
}

// releaseQueue bounds the notifications waiting to be sent; beyond it they
// are dropped and counted as failed (the prefill side's timeout frees the
// blocks).
const releaseQueue = 4096

// release queues the notification that ends a remote hold. r.mu may be held.
func (r *Replica) release(c *core, remote *kvRemote) {
	select {
	case r.releases.queue <- releaseJob{remote, c}:
	default:
		c.metrics.failedNotifications.Inc()
	}
}

// sendReleases is the releaser's loop, until the replica stops (which
// cancels sideCtx, cutting a call under way).
func (r *Replica) sendReleases() {
	defer r.wg.Done()
	ctx := r.sideCtx
	for {
		select {
		case job := <-r.releases.queue:
			q := kvReadRequest{EngineID: job.remote.engineID, RequestID: job.remote.requestID}
			var ans map[string]bool
			if err := r.sideCall(ctx, job.remote.url+PathKVRelease, q, &ans); err != nil {
				job.core.metrics.failedNotifications.Inc()
				if !errors.Is(err, context.Canceled) {
					r.log.Warn("sim: KV release notification failed", "replica", r.url, "error", err)
				}
			}
		case <-r.done:
			return
		}
	}
}
