package sim

import (
	"bytes"
	"encoding/json"
	"errors"
	"math"
	"strconv"

	"github.com/kvgate/kvgate/internal/prompt"
)

// body is a request body's top-level fields by their exact keys. vLLM's
// request models match keys case-sensitively ("MODEL" or "Stream" are
// unknown fields, ignored), while encoding/json matches struct fields
// case-insensitively: so the sim reads every field by its exact name from
// here, and hands prompt.Parse a body rebuilt from the exact keys only.
type body map[string]json.RawMessage

func decodeBody(data []byte) (body, error) {
	var b body
	if err := json.Unmarshal(data, &b); err != nil {
		return nil, badRequest("", "request body is not a JSON object: %v", err)
	}
	if b == nil { // the body was null
		return nil, badRequest("", "request body is not a JSON object")
	}
	return b, nil
}

// get is the field's value, nil when absent or null (pydantic's None).
func (b body) get(key string) json.RawMessage {
	v := bytes.TrimSpace(b[key])
	if len(v) == 0 || string(v) == "null" {
		return nil
	}
	return v
}

// flag reads a boolean field; absent or null is false.
func (b body) flag(key string) (bool, error) {
	switch v := b.get(key); string(v) {
	case "", "false":
		return false, nil
	case "true":
		return true, nil
	}
	return false, badRequest(key, "%s must be a boolean.", key)
}

// intField is an integer field as read.
type intField struct {
	v   int64
	set bool // present and not null
	// saturated: the value lies beyond int64 and v is the bound on its
	// side, so that no arithmetic on it can wrap.
	saturated bool
}

// integer reads an integer field: a JSON number with no fractional part
// (pydantic takes 3.0 as 3). A value beyond int64 saturates instead of
// failing: pydantic's ints are unbounded, and vLLM answers such a
// max_tokens with a context-length error, not a type error. Strings and
// booleans are refused (pydantic's lax mode would take "3" and true).
func (b body) integer(key string) (intField, error) {
	v := b.get(key)
	if v == nil {
		return intField{}, nil
	}
	if v[0] != '-' && (v[0] < '0' || v[0] > '9') {
		return intField{}, badRequest(key, "%s must be an integer.", key)
	}
	s := string(v)
	i, err := strconv.ParseInt(s, 10, 64)
	if err == nil {
		return intField{v: i, set: true}, nil
	}
	if errors.Is(err, strconv.ErrRange) {
		return saturate(v[0] == '-'), nil
	}
	// A fraction or an exponent: valid JSON, so a float; ErrRange means
	// ±Inf (or an underflow to 0).
	f, err := strconv.ParseFloat(s, 64)
	switch {
	case err != nil && !errors.Is(err, strconv.ErrRange):
		return intField{}, badRequest(key, "%s must be an integer.", key)
	case f != math.Trunc(f):
		return intField{}, badRequest(key, "%s must be an integer, got a number with a fractional part.", key)
	case f >= math.MaxInt64 || f < math.MinInt64: // 2^63 is the first float beyond
		return saturate(f < 0), nil
	}
	return intField{v: int64(f), set: true}, nil
}

func saturate(negative bool) intField {
	if negative {
		return intField{v: math.MinInt64, set: true, saturated: true}
	}
	return intField{v: math.MaxInt64, set: true, saturated: true}
}

// clampInt converts to int, saturating where int is narrower than int64.
func clampInt(v int64) int {
	return int(max(min(v, math.MaxInt), math.MinInt))
}

// keys names the exact keys kept of a JSON object, each with the keys of
// its value (nil: the value is kept whole). A list's schema applies to each
// of its elements.
type keys map[string]keys

var (
	// contentKeys are the fields of a chat content part prompt.ContentText reads.
	contentKeys = keys{"type": nil, "text": nil, "image_url": {"url": nil}, "input_audio": {"data": nil}}
	// messageKeys are the fields of a chat message prompt.Parse reads.
	messageKeys = keys{"role": nil, "content": contentKeys, "name": nil, "tool_calls": nil, "tool_call_id": nil}
	// parseKeys are the top-level fields the sim hands prompt.Parse
	// (max_tokens and max_completion_tokens it reads itself).
	parseKeys = keys{"model": nil, "prompt": nil, "messages": messageKeys, "tools": nil, "stream": nil,
		"user": nil, "cache_salt": nil}
)

// parse is prompt.Parse of b rebuilt from the exact keys of k.
func (b body) parse(kind prompt.Kind, k keys) (*prompt.Parsed, error) {
	data, err := exactObject(b, k)
	if err != nil {
		return nil, badRequest("", "request body: %v", err)
	}
	return prompt.Parse(kind, data)
}

func exactObject(b body, k keys) ([]byte, error) {
	out := make(map[string]json.RawMessage, len(k))
	for name, sub := range k {
		v, ok := b[name]
		if !ok {
			continue
		}
		v, err := exact(v, sub)
		if err != nil {
			return nil, err
		}
		out[name] = v
	}
	return json.Marshal(out)
}

// exact is raw with only the keys of k kept in its objects (raw itself or,
// for a list, its elements that are objects); anything else is returned as
// it is.
func exact(raw json.RawMessage, k keys) (json.RawMessage, error) {
	t := bytes.TrimSpace(raw)
	if k == nil || len(t) == 0 {
		return raw, nil
	}
	switch t[0] {
	case '{':
		var b body
		if err := json.Unmarshal(t, &b); err != nil {
			return nil, err
		}
		return exactObject(b, k)
	case '[':
		var list []json.RawMessage
		if err := json.Unmarshal(t, &list); err != nil {
			return nil, err
		}
		for i, el := range list {
			// Only objects: a list of lists is not what a schema names,
			// and recursing into it would rescan deep nesting per level.
			if el = bytes.TrimSpace(el); len(el) == 0 || el[0] != '{' {
				continue
			}
			v, err := exact(el, k)
			if err != nil {
				return nil, err
			}
			list[i] = v
		}
		return json.Marshal(list)
	}
	return raw, nil
}
