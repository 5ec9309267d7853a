package gateway

import (
	"bytes"
	"encoding/json"
	"fmt"
	"slices"

	"github.com/kvgate/kvgate/internal/sharedstate"
)

// The stored responses' homes across a restart (state_file). With tenants a
// gateway answers a response id whose owner it does not know with 404
// (responseHomes.locate): without shared state, a restart forgot every
// owner, and every tenant's open Responses chain ended. So the homes are
// written beside the index's snapshot at shutdown, to state_file +
// ".responses", and read back at start: the ids, their replicas by name
// (a slot may hold another replica after a restart), their chains' first
// ids and their owners. The file is the gateway's own, but it is read as
// untrusted input: bounded in size and entries, every field checked, an
// entry whose replica is no longer listed dropped; a bad file is logged
// and ignored, as a bad snapshot is.

// responsesFileVersion is the format written; another is refused.
const responsesFileVersion = 1

// maxResponsesFileBytes bounds the file read and written: 64 Ki entries
// of vLLM's ids ("resp_" and 32 hex digits) and names of a few tens of
// bytes take about 10 MiB; save keeps the newest homes within it.
const maxResponsesFileBytes = 64 << 20

// responseEntryBytes is at least what entry e takes in the file: its
// strings, JSON's escaping at most sextupling them (\u0000), and its keys.
func responseEntryBytes(e *responseFileEntry) int {
	return 6*(len(e.ID)+len(e.Replica)+len(e.Root)+len(e.Tenant)) + 64
}

type responsesFile struct {
	Version int                 `json:"version"`
	Homes   []responseFileEntry `json:"homes"` // oldest first: the LRU's order
}

type responseFileEntry struct {
	ID      string `json:"id"`
	Replica string `json:"replica"`
	Root    string `json:"root,omitempty"`
	Tenant  string `json:"tenant,omitempty"`
	Owned   bool   `json:"owned,omitempty"`
}

// responsesPath is where the homes go for state file path.
func responsesPath(path string) string { return path + ".responses" }

// save writes the homes whose replica is still the one that answered,
// oldest first, to path: the newest within maxResponsesFileBytes.
func (h *responseHomes) save(path string) (int, error) {
	f := responsesFile{Version: responsesFileVersion}
	keys, size := h.c.Keys(), 64 // oldest first
	for i := len(keys) - 1; i >= 0; i-- {
		hm, ok := h.c.Peek(keys[i])
		if !ok || hm.slot >= h.rt.Replicas() || h.rt.Replica(hm.slot).Serial() != hm.serial {
			continue
		}
		e := responseFileEntry{ID: keys[i], Replica: h.rt.Name(hm.slot), Root: hm.root, Tenant: hm.owner, Owned: hm.owned}
		if size += responseEntryBytes(&e); size > maxResponsesFileBytes {
			break
		}
		f.Homes = append(f.Homes, e)
	}
	slices.Reverse(f.Homes)
	data, err := json.Marshal(&f)
	if err != nil {
		return 0, err
	}
	return len(f.Homes), sharedstate.WriteFileAtomic(path, data)
}

// load reads the homes save wrote at path and remembers those whose
// replica is listed now; it returns how many. A missing file is a first
// start (0, nil); a file out of bounds or with one bad entry is refused
// whole, and nothing is remembered.
func (h *responseHomes) load(path string) (int, error) {
	data, err := sharedstate.ReadFileBounded(path, maxResponsesFileBytes)
	if data == nil || err != nil {
		return 0, err
	}
	var f responsesFile
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&f); err != nil {
		return 0, fmt.Errorf("responses file %s: %w", path, err)
	}
	if f.Version != responsesFileVersion || len(f.Homes) > responseHomesSize {
		return 0, fmt.Errorf("responses file %s: version %d with %d entries; want version %d, at most %d",
			path, f.Version, len(f.Homes), responsesFileVersion, responseHomesSize)
	}
	for i, e := range f.Homes {
		if err := e.check(); err != nil {
			return 0, fmt.Errorf("responses file %s: entry %d: %w", path, i, err)
		}
	}
	n := 0
	for _, e := range f.Homes {
		if slot, ok := h.rt.Lookup(e.Replica); ok {
			h.add(e.ID, slot, e.Root, e.Owned, e.Tenant)
			n++
		}
	}
	return n, nil
}

// check bounds an entry as the shared state bounds the same record
// (sharedstate.CheckResponseHome), and its chain's first id alike.
func (e *responseFileEntry) check() error {
	if err := sharedstate.CheckResponseHome(e.ID, sharedstate.ResponseHome{Replica: e.Replica, Tenant: e.Tenant}); err != nil {
		return err
	}
	switch {
	case len(e.Root) > sharedstate.MaxResponseID:
		return fmt.Errorf("a chain's first id over %d bytes", sharedstate.MaxResponseID)
	case e.Replica == "":
		return fmt.Errorf("no replica")
	case !e.Owned && e.Tenant != "":
		return fmt.Errorf("a tenant for a response of unknown owner")
	}
	return nil
}
