package replay

// tierSummary adds what the host tiers and peer pulls did to a run's
// extras: prompt tokens loaded from the host tiers and pulled from peers,
// pulls done and pulls that found nothing more than the puller's own hit,
// and blocks the host tiers evicted (only when there was any).
func (vr *virtualRun) tierSummary(extra map[string]float64) {
	var host, pulled, pulls, misses, evicted int64
	for _, rep := range vr.replicas {
		st := rep.engine.Stats()
		host += st.HostLoadTokens
		pulled += st.PeerPullTokens
		pulls += st.PeerPulls
		misses += st.PeerPullMisses
		evicted += st.HostEvicted
	}
	if vr.cfg.OffloadBlocks > 0 {
		extra["host_load_tokens"] = float64(host)
		extra["host_evicted_blocks"] = float64(evicted)
	}
	if vr.cfg.Pulls {
		extra["peer_pull_tokens"] = float64(pulled)
		extra["peer_pulls"] = float64(pulls)
		extra["peer_pull_misses"] = float64(misses)
	}
}
