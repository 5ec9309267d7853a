package h1

import (
	"bufio"
	"fmt"
)

// Header and request-line checks, as net/http's (httpguts): a name is an
// RFC 7230 token; a value has no control byte but tab (no CR or LF that
// would end the field and start another).

func writeField(w *bufio.Writer, k, v string) error {
	if !validName(k) || !validValue(v) {
		return fmt.Errorf("h1: invalid header field %q", k)
	}
	_, _ = w.WriteString(k)
	_, _ = w.WriteString(": ")
	_, _ = w.WriteString(trimOWS(v))
	_, err := w.WriteString("\r\n")
	return err
}

func validName(k string) bool {
	if k == "" {
		return false
	}
	for i := 0; i < len(k); i++ {
		if !isTokenByte(k[i]) {
			return false
		}
	}
	return true
}

func validMethod(m string) bool { return validName(m) }

func isTokenByte(b byte) bool {
	switch {
	case 'a' <= b && b <= 'z', 'A' <= b && b <= 'Z', '0' <= b && b <= '9':
		return true
	}
	switch b {
	case '!', '#', '$', '%', '&', '\'', '*', '+', '-', '.', '^', '_', '`', '|', '~':
		return true
	}
	return false
}

func validValue(v string) bool {
	for i := 0; i < len(v); i++ {
		if b := v[i]; b < ' ' && b != '\t' || b == 0x7f {
			return false
		}
	}
	return true
}

// validURI: a request target with no space or control byte.
func validURI(u string) bool {
	if u == "" {
		return false
	}
	for i := 0; i < len(u); i++ {
		if b := u[i]; b <= ' ' || b == 0x7f {
			return false
		}
	}
	return true
}

func trimOWS(s string) string {
	for len(s) > 0 && (s[0] == ' ' || s[0] == '\t') {
		s = s[1:]
	}
	for len(s) > 0 && (s[len(s)-1] == ' ' || s[len(s)-1] == '\t') {
		s = s[:len(s)-1]
	}
	return s
}

func cutComma(s string) (before, after string, found bool) {
	for i := 0; i < len(s); i++ {
		if s[i] == ',' {
			return s[:i], s[i+1:], true
		}
	}
	return s, "", false
}
