package gateway

import (
	"context"
	"errors"
	"strings"

	"github.com/kvgate/kvgate/internal/kvevents"
	"github.com/kvgate/kvgate/internal/prefixindex"
)

func (g *Gateway) runKVEvents(ctx context.Context) {
	var subs []*kvevents.Subscriber
	for i, rc := range g.cfg.Replicas {
		if rc.KVEvents == "" {
			continue
		}
		g.rt.Replica(i).KVStart(g.clock.Now())
		sub, err := kvevents.SubscribeWithOptions(ctx, rc.KVEvents, "",
			func(m kvevents.Message) { g.onKVMessage(i, m) },
			func(expected, got uint64) { g.onKVGap(i, expected, got) },
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

func (g *Gateway) onKVGap(i int, expected, got uint64) {
	g.log.Warn("kv events: sequence gap; replica falls back to the approximate index until resynchronised",
		"replica", g.rt.URL(i), "expected", expected, "got", got)
	g.rt.Replica(i).KVGap(g.clock.Now())
	_ = g.rt.Precise().Cleared(i)
}

func (g *Gateway) onKVMessage(i int, m kvevents.Message) {
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
	capacity := g.cfg.BlocksPerReplica
	if m, _, ok := g.rt.ReplicaMetrics(i); ok && m.NumBlocks > 0 {
		capacity = m.NumBlocks
	}
	g.rt.Replica(i).KVBatch(m.Seq, stored, capacity, g.clock.Now())
}

// topicModel is the model of a vLLM KV-event topic "kv@HOST:PORT@MODEL"
// ("" when the topic has no model part).
func topicModel(topic string) string {
	if i := strings.LastIndexByte(topic, '@'); i >= 0 && strings.Count(topic, "@") >= 2 {
		return topic[i+1:]
	}
	return ""
}
