package prompt

import (
	"bytes"
	"encoding/json"
	"unicode/utf8"
)

// members reads the members of a request body's top-level object as
// sub-slices of data, as json.Unmarshal into a map[string]json.RawMessage
// would, without its copy of every value (the prompt included) and its
// second scan by the decoder's state machine: data is checked once by
// json.Valid, then a plain scan finds each member's extent. ok is false
// when data is not a valid JSON object (or a key needs what only
// encoding/json does): the caller takes encoding/json's path, for its
// errors. The values share data's memory: read-only, as Parse uses them.
func members(data []byte) (m map[string]json.RawMessage, ok bool) {
	i := skipSpace(data, 0)
	if i >= len(data) || data[i] != '{' || !json.Valid(data) {
		return nil, false
	}
	m = make(map[string]json.RawMessage, 8)
	if i = skipSpace(data, i+1); i < len(data) && data[i] == '}' {
		return m, true
	}
	for i < len(data) && data[i] == '"' {
		end := stringEnd(data, i)
		key, simple := simpleString(data[i:end])
		if !simple {
			if json.Unmarshal(data[i:end], &key) != nil {
				return nil, false
			}
		}
		if i = skipSpace(data, end); i >= len(data) || data[i] != ':' {
			return nil, false
		}
		i = skipSpace(data, i+1)
		vend := ValueEnd(data, i)
		if vend <= i {
			return nil, false
		}
		m[key] = data[i:vend:vend] // capacity cut: an append copies
		if i = skipSpace(data, vend); i < len(data) && data[i] == ',' {
			i = skipSpace(data, i+1)
			continue
		}
		return m, i < len(data) && data[i] == '}'
	}
	return nil, false
}

func skipSpace(data []byte, i int) int {
	for i < len(data) && (data[i] == ' ' || data[i] == '\t' || data[i] == '\n' || data[i] == '\r') {
		i++
	}
	return i
}

// stringEnd is the index after the string that opens at data[i] (a '"').
func stringEnd(data []byte, i int) int {
	for j := i + 1; j < len(data); j++ {
		switch data[j] {
		case '\\':
			j++
		case '"':
			return j + 1
		}
	}
	return len(data)
}

// ValueEnd is the index after the JSON value that starts at data[i]: a
// string (escapes skipped), an object or array (strings inside skipped),
// or a scalar; len(data) when it does not end in data. It does not check
// the value: a caller that needs a valid one checks it (json.Valid) or
// decodes what it cut (the gateway cuts a usage object out of an
// answer's tail).
func ValueEnd(data []byte, i int) int {
	if i >= len(data) {
		return i
	}
	switch data[i] {
	case '"':
		return stringEnd(data, i)
	case '{', '[':
		depth := 0
		for j := i; j < len(data); j++ {
			switch data[j] {
			case '"':
				j = stringEnd(data, j) - 1
			case '{', '[':
				depth++
			case '}', ']':
				if depth--; depth == 0 {
					return j + 1
				}
			}
		}
		return len(data)
	}
	j := i
	for j < len(data) && bytes.IndexByte([]byte(",}] \t\n\r"), data[j]) < 0 {
		j++
	}
	return j
}

// simpleString decodes a JSON string token that needs no decoding: no
// escape and valid UTF-8 (encoding/json would replace invalid bytes).
// ok is false for anything else (the caller asks encoding/json).
func simpleString(tok []byte) (string, bool) {
	if len(tok) < 2 || tok[0] != '"' || tok[len(tok)-1] != '"' {
		return "", false
	}
	s := tok[1 : len(tok)-1]
	if bytes.IndexByte(s, '\\') >= 0 || bytes.IndexByte(s, '"') >= 0 || !utf8.Valid(s) {
		return "", false
	}
	if k, ok := common(s); ok {
		return k, true
	}
	return string(s), true
}

// common is s when it is one of the member names and roles every request
// carries, without allocating a copy (a switch on string(s) does not).
func common(s []byte) (string, bool) {
	switch string(s) {
	case "model":
		return "model", true
	case "prompt":
		return "prompt", true
	case "messages":
		return "messages", true
	case "max_tokens":
		return "max_tokens", true
	case "stream":
		return "stream", true
	case "role":
		return "role", true
	case "content":
		return "content", true
	case "user":
		return "user", true
	case "system":
		return "system", true
	case "assistant":
		return "assistant", true
	case "temperature":
		return "temperature", true
	}
	return "", false
}
