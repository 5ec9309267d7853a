package gateway

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"time"

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
	g.watchKVSilence(ctx)
	for _, s := range subs {
		_ = s.Close()
	}
}

// kvSilence is how long a replica configured for KV events may send none
// before kvgate warns: vLLM publishes a batch for every step that stores or
// evicts a block, so a minute of silence under traffic is a misconfigured
// publisher (endpoint, topic, --kv-events-config), not a quiet engine.
const kvSilence = time.Minute

// watchKVSilence warns once when a replica's KV events stop for kvSilence,
// and notes once when they come back, until ctx ends.
func (g *Gateway) watchKVSilence(ctx context.Context) {
	tick := g.clock.NewTicker(kvSilence / 4)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C():
		}
		for i, rc := range g.cfg.Replicas {
			if rc.KVEvents == "" {
				continue
			}
			changed, silent := g.rt.Replica(i).KVSilence(g.clock.Now(), kvSilence)
			switch {
			case changed && silent:
				g.log.Warn("kv events: none received for a minute; the replica is routed on the approximate index. "+
					"Check the replica's KV-event publisher (vLLM --kv-events-config) and this endpoint",
					"replica", rc.URL, "endpoint", rc.KVEvents)
			case changed:
				g.log.Info("kv events: arriving again", "replica", rc.URL)
			}
		}
	}
}

func (g *Gateway) onKVGap(i int, expected, got uint64) {
	g.met.kvGaps.WithLabelValues(g.rt.URL(i)).Inc()
	g.log.Warn("kv events: sequence gap; replica falls back to the approximate index until resynchronised",
		"replica", g.rt.URL(i), "expected", expected, "got", got)
	g.rt.Replica(i).KVGap(g.clock.Now())
	_ = g.rt.Precise().Cleared(i)
}

func (g *Gateway) onKVMessage(i int, m kvevents.Message) {
	g.met.kvBatches.WithLabelValues(g.rt.URL(i)).Inc()
	p := g.rt.Precise()
	stored := 0
	for _, ev := range m.Batch.Events {
		switch e := ev.(type) {
		case *kvevents.BlockStored:
			if e.Medium != "" && e.Medium != "GPU" {
				continue // offloaded tiers are not what the engine hits first
			}
			err := p.Stored(i, topicModel(m.Topic), e.BlockHashes, e.ParentBlockHash, e.TokenIDs, e.BlockSize, e.LoraName)
			if err != nil {
				// A child of a block stored before we subscribed (or lost)
				// cannot be chained; the approximate index covers it.
				g.kvDropped(i, err)
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

// kvDropped counts a stored event the precise index could not take, by
// reason, and logs each replica's first drop of each reason at warn level
// (a misconfiguration shows at once; the counter shows how often).
func (g *Gateway) kvDropped(i int, err error) {
	reason := "other"
	switch {
	case errors.Is(err, prefixindex.ErrUnknownParent):
		reason = "unknown_parent"
	case errors.Is(err, prefixindex.ErrBlockSize):
		reason = "block_size"
	}
	c := g.met.kvDropped.WithLabelValues(g.rt.URL(i), reason)
	c.Inc()
	if _, logged := g.kvLogged.LoadOrStore(g.rt.URL(i)+"\x00"+reason, true); logged {
		return
	}
	level := slog.LevelWarn
	if reason == "unknown_parent" {
		level = slog.LevelInfo // expected after a late join: the parent was stored before we listened
	}
	g.log.Log(context.Background(), level, "kv events: stored blocks dropped from the precise index (logged once per cause)",
		"replica", g.rt.URL(i), "reason", reason, "err", err)
}

// topicModel is the model of a vLLM KV-event topic "kv@HOST:PORT@MODEL"
// ("" when the topic has no model part).
func topicModel(topic string) string {
	if i := strings.LastIndexByte(topic, '@'); i >= 0 && strings.Count(topic, "@") >= 2 {
		return topic[i+1:]
	}
	return ""
}
