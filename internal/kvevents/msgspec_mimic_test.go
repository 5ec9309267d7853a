package kvevents

import (
	"encoding/binary"
	"fmt"
	"math"
)

// This file is a small msgpack writer, independent of the package's encoder
// and of vmihailenco/msgpack, written from the msgpack spec to produce what
// Python's msgspec encoder produces: shortest integer encodings (unsigned
// codes for non-negative values), float64 for every float, str for str, bin
// for bytes, maps in insertion order. Wrapper types force the wider
// encodings other producers use, so the decoder is tested against both.

// omap is a map with a fixed key order, as msgspec writes struct fields.
type omap []kv

type kv struct {
	k string
	v any
}

type (
	i8   int8    // forced int8 code 0xd0
	i16  int16   // forced int16 code 0xd1
	i32  int32   // forced int32 code 0xd2
	i64  int64   // forced int64 code 0xd3
	u16  uint16  // forced uint16 code 0xcd
	u64  uint64  // forced uint64 code 0xcf
	f32  float32 // float32 code 0xca
	raw  []byte  // spliced in as is
	bin  []byte  // bin family
	ext1 byte    // fixext1 of type 5 with this data byte
)

func mp(v any) []byte { return appendMP(nil, v) }

func appendMP(b []byte, v any) []byte {
	switch x := v.(type) {
	case nil:
		return append(b, 0xc0)
	case bool:
		if x {
			return append(b, 0xc3)
		}
		return append(b, 0xc2)
	case int:
		return appendInt(b, int64(x))
	case uint64:
		return appendUint(b, x)
	case i8:
		return append(b, 0xd0, byte(x))
	case i16:
		return binary.BigEndian.AppendUint16(append(b, 0xd1), uint16(x))
	case i32:
		return binary.BigEndian.AppendUint32(append(b, 0xd2), uint32(x))
	case i64:
		return binary.BigEndian.AppendUint64(append(b, 0xd3), uint64(x))
	case u16:
		return binary.BigEndian.AppendUint16(append(b, 0xcd), uint16(x))
	case u64:
		return binary.BigEndian.AppendUint64(append(b, 0xcf), uint64(x))
	case float64:
		return binary.BigEndian.AppendUint64(append(b, 0xcb), math.Float64bits(x))
	case f32:
		return binary.BigEndian.AppendUint32(append(b, 0xca), math.Float32bits(float32(x)))
	case string:
		n := len(x)
		switch {
		case n < 32:
			b = append(b, 0xa0|byte(n))
		case n < 256:
			b = append(b, 0xd9, byte(n))
		default:
			b = binary.BigEndian.AppendUint16(append(b, 0xda), uint16(n))
		}
		return append(b, x...)
	case bin:
		if len(x) < 256 {
			b = append(b, 0xc4, byte(len(x)))
		} else {
			b = binary.BigEndian.AppendUint16(append(b, 0xc5), uint16(len(x)))
		}
		return append(b, x...)
	case ext1:
		return append(b, 0xd4, 5, byte(x))
	case raw:
		return append(b, x...)
	case []any:
		b = appendArrayLen(b, len(x))
		for _, e := range x {
			b = appendMP(b, e)
		}
		return b
	case omap:
		b = appendMapLen(b, len(x))
		for _, e := range x {
			b = appendMP(b, e.k)
			b = appendMP(b, e.v)
		}
		return b
	}
	panic(fmt.Sprintf("mp: unsupported %T", v))
}

func appendArrayLen(b []byte, n int) []byte {
	switch {
	case n < 16:
		return append(b, 0x90|byte(n))
	case n <= math.MaxUint16:
		return binary.BigEndian.AppendUint16(append(b, 0xdc), uint16(n))
	}
	return binary.BigEndian.AppendUint32(append(b, 0xdd), uint32(n))
}

func appendMapLen(b []byte, n int) []byte {
	switch {
	case n < 16:
		return append(b, 0x80|byte(n))
	case n <= math.MaxUint16:
		return binary.BigEndian.AppendUint16(append(b, 0xde), uint16(n))
	}
	return binary.BigEndian.AppendUint32(append(b, 0xdf), uint32(n))
}

// appendUint writes the shortest unsigned encoding, as msgspec does.
func appendUint(b []byte, x uint64) []byte {
	switch {
	case x < 128:
		return append(b, byte(x))
	case x <= math.MaxUint8:
		return append(b, 0xcc, byte(x))
	case x <= math.MaxUint16:
		return binary.BigEndian.AppendUint16(append(b, 0xcd), uint16(x))
	case x <= math.MaxUint32:
		return binary.BigEndian.AppendUint32(append(b, 0xce), uint32(x))
	}
	return binary.BigEndian.AppendUint64(append(b, 0xcf), x)
}

// appendInt writes the shortest encoding: unsigned codes for x >= 0.
func appendInt(b []byte, x int64) []byte {
	switch {
	case x >= 0:
		return appendUint(b, uint64(x))
	case x >= -32:
		return append(b, byte(x))
	case x >= math.MinInt8:
		return append(b, 0xd0, byte(x))
	case x >= math.MinInt16:
		return binary.BigEndian.AppendUint16(append(b, 0xd1), uint16(x))
	case x >= math.MinInt32:
		return binary.BigEndian.AppendUint32(append(b, 0xd2), uint32(x))
	}
	return binary.BigEndian.AppendUint64(append(b, 0xd3), uint64(x))
}
