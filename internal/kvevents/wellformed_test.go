package kvevents

import (
	"errors"
	"strings"
	"testing"
)

// TestValueEndSizesEveryFormat checks valueEnd's table of type codes: one
// value of each msgpack format is measured whole, with a byte after it, and
// cut one byte short.
func TestValueEndSizesEveryFormat(t *testing.T) {
	values := []string{
		"00", "7f", "e0", "ff", // fixint
		"c0", "c2", "c3", // nil, false, true
		"80", "81 01 02", "8f" + strings.Repeat("01 02 ", 15), // fixmap
		"90", "91 00", "9f" + strings.Repeat("00 ", 15), // fixarray
		"a0", "a3" + ascii("abc"), "bf" + strings.Repeat("61", 31), // fixstr
		"c4 02 0102", "c5 0002 0102", "c6 00000002 0102", // bin
		"c7 02 05 0102", "c8 0002 05 0102", "c9 00000002 05 0102", // ext: length, type, data
		"ca 3f800000", "cb 3ff0000000000000", // float32, float64
		"cc 01", "cd 0001", "ce 00000001", "cf 0000000000000001", // uint
		"d0 ff", "d1 ffff", "d2 ffffffff", "d3 ffffffffffffffff", // int
		"d4 05 01", "d5 05 0102", "d6 05 01020304", // fixext 1, 2, 4
		"d7 05 0102030405060708", "d8 05" + strings.Repeat("01", 16), // fixext 8, 16
		"d9 02 6162", "da 0002 6162", "db 00000002 6162", // str
		"dc 0002 01 02", "dd 00000002 01 02", // array16, array32
		"de 0001 01 02", "df 00000001 01 02", // map16, map32
		"92 81 a1" + ascii("k") + "91 c0 dc 0001 d9 01 61", // nested
	}
	for _, v := range values {
		b := hx(t, v)
		if end, err := valueEnd(append(b, 0xc0), 0); end != len(b) || err != nil {
			t.Errorf("valueEnd(%s, then nil) = %d, %v; want %d", v, end, err, len(b))
		}
		if err := checkWellFormed(b); err != nil {
			t.Errorf("checkWellFormed(%s): %v", v, err)
		}
		if err := checkWellFormed(b[:len(b)-1]); !errors.Is(err, ErrMalformed) {
			t.Errorf("checkWellFormed(%s less its last byte) = %v, want ErrMalformed", v, err)
		}
	}
}
