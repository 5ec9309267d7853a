package policy

import "fmt"

func init() {
	register("session", func(o Options) (Policy, error) {
		params := sessionParams{VNodes: defaultVNodes}
		if err := decodeParams(o.Params, &params); err != nil {
			return nil, err
		}
		if params.VNodes < 1 {
			return nil, fmt.Errorf("%w: vnodes must be at least 1", ErrParam)
		}
		return &Session{ring: ringCache{vnodes: params.VNodes}, ll: LeastLoad{g: newRNG(o.Seed)}}, nil
	})
}

type sessionParams struct {
	VNodes int `json:"vnodes"` // ring points per replica
}

// Session pins a session to a replica by consistent hashing of the session
// key (X-Session-Id, else the body's "user"): every turn of a conversation
// lands where its history is cached, and a replica going down moves only its
// own sessions (to the next healthy replica clockwise). Requests without a
// key are balanced by least load.
type Session struct {
	ring ringCache
	ll   LeastLoad
}

var _ Policy = (*Session)(nil)

func (*Session) Name() string { return "session" }

func (p *Session) Pick(req *Request, rs []ReplicaView) (Decision, error) {
	if req.Session == "" {
		d, err := p.ll.Pick(req, rs)
		d.Reason = "no session key: fewest in flight"
		return d, err
	}
	_, i := p.ring.get(rs).walk(hashKey(req.Session), rs, nil)
	if i < 0 {
		return Decision{}, ErrNoReplica
	}
	return decide(rs, i, "consistent hash of the session key", 0, float64(rs[i].InFlight)), nil
}
