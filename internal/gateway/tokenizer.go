package gateway

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"sync/atomic"

	"github.com/cespare/xxhash/v2"
	lru "github.com/hashicorp/golang-lru/v2"
	"golang.org/x/sync/singleflight"

	"github.com/kvgate/kvgate/internal/fleet"
	"github.com/kvgate/kvgate/internal/prompt"
	"github.com/kvgate/kvgate/internal/router"
)

// remoteTokenizer asks a replica for the engine's own token ids (vLLM's
// POST /tokenize, which takes a prompt or chat messages and applies the chat
// template), so that in precise mode the gateway hashes exactly the tokens
// the engine's KV events carry. Calls are spread over the healthy replicas
// (round robin), each bounded by tokenize_timeout, at most two replicas per
// lookup; when none answers in time the approximate tokenizer routes the
// request. Answers are cached (bounded LRU, keyed by a hash of the request's
// kind, model, cache salt and text), and concurrent lookups of one key are merged
// (singleflight): a burst of identical prompts asks a replica once.
type remoteTokenizer struct {
	g     *Gateway
	cache *lru.Cache[uint64, []uint32]
	next  atomic.Uint64
	calls singleflight.Group // by key, in hex
	// testHookJoined, when set (tests only), runs once a request has
	// started or joined the lookup of its key, before it waits for it.
	testHookJoined func()
}

func newRemoteTokenizer(g *Gateway, entries int) *remoteTokenizer {
	c, _ := lru.New[uint64, []uint32](entries)
	return &remoteTokenizer{g: g, cache: c}
}

// tokenizeTries bounds the replicas one lookup asks.
const tokenizeTries = 2

// errNoTokenizer: no replica of the model's pool may tokenize now.
var errNoTokenizer = errors.New("no healthy replica of the model's pool to tokenize")

// tokenized is a lookup's answer, and the result label of the request that
// ran it (cache, when a lookup of the same key had just filled the cache).
type tokenized struct {
	ids    []uint32
	result string
}

// tokenize returns the engine's token ids, or false to route on the
// approximate tokenizer. The lookup it starts or joins runs apart from the
// request's context (bounded by tokenize_timeout per try), so that a client
// that hangs up fails no other request waiting on the same lookup; this
// request alone stops waiting when its context ends.
func (t *remoteTokenizer) tokenize(ctx context.Context, kind prompt.Kind, p *prompt.Parsed, model router.Resolved, body []byte) ([]uint32, bool) {
	key := tokenizeKey(kind, p)
	if ids, ok := t.cache.Get(key); ok {
		t.g.met.tokenize.WithLabelValues("cache").Inc()
		return ids, true
	}
	data, err := tokenizeBody(kind, p, body)
	if err != nil || t.g.rt.Replicas() == 0 {
		return nil, false // discovery has found no replica yet: nothing to route to either
	}
	ran := false // this request runs the lookup (read after the receive)
	wait := t.calls.DoChan(strconv.FormatUint(key, 16), func() (any, error) {
		ran = true
		return t.lookup(context.WithoutCancel(ctx), key, model, data)
	})
	if t.testHookJoined != nil {
		t.testHookJoined()
	}
	var res singleflight.Result
	select {
	case res = <-wait:
	case <-ctx.Done():
		res.Err = context.Cause(ctx)
	}
	if res.Err != nil {
		t.g.met.tokenize.WithLabelValues("fallback").Inc()
		t.g.log.Debug("remote tokenizer unavailable; routing on the approximate tokenizer", "err", res.Err)
		return nil, false
	}
	tk := res.Val.(tokenized)
	if !ran {
		tk.result = "shared"
	}
	t.g.met.tokenize.WithLabelValues(tk.result).Inc()
	return tk.ids, true
}

// lookup asks up to tokenizeTries healthy replicas of the model's pool, from
// the next in round robin, and caches the first answer.
func (t *remoteTokenizer) lookup(ctx context.Context, key uint64, model router.Resolved, data []byte) (tokenized, error) {
	if ids, ok := t.cache.Get(key); ok {
		return tokenized{ids, "cache"}, nil // a lookup of this key ended since the caller's miss
	}
	n := t.g.rt.Replicas()
	if n == 0 {
		return tokenized{}, errNoTokenizer
	}
	start := int(t.next.Add(1) % uint64(n))
	tries := 0
	lastErr := errNoTokenizer
	// With pools, only a replica of the model's pool tokenizes it: another
	// pool's replica, not listed yet, would take it with another model's
	// tokenizer.
	pool, _ := model.Pool()
	for k := range n {
		i := (start + k) % n
		if r := t.g.rt.Replica(i); !r.Healthy() || r.Removed() || !r.Serves(model.Model) || r.Pool() != pool {
			continue
		}
		ids, err := t.call(ctx, i, data)
		if err == nil {
			t.cache.Add(key, ids)
			return tokenized{ids, "remote"}, nil
		}
		lastErr = err
		if tries++; tries == tokenizeTries {
			break
		}
	}
	return tokenized{}, lastErr
}

func tokenizeBody(kind prompt.Kind, p *prompt.Parsed, body []byte) ([]byte, error) {
	req := map[string]any{"model": p.Model}
	switch {
	case kind == prompt.Messages || kind == prompt.CountTokens:
		// The chat vLLM converts the call to, tools included: its template
		// renders them ahead of the conversation.
		msgs, tools, err := prompt.AnthropicChatOf(body)
		if err != nil {
			return nil, err
		}
		req["messages"] = msgs
		if len(tools) > 0 {
			req["tools"] = tools
		}
	case p.Messages && kind != prompt.Responses:
		var b struct {
			Messages json.RawMessage `json:"messages"`
		}
		if err := json.Unmarshal(body, &b); err != nil {
			return nil, err
		}
		req["messages"] = b.Messages
		// What else the chat template renders: the tools, a thinking
		// switch in chat_template_kwargs, a continued final message...
		// Without them the engine's tokens, and its KV events' blocks,
		// differ from the ones looked up.
		for _, f := range p.Render {
			req[f.Key] = f.Value
		}
	default:
		req["prompt"] = p.Text
	}
	return json.Marshal(req)
}

// tokenizeKey is a lookup's cache key: what decides the engine's tokens
// (the kind, the model, the rendered text and what else the chat template
// renders), and the salt (a tenant's, when it isolates its cache: an
// isolated tenant's prompt is no other's cache hit, whose speed would tell
// that someone just sent that text).
func tokenizeKey(kind prompt.Kind, p *prompt.Parsed) uint64 {
	d := xxhash.New()
	// Each field after its length: a salt or a text may hold any byte, so
	// no separator could keep two pairs of them from spelling one key.
	var n [binary.MaxVarintLen64]byte
	field := func(s string) {
		_, _ = d.Write(n[:binary.PutUvarint(n[:], uint64(len(s)))])
		_, _ = d.WriteString(s)
	}
	for _, s := range []string{kind.String(), p.Model, p.CacheSalt, p.Text} {
		field(s)
	}
	for _, f := range p.Render {
		field(f.Key)
		_, _ = d.Write(n[:binary.PutUvarint(n[:], uint64(len(f.Value)))])
		_, _ = d.Write(f.Value)
	}
	return d.Sum64()
}

// jsonBody marks a request's body as JSON.
func jsonBody(h http.Header) { h.Set("Content-Type", "application/json") }

func (t *remoteTokenizer) call(ctx context.Context, i int, data []byte) ([]uint32, error) {
	ctx, cancel := context.WithTimeout(ctx, t.g.conf().TokenizeTimeout.D())
	defer cancel()
	rep := t.g.rt.Replica(i)
	req, err := fleet.NewRequest(ctx, http.MethodPost, rep.URL(), rep.APIKey(), "/tokenize", bytes.NewReader(data), jsonBody)
	if err != nil {
		return nil, err
	}
	resp, err := t.g.client.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("POST /tokenize: %s", resp.Status)
	}
	var out struct {
		Tokens []uint32 `json:"tokens"`
	}
	if err := json.NewDecoder(io.LimitReader(resp.Body, 64<<20)).Decode(&out); err != nil {
		return nil, fmt.Errorf("POST /tokenize: %w", err)
	}
	return out.Tokens, nil
}
