package prompt

import "unsafe"

// unsafeBytes views a string's bytes without copying; the result must not be
// modified (hashing only reads it).
func unsafeBytes(s string) []byte {
	if s == "" {
		return nil
	}
	return unsafe.Slice(unsafe.StringData(s), len(s))
}
