package fleet

import (
	"context"
	"go/ast"
	"go/parser"
	"go/token"
	"net/http"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

func TestNewRequest(t *testing.T) {
	for _, c := range []struct {
		name, base, key, path string
		header                http.Header
		wantURL, wantAuth     string
	}{
		{"probe", "http://10.0.0.1:8000", "", "/metrics", nil, "http://10.0.0.1:8000/metrics", ""},
		{"keyed", "http://r:8000", "k1", "/tokenize", nil, "http://r:8000/tokenize", "Bearer k1"},
		{"base path", "http://r:8000/vllm/", "", "/v1/completions", nil, "http://r:8000/vllm/v1/completions", ""},
		// A decoded path is set as a path: escaped afresh, never decoded again.
		{"escaped", "http://r", "", "/v1/responses/a b%2F", nil, "http://r/v1/responses/a%20b%252F", ""},
		{"key over the client's", "http://r", "k2", "/v1/completions", http.Header{"Authorization": {"Bearer client"}, "X-A": {"1"}},
			"http://r/v1/completions", "Bearer k2"},
		{"client's kept without a key", "http://r", "", "/v1/completions", http.Header{"Authorization": {"Bearer client"}},
			"http://r/v1/completions", "Bearer client"},
	} {
		t.Run(c.name, func(t *testing.T) {
			var fill func(http.Header)
			if c.header != nil {
				fill = func(h http.Header) { copyHeader(h, c.header) }
			}
			req, err := NewRequest(context.Background(), http.MethodPost, c.base, c.key, c.path, nil, fill)
			if err != nil {
				t.Fatal(err)
			}
			if got := req.URL.String(); got != c.wantURL {
				t.Errorf("URL %s, want %s", got, c.wantURL)
			}
			if got := req.Header.Get("Authorization"); got != c.wantAuth {
				t.Errorf("Authorization %q, want %q", got, c.wantAuth)
			}
			if c.header.Get("X-A") != req.Header.Get("X-A") {
				t.Error("the header written is not the request's")
			}
		})
	}
	if _, err := NewRequest(context.Background(), "BAD METHOD", "http://r", "", "/", nil, nil); err == nil {
		t.Error("an invalid method built a request")
	}
}

func copyHeader(dst, src http.Header) {
	for k, v := range src {
		dst[k] = v
	}
}

// NewRequest is the one place a request to a replica is built: the
// gateway's and the fleet's code call no other.
func TestOneOutboundRequestBuilder(t *testing.T) {
	for _, dir := range []string{".", "../gateway"} {
		files, err := filepath.Glob(filepath.Join(dir, "*.go"))
		if err != nil || len(files) == 0 {
			t.Fatalf("%s: %v", dir, err)
		}
		for _, f := range files {
			if strings.HasSuffix(f, "_test.go") || filepath.Base(f) == "request.go" {
				continue
			}
			file, err := parser.ParseFile(token.NewFileSet(), f, nil, 0)
			if err != nil {
				t.Fatal(err)
			}
			ast.Inspect(file, func(n ast.Node) bool {
				if sel, ok := n.(*ast.SelectorExpr); ok {
					if x, ok := sel.X.(*ast.Ident); ok && x.Name == "http" && strings.HasPrefix(sel.Sel.Name, "NewRequest") {
						t.Errorf("%s builds a request with http.%s: use fleet.NewRequest", f, sel.Sel.Name)
					}
				}
				return true
			})
		}
	}
}

// The parsed base is cached: requests built from it must not share (and
// so change) its URL, and the cache stays within its bound.
func TestNewRequestCachedBase(t *testing.T) {
	a, _ := NewRequest(context.Background(), http.MethodGet, "http://r:8000/base/", "", "/a", nil, nil)
	a.URL.RawQuery, a.URL.Host = "x=1", "elsewhere"
	b, _ := NewRequest(context.Background(), http.MethodGet, "http://r:8000/base/", "", "/b", nil, nil)
	if got := b.URL.String(); got != "http://r:8000/base/b" || b.Host != "r:8000" {
		t.Fatalf("second request %s (host %q): the first changed the cached base", got, b.Host)
	}
	if c, _ := NewRequest(context.Background(), http.MethodGet, "http://r:/", "", "/c", nil, nil); c.URL.Host != "r" || c.Host != "r" {
		t.Fatalf("empty port kept: %q %q", c.URL.Host, c.Host)
	}
	if _, err := NewRequest(context.Background(), http.MethodGet, "http://r:8000/%zz", "", "/", nil, nil); err == nil {
		t.Fatal("a bad base URL built a request")
	}
	for i := range maxBaseURLs + 10 {
		_, _ = NewRequest(context.Background(), http.MethodGet, "http://r:"+strconv.Itoa(i), "", "/", nil, nil)
	}
	if n := baseURLs.n.Load(); n > maxBaseURLs {
		t.Fatalf("%d cached base URLs, bound %d", n, maxBaseURLs)
	}
}
