package fleet

import (
	"context"
	"io"
	"net/http"
	"strings"
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
	req, err := http.NewRequestWithContext(ctx, method, base, body)
	if err != nil {
		return nil, err
	}
	req.URL.Path, req.URL.RawPath = strings.TrimSuffix(req.URL.Path, "/")+path, ""
	if header != nil {
		header(req.Header)
	}
	if apiKey != "" {
		req.Header.Set("Authorization", "Bearer "+apiKey)
	}
	return req, nil
}
