package kvevents

import (
	"bytes"
	"encoding/hex"
	"errors"
	"fmt"
	"math"
	"reflect"
	"strings"
	"testing"

	"pgregory.net/rapid"
)

// hx joins hex fragments, ignoring spaces.
func hx(t testing.TB, parts ...string) []byte {
	t.Helper()
	b, err := hex.DecodeString(strings.ReplaceAll(strings.Join(parts, ""), " ", ""))
	if err != nil {
		t.Fatalf("bad hex: %v", err)
	}
	return b
}

// ascii is the hex of a string's bytes, to write string bodies readably.
func ascii(s string) string { return hex.EncodeToString([]byte(s)) }

func ptr[T any](v T) *T { return &v }

// sameBatch compares batches, treating nil and empty slices alike and
// timestamps by their bits (so NaN equals NaN).
func sameBatch(a, b Batch) bool {
	if math.Float64bits(a.Timestamp) != math.Float64bits(b.Timestamp) {
		return false
	}
	if (a.DataParallelRank == nil) != (b.DataParallelRank == nil) ||
		(a.DataParallelRank != nil && *a.DataParallelRank != *b.DataParallelRank) {
		return false
	}
	if len(a.Events) != len(b.Events) {
		return false
	}
	for i := range a.Events {
		if !sameEvent(a.Events[i], b.Events[i]) {
			return false
		}
	}
	return true
}

func sameEvent(a, b Event) bool {
	switch x := a.(type) {
	case *BlockStored:
		y, ok := b.(*BlockStored)
		return ok && sameU64s(x.BlockHashes, y.BlockHashes) &&
			reflect.DeepEqual(x.ParentBlockHash, y.ParentBlockHash) &&
			(len(x.TokenIDs) == 0 && len(y.TokenIDs) == 0 || reflect.DeepEqual(x.TokenIDs, y.TokenIDs)) &&
			x.BlockSize == y.BlockSize && reflect.DeepEqual(x.LoraID, y.LoraID) &&
			x.Medium == y.Medium && x.LoraName == y.LoraName
	case *BlockRemoved:
		y, ok := b.(*BlockRemoved)
		return ok && sameU64s(x.BlockHashes, y.BlockHashes) && x.Medium == y.Medium
	case *AllBlocksCleared:
		_, ok := b.(*AllBlocksCleared)
		return ok
	}
	return false
}

func sameU64s(a, b []uint64) bool {
	return len(a) == 0 && len(b) == 0 || reflect.DeepEqual(a, b)
}

// stored is the BlockStored used by the golden cases: every field set, each
// to a value distinct from its neighbours, so a swapped field shows.
func stored() *BlockStored {
	return &BlockStored{
		BlockHashes:     []uint64{1, 0xfedcba9876543210},
		ParentBlockHash: ptr(uint64(300)),
		TokenIDs:        []uint32{7, 200, 70000},
		BlockSize:       16,
		LoraID:          ptr(5),
		Medium:          "GPU",
		LoraName:        "ad",
	}
}

// Golden bytes, written by hand from vLLM's struct definitions and msgspec's
// encoding rules (see the package doc), one event of each kind in each form.
func goldenCases(t testing.TB) []struct {
	name  string
	form  Form
	batch Batch
	wire  []byte
} {
	const (
		ts15 = "cb 3ff8000000000000" // float64 1.5
	)
	storedArray := strings.Join([]string{
		"98",                        // event: array(8)
		"ab" + ascii("BlockStored"), // tag
		"92 01 cf fedcba9876543210", // block_hashes [1, 0xfedcba9876543210]
		"cd 012c",                   // parent_block_hash 300
		"93 07 cc c8 ce 00011170",   // token_ids [7, 200, 70000]
		"10",                        // block_size 16
		"05",                        // lora_id 5
		"a3" + ascii("GPU"),         // medium
		"a2" + ascii("ad"),          // lora_name
	}, "")
	storedMap := strings.Join([]string{
		"88",                                              // event: map(8)
		"a4" + ascii("type"), "ab" + ascii("BlockStored"), // tag first
		"ac" + ascii("block_hashes"), "92 01 cf fedcba9876543210",
		"b1" + ascii("parent_block_hash"), "cd 012c",
		"a9" + ascii("token_ids"), "93 07 cc c8 ce 00011170",
		"aa" + ascii("block_size"), "10",
		"a7" + ascii("lora_id"), "05",
		"a6" + ascii("medium"), "a3" + ascii("GPU"),
		"a9" + ascii("lora_name"), "a2" + ascii("ad"),
	}, "")
	// The nil-heavy BlockStored current vLLM sends for a plain request.
	storedNilsMap := strings.Join([]string{
		"88",
		"a4" + ascii("type"), "ab" + ascii("BlockStored"),
		"ac" + ascii("block_hashes"), "91 2a", // [42]
		"b1" + ascii("parent_block_hash"), "c0",
		"a9" + ascii("token_ids"), "92 01 02",
		"aa" + ascii("block_size"), "02",
		"a7" + ascii("lora_id"), "c0",
		"a6" + ascii("medium"), "c0",
		"a9" + ascii("lora_name"), "c0",
	}, "")
	removedArray := "93" + "ac" + ascii("BlockRemoved") + "92 02 cf ffffffffffffffff" + "a3" + ascii("CPU")
	removedMap := "83" + "a4" + ascii("type") + "ac" + ascii("BlockRemoved") +
		"ac" + ascii("block_hashes") + "92 02 cf ffffffffffffffff" +
		"a6" + ascii("medium") + "a3" + ascii("CPU")
	clearedArray := "91" + "b0" + ascii("AllBlocksCleared")
	clearedMap := "81" + "a4" + ascii("type") + "b0" + ascii("AllBlocksCleared")

	removed := &BlockRemoved{BlockHashes: []uint64{2, math.MaxUint64}, Medium: "CPU"}
	return []struct {
		name  string
		form  Form
		batch Batch
		wire  []byte
	}{
		// Batches: [ts, [event], dp_rank], the rank omitted when nil.
		{"stored/array", FormArray, Batch{1.5, []Event{stored()}, ptr(0)}, hx(t, "93", ts15, "91", storedArray, "00")},
		{"stored/map", FormMap, Batch{1.5, []Event{stored()}, ptr(0)}, hx(t, "93", ts15, "91", storedMap, "00")},
		{"stored-nils/map", FormMap, Batch{1.5, []Event{&BlockStored{BlockHashes: []uint64{42}, TokenIDs: []uint32{1, 2}, BlockSize: 2}}, ptr(0)}, hx(t, "93", ts15, "91", storedNilsMap, "00")},
		{"removed/array", FormArray, Batch{1.5, []Event{removed}, nil}, hx(t, "92", ts15, "91", removedArray)},
		{"removed/map", FormMap, Batch{1.5, []Event{removed}, nil}, hx(t, "92", ts15, "91", removedMap)},
		{"cleared/array", FormArray, Batch{1.5, []Event{&AllBlocksCleared{}}, ptr(3)}, hx(t, "93", ts15, "91", clearedArray, "03")},
		{"cleared/map", FormMap, Batch{1.5, []Event{&AllBlocksCleared{}}, ptr(3)}, hx(t, "93", ts15, "91", clearedMap, "03")},
		{"empty/map", FormMap, Batch{0, []Event{}, ptr(0)}, hx(t, "93 cb 0000000000000000 90 00")},
	}
}

func TestGolden(t *testing.T) {
	for _, tc := range goldenCases(t) {
		t.Run(tc.name, func(t *testing.T) {
			got, err := Encode(tc.batch, tc.form)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, tc.wire) {
				t.Errorf("Encode:\n got  %x\n want %x", got, tc.wire)
			}
			back, err := Decode(tc.wire)
			if err != nil {
				t.Fatal(err)
			}
			if !sameBatch(back, tc.batch) {
				t.Errorf("Decode = %+v, want %+v", back, tc.batch)
			}
		})
	}
}

// The package's encoder and the independent msgspec mimic agree byte for
// byte on the golden batches.
func TestGoldenMatchesMimic(t *testing.T) {
	cases := goldenCases(t)
	mimic := map[string]any{
		"stored/array": []any{1.5, []any{[]any{"BlockStored", []any{1, uint64(0xfedcba9876543210)}, 300, []any{7, 200, 70000}, 16, 5, "GPU", "ad"}}, 0},
		"stored/map": []any{1.5, []any{omap{{"type", "BlockStored"}, {"block_hashes", []any{1, uint64(0xfedcba9876543210)}},
			{"parent_block_hash", 300}, {"token_ids", []any{7, 200, 70000}}, {"block_size", 16}, {"lora_id", 5},
			{"medium", "GPU"}, {"lora_name", "ad"}}}, 0},
		"removed/array": []any{1.5, []any{[]any{"BlockRemoved", []any{2, uint64(math.MaxUint64)}, "CPU"}}},
		"cleared/map":   []any{1.5, []any{omap{{"type", "AllBlocksCleared"}}}, 3},
	}
	for _, tc := range cases {
		m, ok := mimic[tc.name]
		if !ok {
			continue
		}
		if got := mp(m); !bytes.Equal(got, tc.wire) {
			t.Errorf("%s: mimic %x\n           golden %x", tc.name, got, tc.wire)
		}
	}
}

func TestDecodeVariants(t *testing.T) {
	sha := bytes.Repeat([]byte{0xaa}, 24)
	sha = append(sha, 0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x08)
	tests := []struct {
		name string
		wire []byte
		want Batch
	}{
		{
			// A batch captured from vLLM 0.26 (volcano-sh/kthena#1535): map
			// events with fields newer than ours, a hash above MaxInt64.
			name: "vllm-0.26-capture",
			wire: mp([]any{1789095808.8378847, []any{omap{
				{"type", "BlockStored"}, {"block_hashes", []any{uint64(15760518052499183552)}},
				{"parent_block_hash", nil},
				{"token_ids", []any{151644, 872, 198, 9064, 374, 279, 6722, 315, 5616, 30, 151645, 198, 151644, 77091, 198, 151667}},
				{"block_size", 16}, {"lora_id", nil}, {"medium", "GPU"}, {"lora_name", nil},
				{"extra_keys", []any{nil}}, {"group_idx", 0}, {"kv_cache_spec_kind", "full_attention"},
			}}, 0}),
			want: Batch{1789095808.8378847, []Event{&BlockStored{
				BlockHashes: []uint64{15760518052499183552},
				TokenIDs:    []uint32{151644, 872, 198, 9064, 374, 279, 6722, 315, 5616, 30, 151645, 198, 151644, 77091, 198, 151667},
				BlockSize:   16, Medium: "GPU",
			}}, ptr(0)},
		},
		{
			// vLLM 0.8-0.9: [ts, events] without the DP rank, BlockStored
			// ending at lora_id, BlockRemoved without medium, Python hash()
			// values that are negative.
			name: "oldest-array",
			wire: mp([]any{2.0, []any{
				[]any{"BlockStored", []any{-5, 7}, -9223372036854775808, []any{1, 2, 3, 4}, 2, nil},
				[]any{"BlockRemoved", []any{-5}},
				[]any{"AllBlocksCleared"},
			}}),
			want: Batch{2.0, []Event{
				&BlockStored{BlockHashes: []uint64{math.MaxUint64 - 4, 7}, ParentBlockHash: ptr(uint64(1) << 63), TokenIDs: []uint32{1, 2, 3, 4}, BlockSize: 2},
				&BlockRemoved{BlockHashes: []uint64{math.MaxUint64 - 4}},
				&AllBlocksCleared{},
			}, nil},
		},
		{
			// Recent vLLM default: sha256 digests as bytes.
			name: "bytes-hashes",
			wire: mp([]any{1.0, []any{
				omap{{"type", "BlockStored"}, {"block_hashes", []any{bin(sha), bin{0x01, 0x00}}}, {"parent_block_hash", bin(sha)},
					{"token_ids", []any{5}}, {"block_size", 1}, {"lora_id", nil}, {"medium", "GPU"}, {"lora_name", nil}},
				omap{{"type", "BlockRemoved"}, {"block_hashes", []any{bin(sha)}}, {"medium", "GPU"}},
			}, 0}),
			want: Batch{1.0, []Event{
				&BlockStored{BlockHashes: []uint64{0x0102030405060708, 0x0100}, ParentBlockHash: ptr(uint64(0x0102030405060708)), TokenIDs: []uint32{5}, BlockSize: 1, Medium: "GPU"},
				&BlockRemoved{BlockHashes: []uint64{0x0102030405060708}, Medium: "GPU"},
			}, ptr(0)},
		},
		{
			// Other encoders need not pick the shortest integer form.
			name: "wide-ints",
			wire: mp([]any{f32(0.5), []any{
				[]any{"BlockStored", []any{i64(9), u64(10), i8(11)}, i32(12), []any{i64(1), u64(2), i16(3), u16(4), i8(5)}, u16(16), i64(-1), "GPU", nil},
			}, i64(2)}),
			want: Batch{0.5, []Event{&BlockStored{BlockHashes: []uint64{9, 10, 11}, ParentBlockHash: ptr(uint64(12)), TokenIDs: []uint32{1, 2, 3, 4, 5}, BlockSize: 16, LoraID: ptr(-1), Medium: "GPU"}}, ptr(2)},
		},
		{
			name: "int-timestamp",
			wire: mp([]any{1700000000, []any{}, 1}),
			want: Batch{1700000000, []Event{}, ptr(1)},
		},
		{
			// Unknown event types are skipped, known ones kept; map keys in
			// any order; both forms in one batch; unknown fields and trailing
			// positions (extra_keys, group_idx, ...) ignored, whatever their type.
			name: "forward-compatible",
			wire: mp([]any{3.0, []any{
				omap{{"type", "BlockUpdated"}, {"block_hashes", "not a list"}},
				omap{{"medium", nil}, {"block_hashes", []any{4}}, {"future", omap{{"x", ext1(9)}}}, {"type", "BlockRemoved"}},
				[]any{"KVCacheCreated", 1, 2, 3},
				[]any{"BlockStored", []any{8}, 4, []any{9}, 1, nil, "CPU", "lora-a", []any{[]any{"salt", 1}}, 0, "sliding_window", 4096},
				[]any{"AllBlocksCleared", "future field"},
			}, 0, "future batch field"}),
			want: Batch{3.0, []Event{
				&BlockRemoved{BlockHashes: []uint64{4}},
				&BlockStored{BlockHashes: []uint64{8}, ParentBlockHash: ptr(uint64(4)), TokenIDs: []uint32{9}, BlockSize: 1, Medium: "CPU", LoraName: "lora-a"},
				&AllBlocksCleared{},
			}, ptr(0)},
		},
		{
			name: "map-envelope",
			wire: mp(omap{{"events", []any{omap{{"type", "AllBlocksCleared"}}}}, {"ts", 4.0}, {"data_parallel_rank", 1}, {"other", nil}}),
			want: Batch{4.0, []Event{&AllBlocksCleared{}}, ptr(1)},
		},
		{
			name: "empty-token-ids-and-hashes",
			wire: mp([]any{0.0, []any{[]any{"BlockStored", []any{}, nil, []any{}, 16, nil, nil, nil}}}),
			want: Batch{0, []Event{&BlockStored{BlockHashes: []uint64{}, TokenIDs: []uint32{}, BlockSize: 16}}, nil},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, err := Decode(tc.wire)
			if err != nil {
				t.Fatal(err)
			}
			if !sameBatch(got, tc.want) {
				t.Errorf("Decode =\n %s\nwant\n %s", dump(got), dump(tc.want))
			}
		})
	}
}

// dump prints a batch with its pointers followed, for failure messages.
func dump(b Batch) string {
	var sb strings.Builder
	fmt.Fprintf(&sb, "ts=%v", b.Timestamp)
	if b.DataParallelRank != nil {
		fmt.Fprintf(&sb, " dp=%d", *b.DataParallelRank)
	}
	for _, e := range b.Events {
		switch x := e.(type) {
		case *BlockStored:
			parent, lora := "nil", "nil"
			if x.ParentBlockHash != nil {
				parent = fmt.Sprint(*x.ParentBlockHash)
			}
			if x.LoraID != nil {
				lora = fmt.Sprint(*x.LoraID)
			}
			fmt.Fprintf(&sb, " Stored{%v parent=%s tokens=%v bs=%d lora=%s medium=%q name=%q}",
				x.BlockHashes, parent, x.TokenIDs, x.BlockSize, lora, x.Medium, x.LoraName)
		case *BlockRemoved:
			fmt.Fprintf(&sb, " Removed{%v medium=%q}", x.BlockHashes, x.Medium)
		default:
			fmt.Fprintf(&sb, " %T", e)
		}
	}
	return sb.String()
}

func TestDecodeErrors(t *testing.T) {
	okStored := func(fields ...any) []byte {
		return mp([]any{1.0, []any{append([]any{"BlockStored"}, fields...)}, 0})
	}
	deep := bytes.Repeat([]byte{0x91}, 40)
	deep = append(deep, 0x00)
	tests := []struct {
		name     string
		wire     []byte
		want     error
		wherePos string // substring of the error (path or detail)
	}{
		{"empty", nil, ErrMalformed, "truncated"},
		{"truncated", mp([]any{1.0, []any{}, 0})[:5], ErrMalformed, "declares 8 bytes"},
		{"trailing", append(mp([]any{1.0, []any{}, 0}), 0x00), ErrMalformed, "1 trailing bytes"},
		{"reserved-code", hx(t, "91 c1"), ErrMalformed, "0xc1"},
		{"huge-array", hx(t, "93 cb 3ff0000000000000 dd ffffffff 00"), ErrMalformed, "declares 4294967295 items"},
		{"huge-str", hx(t, "93 cb 3ff0000000000000 91 91 db 7fffffff"), ErrMalformed, "declares 2147483647 bytes"},
		{"too-deep", deep, ErrMalformed, "nesting deeper than 32"},
		{"not-array", mp(7), ErrSchema, "$: expected batch array, got int"},
		{"short-batch", mp([]any{1.0}), ErrSchema, "batch array has 1 elements"},
		{"ts-string", mp([]any{"now", []any{}}), ErrSchema, "$[0]: expected float timestamp, got str"},
		{"events-map", mp([]any{1.0, omap{}}), ErrSchema, "$[1]: expected events array, got map"},
		{"event-int", mp([]any{1.0, []any{7}}), ErrSchema, "$[1][0]: expected event array or map, got int"},
		{"event-empty-array", mp([]any{1.0, []any{[]any{}}}), ErrSchema, "$[1][0]: empty event array"},
		{"tag-int", mp([]any{1.0, []any{[]any{3}}}), ErrSchema, "$[1][0][0]: expected event tag str, got int"},
		{"map-no-type", mp([]any{1.0, []any{omap{{"block_hashes", []any{}}}}}), ErrSchema, `$[1][0]: event map has no "type" key`},
		{"map-type-nil", mp([]any{1.0, []any{omap{{"type", nil}}}}), ErrSchema, "$[1][0].type: expected event tag str, got nil"},
		{"map-int-key", mp([]any{1.0, []any{raw(hx(t, "81 01 02"))}}), ErrSchema, "$[1][0]: expected string map key, got int"},
		{"token-negative", okStored([]any{1}, nil, []any{1, -1}, 2, nil), ErrSchema, "$[1][0].token_ids[1]: token id -1 outside [0, 2^32)"},
		{"token-too-big", okStored([]any{1}, nil, []any{uint64(1) << 32}, 1, nil), ErrSchema, "$[1][0].token_ids[0]: token id 4294967296"},
		{"token-float", okStored([]any{1}, nil, []any{1.0}, 1, nil), ErrSchema, "$[1][0].token_ids[0]: expected int token id, got float"},
		{"tokens-nil", okStored([]any{1}, nil, nil, 1, nil), ErrSchema, "$[1][0].token_ids: expected array of token ids, got nil"},
		{"hash-string", okStored([]any{"abc"}, nil, []any{1}, 1, nil), ErrSchema, "$[1][0].block_hashes[0]: expected int or bytes block hash, got str"},
		{"hash-empty-bytes", okStored([]any{1, bin{}}, nil, []any{1}, 1, nil), ErrSchema, "$[1][0].block_hashes[1]: empty bytes"},
		{"parent-array", okStored([]any{1}, []any{1}, []any{1}, 1, nil), ErrSchema, "$[1][0].parent_block_hash: expected int or bytes block hash, got array"},
		{"block-size-negative", okStored([]any{1}, nil, []any{1}, -16, nil), ErrSchema, "$[1][0].block_size: block size -16 out of range"},
		{"block-size-missing", okStored([]any{1}, nil, []any{1}), ErrSchema, "$[1][0]: missing field block_size"},
		{"block-size-float", okStored([]any{1}, nil, []any{1}, 16.0, nil), ErrSchema, "$[1][0].block_size: expected int, got float"},
		{"lora-id-string", okStored([]any{1}, nil, []any{1}, 1, "x"), ErrSchema, "$[1][0].lora_id: expected int or nil, got str"},
		{"lora-id-huge", okStored([]any{1}, nil, []any{1}, 1, uint64(math.MaxUint64)), ErrSchema, "$[1][0].lora_id: int 18446744073709551615 out of range"},
		{"medium-int", okStored([]any{1}, nil, []any{1}, 1, nil, 3), ErrSchema, "$[1][0].medium: expected str or nil, got int"},
		{"lora-name-bytes", okStored([]any{1}, nil, []any{1}, 1, nil, nil, bin("a")), ErrSchema, "$[1][0].lora_name: expected str or nil, got bytes"},
		{"removed-no-hashes", mp([]any{1.0, []any{omap{{"type", "BlockRemoved"}}}}), ErrSchema, "$[1][0]: missing field block_hashes"},
		{"removed-hashes-map", mp([]any{1.0, []any{[]any{"BlockRemoved", omap{}}}}), ErrSchema, "$[1][0].block_hashes: expected array of block hashes, got map"},
		{"dp-rank-string", mp([]any{1.0, []any{}, "0"}), ErrSchema, "$[2]: expected int or nil, got str"},
		{"map-envelope-no-events", mp(omap{{"ts", 1.0}}), ErrSchema, "batch map lacks ts or events"},
		{"second-event-bad", mp([]any{1.0, []any{[]any{"AllBlocksCleared"}, omap{{"type", "BlockRemoved"}, {"block_hashes", []any{true}}}}}), ErrSchema, "$[1][1].block_hashes[0]: expected int or bytes block hash, got bool"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			b, err := Decode(tc.wire)
			if err == nil {
				t.Fatalf("Decode succeeded: %+v", b)
			}
			if !errors.Is(err, tc.want) {
				t.Fatalf("error %v, want %v", err, tc.want)
			}
			var de *DecodeError
			if !errors.As(err, &de) {
				t.Fatalf("error %T is not a *DecodeError", err)
			}
			if !strings.Contains(err.Error(), tc.wherePos) {
				t.Errorf("error %q does not contain %q", err, tc.wherePos)
			}
		})
	}
}

func TestEncodeErrors(t *testing.T) {
	tests := []struct {
		name  string
		batch Batch
		form  Form
		want  error
	}{
		{"nil-event", Batch{Events: []Event{nil}}, FormMap, ErrInvalidBatch},
		{"nil-stored", Batch{Events: []Event{(*BlockStored)(nil)}}, FormArray, ErrInvalidBatch},
		{"nil-removed", Batch{Events: []Event{(*BlockRemoved)(nil)}}, FormMap, ErrInvalidBatch},
		{"nil-cleared", Batch{Events: []Event{(*AllBlocksCleared)(nil)}}, FormMap, ErrInvalidBatch},
		{"negative-block-size", Batch{Events: []Event{&BlockStored{BlockSize: -1}}}, FormMap, ErrInvalidBatch},
		{"unknown-form", Batch{}, Form(7), ErrUnknownForm},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := Encode(tc.batch, tc.form); !errors.Is(err, tc.want) {
				t.Errorf("Encode error %v, want %v", err, tc.want)
			}
		})
	}
}

func TestParseForm(t *testing.T) {
	tests := []struct {
		in   string
		want Form
		err  bool
	}{{"map", FormMap, false}, {"array", FormArray, false}, {"Map", 0, true}, {"", 0, true}}
	for _, tc := range tests {
		got, err := ParseForm(tc.in)
		if (err != nil) != tc.err || (!tc.err && got != tc.want) {
			t.Errorf("ParseForm(%q) = %v, %v", tc.in, got, err)
		}
		if !tc.err && got.String() != tc.in {
			t.Errorf("%v.String() = %q", got, got.String())
		}
	}
}

func TestHashFromBytes(t *testing.T) {
	tests := []struct {
		in   []byte
		want uint64
	}{
		{[]byte{0x01}, 1},
		{[]byte{0x01, 0x00}, 256},
		{[]byte{1, 2, 3, 4, 5, 6, 7, 8}, 0x0102030405060708},
		// Longer: the low 64 bits of the big-endian value.
		{append(bytes.Repeat([]byte{0xff}, 24), 0, 0, 0, 0, 0, 0, 0, 9), 9},
	}
	for _, tc := range tests {
		if got := HashFromBytes(tc.in); got != tc.want {
			t.Errorf("HashFromBytes(%x) = %#x, want %#x", tc.in, got, tc.want)
		}
	}
}

// genBatch draws batches covering every field, nil and not.
func genBatch() *rapid.Generator[Batch] {
	hashes := rapid.SliceOfN(rapid.Uint64(), 0, 6)
	optStr := rapid.SampledFrom([]string{"", "GPU", "CPU", "a-much-longer-medium-name-than-thirty-one-bytes"})
	event := rapid.Custom(func(t *rapid.T) Event {
		switch rapid.IntRange(0, 2).Draw(t, "kind") {
		case 0:
			return &BlockStored{
				BlockHashes:     hashes.Draw(t, "hashes"),
				ParentBlockHash: rapid.Ptr(rapid.Uint64(), true).Draw(t, "parent"),
				TokenIDs:        rapid.SliceOfN(rapid.Uint32(), 0, 40).Draw(t, "tokens"),
				BlockSize:       rapid.IntRange(0, 1<<20).Draw(t, "block_size"),
				LoraID:          rapid.Ptr(rapid.Int(), true).Draw(t, "lora_id"),
				Medium:          optStr.Draw(t, "medium"),
				LoraName:        optStr.Draw(t, "lora_name"),
			}
		case 1:
			return &BlockRemoved{BlockHashes: hashes.Draw(t, "hashes"), Medium: optStr.Draw(t, "medium")}
		}
		return &AllBlocksCleared{}
	})
	return rapid.Custom(func(t *rapid.T) Batch {
		return Batch{
			Timestamp:        rapid.Float64().Draw(t, "ts"),
			Events:           rapid.SliceOfN(event, 0, 20).Draw(t, "events"),
			DataParallelRank: rapid.Ptr(rapid.Int(), true).Draw(t, "dp"),
		}
	})
}

func TestRoundTrip(t *testing.T) {
	gen := genBatch()
	for _, f := range []Form{FormMap, FormArray} {
		t.Run(f.String(), func(t *testing.T) {
			rapid.Check(t, func(t *rapid.T) {
				b := gen.Draw(t, "batch")
				wire, err := Encode(b, f)
				if err != nil {
					t.Fatal(err)
				}
				got, err := Decode(wire)
				if err != nil {
					t.Fatalf("Decode(%x): %v", wire, err)
				}
				if !sameBatch(got, b) {
					t.Fatalf("round trip changed the batch:\n got  %s\n want %s", dump(got), dump(b))
				}
			})
		})
	}
}

// Both forms carry the same information: re-encoding a decoded batch in the
// other form and decoding again gives the same batch.
func TestFormsInterchangeable(t *testing.T) {
	gen := genBatch()
	rapid.Check(t, func(t *rapid.T) {
		b := gen.Draw(t, "batch")
		m, err := Encode(b, FormMap)
		if err != nil {
			t.Fatal(err)
		}
		a, err := Encode(b, FormArray)
		if err != nil {
			t.Fatal(err)
		}
		if len(b.Events) > 0 && bytes.Equal(m, a) {
			t.Fatalf("map and array forms encode identically: %x", m)
		}
		dm, err1 := Decode(m)
		da, err2 := Decode(a)
		if err1 != nil || err2 != nil {
			t.Fatal(err1, err2)
		}
		if !sameBatch(dm, da) {
			t.Fatalf("forms decode differently")
		}
	})
}
