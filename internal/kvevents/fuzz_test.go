package kvevents

import (
	"errors"
	"testing"
)

// FuzzDecode checks that Decode never panics, that every failure is a
// *DecodeError wrapping one of the two sentinels, and that whatever it
// accepts survives a re-encode in both forms unchanged. The seed corpus in
// testdata/fuzz/FuzzDecode holds the golden payloads, the msgspec variants
// and near-misses of both.
func FuzzDecode(f *testing.F) {
	for _, tc := range goldenCases(f) {
		f.Add(tc.wire)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		b, err := Decode(data)
		if err != nil {
			var de *DecodeError
			if !errors.As(err, &de) {
				t.Fatalf("error %T %v is not a *DecodeError", err, err)
			}
			if !errors.Is(err, ErrMalformed) && !errors.Is(err, ErrSchema) {
				t.Fatalf("error %v wraps neither sentinel", err)
			}
			return
		}
		for _, form := range []Form{FormMap, FormArray} {
			wire, err := Encode(b, form)
			if err != nil {
				t.Fatalf("decoded batch does not encode in %s form: %v", form, err)
			}
			again, err := Decode(wire)
			if err != nil {
				t.Fatalf("re-encoded %s batch does not decode: %v", form, err)
			}
			if !sameBatch(b, again) {
				t.Fatalf("%s re-encode changed the batch:\n %s\n %s", form, dump(b), dump(again))
			}
		}
	})
}
