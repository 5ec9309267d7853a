package prompt

import (
	"bytes"
	"encoding/json"
	"unicode/utf8"
)

// member is one member of a JSON object: its name (decoded) and its raw
// value, a sub-slice of the body.
type member struct{ key, val []byte }

// members are a JSON object's members in order. A lookup is a scan from
// the last (a repeated name's last value counts, as encoding/json's map
// decoding keeps it): for the few members of a request, cheaper than
// building and hashing a map.
type members []member

// get is the value of the member named key.
func (ms members) get(key string) (json.RawMessage, bool) {
	for i := len(ms) - 1; i >= 0; i-- {
		if string(ms[i].key) == key {
			return ms[i].val, true
		}
	}
	return nil, false
}

// val is the value of the member named key (nil: none).
func (ms members) val(key string) json.RawMessage {
	v, _ := ms.get(key)
	return v
}

// fromMap lists the members encoding/json decoded into a map.
func fromMap(m map[string]json.RawMessage) members {
	ms := make(members, 0, len(m))
	for k, v := range m {
		ms = append(ms, member{[]byte(k), v})
	}
	return ms
}

// readMembers reads the members of a request body's top-level object as
// sub-slices of data, as json.Unmarshal into a map[string]json.RawMessage
// would, without its copy of every value (the prompt included), its map
// and its second scan by the decoder's state machine: data is checked
// once by json.Valid, then a plain scan finds each member's extent. ok is
// false when data is not a valid JSON object: the caller takes
// encoding/json's path, for its errors. The values share data's memory:
// read-only, as Parse uses them.
func readMembers(data []byte) (ms members, ok bool) {
	i := skipSpace(data, 0)
	if i >= len(data) || data[i] != '{' || !json.Valid(data) {
		return nil, false
	}
	ms = make(members, 0, 8)
	if i = skipSpace(data, i+1); i < len(data) && data[i] == '}' {
		return ms, true
	}
	for i < len(data) && data[i] == '"' {
		end := stringEnd(data, i)
		key := data[i+1 : end-1]
		if !plainString(data[i:end]) {
			var k string
			if json.Unmarshal(data[i:end], &k) != nil {
				return nil, false
			}
			key = []byte(k)
		}
		if i = skipSpace(data, end); i >= len(data) || data[i] != ':' {
			return nil, false
		}
		i = skipSpace(data, i+1)
		vend := ValueEnd(data, i)
		if vend <= i {
			return nil, false
		}
		ms = append(ms, member{key, data[i:vend:vend]}) // capacity cut: an append copies
		if i = skipSpace(data, vend); i < len(data) && data[i] == ',' {
			i = skipSpace(data, i+1)
			continue
		}
		return ms, i < len(data) && data[i] == '}'
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

// plainString: a JSON string token that needs no decoding: quoted, no
// escape, valid UTF-8 (encoding/json would replace invalid bytes).
func plainString(tok []byte) bool {
	if len(tok) < 2 || tok[0] != '"' || tok[len(tok)-1] != '"' {
		return false
	}
	s := tok[1 : len(tok)-1]
	return bytes.IndexByte(s, '\\') < 0 && bytes.IndexByte(s, '"') < 0 && utf8.Valid(s)
}

// simpleString decodes a plain JSON string token (plainString); ok is
// false for anything else (the caller asks encoding/json).
func simpleString(tok []byte) (string, bool) {
	if !plainString(tok) {
		return "", false
	}
	s := tok[1 : len(tok)-1]
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
