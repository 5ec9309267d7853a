package kvevents

import (
	"encoding/binary"
	"fmt"
)

// maxDepth bounds container nesting. vLLM's deepest payload is
// batch > events > event > extra_keys > per-block tuple > key tuple: 6 levels.
// The bound keeps the decoder's recursion (and msgpack's Skip) shallow on
// hostile input.
const maxDepth = 32

// checkWellFormed verifies that data holds exactly one well-formed msgpack
// value (see valueEnd) and nothing after it.
func checkWellFormed(data []byte) error {
	end, err := valueEnd(data, 0)
	if err != nil {
		return err
	}
	if end != len(data) {
		return malformedAt(end, fmt.Sprintf("%d trailing bytes after the batch", len(data)-end))
	}
	return nil
}

// valueEnd returns where the msgpack value starting at data[start] ends,
// after checking that it is well-formed, nested at most maxDepth deep, and
// that every declared length fits in the bytes that remain. It walks the
// bytes iteratively with a fixed stack of "items still to read" counters, so
// it neither recurses nor allocates: hostile input cannot exhaust the stack,
// and once a payload passes, every list the decoder makes is bounded by the
// payload's length whatever lengths were declared.
func valueEnd(data []byte, start int) (int, error) {
	var stack [maxDepth + 1]uint64 // stack[0] is the top-level "one value"
	depth := 0
	stack[0] = 1
	pos := start
	for {
		for depth >= 0 && stack[depth] == 0 {
			depth--
		}
		if depth < 0 {
			break
		}
		stack[depth]--
		if pos >= len(data) {
			return 0, malformedAt(pos, "truncated: value expected")
		}
		at := pos
		c := data[pos]
		pos++
		var (
			skip  uint64 // payload bytes after the header
			items uint64 // container items (maps count keys and values)
			cont  bool
			hdr   int // length-header bytes after the code
		)
		switch {
		case c <= 0x7f, c >= 0xe0: // positive, negative fixint
		case c >= 0x80 && c <= 0x8f: // fixmap
			items, cont = 2*uint64(c&0x0f), true
		case c >= 0x90 && c <= 0x9f: // fixarray
			items, cont = uint64(c&0x0f), true
		case c >= 0xa0 && c <= 0xbf: // fixstr
			skip = uint64(c & 0x1f)
		default:
			switch c {
			case 0xc0, 0xc2, 0xc3: // nil, false, true
			case 0xc1:
				return 0, malformedAt(at, "reserved code 0xc1")
			case 0xc4, 0xd9: // bin8, str8
				hdr = 1
			case 0xc5, 0xda: // bin16, str16
				hdr = 2
			case 0xc6, 0xdb: // bin32, str32
				hdr = 4
			case 0xc7: // ext8: len8, type, data
				hdr = 1
			case 0xc8: // ext16
				hdr = 2
			case 0xc9: // ext32
				hdr = 4
			case 0xca: // float32
				skip = 4
			case 0xcb: // float64
				skip = 8
			case 0xcc, 0xd0: // uint8, int8
				skip = 1
			case 0xcd, 0xd1: // uint16, int16
				skip = 2
			case 0xce, 0xd2: // uint32, int32
				skip = 4
			case 0xcf, 0xd3: // uint64, int64
				skip = 8
			case 0xd4, 0xd5, 0xd6, 0xd7, 0xd8: // fixext 1, 2, 4, 8, 16 (+1 type byte)
				skip = 1 + (1 << (c - 0xd4))
			case 0xdc: // array16
				hdr, cont = 2, true
			case 0xdd: // array32
				hdr, cont = 4, true
			case 0xde: // map16
				hdr, cont = 2, true
			case 0xdf: // map32
				hdr, cont = 4, true
			}
		}
		if hdr > 0 {
			if len(data)-pos < hdr {
				return 0, malformedAt(at, fmt.Sprintf("truncated length of code 0x%02x", c))
			}
			var n uint64
			switch hdr {
			case 1:
				n = uint64(data[pos])
			case 2:
				n = uint64(binary.BigEndian.Uint16(data[pos:]))
			case 4:
				n = uint64(binary.BigEndian.Uint32(data[pos:]))
			}
			pos += hdr
			switch {
			case !cont && c >= 0xc7 && c <= 0xc9:
				skip = n + 1 // ext: type byte, then n data bytes
			case !cont:
				skip = n
			case c == 0xde || c == 0xdf:
				items = 2 * n
			default:
				items = n
			}
		}
		left := uint64(len(data) - pos)
		if skip > left {
			return 0, malformedAt(at, fmt.Sprintf("code 0x%02x declares %d bytes, %d left", c, skip, left))
		}
		pos += int(skip)
		if cont && items > 0 {
			// Every item takes at least one byte: a longer declaration is a lie
			// that would otherwise size an allocation.
			if items > left {
				return 0, malformedAt(at, fmt.Sprintf("container declares %d items, %d bytes left", items, left))
			}
			if depth+1 > maxDepth {
				return 0, malformedAt(at, fmt.Sprintf("nesting deeper than %d", maxDepth))
			}
			depth++
			stack[depth] = items
		}
	}
	return pos, nil
}

func malformedAt(off int, detail string) error {
	return &DecodeError{Err: ErrMalformed, Offset: off, Detail: detail}
}
