package gateway

import (
	"hash/fnv"

	"github.com/kvgate/kvgate/internal/router"
	"github.com/kvgate/kvgate/internal/sharedstate"
)

// newSyncer is the shared-state syncer (shared_state), nil when off. It
// is built before the router, whose OnLearn it is. In precise mode the
// index needs no sharing (every gateway follows every replica's events):
// only loads are shared. The snapshot's cap follows the index's bound
// (index_max_entries), as the state file's does.
func newSyncer(cfg Config, o Options) (*sharedstate.Syncer, error) {
	if cfg.SharedState == "" {
		return nil, nil
	}
	return sharedstate.New(sharedstate.Options{URL: cfg.SharedState, Namespace: cfg.SharedStateNamespace,
		ShareDecisions: !cfg.Precise(), MaxSnapshotBytes: sharedstate.SnapshotBytesFor(cfg.IndexMaxEntries),
		Clock: o.Clock, Log: o.Logger, Registerer: o.Registry})
}

// policySeed seeds the policy's random tie breaks: the configured seed,
// mixed with this gateway's own id when it shares state. Gateways deployed
// from one configuration would otherwise break every tie alike, and send
// the requests that reach them at the same instant to the same replica.
func policySeed(seed uint64, s *sharedstate.Syncer) uint64 {
	if s == nil {
		return seed
	}
	h := fnv.New64a()
	_, _ = h.Write([]byte(s.Gateway()))
	return seed ^ h.Sum64()
}

// onLearn is the router's OnLearn: the syncer's, when sharing.
func onLearn(s *sharedstate.Syncer) func(router.Learned) {
	if s == nil {
		return nil
	}
	return s.OnLearn
}

// loadStateFile warms the index from state_file, written at the last
// shutdown. A missing file is a cold start; a bad one is logged and
// ignored (the gateway starts cold rather than not at all).
func (g *Gateway) loadStateFile() {
	if g.cfg.StateFile == "" {
		return
	}
	n, err := sharedstate.LoadFile(g.cfg.StateFile, g.rt, sharedstate.SnapshotBytesFor(g.cfg.IndexMaxEntries))
	switch {
	case err != nil:
		g.log.Warn("state_file cannot be read: starting with an empty index", "path", g.cfg.StateFile, "err", err)
	case n > 0:
		g.log.Info("index restored from state_file", "path", g.cfg.StateFile, "blocks", n)
	}
}

// loadResponseHomes restores the stored responses' homes and owners
// saved beside state_file (responses_file.go), once the passthrough
// routes that keep them exist.
func (g *Gateway) loadResponseHomes() {
	if g.cfg.StateFile == "" || g.pt == nil {
		return
	}
	path := responsesPath(g.cfg.StateFile)
	n, err := g.pt.homes.load(path)
	switch {
	case err != nil:
		g.log.Warn("stored responses' homes cannot be read: starting without them", "path", path, "err", err)
	case n > 0:
		g.log.Info("stored responses' homes restored", "path", path, "responses", n)
	}
}

// saveStateFile writes the index to state_file, and the stored responses'
// homes beside it (at the end of Run).
func (g *Gateway) saveStateFile() {
	if g.cfg.StateFile == "" {
		return
	}
	if g.pt != nil {
		path := responsesPath(g.cfg.StateFile)
		if n, err := g.pt.homes.save(path); err != nil {
			g.log.Warn("stored responses' homes cannot be written", "path", path, "err", err)
		} else if n > 0 {
			g.log.Info("stored responses' homes saved", "path", path, "responses", n)
		}
	}
	if err := sharedstate.SaveFile(g.cfg.StateFile, g.rt, g.clock.Now()); err != nil {
		g.log.Warn("state_file cannot be written", "path", g.cfg.StateFile, "err", err)
		return
	}
	g.log.Info("index saved to state_file", "path", g.cfg.StateFile, "blocks", g.rt.Index().Len())
}
