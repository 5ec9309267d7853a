package workload

import (
	"errors"
	"fmt"
	"hash/fnv"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"
)

// A multi-tenant workload: each tenant its own workload (generator,
// parameters, size, seed: its own prompts), its own arrival rate and
// priority, and for `kvgate bench` its own API key and closed-loop
// concurrency. Mix merges the tenants' requests by arrival, each tagged
// with its tenant and priority, for the replay and for an open-loop bench;
// a closed-loop bench runs each tenant's requests with its own clients.

// TenantSpec is one tenant of a multi-tenant workload.
type TenantSpec struct {
	Name string
	// Spec is the tenant's workload (Seed 0: derived from the run's seed
	// and the tenant's name, so that tenants' prompts differ).
	Spec Spec
	// Rate is its Poisson arrival rate, requests/s (0: closed loop at
	// Concurrency, bench only).
	Rate        float64
	Concurrency int
	Priority    int
	// Deadline is its requests' time-to-first-token deadline (0: none).
	Deadline time.Duration
	// Key is its API key (bench: sent as Authorization: Bearer).
	Key string
	// Weight is its share where flow control weighs tenants (replay: the
	// router's FlowTenant.Weight; 0: 1).
	Weight float64
}

// ErrTenant is wrapped by every error of a tenant's spec.
var ErrTenant = errors.New("bad tenant spec")

// ParseTenant reads a tenant from the --tenant form: comma-separated
// name=value pairs, name= first; workload= (default random), requests=,
// rate=, concurrency=, priority=, deadline= (a duration), key=, seed=,
// weight=, and any other name a parameter of its workload.
func ParseTenant(s string) (TenantSpec, error) {
	t := TenantSpec{Spec: Spec{Name: "random"}}
	var params []string
	for _, kv := range strings.Split(s, ",") {
		k, v, ok := strings.Cut(strings.TrimSpace(kv), "=")
		if !ok || k == "" {
			return t, fmt.Errorf("%w: %q is not name=value", ErrTenant, kv)
		}
		if err := t.set(k, v, &params); err != nil {
			return t, fmt.Errorf("%w: %s: %v", ErrTenant, k, err)
		}
	}
	if t.Name == "" || len(t.Name) > MaxTenantName {
		return t, fmt.Errorf("%w: name= is missing or longer than %d bytes", ErrTenant, MaxTenantName)
	}
	for _, p := range params {
		if err := t.Spec.SetParam(p); err != nil {
			return t, fmt.Errorf("%w: tenant %s: %w", ErrTenant, t.Name, err)
		}
	}
	if t.Rate == 0 && t.Concurrency == 0 {
		return t, fmt.Errorf("%w: tenant %s needs rate= or concurrency=", ErrTenant, t.Name)
	}
	return t, nil
}

// set sets one key of a tenant spec; the workload's parameters are kept
// in params until the workload is known.
func (t *TenantSpec) set(k, v string, params *[]string) error {
	var err error
	switch k {
	case "name":
		t.Name = v
	case "workload":
		var sp Spec
		if sp, err = Parse(v); err == nil {
			t.Spec.Name, t.Spec.Path = sp.Name, sp.Path
		}
	case "requests":
		t.Spec.Requests, err = boundedInt(v, 1, MaxRequests)
	case "concurrency":
		t.Concurrency, err = boundedInt(v, 1, 1<<16)
	case "priority":
		t.Priority, err = boundedInt(v, -MaxPriority, MaxPriority)
	case "seed":
		t.Spec.Seed, err = strconv.ParseUint(v, 10, 64)
	case "key":
		t.Key = v
	case "rate":
		t.Rate, err = strconv.ParseFloat(v, 64)
		if err == nil && (!(t.Rate > 0) || math.IsInf(t.Rate, 0)) {
			err = errors.New("must be a positive number of requests per second")
		}
	case "weight":
		t.Weight, err = strconv.ParseFloat(v, 64)
		if err == nil && (!(t.Weight > 0) || math.IsInf(t.Weight, 0)) {
			err = errors.New("must be a positive number")
		}
	case "deadline":
		t.Deadline, err = time.ParseDuration(v)
		if err == nil && t.Deadline <= 0 {
			err = errors.New("must be positive")
		}
	default:
		*params = append(*params, k+"="+v)
	}
	return err
}

func boundedInt(v string, lo, hi int) (int, error) {
	n, err := strconv.Atoi(v)
	if err != nil || n < lo || n > hi {
		return 0, fmt.Errorf("%q is not an integer in [%d, %d]", v, lo, hi)
	}
	return n, nil
}

// Generate makes the tenant's requests: its workload with its seed,
// Poisson arrivals at its rate (closed loop: none), tagged.
func (t *TenantSpec) Generate(seed uint64) ([]Request, error) {
	sp := t.Spec
	if sp.Seed == 0 {
		h := fnv.New64a()
		h.Write([]byte(t.Name))
		sp.Seed = seed ^ h.Sum64()
	}
	reqs, err := Generate(sp)
	if err != nil {
		return nil, fmt.Errorf("tenant %s: %w", t.Name, err)
	}
	Arrivals(reqs, t.Rate, sp.Seed)
	for i := range reqs {
		reqs[i].Tenant, reqs[i].Priority, reqs[i].Deadline = t.Name, t.Priority, t.Deadline
	}
	return reqs, nil
}

// Mix generates every tenant's requests (each open loop: Rate > 0) and
// merges them by arrival (ties by tenant order); Index and Prev are
// renumbered.
func Mix(ts []TenantSpec, seed uint64) ([]Request, error) {
	var all []Request
	seen := map[string]bool{}
	for _, t := range ts {
		if seen[t.Name] {
			return nil, fmt.Errorf("%w: tenant %s is given twice", ErrTenant, t.Name)
		}
		seen[t.Name] = true
		if t.Rate <= 0 {
			return nil, fmt.Errorf("%w: tenant %s has no rate: a merged workload is open loop", ErrTenant, t.Name)
		}
		reqs, err := t.Generate(seed)
		if err != nil {
			return nil, err
		}
		base := len(all)
		for _, r := range reqs {
			r.Index += base
			if r.Prev >= 0 {
				r.Prev += base
			}
			all = append(all, r)
		}
		if len(all) > MaxRequests {
			return nil, fmt.Errorf("%w: %d requests, at most %d", ErrTooLarge, len(all), MaxRequests)
		}
	}
	order := make([]int, len(all))
	for i := range order {
		order[i] = i
	}
	slices.SortStableFunc(order, func(a, b int) int { return int(min(max(all[a].At-all[b].At, -1), 1)) })
	pos := make([]int, len(all))
	for newIdx, old := range order {
		pos[old] = newIdx
	}
	out := make([]Request, len(all))
	for newIdx, old := range order {
		r := all[old]
		r.Index = newIdx
		if r.Prev >= 0 {
			r.Prev = pos[r.Prev]
		}
		out[newIdx] = r
	}
	return out, nil
}
