package gateway

import (
	"sync"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"
)

// seriesCache keeps, by policy and replica, the children of the series a
// served attempt updates (settled, the receipt's check): WithLabelValues
// hashes its labels and takes its vector's lock on every call, some ten
// times per request. Each child is made on first use, by WithLabelValues
// itself, so that a series appears when first counted, as before; a
// replica's go when its series do (forgetReplica).
type seriesCache struct {
	mu sync.RWMutex
	by map[seriesKey]*servedSeries
}

type seriesKey struct{ policy, replica string }

// servedSeries are one policy's and replica's children.
type servedSeries struct {
	ok, served, checks lazyCounter // requests{code="200"}, attempts{verdict="served"}, route checks
	prompt, gen        lazyCounter
	cached, reported   lazyCounter
	branch             [3]lazyCounter // held, spilled, miss
	e2e, ttft          lazyObserver
}

// of is the policy's and replica's series.
func (c *seriesCache) of(policy, replica string) *servedSeries {
	k := seriesKey{policy, replica}
	c.mu.RLock()
	s := c.by[k]
	c.mu.RUnlock()
	if s != nil {
		return s
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if s = c.by[k]; s == nil {
		if c.by == nil {
			c.by = map[seriesKey]*servedSeries{}
		}
		s = &servedSeries{}
		c.by[k] = s
	}
	return s
}

// forget drops the replica's series (call after deleting them from their
// vectors: a later attempt makes them anew).
func (c *seriesCache) forget(replica string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for k := range c.by {
		if k.replica == replica {
			delete(c.by, k)
		}
	}
}

// lazyCounter is a child counter made on first use by mk.
type lazyCounter struct {
	c atomic.Pointer[prometheus.Counter]
}

func (l *lazyCounter) get(mk func() prometheus.Counter) prometheus.Counter {
	if c := l.c.Load(); c != nil {
		return *c
	}
	c := mk() // racing first uses get the same child from the vector
	l.c.Store(&c)
	return c
}

// lazyObserver is a child histogram made on first use by mk.
type lazyObserver struct {
	o atomic.Pointer[prometheus.Observer]
}

func (l *lazyObserver) get(mk func() prometheus.Observer) prometheus.Observer {
	if o := l.o.Load(); o != nil {
		return *o
	}
	o := mk()
	l.o.Store(&o)
	return o
}
