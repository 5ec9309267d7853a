package router

import "github.com/kvgate/kvgate/internal/policy"

// Resolved is a request's model as the router resolves it, once per
// request: the pool routing it (with pools; the one pool without),
// what the replicas list for it, the partition its prompt is hashed
// under (an adapter's base model, an alias's root) and whether a replica
// serves it. The gateway resolves a request's model when it parses it,
// checks and tokenizes with the resolution, and PrepareIn carries it into
// the request (policy.Request.Pool): routing looks nothing up again.
type Resolved struct {
	Model string
	pool  *pool
	// ref is policy.Request.Pool: 1 + the pool's index, -1 for none.
	ref           int
	info          Model
	listed        bool
	base, adapter string
	served        bool
}

// Resolve resolves model (Resolved).
func (rt *Router) Resolve(model string) Resolved {
	m := rt.resolve(model)
	m.served = rt.servesIn(m.pool, model)
	return m
}

// resolve is Resolve less whether a replica serves model.
func (rt *Router) resolve(model string) Resolved {
	m := Resolved{Model: model, ref: -1}
	m.info, m.listed = rt.ModelInfo(model)
	m.base, m.adapter = rt.keyFrom(model, m.info, m.listed)
	if i := rt.poolIndex(model, m.base, m.adapter); i >= 0 {
		m.pool, m.ref = rt.pools[i], i+1
	}
	return m
}

// Served reports what Serves does: some replica of the model's pool
// serves it (or has not been listed), or the pool has none yet.
func (m Resolved) Served() bool { return m.served }

// Info is what the replicas list for the model (the first listing found),
// false when none lists it.
func (m Resolved) Info() (Model, bool) { return m.info, m.listed }

// Pool is the name of the pool routing the model ("" with no pools
// configured), false when no pool routes it.
func (m Resolved) Pool() (string, bool) {
	if m.pool == nil {
		return "", false
	}
	return m.pool.name, true
}

// Policy is the policy of the model's pool now (the router's own without
// pools; nil when no pool routes the model).
func (m Resolved) Policy() policy.Policy {
	if m.pool == nil {
		return nil
	}
	return m.pool.pol.Load().pol
}

// poolOfRequest is the pool routing req: resolved once when it was
// prepared (policy.Request.Pool), else resolved from its model now (a
// request made by hand, a peer gateway's decision).
func (rt *Router) poolOfRequest(req *policy.Request) *pool {
	switch i := req.Pool; {
	case i > 0 && i <= len(rt.pools):
		return rt.pools[i-1]
	case i < 0:
		return nil
	}
	return rt.poolFor(req.Model)
}
