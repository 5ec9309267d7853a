package gateway

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"sync/atomic"

	"github.com/cespare/xxhash/v2"
	lru "github.com/hashicorp/golang-lru/v2"

	"github.com/kvgate/kvgate/internal/prompt"
)

// remoteTokenizer asks a replica for the engine's own token ids (vLLM's
// POST /tokenize, which takes a prompt or chat messages and applies the chat
// template), so that in precise mode the gateway hashes exactly the tokens
// the engine's KV events carry. Calls are spread over the healthy replicas
// (round robin), each bounded by tokenize_timeout, at most two replicas per
// request; when none answers in time the approximate tokenizer routes the
// request. Answers are cached (bounded LRU, keyed by a hash of the request's
// kind, model and text).
type remoteTokenizer struct {
	g     *Gateway
	cache *lru.Cache[uint64, []uint32]
	next  atomic.Uint64
}

func newRemoteTokenizer(g *Gateway, entries int) *remoteTokenizer {
	c, _ := lru.New[uint64, []uint32](entries)
	return &remoteTokenizer{g: g, cache: c}
}

// tokenizeTries bounds the replicas one request asks.
const tokenizeTries = 2

// tokenize returns the engine's token ids, or false to route on the
// approximate tokenizer.
func (t *remoteTokenizer) tokenize(ctx context.Context, kind prompt.Kind, p *prompt.Parsed, body []byte) ([]uint32, bool) {
	key := xxhash.Sum64String(kind.String() + "\x00" + p.Model + "\x00" + p.Text)
	if ids, ok := t.cache.Get(key); ok {
		t.g.met.tokenize.WithLabelValues("cache").Inc()
		return ids, true
	}
	data, err := tokenizeBody(kind, p, body)
	if err != nil {
		return nil, false
	}
	n := t.g.rt.Replicas()
	if n == 0 {
		return nil, false // discovery has found no replica yet
	}
	start := int(t.next.Add(1) % uint64(n))
	tries := 0
	var lastErr error
	// With pools, only a replica of the model's pool tokenizes it: another
	// pool's replica, not listed yet, would take it with another model's
	// tokenizer.
	pool, _ := t.g.rt.PoolFor(p.Model)
	for k := range n {
		i := (start + k) % n
		if r := t.g.rt.Replica(i); !r.Healthy() || r.Removed() || !r.Serves(p.Model) || r.Pool() != pool {
			continue
		}
		ids, err := t.call(ctx, i, data)
		if err == nil {
			t.cache.Add(key, ids)
			t.g.met.tokenize.WithLabelValues("remote").Inc()
			return ids, true
		}
		lastErr = err
		if tries++; tries == tokenizeTries || ctx.Err() != nil {
			break
		}
	}
	t.g.met.tokenize.WithLabelValues("fallback").Inc()
	t.g.log.Debug("remote tokenizer unavailable; routing on the approximate tokenizer", "err", lastErr)
	return nil, false
}

func tokenizeBody(kind prompt.Kind, p *prompt.Parsed, body []byte) ([]byte, error) {
	req := map[string]any{"model": p.Model}
	if p.Messages && kind != prompt.Responses {
		var b struct {
			Messages json.RawMessage `json:"messages"`
		}
		if err := json.Unmarshal(body, &b); err != nil {
			return nil, err
		}
		req["messages"] = b.Messages
	} else {
		req["prompt"] = p.Text
	}
	return json.Marshal(req)
}

func (t *remoteTokenizer) call(ctx context.Context, i int, data []byte) ([]uint32, error) {
	ctx, cancel := context.WithTimeout(ctx, t.g.conf().TokenizeTimeout.D())
	defer cancel()
	rep := t.g.rt.Replica(i)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, rep.URL()+"/tokenize", bytes.NewReader(data))
	if err != nil {
		return nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	if k := rep.APIKey(); k != "" {
		req.Header.Set("Authorization", "Bearer "+k)
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
