package gateway

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"reflect"
	"regexp"
	"slices"
	"strconv"
	"strings"

	yamlv3 "go.yaml.in/yaml/v3"
	"sigs.k8s.io/yaml"

	"github.com/kvgate/kvgate/internal/discovery"
)

// Reading a configuration file, every problem at once. The file is read as
// before (sigs.k8s.io/yaml: YAML to JSON, then encoding/json, strict), but
// the JSON is first walked as a tree against the Go types, by reflection,
// so that each problem the strict decoder would stop at (a key no setting
// has, a value of the wrong type) is found, every one of them, with its key
// path; the value is left out (its setting keeps its default) and the rest
// decoded. The lines come from a second parse of the same bytes into
// go.yaml.in/yaml/v3's node tree, which keeps them (the first parser's
// values are the ones used: the two agree on structure, not on every
// scalar, YAML 1.1's yes/no among them).

// ReadConfig reads a configuration file over the defaults: the
// configuration (each key with a problem left at its default), where the
// file writes each key, and the file's own problems, all of them (not
// YAML, unknown keys, values of the wrong type). An error reading the
// file is returned alone, with a nil ConfigSource. Validate's problems are
// located with the ConfigSource (Locate).
func ReadConfig(path string) (Config, *ConfigSource, error) {
	data, err := discovery.ReadFile(path)
	if err != nil {
		return Defaults(), nil, err
	}
	cfg, lines, err := readConfig(data)
	return cfg, &ConfigSource{file: path, lines: lines}, err
}

// readConfig is ReadConfig of the file's bytes.
func readConfig(data []byte) (Config, map[string]int, error) {
	cfg := Defaults()
	js, err := yaml.YAMLToJSON(data)
	if err != nil {
		return cfg, nil, yamlError(err)
	}
	lines, probs := keyLines(data, "")
	var tree any
	dec := json.NewDecoder(bytes.NewReader(js))
	dec.UseNumber()
	if err := dec.Decode(&tree); err != nil || tree == nil {
		return cfg, lines, errors.Join(probs...) // empty, or null: the defaults
	}
	if _, ok := tree.(map[string]any); !ok {
		return cfg, lines, &ConfigError{Msg: "want a mapping of keys (key: value, one a line), not " + describe(tree), read: true}
	}
	checkValue(tree, reflect.TypeFor[Config](), "", &probs)
	if err := decodeStrict(tree, &cfg); err != nil {
		// The walk missed it: still one problem among the others.
		probs = append(probs, &ConfigError{Msg: plainJSON(err), read: true})
	}
	return cfg, lines, errors.Join(probs...)
}

// decodeStrict decodes a checked tree into v, unknown keys refused.
func decodeStrict(tree any, v any) error {
	js, err := json.Marshal(tree)
	if err != nil {
		return err
	}
	dec := json.NewDecoder(bytes.NewReader(js))
	dec.DisallowUnknownFields()
	return dec.Decode(v)
}

// yamlLine is the line sigs.k8s.io/yaml's parser names in its errors.
var yamlLine = regexp.MustCompile(`yaml: line (\d+): (.*)`)

// yamlError is a YAML syntax error as a problem of its line.
func yamlError(err error) error {
	if m := yamlLine.FindStringSubmatch(err.Error()); m != nil {
		n, _ := strconv.Atoi(m[1])
		return &ConfigError{Line: n, Msg: "not valid YAML: " + m[2], read: true}
	}
	msg := strings.TrimPrefix(err.Error(), "error converting YAML to JSON: ")
	return &ConfigError{Msg: "not valid YAML: " + strings.TrimPrefix(msg, "yaml: "), read: true}
}

// plainJSON is an encoding/json error without its package's prefix.
func plainJSON(err error) string { return strings.TrimPrefix(err.Error(), "json: ") }

var unmarshalerType = reflect.TypeFor[json.Unmarshaler]()

// checkValue checks v (a JSON value, numbers as json.Number) against the
// Go type t that key decodes into, adding a problem for each mistake; it
// reports whether v may stay (false: the caller leaves it out). Mappings
// lose their unknown and ill-typed keys; a list's ill-typed item becomes
// null (its setting's zero value), so that the next items keep their
// index. null is accepted where encoding/json accepts it (it leaves the
// default).
func checkValue(v any, t reflect.Type, key string, probs *[]error) bool {
	bad := func(format string, args ...any) bool {
		*probs = append(*probs, &ConfigError{Key: key, Msg: fmt.Sprintf(format, args...), read: true})
		return false
	}
	if reflect.PointerTo(t).Implements(unmarshalerType) {
		// Its own parser (Duration, TrustList, PortRef) says what is wrong.
		b, _ := json.Marshal(v)
		if err := json.Unmarshal(b, reflect.New(t).Interface()); err != nil {
			return bad("%s", plainJSON(err))
		}
		return true
	}
	if v == nil {
		return true
	}
	switch t.Kind() {
	case reflect.Pointer:
		return checkValue(v, t.Elem(), key, probs)
	case reflect.Struct:
		m, ok := v.(map[string]any)
		if !ok {
			return bad("want a mapping (key: value), not %s", describe(v))
		}
		checkFields(m, t, key, probs)
	case reflect.Slice:
		list, ok := v.([]any)
		if !ok {
			return bad("want a list ([a, b], or one \"- item\" a line), not %s", describe(v))
		}
		for i, e := range list {
			if !checkValue(e, t.Elem(), indexKey(key, i), probs) {
				list[i] = nil
			}
		}
	case reflect.Map:
		m, ok := v.(map[string]any)
		if !ok {
			return bad("want a mapping (key: value), not %s", describe(v))
		}
		for k, e := range m {
			if !checkValue(e, t.Elem(), fieldKey(key, k), probs) {
				delete(m, k)
			}
		}
	default:
		if msg := scalarProblem(v, t); msg != "" {
			return bad("%s", msg)
		}
	}
	return true
}

// checkFields checks a mapping's keys against struct type t's fields
// (their JSON names, matched as encoding/json matches them: exactly, else
// without regard to case).
func checkFields(m map[string]any, t reflect.Type, key string, probs *[]error) {
	fields := jsonFields(t)
	names := make([]string, len(fields))
	for i, f := range fields {
		names[i] = f.name
	}
	for _, k := range slices.Sorted(maps.Keys(m)) {
		i := slices.Index(names, k)
		if i < 0 {
			i = slices.IndexFunc(names, func(n string) bool { return strings.EqualFold(n, k) })
		}
		if i < 0 {
			*probs = append(*probs, &ConfigError{Key: fieldKey(key, k), Msg: "unknown key", Hint: nearest(k, names), read: true})
			delete(m, k)
			continue
		}
		if !checkValue(m[k], fields[i].typ, fieldKey(key, k), probs) {
			delete(m, k)
		}
	}
}

// scalarProblem is what is wrong with v as a value of the scalar type t
// ("" when nothing is): encoding/json's rules, in words.
func scalarProblem(v any, t reflect.Type) string {
	n, isNum := v.(json.Number)
	switch t.Kind() {
	case reflect.String:
		if _, ok := v.(string); !ok {
			return fmt.Sprintf("want text, not %s: write it in quotes (\"%v\")", describe(v), v)
		}
	case reflect.Bool:
		if _, ok := v.(bool); !ok {
			return "want true or false, not " + describe(v)
		}
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		if !isNum {
			return "want a whole number, not " + describe(v)
		}
		if _, err := strconv.ParseInt(string(n), 10, t.Bits()); err != nil {
			return numberProblem(n, err, "a whole number")
		}
	case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		if !isNum {
			return "want a whole number ≥ 0, not " + describe(v)
		}
		if _, err := strconv.ParseUint(string(n), 10, t.Bits()); err != nil {
			return numberProblem(n, err, "a whole number ≥ 0")
		}
	case reflect.Float32, reflect.Float64:
		if !isNum {
			return "want a number, not " + describe(v)
		}
		if _, err := strconv.ParseFloat(string(n), t.Bits()); err != nil {
			return numberProblem(n, err, "a number")
		}
	}
	return ""
}

func numberProblem(n json.Number, err error, want string) string {
	if errors.Is(err, strconv.ErrRange) && !strings.ContainsAny(string(n), ".eE-") {
		return fmt.Sprintf("%s is out of range", n)
	}
	return fmt.Sprintf("want %s, not %s", want, n)
}

// describe names a JSON value for a message: "the number 250", "the text
// \"x\"", "a list".
func describe(v any) string {
	switch v := v.(type) {
	case nil:
		return "nothing (null)"
	case json.Number:
		return "the number " + string(v)
	case string:
		return fmt.Sprintf("the text %q", v)
	case bool:
		return fmt.Sprint(v)
	case []any:
		return "a list"
	case map[string]any:
		return "a mapping"
	}
	return fmt.Sprintf("%v", v)
}

// jsonField is a struct field as encoding/json names it.
type jsonField struct {
	name string
	typ  reflect.Type
}

// jsonFields are the fields of struct type t as encoding/json decodes
// them: by their JSON names, an embedded struct's fields inline, "-" and
// unexported fields left out.
func jsonFields(t reflect.Type) []jsonField {
	var out []jsonField
	for f := range t.Fields() {
		name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
		switch {
		case name == "-" || !f.IsExported():
		case f.Anonymous && name == "" && f.Type.Kind() == reflect.Struct:
			out = append(out, jsonFields(f.Type)...)
		case name == "":
			out = append(out, jsonField{f.Name, f.Type})
		default:
			out = append(out, jsonField{name, f.Type})
		}
	}
	return out
}

// nearest is the known key closest to an unknown one, for "did you mean":
// the same once '-' is read as '_' and case ignored (a flag's spelling),
// else the one at the smallest edit distance (optimal string alignment: an
// insertion, deletion, substitution or swap of two neighbours costs 1), if
// that is at most a third of its length (at least 1, at most 3); "" when
// none is that close.
func nearest(unknown string, known []string) string {
	norm := strings.ToLower(strings.ReplaceAll(unknown, "-", "_"))
	best, bestD := "", max(1, min(3, len(norm)/3))+1
	for _, k := range known {
		if k == norm {
			return k
		}
		if d := editDistance(norm, k); d < bestD {
			best, bestD = k, d
		}
	}
	return best
}

// editDistance is the optimal string alignment distance of a and b (bytes).
func editDistance(a, b string) int {
	prev2 := make([]int, len(b)+1)
	prev := make([]int, len(b)+1)
	cur := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
			if i > 1 && j > 1 && a[i-1] == b[j-2] && a[i-2] == b[j-1] {
				cur[j] = min(cur[j], prev2[j-2]+1)
			}
		}
		prev2, prev, cur = prev, cur, prev2
	}
	return prev[len(b)]
}

// keyLines is where the YAML data writes each key path (a key's line, a
// list item's; the document's own path is root), and a problem for each
// key written twice in one mapping (the parser keeps the last, silently).
// Best effort: nil when this parser refuses what the first accepted;
// aliases are not followed.
func keyLines(data []byte, root string) (map[string]int, []error) {
	var doc yamlv3.Node
	if yamlv3.Unmarshal(data, &doc) != nil {
		return nil, nil
	}
	lines := map[string]int{}
	var probs []error
	var walk func(n *yamlv3.Node, key string)
	walk = func(n *yamlv3.Node, key string) {
		switch n.Kind {
		case yamlv3.DocumentNode:
			for _, c := range n.Content {
				walk(c, key)
			}
		case yamlv3.SequenceNode:
			for i, c := range n.Content {
				lines[indexKey(key, i)] = c.Line
				walk(c, indexKey(key, i))
			}
		case yamlv3.MappingNode:
			for i := 0; i+1 < len(n.Content); i += 2 {
				k := n.Content[i]
				if k.Kind != yamlv3.ScalarNode || k.Value == "<<" {
					continue // a merge key's keys are its anchor's
				}
				p := fieldKey(key, k.Value)
				if first, dup := lines[p]; dup {
					probs = append(probs, &ConfigError{Key: p, Line: k.Line,
						Msg: fmt.Sprintf("written twice (line %d and here): the last one is used; keep one", first)})
				}
				lines[p] = k.Line
				walk(n.Content[i+1], p)
			}
		}
	}
	walk(&doc, root)
	return lines, probs
}
