package prompt

import (
	"bytes"
	"encoding/json"
	"strings"
	"unicode/utf16"
)

// PyJSON writes a JSON value as Python's json.dumps does by default
// (separators ", " and ": ", ensure_ascii: every non-ASCII character as a
// \uXXXX escape, a surrogate pair above U+FFFF), members in their order,
// so that a tool call's arguments are the text vLLM renders (it converts a
// tool_use block's input with json.dumps). Numbers are kept as written:
// Python would print a float in its own shortest form ("1e5" as
// "100000.0"), which no client's tool input is expected to rely on. raw
// must be valid JSON; an invalid value is returned compact.
func PyJSON(raw []byte) string {
	var sb strings.Builder
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	if pyValue(&sb, dec) != nil {
		var c bytes.Buffer
		if json.Compact(&c, raw) != nil {
			return string(raw)
		}
		return c.String()
	}
	return sb.String()
}

// pyValue writes the next value of dec.
func pyValue(sb *strings.Builder, dec *json.Decoder) error {
	tok, err := dec.Token()
	if err != nil {
		return err
	}
	switch t := tok.(type) {
	case json.Delim:
		return pyComposite(sb, dec, t)
	case string:
		pyString(sb, t)
	case json.Number:
		sb.WriteString(t.String())
	case bool:
		if t {
			sb.WriteString("true")
		} else {
			sb.WriteString("false")
		}
	case nil:
		sb.WriteString("null")
	}
	return nil
}

// pyComposite writes an object or array whose opening delimiter was read.
func pyComposite(sb *strings.Builder, dec *json.Decoder, open json.Delim) error {
	obj := open == '{'
	sb.WriteByte(byte(open))
	for first := true; dec.More(); first = false {
		if !first {
			sb.WriteString(", ")
		}
		if obj {
			k, err := dec.Token()
			if err != nil {
				return err
			}
			pyString(sb, k.(string))
			sb.WriteString(": ")
		}
		if err := pyValue(sb, dec); err != nil {
			return err
		}
	}
	if _, err := dec.Token(); err != nil { // the closing delimiter
		return err
	}
	if obj {
		sb.WriteByte('}')
	} else {
		sb.WriteByte(']')
	}
	return nil
}

// pyString writes s as json.dumps with ensure_ascii does.
func pyString(sb *strings.Builder, s string) {
	const hex = "0123456789abcdef"
	u := func(r uint16) {
		sb.WriteString(`\u`)
		sb.WriteByte(hex[r>>12&15])
		sb.WriteByte(hex[r>>8&15])
		sb.WriteByte(hex[r>>4&15])
		sb.WriteByte(hex[r&15])
	}
	sb.WriteByte('"')
	for _, r := range s {
		switch {
		case r == '"':
			sb.WriteString(`\"`)
		case r == '\\':
			sb.WriteString(`\\`)
		case r == '\n':
			sb.WriteString(`\n`)
		case r == '\r':
			sb.WriteString(`\r`)
		case r == '\t':
			sb.WriteString(`\t`)
		case r == '\b':
			sb.WriteString(`\b`)
		case r == '\f':
			sb.WriteString(`\f`)
		case r < 0x20 || r > 0x7e && r <= 0xffff:
			u(uint16(r))
		case r > 0xffff:
			a, b := utf16.EncodeRune(r)
			u(uint16(a))
			u(uint16(b))
		default:
			sb.WriteRune(r)
		}
	}
	sb.WriteByte('"')
}
