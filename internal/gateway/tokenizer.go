package gateway

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"time"

	"github.com/cespare/xxhash/v2"
	lru "github.com/hashicorp/golang-lru/v2"

	"github.com/kvgate/kvgate/internal/prompt"
)

// remoteTokenizer asks a replica for the engine's own token ids (vLLM's
// POST /tokenize, which takes a prompt or chat messages and applies the chat
// template), so that in precise mode the gateway hashes exactly the tokens
// the engine's KV events carry. Answers are cached (bounded LRU, keyed by a
// hash of the request's model and text).
type remoteTokenizer struct {
	g     *Gateway
	cache *lru.Cache[uint64, []uint32]
}

func newRemoteTokenizer(g *Gateway, entries int) *remoteTokenizer {
	c, _ := lru.New[uint64, []uint32](entries)
	return &remoteTokenizer{g: g, cache: c}
}

func (t *remoteTokenizer) tokenize(ctx context.Context, kind prompt.Kind, p *prompt.Parsed, body []byte) ([]uint32, error) {
	key := xxhash.Sum64String(kind.String() + "\x00" + p.Model + "\x00" + p.Text)
	if ids, ok := t.cache.Get(key); ok {
		return ids, nil
	}
	req := map[string]any{"model": p.Model}
	if kind == prompt.Chat {
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
	data, _ := json.Marshal(req)
	var lastErr error = errors.New("no healthy replica to tokenize with")
	for i := range t.g.rt.Replicas() {
		if !t.g.rt.Healthy(i) {
			continue
		}
		ids, err := t.call(ctx, i, data)
		if err == nil {
			t.cache.Add(key, ids)
			return ids, nil
		}
		lastErr = err
	}
	return nil, lastErr
}

func (t *remoteTokenizer) call(ctx context.Context, i int, data []byte) ([]uint32, error) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, t.g.rt.URL(i)+"/tokenize", bytes.NewReader(data))
	if err != nil {
		return nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	if k := t.g.cfg.Replicas[i].APIKey; k != "" {
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
