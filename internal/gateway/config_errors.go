package gateway

import (
	"cmp"
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
)

// A configuration's problems are reported all at once, each with the key
// it is about (a path such as pools[1].replicas[0].url) and, for a key
// the file writes, the file and line: the file's own problems (unknown
// keys, values of the wrong type: config_check.go) and Validate's, in
// one list, ordered by line.

// ConfigError is one problem of a configuration.
type ConfigError struct {
	// Key is the key path the problem is about ("" for none): top-level
	// keys by name, list items by index, nested keys after a dot.
	Key string
	// File and Line are where the file writes Key (Line 0: not known,
	// e.g. a key given by a flag, or one the file leaves at its default).
	File string
	Line int
	Msg  string
	// Hint is a suggestion for a near miss: the known key of that level
	// closest to an unknown one.
	Hint string
	// read: a problem of the file's own reading (unknown key, wrong type):
	// the value was left out, so that Validate's problems with the same key
	// or one under it are its consequences, not news.
	read bool
}

func (e *ConfigError) Error() string {
	var b strings.Builder
	switch {
	case e.File != "" && e.Line > 0:
		fmt.Fprintf(&b, "%s:%d: ", e.File, e.Line)
	case e.File != "":
		b.WriteString(e.File + ": ")
	case e.Line > 0:
		fmt.Fprintf(&b, "line %d: ", e.Line)
	}
	if e.Key != "" {
		b.WriteString(e.Key + ": ")
	}
	b.WriteString(e.Msg)
	if e.Hint != "" {
		b.WriteString(" (did you mean " + e.Hint + "?)")
	}
	return b.String()
}

// keyErr is a problem with key: Validate's checks name the key they check
// this way, so that it can be located in the file.
func keyErr(key, format string, args ...any) *ConfigError {
	return &ConfigError{Key: key, Msg: fmt.Sprintf(format, args...)}
}

// ConfigProblems are err's problems one by one: errors.Join's lists
// flattened (a nil err has none).
func ConfigProblems(err error) []error {
	if err == nil {
		return nil
	}
	if j, ok := err.(interface{ Unwrap() []error }); ok {
		var out []error
		for _, e := range j.Unwrap() {
			out = append(out, ConfigProblems(e)...)
		}
		return out
	}
	return []error{err}
}

// ConfigSource is where a configuration file writes each key: its path and
// the line of every key path, for messages. A nil ConfigSource (flags only)
// locates nothing.
type ConfigSource struct {
	file  string
	lines map[string]int
}

// Forget drops key (a top-level key or a path) and every key under it: a
// flag replaced its value, so that the file's line no longer tells where it
// comes from.
func (s *ConfigSource) Forget(key string) {
	if s == nil {
		return
	}
	for k := range s.lines {
		if under(k, key) {
			delete(s.lines, k)
		}
	}
}

// line is where the file writes key, or the nearest key above it that it
// writes (a missing key is reported at its parent's line); 0 when none.
func (s *ConfigSource) line(key string) int {
	if s == nil || key == "" {
		return 0
	}
	for k := key; k != ""; k = parentKey(k) {
		if n, ok := s.lines[k]; ok {
			return n
		}
	}
	return 0
}

// Locate is err's problems, each ConfigError with the file and line of its
// key, ordered by line (those without a line last, in their order); a
// problem whose key is at or under a key the file's reading already
// reported (its value left out) is dropped as a consequence of that one,
// and so is every problem of a file that could not be read as a whole (not
// YAML, not a mapping: a read problem of no key).
func (s *ConfigSource) Locate(err error) error {
	probs := ConfigProblems(err)
	var read []string
	for _, p := range probs {
		if ce, ok := p.(*ConfigError); ok && ce.read {
			read = append(read, ce.Key)
		}
	}
	out := make([]error, 0, len(probs))
	for _, p := range probs {
		ce, ok := p.(*ConfigError)
		if !ok {
			out = append(out, p)
			continue
		}
		if !ce.read && slices.ContainsFunc(read, func(k string) bool { return k == "" || under(ce.Key, k) }) {
			continue
		}
		c := *ce
		if s != nil && c.File == "" {
			if c.Line == 0 {
				c.Line = s.line(c.Key)
			}
			if c.Line > 0 || c.Key == "" {
				c.File = s.file // a key the file does not write is the flags' or the defaults'
			}
		}
		out = append(out, &c)
	}
	// By line; the problems without one (keys the file does not write,
	// problems of no key) last, in their order.
	slices.SortStableFunc(out, func(a, b error) int { return cmp.Compare(lineOf(a), lineOf(b)) })
	return errors.Join(out...)
}

// lineOf is a problem's line for ordering: past every line when it has none.
func lineOf(err error) int {
	if ce, ok := err.(*ConfigError); ok && ce.Line > 0 {
		return ce.Line
	}
	return math.MaxInt
}

// under reports whether key k is key or under it (key.x, key[3]).
func under(k, key string) bool {
	return k == key || (strings.HasPrefix(k, key) && key != "" && (k[len(key)] == '.' || k[len(key)] == '['))
}

// parentKey is the key path above k ("" at the top).
func parentKey(k string) string {
	i := strings.LastIndexAny(k, ".[")
	if i < 0 {
		return ""
	}
	return k[:i]
}

// indexKey is the key path of item i of the list at key.
func indexKey(key string, i int) string { return key + "[" + strconv.Itoa(i) + "]" }

// fieldKey is the key path of name under key.
func fieldKey(key, name string) string {
	if key == "" {
		return name
	}
	return key + "." + name
}
