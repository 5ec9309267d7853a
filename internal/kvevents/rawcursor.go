package kvevents

import (
	"encoding/binary"
	"errors"
	"math"

	"github.com/vmihailenco/msgpack/v5/msgpcode"
)

// rawCursor reads msgpack values straight from a byte slice.
//
// Decoding does not go through vmihailenco/msgpack's Decoder (Encode does
// use its Encoder). The Decoder reads every value through io.Reader with a
// copy: a batch of 16 BlockStored events of 16 blocks took about 190 µs that
// way against about 70 µs here (BenchmarkDecode), most of it on the token
// and hash lists. And what the decoder needs here is different anyway: to
// dispatch on the exact msgpack type of every value, to know byte offsets
// (map fields are located first and interpreted once the event's tag is
// known), and to skip unknown values without recursion. Every read is
// bounds-checked; the payload has also passed checkWellFormed first.
type rawCursor struct {
	b   []byte
	pos int
}

var errShort = errors.New("kvevents: value ends early")

func (c *rawCursor) peek() (byte, error) {
	if c.pos >= len(c.b) {
		return 0, errShort
	}
	return c.b[c.pos], nil
}

func (c *rawCursor) take(n uint64) ([]byte, error) {
	if uint64(len(c.b)-c.pos) < n {
		return nil, errShort
	}
	p := c.b[c.pos : c.pos+int(n)]
	c.pos += int(n)
	return p, nil
}

// uintN reads an n-byte big-endian unsigned integer.
func (c *rawCursor) uintN(n uint64) (uint64, error) {
	p, err := c.take(n)
	if err != nil {
		return 0, err
	}
	return bigEndian(p), nil
}

// skip steps over one value of any type.
func (c *rawCursor) skip() error {
	end, err := valueEnd(c.b, c.pos)
	if err != nil {
		return err
	}
	c.pos = end
	return nil
}

// nilValue consumes a nil and reports true, or leaves the cursor alone.
func (c *rawCursor) nilValue() (bool, error) {
	code, err := c.peek()
	if err != nil {
		return false, err
	}
	if code == msgpcode.Nil {
		c.pos++
		return true, nil
	}
	return false, nil
}

// containerLen reads an array (or, with maps, a map) header.
func (c *rawCursor) containerLen(want string, maps bool) (int, error) {
	code, err := c.peek()
	if err != nil {
		return 0, err
	}
	var (
		n    uint64
		size uint64
	)
	switch {
	case !maps && msgpcode.IsFixedArray(code):
		n = uint64(code & msgpcode.FixedArrayMask)
	case !maps && code == msgpcode.Array16, maps && code == msgpcode.Map16:
		size = 2
	case !maps && code == msgpcode.Array32, maps && code == msgpcode.Map32:
		size = 4
	case maps && msgpcode.IsFixedMap(code):
		n = uint64(code & msgpcode.FixedMapMask)
	default:
		return 0, wrongType(want, code)
	}
	c.pos++
	if size > 0 {
		if n, err = c.uintN(size); err != nil {
			return 0, err
		}
	}
	// Each element takes a byte at least: a longer count is a lie, and must
	// not size an allocation.
	if n > uint64(len(c.b)-c.pos) {
		return 0, errShort
	}
	return int(n), nil
}

func (c *rawCursor) arrayLen(want string) (int, error) { return c.containerLen(want, false) }
func (c *rawCursor) mapLen(want string) (int, error)   { return c.containerLen(want, true) }

// integer reads any msgpack integer, whatever its width: msgspec writes the
// shortest encoding, other encoders may not, and both the signed and the
// unsigned codes carry non-negative values.
func (c *rawCursor) integer(want string) (integer, error) {
	code, err := c.peek()
	if err != nil {
		return integer{}, err
	}
	switch {
	case code <= msgpcode.PosFixedNumHigh:
		c.pos++
		return integer{u: uint64(code)}, nil
	case code >= msgpcode.NegFixedNumLow:
		c.pos++
		return integer{neg: true, i: int64(int8(code))}, nil
	case code >= msgpcode.Uint8 && code <= msgpcode.Uint64:
		c.pos++
		u, err := c.uintN(1 << (code - msgpcode.Uint8))
		return integer{u: u}, err
	case code >= msgpcode.Int8 && code <= msgpcode.Int64:
		c.pos++
		width := uint64(1) << (code - msgpcode.Int8)
		u, err := c.uintN(width)
		if err != nil {
			return integer{}, err
		}
		shift := 64 - 8*width // sign-extend from the encoded width
		i := int64(u<<shift) >> shift
		if i >= 0 {
			return integer{u: uint64(i)}, nil
		}
		return integer{neg: true, i: i}, nil
	}
	return integer{}, wrongType(want, code)
}

// float reads a float32, a float64 or, as msgspec accepts for a float
// field, an integer.
func (c *rawCursor) float(want string) (float64, error) {
	code, err := c.peek()
	if err != nil {
		return 0, err
	}
	switch code {
	case msgpcode.Float:
		c.pos++
		u, err := c.uintN(4)
		return float64(math.Float32frombits(uint32(u))), err
	case msgpcode.Double:
		c.pos++
		u, err := c.uintN(8)
		return math.Float64frombits(u), err
	}
	n, err := c.integer(want)
	if err != nil {
		return 0, err
	}
	if n.neg {
		return float64(n.i), nil
	}
	return float64(n.u), nil
}

// bytesOf reads the body of a str (str=true) or bin value.
func (c *rawCursor) bytesOf(want string, str bool) ([]byte, error) {
	code, err := c.peek()
	if err != nil {
		return nil, err
	}
	var n, size uint64
	switch {
	case str && msgpcode.IsFixedString(code):
		n = uint64(code & msgpcode.FixedStrMask)
	case str && code >= msgpcode.Str8 && code <= msgpcode.Str32:
		size = 1 << (code - msgpcode.Str8)
	case !str && msgpcode.IsBin(code):
		size = 1 << (code - msgpcode.Bin8)
	default:
		return nil, wrongType(want, code)
	}
	c.pos++
	if size > 0 {
		if n, err = c.uintN(size); err != nil {
			return nil, err
		}
	}
	return c.take(n)
}

func (c *rawCursor) str(want string) (string, error) {
	b, err := c.bytesOf(want, true)
	return string(b), err
}

// hash reads an ExternalBlockHash: an int (two's complement bits) or bytes
// (big-endian value of the last 8 bytes), see the package doc.
func (c *rawCursor) hash() (uint64, error) {
	code, err := c.peek()
	if err != nil {
		return 0, err
	}
	if msgpcode.IsBin(code) {
		p, err := c.bytesOf("bytes", false)
		if err != nil {
			return 0, err
		}
		if len(p) == 0 {
			return 0, &valueErr{msg: "empty bytes block hash"}
		}
		return hashFromBytes(p), nil
	}
	n, err := c.integer("int or bytes block hash")
	if err != nil {
		return 0, err
	}
	if n.neg {
		return uint64(n.i), nil
	}
	return n.u, nil
}

// HashFromBytes maps a bytes block hash to uint64 as Decode does: the
// big-endian value of the last 8 bytes, zero-extended when shorter, which is
// vLLM's int.from_bytes(h, "big") & (2**64-1).
func HashFromBytes(b []byte) uint64 { return hashFromBytes(b) }

func hashFromBytes(b []byte) uint64 {
	if len(b) >= 8 {
		return binary.BigEndian.Uint64(b[len(b)-8:])
	}
	return bigEndian(b)
}

// bigEndian reads a big-endian unsigned integer of len(p) <= 8 bytes.
func bigEndian(p []byte) uint64 {
	var v uint64
	for _, x := range p {
		v = v<<8 | uint64(x)
	}
	return v
}
