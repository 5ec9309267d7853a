package gateway

import (
	"net/url"
	"path"
	"strings"
)

// A request's path is checked before any handler sees it (checkPath, in
// front of the mux): the allow-list compares paths, so a path must name
// one resource one way. Go's ServeMux redirects a literal "/v1/../x" to
// its clean form, but it matches and passes on "/v1/%2e%2e/x" decoded (as
// "/v1/../x"), and a replica or a proxy behind it may resolve the dot
// segment. So a path is refused (400), not rewritten, when a segment of
// its escaped form decodes to "." or "..", is empty inside the path
// ("//"), or decodes to a character that would change its meaning once
// decoded and sent on: "/" (%2F), "\" (%5C), "?" (%3F), "#" (%23), "%"
// (%25: decoded once here, it would be decoded again upstream) or a
// control character (%00, which the upstream URL cannot even carry).

// checkPath reports why u's path is refused, or nil.
func checkPath(u *url.URL) error {
	esc := u.EscapedPath()
	if !strings.HasPrefix(esc, "/") {
		return errBadPath.with("the request path must start with /")
	}
	for rest, more := esc[1:], true; more; {
		var seg string
		seg, rest, more = strings.Cut(rest, "/")
		if seg == "" {
			if !more {
				break // a trailing slash ("/", "/ui/")
			}
			return errBadPath.with("the request path has an empty segment (//)")
		}
		dec := seg
		if strings.Contains(seg, "%") {
			var err error
			if dec, err = url.PathUnescape(seg); err != nil {
				return errBadPath.with("the request path has a malformed %-escape")
			}
		}
		if dec == "." || dec == ".." {
			return errBadPath.with("the request path has a dot segment (. or .., plain or %2e-encoded)")
		}
		if strings.ContainsAny(dec, "/\\?#%") || strings.ContainsFunc(dec, isControl) {
			return errBadPath.with("the request path has an encoded /, \\, ?, #, % or control character")
		}
	}
	return nil
}

func isControl(r rune) bool { return r < 0x20 || r == 0x7f }

// maxPassthrough bounds the passthrough: list.
const maxPassthrough = 256

// ownPaths are the gateway's own paths (routes), which passthrough: must
// not shadow; ownPrefixes its own subtrees.
var (
	ownPaths    = []string{"/health", "/ready", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions", "/ui"}
	ownPrefixes = []string{"/debug/", "/admin/", "/ui/"}
)

// validatePassthrough checks passthrough: exact paths, written as the
// request must arrive (clean, no escapes, no wildcard, no trailing slash:
// in the mux a trailing slash would match a whole subtree). Prefixes are
// refused on purpose: a prefix such as /v1/ would let through every admin
// path a later vLLM adds, the hole the allow-list closes.
func validatePassthrough(list []string) []error {
	var errs []error
	if len(list) > maxPassthrough {
		errs = append(errs, keyErr("passthrough", "%d paths, at most %d", len(list), maxPassthrough))
	}
	for i, p := range list {
		if why := passthroughPathProblem(p); why != "" {
			errs = append(errs, keyErr(indexKey("passthrough", i), "%q: %s", p, why))
		}
	}
	return errs
}

// passthroughPathProblem is what is wrong with one passthrough: path ("" for nothing).
func passthroughPathProblem(p string) string {
	switch {
	case len(p) < 2 || len(p) > 256 || p[0] != '/':
		return "want an exact path such as /v1/load_lora_adapter (1 to 255 characters after the /)"
	case strings.HasSuffix(p, "/"):
		return "ends with /: paths are exact, prefixes are not accepted"
	case strings.ContainsFunc(p, func(r rune) bool { return !isPathChar(r) }):
		return "only letters, digits and / _ - . ~ are allowed (no escapes, queries or {wildcards})"
	case path.Clean(p) != p:
		return "not a clean path (no //, . or .. segments)"
	}
	for _, own := range ownPaths {
		if p == own {
			return "the gateway's own endpoint"
		}
	}
	for _, pre := range ownPrefixes {
		if strings.HasPrefix(p, pre) {
			return "under the gateway's own " + pre
		}
	}
	return ""
}

func isPathChar(r rune) bool {
	return r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || strings.ContainsRune("/_-.~", r)
}
