package kvevents

import "fmt"

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
			return pos, nil
		}
		stack[depth]--
		if pos >= len(data) {
			return 0, malformedAt(pos, "truncated: value expected")
		}
		at, c := pos, data[pos]
		info := codeTable[c]
		pos++
		skip, items := uint64(info.skip), uint64(info.items)
		if info.lenBytes > 0 || info.counts == reservedCode {
			var err error
			if pos, skip, items, err = lengthPrefixed(data, at, info); err != nil {
				return 0, err
			}
		}
		left := uint64(len(data) - pos)
		if skip > left {
			return 0, malformedAt(at, fmt.Sprintf("code 0x%02x declares %d bytes, %d left", c, skip, left))
		}
		pos += int(skip)
		if items > 0 {
			// Every item takes at least one byte: a longer declaration is a
			// lie that would otherwise size an allocation.
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
}

// lengthPrefixed reads the length after the code at data[at] (str, bin,
// ext, array16/32, map16/32), or rejects the reserved code. It returns where
// the payload or the items begin, and the payload's size or the number of
// items (maps count keys and values). It is out of valueEnd's loop because
// the values of the lists that make up most of a payload (token ids, block
// hashes) are sized by their code alone.
func lengthPrefixed(data []byte, at int, info codeInfo) (next int, skip, items uint64, err error) {
	c := data[at]
	if info.counts == reservedCode {
		return 0, 0, 0, malformedAt(at, "reserved code 0xc1")
	}
	pos := at + 1
	if len(data)-pos < int(info.lenBytes) {
		return 0, 0, 0, malformedAt(at, fmt.Sprintf("truncated length of code 0x%02x", c))
	}
	n := bigEndian(data[pos : pos+int(info.lenBytes)])
	skip = uint64(info.skip)
	switch info.counts {
	case countsBytes: // str, bin; ext: the type byte, then n bytes
		skip += n
	case countsItems:
		items = n
	case countsPairs:
		items = 2 * n
	}
	return pos + int(info.lenBytes), skip, items, nil
}

// codeInfo is what a msgpack type code alone says about the value it starts.
// It has at most four fields so that the compiler keeps it in registers.
type codeInfo struct {
	skip     uint8     // payload bytes after the code, and after the length if any (ext: the type byte)
	items    uint8     // items of a fixarray or fixmap (maps count keys and values)
	lenBytes uint8     // width of the big-endian length after the code, 0 if none
	counts   lenCounts // what that length counts
}

// lenCounts says what the length after a type code counts.
type lenCounts uint8

const (
	countsBytes  lenCounts = iota // payload bytes: str, bin, ext
	countsItems                   // array items
	countsPairs                   // map entries, each a key and a value
	reservedCode                  // no length: 0xc1, which msgpack never uses
)

// codeTable classifies every type code once, at start-up, so that valueEnd's
// loop, which runs for every value of every payload (most of them twice: to
// check the payload, then as the decoder steps over each event field), sizes
// a value with one index where a switch on the code would be longer and no
// faster.
var codeTable = func() (t [256]codeInfo) {
	for c := range t {
		t[c] = classify(byte(c))
	}
	return t
}()

// classify says what code c alone tells of the size of the value it starts,
// after the msgpack spec's table of formats.
func classify(c byte) codeInfo {
	switch {
	case c <= 0x7f, c >= 0xe0: // positive, negative fixint
		return codeInfo{}
	case c <= 0x8f: // fixmap
		return codeInfo{items: 2 * (c & 0x0f)}
	case c <= 0x9f: // fixarray
		return codeInfo{items: c & 0x0f}
	case c <= 0xbf: // fixstr
		return codeInfo{skip: c & 0x1f}
	}
	switch c {
	case 0xc1:
		return codeInfo{counts: reservedCode}
	case 0xc4, 0xc5, 0xc6: // bin8, bin16, bin32
		return codeInfo{lenBytes: 1 << (c - 0xc4)}
	case 0xd9, 0xda, 0xdb: // str8, str16, str32
		return codeInfo{lenBytes: 1 << (c - 0xd9)}
	case 0xc7, 0xc8, 0xc9: // ext8, ext16, ext32: length, type, data
		return codeInfo{lenBytes: 1 << (c - 0xc7), skip: 1}
	case 0xca: // float32
		return codeInfo{skip: 4}
	case 0xcb: // float64
		return codeInfo{skip: 8}
	case 0xcc, 0xcd, 0xce, 0xcf: // uint8, 16, 32, 64
		return codeInfo{skip: 1 << (c - 0xcc)}
	case 0xd0, 0xd1, 0xd2, 0xd3: // int8, 16, 32, 64
		return codeInfo{skip: 1 << (c - 0xd0)}
	case 0xd4, 0xd5, 0xd6, 0xd7, 0xd8: // fixext 1, 2, 4, 8, 16 (+1 type byte)
		return codeInfo{skip: 1 + (1 << (c - 0xd4))}
	case 0xdc, 0xdd: // array16, array32
		return codeInfo{lenBytes: 2 << (c - 0xdc), counts: countsItems}
	case 0xde, 0xdf: // map16, map32
		return codeInfo{lenBytes: 2 << (c - 0xde), counts: countsPairs}
	}
	return codeInfo{} // nil, false, true: the code is the whole value
}

func malformedAt(off int, detail string) error {
	return &DecodeError{Err: ErrMalformed, Offset: off, Detail: detail}
}
