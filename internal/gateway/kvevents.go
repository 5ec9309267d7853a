package gateway

import (
	"context"
	"errors"
	"strings"
	"sync"
	"time"

	"github.com/kvgate/kvgate/internal/kvevents"
	"github.com/kvgate/kvgate/internal/prefixindex"
)

// kvSync is the precise index's state for one replica. The index only
// knows what was stored since kvgate subscribed: it is trusted (synced)
// when the stream was followed from the publisher's first message, or once
// the replica has stored as many blocks as its cache holds since the last
// gap (everything older has been evicted by then), or after resyncAfter.
// Until then the approximate index answers for the replica.
type kvSync struct {
	mu          sync.Mutex
	seen        bool
	storedSince int
	since       time.Time
}

const resyncAfter = 2 * time.Minute

func (g *Gateway) runKVEvents(ctx context.Context) {
	var subs []*kvevents.Subscriber
	for i, rc := range g.cfg.Replicas {
		if rc.KVEvents == "" {
			continue
		}
		st := &kvSync{since: g.clock.Now()}
		sub, err := kvevents.SubscribeWithOptions(ctx, rc.KVEvents, "",
			func(m kvevents.Message) { g.onKVMessage(i, st, m) },
			func(expected, got uint64) { g.onKVGap(i, st, expected, got) },
			kvevents.SubscribeOptions{OnError: func(err error) {
				g.log.Debug("kv events", "replica", rc.URL, "endpoint", rc.KVEvents, "err", err)
			}})
		if err != nil {
			g.log.Error("kv events: cannot subscribe; the replica stays on the approximate index",
				"replica", rc.URL, "endpoint", rc.KVEvents, "err", err)
			continue
		}
		subs = append(subs, sub)
	}
	<-ctx.Done()
	for _, s := range subs {
		_ = s.Close()
	}
}

func (g *Gateway) onKVGap(i int, st *kvSync, expected, got uint64) {
	g.log.Warn("kv events: sequence gap; replica falls back to the approximate index until resynchronised",
		"replica", g.rt.URL(i), "expected", expected, "got", got)
	st.mu.Lock()
	st.storedSince, st.since = 0, g.clock.Now()
	st.mu.Unlock()
	g.rt.SetPreciseSynced(i, false)
	_ = g.rt.Precise().Cleared(i)
}

func (g *Gateway) onKVMessage(i int, st *kvSync, m kvevents.Message) {
	p := g.rt.Precise()
	stored := 0
	for _, ev := range m.Batch.Events {
		switch e := ev.(type) {
		case *kvevents.BlockStored:
			if e.Medium != "" && e.Medium != "GPU" {
				continue // offloaded tiers are not what the engine hits first
			}
			err := p.Stored(i, topicModel(m.Topic), e.BlockHashes, e.ParentBlockHash, e.TokenIDs, e.BlockSize, e.LoraName)
			if errors.Is(err, prefixindex.ErrUnknownParent) {
				// A child of a block stored before we subscribed (or lost):
				// the chain cannot be rebuilt; the approximate index covers it.
				continue
			}
			if err != nil {
				g.log.Debug("kv events: stored", "replica", g.rt.URL(i), "err", err)
				continue
			}
			stored += len(e.BlockHashes)
		case *kvevents.BlockRemoved:
			if e.Medium != "" && e.Medium != "GPU" {
				continue
			}
			_ = p.Removed(i, e.BlockHashes)
		case *kvevents.AllBlocksCleared:
			_ = p.Cleared(i)
		}
	}
	st.mu.Lock()
	first := !st.seen
	st.seen = true
	st.storedSince += stored
	capacity := g.cfg.BlocksPerReplica
	if m, _, ok := g.rt.ReplicaMetrics(i); ok && m.NumBlocks > 0 {
		capacity = m.NumBlocks
	}
	synced := (first && m.Seq == 0) || st.storedSince >= capacity || g.clock.Now().Sub(st.since) >= resyncAfter
	if first && m.Seq == 0 {
		st.storedSince = capacity // followed from the start
	}
	st.mu.Unlock()
	if synced {
		g.rt.SetPreciseSynced(i, true)
	}
}

// topicModel is the model of a vLLM KV-event topic "kv@HOST:PORT@MODEL"
// ("" when the topic has no model part).
func topicModel(topic string) string {
	if i := strings.LastIndexByte(topic, '@'); i >= 0 && strings.Count(topic, "@") >= 2 {
		return topic[i+1:]
	}
	return ""
}
