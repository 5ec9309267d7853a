package fleet

import (
	"context"
	"io"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
)

// NewRequest is the one builder of a request to a replica, whoever sends
// it (the gateway's proxied requests and remote tokenization, the fleet's
// probes and scrapes): the replica's base URL as configured, path joined
// to it as a path (set on the URL, never re-parsed from a string: net/url
// escapes it afresh, so nothing in it is decoded a second time), the
// header header writes (nil: none), and the replica's key, when it has
// one, as the bearer token over any Authorization header wrote. The error
// is the base URL's (checked when it was configured) or the method's.
func NewRequest(ctx context.Context, method, base, apiKey, path string, body io.Reader, header func(http.Header)) (*http.Request, error) {
	u, err := baseURLs.get(base)
	if err != nil {
		return nil, err
	}
	// An empty URL parses to nothing: the request's URL is the parsed
	// base, copied into the one NewRequestWithContext allocated.
	req, err := http.NewRequestWithContext(ctx, method, "", body)
	if err != nil {
		return nil, err
	}
	*req.URL = *u
	req.Host = u.Host
	req.URL.Path, req.URL.RawPath = strings.TrimSuffix(req.URL.Path, "/")+path, ""
	if header != nil {
		header(req.Header)
	}
	if apiKey != "" {
		req.Header.Set("Authorization", "Bearer "+apiKey)
	}
	return req, nil
}

// baseURLs caches the parsed base URLs of the replicas: every request to
// a replica would otherwise parse its URL again (a string that changes
// only with the configuration). Bounded: past maxBaseURLs entries (a
// discovery that churns through addresses) it starts afresh.
var baseURLs urlCache

const maxBaseURLs = 4096

type urlCache struct {
	m sync.Map // string → *url.URL, never modified once stored
	n atomic.Int64
}

// get is base parsed (its empty port removed, as http.NewRequest does).
func (c *urlCache) get(base string) (*url.URL, error) {
	if u, ok := c.m.Load(base); ok {
		return u.(*url.URL), nil
	}
	u, err := url.Parse(base)
	if err != nil {
		return nil, err
	}
	u.Host = strings.TrimSuffix(u.Host, ":")
	if c.n.Add(1) > maxBaseURLs {
		c.m.Clear()
		c.n.Store(1)
	}
	c.m.Store(base, u)
	return u, nil
}
