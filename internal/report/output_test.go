package report

import (
	"bytes"
	"errors"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestOutputsWrite(t *testing.T) {
	res := sampleResult(t, []string{"round_robin", "ttft"}, 2, 20)
	dir := t.TempDir()
	o := Outputs{JSON: filepath.Join(dir, "r.json"), ReportDir: filepath.Join(dir, "report"), Title: "t"}
	var table, log, wantTable, wantJSON bytes.Buffer
	if err := o.Write(&table, &log, res); err != nil {
		t.Fatal(err)
	}
	WriteTable(&wantTable, res)
	if table.String() != wantTable.String() {
		t.Errorf("table:\n%s\nwant:\n%s", table.String(), wantTable.String())
	}
	if err := WriteJSON(&wantJSON, res); err != nil {
		t.Fatal(err)
	}
	for _, path := range []string{o.JSON, filepath.Join(o.ReportDir, "result.json")} {
		if got := readFile(t, path); !bytes.Equal(got, wantJSON.Bytes()) {
			t.Errorf("%s is not WriteJSON's output", path)
		}
	}
	wantLog := "JSON: " + o.JSON + "\nReport: " + filepath.Join(o.ReportDir, "index.html") + "\n"
	if log.String() != wantLog {
		t.Errorf("log %q, want %q", log.String(), wantLog)
	}

	// Only the table without files; no partial JSON file for a result JSON cannot carry.
	table.Reset()
	log.Reset()
	if err := (Outputs{}).Write(&table, &log, res); err != nil || table.Len() == 0 || log.Len() != 0 {
		t.Errorf("no files: err %v, table %d bytes, log %q", err, table.Len(), log.String())
	}
	res.Runs[0].HitRate = math.NaN()
	bad := Outputs{JSON: filepath.Join(dir, "bad.json")}
	if err := bad.Write(&table, &log, res); !errors.Is(err, ErrNonFinite) {
		t.Errorf("NaN: err %v, want ErrNonFinite", err)
	}
	if _, err := os.Stat(bad.JSON); !errors.Is(err, os.ErrNotExist) || strings.Contains(log.String(), "bad.json") {
		t.Errorf("a failed encoding left %s (stat %v) or named it: %q", bad.JSON, err, log.String())
	}
}
