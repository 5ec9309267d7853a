package gateway

import (
	"bytes"

	"github.com/kvgate/kvgate/internal/openai"
)

// scanUsage decodes a usage object of the shape vLLM writes (integer token
// counts and prompt_tokens_details with cached_tokens) without reflection:
// json.Unmarshal cost a few percent of the proxy's CPU on small answers,
// most of it in its validity scan and its reflective decoding. It accepts
// only that shape: the four keys, spelt exactly and without escapes, and
// non-negative integers of at most 18 digits; ok is false for anything
// else (another key, null, a fraction, an escape, broken JSON), which
// json.Unmarshal then decodes. So the result is json.Unmarshal's either way
// (FuzzScanUsage holds it).
func scanUsage(b []byte) (u openai.Usage, ok bool) {
	s := usageScan{b: b}
	ok = s.members(func(key []byte) bool {
		switch string(key) {
		case "prompt_tokens":
			return s.int(&u.PromptTokens)
		case "completion_tokens":
			return s.int(&u.CompletionTokens)
		case "total_tokens":
			return s.int(&u.TotalTokens)
		case "prompt_tokens_details":
			if u.PromptTokensDetails == nil { // a repeated key decodes into the same one, as json does
				u.PromptTokensDetails = &openai.PromptTokensDetails{}
			}
			d := u.PromptTokensDetails
			return s.members(func(k []byte) bool { return string(k) == "cached_tokens" && s.int(&d.CachedTokens) })
		}
		return false
	})
	s.space()
	return u, ok && s.i == len(b)
}

// usageScan is scanUsage's cursor over the object's bytes.
type usageScan struct {
	b []byte
	i int
}

// space skips JSON whitespace.
func (s *usageScan) space() {
	for s.i < len(s.b) && (s.b[s.i] == ' ' || s.b[s.i] == '\t' || s.b[s.i] == '\n' || s.b[s.i] == '\r') {
		s.i++
	}
}

// next consumes c, after whitespace, if it comes next.
func (s *usageScan) next(c byte) bool {
	s.space()
	if s.i < len(s.b) && s.b[s.i] == c {
		s.i++
		return true
	}
	return false
}

// members scans an object, each member's value by member(key); false at
// anything unexpected.
func (s *usageScan) members(member func(key []byte) bool) bool {
	if !s.next('{') {
		return false
	}
	if s.next('}') {
		return true
	}
	for {
		k, ok := s.key()
		if !ok || !member(k) {
			return false
		}
		if s.next('}') {
			return true
		}
		if !s.next(',') {
			return false
		}
	}
}

// key scans a member's key and its colon: a string without escapes.
func (s *usageScan) key() ([]byte, bool) {
	if !s.next('"') {
		return nil, false
	}
	j := bytes.IndexByte(s.b[s.i:], '"')
	if j < 0 {
		return nil, false
	}
	k := s.b[s.i : s.i+j]
	if bytes.IndexByte(k, '\\') >= 0 {
		return nil, false
	}
	s.i += j + 1
	return k, s.next(':')
}

// int scans a non-negative integer of at most 18 digits (no sign,
// fraction, exponent or leading zero: what follows it is checked by the
// caller's next member or end).
func (s *usageScan) int(dst *int) bool {
	s.space()
	j := s.i
	for j < len(s.b) && s.b[j] >= '0' && s.b[j] <= '9' {
		j++
	}
	digits := s.b[s.i:j]
	if len(digits) == 0 || len(digits) > 18 || (len(digits) > 1 && digits[0] == '0') {
		return false
	}
	v := 0
	for _, c := range digits {
		v = v*10 + int(c-'0')
	}
	*dst, s.i = v, j
	return true
}
